"""One declaration per flag: a config dataclass field carries its command-line flag (name, help,
bounds, unit, env default); parsers, configs and a child's argv are all derived from it.

    @dataclass(frozen=True)
    class CacheConfig:
        gpu_plans: int = flag(128, "slab slots (default %(default)s)", low=1, high=1_000_000)
        host_cache_bytes: int = flag(8 * GB, "host tier cap", name="--host-cache-gb", scale=GB, flag_type=float, low=0)

        def __post_init__(self) -> None:
            check_bounds(self)       # programmatic configs obey the same bounds as parsed ones

    add_flags(parser, CacheConfig)                      # --gpu-plans, --host-cache-gb, ...
    cfg = from_args(CacheConfig, parser.parse_args())   # a bad value exits 2 naming the flag
    to_argv(cfg)                                        # ['--gpu-plans=64']: what differs from the defaults

A field whose type is itself a config dataclass is flattened (its flags join the parent's).
`only` / `exclude` name leaf fields at any depth (or a nested config field, meaning all of it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import types
import typing
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
_KEY = "ditruntime.flags"
_SCALARS = (int, float, str, bool, Path)


@dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line."""

    help: str
    name: str = ""
    """'--gpu-plans'; empty: from the field name ('--no-<field>' for a negated boolean)."""
    low: float | None = None
    """Inclusive lower bound in the field's unit; None: unbounded."""
    high: float | None = None
    """Inclusive upper bound in the field's unit; None: unbounded."""
    scale: int = 1
    """Field value = flag value * scale (GB -> bytes: 1000**3; MiB -> bytes: 2**20)."""
    flag_type: type | None = None
    """The flag's type when it differs from the field's (float GB for int bytes)."""
    choices: tuple[str, ...] = ()
    env: str = ""
    """Environment variable that supplies the value when the flag is absent or empty."""
    negate: bool = False
    """A True-by-default boolean written as '--no-<field>' (store_true sets it False)."""


def flag_metadata(help: str, **spec: Any) -> dict[str, Flag]:
    """`dataclasses.field(metadata=...)` for a flag without a default (a required flag)."""
    return {_KEY: Flag(help, **spec)}


def flag(
    default: T,
    help: str,
    *,
    name: str = "",
    low: float | None = None,
    high: float | None = None,
    scale: int = 1,
    flag_type: type | None = None,
    choices: tuple[str, ...] = (),
    env: str = "",
    negate: bool = False,
) -> T:
    """A dataclass field with a default, declared as a command-line flag."""
    spec = Flag(help, name, low, high, scale, flag_type, choices, env, negate)
    return field(default=default, metadata={_KEY: spec})


@dataclass(frozen=True)
class _Option:
    """A declared field, resolved: its scalar type and its flag's name, dest and type."""

    field: dataclasses.Field[Any]
    spec: Flag
    kind: type
    """The field's type with Optional removed: int, float, str, bool or Path."""
    optional: bool
    """The field's type admits None."""
    owner: type = object
    """The config dataclass that declares the field (docs read its docstring from there)."""

    @property
    def name(self) -> str:
        if self.spec.name:
            return self.spec.name
        return ("--no-" if self.spec.negate else "--") + self.field.name.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def flag_kind(self) -> type:
        return self.spec.flag_type or (str if self.kind is Path else self.kind)

    @property
    def has_default(self) -> bool:
        return self.field.default is not dataclasses.MISSING

    def flag_default(self) -> Any:
        """The argparse default, in the flag's unit (None where an env variable may supply it)."""
        d: Any = self.field.default
        if self.spec.env or d is None:
            return None
        if self.spec.scale != 1:
            return d / self.spec.scale if self.flag_kind is float else d // self.spec.scale
        return str(d) if isinstance(d, Path) else d

    def to_field(self, raw: Any) -> Any:
        """A parsed flag value (flag unit) as the field's value (field unit)."""
        if self.spec.env and not raw:
            return os.environ.get(self.spec.env) or self.field.default
        if self.kind is bool:
            return not raw if self.spec.negate else bool(raw)
        if raw is None or (self.optional and raw == ""):
            return None
        if self.spec.scale != 1:  # exact decimal arithmetic: '0.29' GB is 290000000 bytes
            return self.kind(Decimal(repr(raw)) * self.spec.scale)
        return self.kind(raw)

    def render(self, value: Any) -> list[str]:
        """The argv that makes a child parse `value` (not the default) back."""
        if self.kind is bool:
            return [self.name]
        if value is None:
            raise ValueError(f"{self.field.name}=None cannot be written as {self.name} (its default is not None)")
        if self.spec.scale != 1:
            if self.flag_kind is int and value % self.spec.scale:
                raise ValueError(f"{self.field.name}={value} is not a whole number of {self.name} units")
            text = str(Decimal(value) / Decimal(self.spec.scale))
        else:
            text = repr(value) if isinstance(value, float) else str(value)
        return [f"{self.name}={text}"]

    def problem(self, value: Any, as_flag: bool = False) -> str | None:
        """What is wrong with `value` (field unit) against the bounds; told in the flag's unit if `as_flag`."""
        lo, hi = self.spec.low, self.spec.high
        if value is None or (lo is None and hi is None):
            return None
        finite = not isinstance(value, float) or math.isfinite(value)
        if finite and (lo is None or value >= lo) and (hi is None or value <= hi):
            return None
        scale = self.spec.scale if as_flag else 1
        must = "must be finite and" if (self.flag_kind if as_flag else self.kind) is float else "must be"
        if lo is not None and hi is not None:
            return f"{must} in [{_num(lo / scale)}, {_num(hi / scale)}]"
        if lo is not None:
            return f"{must} >= {_num(lo / scale)}"
        assert hi is not None
        return f"{must} <= {_num(hi / scale)}"


def _num(x: float) -> str:
    return str(int(x)) if x == int(x) else repr(x)


class _ParseFlag:
    """argparse `type=`: parse the text, check the declared bounds, return the flag-unit value."""

    def __init__(self, option: _Option) -> None:
        self.option = option
        self.__name__ = option.flag_kind.__name__  # argparse names the type in its messages

    def __call__(self, text: str) -> Any:
        kind, scale = self.option.flag_kind, self.option.spec.scale
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        problem = self.option.problem(value * scale if scale != 1 else value, as_flag=True)
        if problem:
            raise argparse.ArgumentTypeError(f"{problem}, got {text}")
        return value


def _scalar(hint: Any) -> tuple[type, bool]:
    """(the type, whether None is allowed) from `X` or `X | None`; generics reduce to their origin."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = True
        hint = args[0] if len(args) == 1 else object
    if not isinstance(hint, type):
        hint = typing.get_origin(hint) or object
    return hint, optional


def _fields(cls: type) -> tuple[tuple[dataclasses.Field[Any], type, _Option | None], ...]:
    """Each field of `cls` with its scalar type, and its option when it is declared a flag."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind, optional = _scalar(hints[f.name])
        spec = f.metadata.get(_KEY)
        if spec is not None and kind not in _SCALARS:
            raise TypeError(f"{cls.__name__}.{f.name}: a flag needs int, float, str, bool or Path, not {kind}")
        out.append((f, kind, _Option(f, spec, kind, optional, cls) if spec is not None else None))
    return tuple(out)


def _narrow(name: str, only: Collection[str] | None) -> Collection[str] | None:
    """The selection inside a nested config: all of it when `only` names the nested field."""
    return None if only is None or name in only else only


def _options(cls: type, only: Collection[str] | None, exclude: Collection[str]) -> Iterator[_Option]:
    """The selected flags of `cls`, nested configs flattened, in field order."""
    for f, kind, option in _fields(cls):
        if f.name in exclude:
            continue
        if dataclasses.is_dataclass(kind):
            yield from _options(kind, _narrow(f.name, only), exclude)
        elif option is not None and (only is None or f.name in only):
            yield option


def add_flags(
    parser: argparse._ActionsContainer,
    cls: type,
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    group: str | None = None,
) -> None:
    """Add the declared flags of `cls` (its fields named in `only`, less `exclude`) to `parser`
    (a parser or an argument group), in a new argument group titled `group` if given."""
    target: argparse._ActionsContainer = parser.add_argument_group(group) if group else parser
    for opt in _options(cls, only, exclude):
        if opt.kind is bool:
            action = target.add_argument(opt.name, dest=opt.dest, action="store_true", help=opt.spec.help)
            setattr(action, _KEY, opt)
            continue
        kwargs: dict[str, Any] = {"dest": opt.dest, "type": _ParseFlag(opt), "help": opt.spec.help}
        if opt.spec.choices:
            kwargs["choices"] = opt.spec.choices
        if opt.has_default:
            kwargs["default"] = opt.flag_default()
        else:
            kwargs["required"] = True
        setattr(target.add_argument(opt.name, **kwargs), _KEY, opt)


def declared_option(action: argparse.Action) -> _Option | None:
    """The declaration an `add_flags` argument was made from (None for a hand-written one): the generated
    flag tables (ditserve.docgen) read defaults, units, bounds, env and docstrings from it."""
    opt = getattr(action, _KEY, None)
    return opt if isinstance(opt, _Option) else None


def from_args(
    cls: type[T],
    args: argparse.Namespace,
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    **overrides: Any,
) -> T:
    """`cls` built from parsed flags: `overrides` first, then the selected flags, else the defaults."""
    values: dict[str, Any] = {}
    for f, kind, option in _fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif f.name in exclude:
            continue
        elif dataclasses.is_dataclass(kind):
            values[f.name] = from_args(kind, args, only=_narrow(f.name, only), exclude=exclude)
        elif option is not None and (only is None or f.name in only):
            values[f.name] = option.to_field(getattr(args, option.dest))
    unknown = set(overrides) - {f.name for f, _, _ in _fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {sorted(unknown)}")
    return cls(**values)


def to_argv(config: Any, *, only: Collection[str] | None = None, exclude: Collection[str] = ()) -> list[str]:
    """The flags that make a parser built by `add_flags` reproduce `config` (defaults omitted).

    A value equal to its env variable is omitted too: the child inherits the environment, and a
    secret stays off its command line. A non-default field without a flag raises: exclude it and
    pass it another way (as `serve` does with the sidecar's socket).
    """
    argv: list[str] = []
    for f, kind, option in _fields(type(config)):
        value = getattr(config, f.name)
        if f.name in exclude:
            continue
        if dataclasses.is_dataclass(kind):
            argv += to_argv(value, only=_narrow(f.name, only), exclude=exclude)
            continue
        if (only is not None and f.name not in only) or value == f.default:
            continue
        if option is None:
            raise ValueError(f"{type(config).__name__}.{f.name}={value!r} has no flag; exclude it")
        if option.spec.env and value == os.environ.get(option.spec.env):
            continue
        argv += option.render(value)
    return argv


def check_bounds(config: Any) -> None:
    """Raise ValueError naming the field, its flag and the allowed range for a value out of bounds.

    Call it from `__post_init__`, so that a config built in code obeys the declared bounds too.
    """
    for _, _, option in _fields(type(config)):
        if option is not None:
            value = getattr(config, option.field.name)
            problem = option.problem(value)
            if problem:
                raise ValueError(f"{option.field.name} ({option.name}) {problem}, got {value}")


@dataclass(frozen=True)
class LaunchOptions:
    """How a process is started rather than what it serves: both services and `ditserve serve`."""

    run_dir: Path | None = flag(
        None,
        "sidecar socket (serve: also logs, demo checkpoint); default $XDG_RUNTIME_DIR/ditserve or /tmp/ditserve-<uid>",
    )
    """Private (0700) directory of the sidecar socket; `serve` also keeps logs and the demo checkpoint there."""
    log_level: str = flag("INFO", "log level (default %(default)s)")
    """Python logging level name."""
    log_format: str = flag("text", "json: one object per line", choices=("text", "json"))
    """'text' for people, 'json' (one object per line) for log collectors."""
    threads: int | None = flag(None, "torch CPU threads (default: torch's choice)", low=1)
    """torch.set_num_threads; None leaves torch's choice."""

    def __post_init__(self) -> None:
        check_bounds(self)
