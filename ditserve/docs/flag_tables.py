"""docs/flags.md, from the parsers the command line really builds (`ditserve`'s and each service's): one table per
command; a flag declared on a config dataclass (ditruntime.flags) also shows its unit, bounds, env variable and the
field's docstring."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ditruntime.flags import declared_option

from .markdown import cell, code, field_doc, slug, table

_UNIT_BY_SCALE = {1000**3: "GB", 1024**3: "GiB", 1000**2: "MB", 2**20: "MiB", 3600: "h"}
"""A scaled flag's unit (its default and bounds are shown divided by the scale); the field name's suffix names the
field's unit, not the flag's."""
_UNIT_BY_SUFFIX = {"_s": "s", "_ms": "ms", "_bytes": "bytes", "_pixels": "pixels", "_gb": "GB", "_mb": "MiB"}
_DEFAULT_NOTE = re.compile(r"\s*\(default:? %\(default\)s\)")
HEADER = ("flag", "type", "default", "unit", "bounds / choices", "env", "meaning")


@dataclasses.dataclass(frozen=True)
class Command:
    """One command line: its name as typed, what it does, and its real parser."""

    name: str
    summary: str
    parser: argparse.ArgumentParser


def commands() -> list[Command]:
    """`ditserve` itself, then each subcommand in the order `ditserve --help` lists them; `plancache` and
    `generator` hand their argv to the services' own parsers, so those are the ones read."""
    from generator_service.cli import build_parser as generator_parser
    from plancache_service.cli import build_parser as plancache_parser

    from ..cli import SERVICE_COMMANDS, _parser

    own = {"plancache": plancache_parser(), "generator": generator_parser()}
    assert set(own) == set(SERVICE_COMMANDS), "a service command without its parser here"
    top = _parser()
    out = [Command("ditserve", top.description or "", top)]
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    for name, parser in sub.choices.items():
        chosen: argparse.ArgumentParser | None = own.get(name, parser)
        assert chosen is not None
        out.append(Command(f"ditserve {name}", helps.get(name, ""), chosen))
        out += _verbs(f"ditserve {name}", chosen)
    return out


def _verbs(name: str, parser: argparse.ArgumentParser) -> list[Command]:
    """A command's own subcommands (`ditserve jobs create`, ...), each with its parser."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None:
        return []
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    return [Command(f"{name} {verb}", helps.get(verb, ""), p) for verb, p in sub.choices.items()]


def _shown(action: argparse.Action) -> bool:
    return (
        not isinstance(action, argparse._HelpAction | argparse._SubParsersAction) and action.help != argparse.SUPPRESS
    )


def _groups(parser: argparse.ArgumentParser) -> Iterator[tuple[str, list[argparse.Action]]]:
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if _shown(a)]
        if actions:
            yield group.title or "", actions


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return code(str(v).lower())
    if isinstance(v, float):
        return code(str(int(v)) if v == int(v) and abs(v) < 1e15 else repr(v))
    if isinstance(v, str | int | Path):
        return code(f'"{v}"' if v == "" else str(v))
    return code(repr(v))


def _help(action: argparse.Action, prog: str) -> str:
    """The help as `--help` prints it, less the "(default …)" note the default column already gives."""
    text = _DEFAULT_NOTE.sub("", action.help or "")
    params: dict[str, Any] = dict(vars(action), prog=prog)
    for key, v in list(params.items()):
        if hasattr(v, "__name__"):
            params[key] = v.__name__
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    return text % params if "%" in text else text


def _unit(name: str, scale: int = 1) -> str:
    if scale != 1:
        if scale not in _UNIT_BY_SCALE:
            raise ValueError(f"{name}: a flag scaled by {scale} needs its unit in _UNIT_BY_SCALE")
        return _UNIT_BY_SCALE[scale]
    return next((u for suffix, u in _UNIT_BY_SUFFIX.items() if name.endswith(suffix)), "")


def _bounds(low: float | None, high: float | None, scale: int) -> str:
    def num(x: float) -> str:
        x = x / scale
        return str(int(x)) if x == int(x) else repr(x)

    if low is not None and high is not None:
        return f"[{num(low)}, {num(high)}]"
    if low is not None:
        return f"≥ {num(low)}"
    return f"≤ {num(high)}" if high is not None else ""


def _type_name(t: Any) -> str:
    if t is None:
        return "str"
    return {"Path": "path"}.get(t.__name__, t.__name__) if isinstance(t, type) else "str"


def _flag_cell(action: argparse.Action) -> str:
    if not action.option_strings:
        return code(str(action.metavar or action.dest)) + " (positional)"
    return ", ".join(code(s) for s in action.option_strings)


def _choices(action: argparse.Action) -> str:
    return " \\| ".join(code(str(c)) for c in action.choices) if action.choices else ""


def _row(action: argparse.Action, prog: str) -> list[str]:
    """One flag's cells: from its declaration when it has one, else from the argparse action alone."""
    flag_cell, meaning = _flag_cell(action), cell(_help(action, prog))
    switch = action.nargs == 0
    opt = declared_option(action)
    if opt is None:
        default = "required" if action.required else ("off" if switch else _default(action.default))
        name = action.dest
        kind = "switch" if switch else _type_name(action.type)
        return [flag_cell, kind, default, _unit(name), _choices(action), "", meaning]
    f, spec = opt.field, opt.spec
    if f.default is dataclasses.MISSING:
        default = "required"
    elif switch:
        default = "off"
    else:
        value = f.default
        default = _default(value / spec.scale if spec.scale != 1 and value is not None else value)
    doc = field_doc(opt.owner, f.name)
    if not doc:
        raise ValueError(f"{opt.owner.__name__}.{f.name} ({opt.name}): a flag's field needs a docstring")
    meaning = f"{meaning}. {code(f'{opt.owner.__name__}.{f.name}')}: {cell(doc)}" if meaning else cell(doc)
    kind = "switch" if switch else _type_name(opt.flag_kind if opt.kind is not Path else Path)
    bounds = _choices(action) or _bounds(spec.low, spec.high, spec.scale)
    env = code(f"${spec.env}") if spec.env else ""
    return [flag_cell, kind, default, _unit(f.name, spec.scale), bounds, env, meaning]


def _default(value: Any) -> str:
    return "unset" if value is None else _value(value)


def render() -> str:
    """The whole of docs/flags.md."""
    cmds = commands()
    lines = [
        "# Command-line flags",
        "",
        "Generated by `python scripts/gen_docs.py` from the parsers the command line builds (`ditserve/cli.py`,",
        "`generator_service/cli.py`, `plancache_service/cli.py`) and the config declarations they read",
        "(`ditruntime/flags.py`). Do not edit it by hand: the default test suite fails when it differs from what",
        "the script writes. What the commands do, with examples: [cli.md](cli.md).",
        "",
        "A flag declared on a config dataclass is the same flag wherever it appears (its `Class.field` is named",
        "in *meaning*, followed by the field's docstring); its *default* and *bounds* are in the flag's *unit*,",
        "and a value outside the bounds exits with code 2 naming the flag and the range. An *env* variable",
        "supplies the value when the flag is absent or empty. *switch*: a flag without a value.",
        "",
        "Commands: " + " · ".join(f"[{c.name}](#{slug(code(c.name))})" for c in cmds),
    ]
    for c in cmds:
        lines += ["", f"## {code(c.name)}", ""]
        summary = c.summary.rstrip(".")
        about = c.parser.description or ""
        lines.append(cell(f"{summary[:1].upper()}{summary[1:]}." if summary else about))
        for title, actions in _groups(c.parser):
            lines += ["", f"**{cell(title)}**", ""]
            lines += table(HEADER, (_row(a, c.parser.prog) for a in actions))
    return "\n".join(lines) + "\n"
