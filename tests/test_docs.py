"""The docs cannot drift: docs/flags.md and docs/errors.md are what scripts/gen_docs.py writes from the code (and the
check fails when a declaration changes), every relative link resolves, every `ditserve ...` command in the docs uses
flags its parser has, every grpcurl call names a real RPC and real fields, and the quick start is what CI runs."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from docskit import (
    Invocation,
    commands,
    ditserve_invocations,
    doc_files,
    grpcurl_calls,
    links,
    prose,
    rel,
    shell_blocks,
)
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import Descriptor
from grpc_health.v1 import health_pb2  # noqa: F401  (registers grpc.health.v1 in the default pool)
from servicekit import REPO_ROOT

import ditserve.docs as gen
from ditruntime.errors import ServiceError
from ditruntime.flags import Flag
from ditserve.docs import flag_tables
from ditserve.docs.markdown import anchors, cell, field_doc, slug
from plancache_service.config import SidecarConfig
from protos.ditserve.generator.v1 import generator_pb2  # noqa: F401
from protos.ditserve.plancache.v1 import plancache_pb2  # noqa: F401

DOCS = doc_files()


# ----------------------------------------------------------------------------- generated pages
@pytest.mark.processes
def test_generated_docs_are_current() -> None:
    """What CI checks: the committed docs/flags.md and docs/errors.md are what the script writes now."""
    proc = subprocess.run(
        [sys.executable, "scripts/gen_docs.py", "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "DITSERVE_ADMIN_TOKEN": "not-in-the-docs"},  # an env default must not leak in
    )
    assert proc.returncode == 0, f"{proc.stderr}\n{proc.stdout[-4000:]}"


def _patch_help(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, help: str) -> None:
    """Change one declared flag's help, as an edit of its `flag(...)` declaration would."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    key, spec = next((k, v) for k, v in f.metadata.items() if isinstance(v, Flag))
    monkeypatch.setattr(f, "metadata", types.MappingProxyType({key: dataclasses.replace(spec, help=help)}))


def test_check_fails_when_a_flag_help_changes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _patch_help(monkeypatch, SidecarConfig, "heartbeat_s", "beats per nothing")
    diffs = gen.stale()
    added = [line for line in diffs["flags.md"].splitlines() if line.startswith("+| `--heartbeat-s` |")]
    assert len(added) == 1 and "| beats per nothing. `SidecarConfig.heartbeat_s`: " in added[0], added
    assert gen.main(["--check"]) == 1
    out, err = capsys.readouterr()
    assert "beats per nothing" in out and "--- docs/flags.md (committed)" in out
    assert "flags.md" in err and "run: python scripts/gen_docs.py" in err


def test_write_then_check_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gen.main(["--check", "--docs-dir", str(tmp_path)]) == 1  # nothing there yet
    assert gen.main(["--docs-dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["errors.md", "flags.md"]
    assert gen.main(["--check", "--docs-dir", str(tmp_path)]) == 0
    errors = tmp_path / "errors.md"
    errors.write_text(errors.read_text().replace("QUEUE_FULL", "QUEUE_FUL"))
    capsys.readouterr()
    assert gen.main(["--check", "--docs-dir", str(tmp_path)]) == 1
    assert "-| `RESOURCE_EXHAUSTED` (8) | `QUEUE_FUL` |" in capsys.readouterr().out


def test_every_command_and_declared_flag_is_in_flags_md() -> None:
    """Each subcommand has its section, each option its row; declared flags carry their field's docstring."""
    text = (REPO_ROOT / "docs" / "flags.md").read_text()
    sections = dict(re.findall(r"^## `([^`]+)`\n(.*?)(?=^## |\Z)", text, re.S | re.M))
    cmds = flag_tables.commands()
    assert [c.name for c in cmds] == list(sections)
    assert {"ditserve serve", "ditserve plancache", "ditserve generator", "ditserve generate-local"} <= set(sections)
    for c in cmds:
        for action in c.parser._actions:
            for opt in action.option_strings:
                if opt not in ("-h", "--help"):
                    assert f"`{opt}`" in sections[c.name], (c.name, opt)
    plancache = sections["ditserve plancache"]
    for flag in ("--heartbeat-s", "--session-grace-s", "--gpu-plans", "--admin-token"):
        assert f"| `{flag}` |" in plancache, flag
    assert f"`SidecarConfig.session_grace_s`: {cell(field_doc(SidecarConfig, 'session_grace_s'))} |" in plancache
    assert "| `$DITSERVE_ADMIN_TOKEN` |" in plancache


def test_a_scaled_flag_shows_its_default_and_bounds_in_its_own_unit() -> None:
    """--job-ttl is hours (its field, job_ttl_s, holds seconds): the table says 168 h, not seconds; --results-max-gb
    is GB; a scale without a unit is refused rather than shown in the field's unit."""
    text = (REPO_ROOT / "docs" / "flags.md").read_text()
    for flag, cells in (
        ("--job-ttl", "| float | `168` | h | [0.016666666666666666, 87600] |"),
        ("--results-max-gb", "| float | `50` | GB | [0, 1000000] |"),
        ("--memory-reserve-gb", "| float | `1` | GB |"),
    ):
        rows = [line for line in text.splitlines() if line.startswith(f"| `{flag}` |")]
        assert rows and all(cells in row for row in rows), (flag, rows)
    with pytest.raises(ValueError, match=r"job_ttl_s: a flag scaled by 60 needs its unit"):
        flag_tables._unit("job_ttl_s", 60)


class _DocumentedError(ServiceError):
    """A refusal the tests invent, to see it reach the table."""

    reason = "TEST_ONLY_REASON"
    grpc_code = "RESOURCE_EXHAUSTED"


def test_a_new_error_class_reaches_the_table_and_one_without_a_docstring_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ditserve.docs import error_table

    monkeypatch.setattr(_DocumentedError, "__module__", "generator_service.errors")
    text = error_table.render()
    assert (
        "| `RESOURCE_EXHAUSTED` (8) | `TEST_ONLY_REASON` | generator | `generator_service.errors._DocumentedError` "
        "| A refusal the tests invent, to see it reach the table. |"
    ) in text
    undocumented = type("UndocumentedError", (ServiceError,), {"reason": "X", "grpc_code": "INTERNAL"})
    undocumented.__module__ = "generator_service.errors"
    try:
        with pytest.raises(ValueError, match=r"UndocumentedError: an error class needs a docstring"):
            error_table.render()
    finally:
        undocumented.__module__ = __name__  # out of the packages the table reads, even if it lingers
        del undocumented
        gc.collect()  # __subclasses__ holds weak references: the class leaves once collected


def test_error_table_covers_every_reason_the_old_hand_table_missed() -> None:
    text = (REPO_ROOT / "docs" / "errors.md").read_text()
    for reason in ("NOT_SERVING", "CACHE_BUSY", "PRESET_INVALID", "DRAIN_TIMEOUT", "PATH_OUTSIDE_ROOT", "INVALID_PATH"):
        assert f"| `{reason}` |" in text, reason
    assert "the running request did not finish within --drain-timeout-s" in text  # followed through `_drain`


def test_markdown_cells_and_slugs() -> None:
    assert cell("a | b <run-dir> `x|y <z>`") == "a \\| b &lt;run-dir&gt; `x\\|y <z>`"
    assert slug("Presets (`ditserve inspect --preset NAME`)") == "presets-ditserve-inspect---preset-name"
    assert slug("The sidecar's threat model") == "the-sidecars-threat-model"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


# ----------------------------------------------------------------------------- links
@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in links(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {rel(dest)}")
    assert not broken, broken


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_table_rows_have_the_header_s_cell_count(doc: Path) -> None:
    """An unescaped `|` in a cell (a help text's `a|b`) would shift a generated table's columns."""
    bad, width = [], None
    for line in prose(doc.read_text()).splitlines():
        cells = len(re.findall(r"(?<!\\)\|", line)) if line.startswith("|") else None
        width = None if cells is None else (width or cells)
        if cells is not None and cells != width:
            bad.append(f"{cells} separators, the header has {width}: {line[:80]}")
    assert not bad, bad


def test_every_docs_page_is_linked_from_the_readme_or_another_page() -> None:
    linked = {
        (doc.parent / t.partition("#")[0]).resolve()
        for doc in DOCS
        for t in links(doc.read_text())
        if not t.startswith("#") and not re.match(r"[a-z]+:", t)
    }
    orphans = [rel(d) for d in DOCS[1:] if d.resolve() not in linked]
    assert not orphans, orphans


# ----------------------------------------------------------------------------- examples
def _parsers() -> dict[str, Any]:
    return {c.name.removeprefix("ditserve").strip(): c.parser for c in flag_tables.commands()}


def test_ditserve_commands_in_the_docs_use_real_flags() -> None:
    parsers = _parsers()
    seen, wrong = 0, []
    for doc in DOCS:
        for inv in ditserve_invocations(doc):
            if inv.args and f"{inv.subcommand} {inv.args[0]}" in parsers:  # a command's own subcommand
                inv = Invocation(inv.where, f"{inv.subcommand} {inv.args[0]}", inv.args[1:])
            parser = parsers.get(inv.subcommand)
            if parser is None:
                wrong.append(f"{inv.where}: no command `ditserve {inv.subcommand}`")
                continue
            for flag in inv.flags():
                seen += 1
                if flag not in parser._option_string_actions:
                    wrong.append(f"{inv.where}: `ditserve {inv.subcommand}` has no {flag}")
    assert not wrong, wrong
    assert seen > 30  # the extraction finds the examples


OTHER_TOOLS_FLAGS = {
    "--alive": "docker/healthcheck.py",
    "--check": "scripts/gen_docs.py, scripts/lock.py, protos.generate",
    "--upgrade": "scripts/lock.py",
    "--quick": "scripts/test.sh (the quick tier)",
    "--dist": "pytest-xdist (scripts/test.sh)",
    "--durations": "pytest (scripts/test.sh)",
    "--from-literal": "kubectl create secret",
    "--cert": "kubectl create secret tls",
    "--key": "kubectl create secret tls",
    "--gpus": "docker run",
    "--rm": "docker run, docker compose run",
    "--profile": "docker compose",
    "--strict": "kubernetes-validate",
    "--local-dir": "huggingface-cli download",
    "--require-hashes": "pip install",
    "--no-deps": "pip install",
    "--no-build-isolation": "pip install",
    "--offline": "scripts/gpu_check.sh",
    "--wheels": "scripts/gpu_check.sh",
    "--python-version": "scripts/gpu_wheels.sh (and pip download)",
}
"""Flags the docs name that belong to other tools (every other `--flag` in the docs must be a ditserve flag)."""


def test_every_flag_the_docs_mention_exists() -> None:
    """Prose and tables too: a `--flag` the docs name is some ditserve parser's, or another tool's listed above."""
    from torch.distributed.run import get_args_parser  # torchrun's own parser: a replica's launcher

    known = {opt for c in flag_tables.commands() for opt in c.parser._option_string_actions} | set(OTHER_TOOLS_FLAGS)
    known |= set(get_args_parser()._option_string_actions)
    unknown: dict[str, list[str]] = {}
    for doc in DOCS:
        for name, glob in set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)(\*?)", doc.read_text())):
            if not (name in known or (glob and any(k.startswith(name) for k in known))):  # `--tls-*`: a family
                unknown.setdefault(rel(doc), []).append(name)
    assert not unknown, unknown


def test_the_flag_check_catches_a_wrong_flag() -> None:
    script = ".venv/bin/ditserve generate --target x --steps 4 | tee out  # H3's --nope\nls -l '#1' # it's --no"
    argv, *rest = commands(script)
    assert argv == [".venv/bin/ditserve", "generate", "--target", "x", "--steps", "4"]
    assert rest == [["tee", "out"], ["ls", "-l", "#1"]]
    assert "--steps" not in _parsers()["generate"]._option_string_actions


def _message(name: str) -> Descriptor:
    return descriptor_pool.Default().FindMessageTypeByName(name)


def _unknown_fields(msg: Descriptor, data: Any, where: str) -> list[str]:
    if not isinstance(data, dict):
        return []
    out = []
    for key, value in data.items():
        field = msg.fields_by_name.get(key) or next((f for f in msg.fields if f.json_name == key), None)
        if field is None:
            out.append(f"{where}: {msg.full_name} has no field {key!r}")
        elif field.message_type is not None:
            out += _unknown_fields(field.message_type, value, where)
    return out


def _stdin_keys(doc: Path, method: str) -> set[str]:
    """The JSON keys the `printf` commands feeding a `-d @` call write, in the blocks that make that call."""
    keys: set[str] = set()
    for block in shell_blocks(doc.read_text()):
        if method in block:
            for argv in commands(block):
                if argv[0] == "printf":
                    keys |= set(re.findall(r'"(\w+)"\s*:', " ".join(argv[1:])))
    return keys


def test_grpcurl_calls_in_the_docs_name_real_rpcs_and_fields() -> None:
    pool = descriptor_pool.Default()
    wrong, checked = [], 0
    for doc in DOCS:
        for call in grpcurl_calls(doc):
            symbol = call.method()
            if symbol is None:
                continue
            service, _, name = symbol.partition("/")
            if not name:  # describe SYMBOL: a service or a message
                try:
                    pool.FindServiceByName(service)
                except KeyError:
                    _message(service)
                continue
            method = pool.FindServiceByName(service).methods_by_name.get(name)
            if method is None:
                wrong.append(f"{call.where}: {service} has no method {name}")
                continue
            checked += 1
            data = call.data()
            if data == "@":
                wrong += [
                    f"{call.where}: {method.input_type.full_name} has no field {k!r}"
                    for k in _stdin_keys(doc, symbol)
                    if k not in method.input_type.fields_by_name
                ]
            elif data is not None:
                wrong += _unknown_fields(method.input_type, json.loads(data), call.where)
    assert not wrong, wrong
    assert checked >= 8


def test_the_field_check_catches_a_removed_field() -> None:
    bad = _unknown_fields(_message("ditserve.generator.v1.GenerateRequest"), {"prompt": "x", "steps": 4}, "here")
    assert bad == ["here: ditserve.generator.v1.GenerateRequest has no field 'steps'"]


def test_python_examples_compile_and_use_the_client_api() -> None:
    from ditserve.client import ClientMedia, ClientResult, GeneratorClient

    blocks = [b for doc in DOCS for lang, b in re.findall(r"^```(\w*)\n(.*?)^```", doc.read_text(), re.S | re.M)]
    python = [b for b in blocks if b.startswith("from ditserve")]
    assert python, "the API page shows the Python client"
    for block in python:
        compile(block, "docs", "exec")
    assert hasattr(GeneratorClient, "generate") and hasattr(ClientMedia, "write")
    assert {"sha256", "generation", "video", "audio", "cache", "media"} <= {
        f.name for f in dataclasses.fields(ClientResult)
    }


# ----------------------------------------------------------------------------- the quick start
def test_quick_start_is_what_ci_runs() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    quick = [argv for block in shell_blocks(readme) for argv in commands(block)]
    assert ["./scripts/serve.sh"] in quick and ["./scripts/test.sh"] in quick
    for script in ("scripts/serve.sh", "scripts/test.sh"):
        assert os.access(REPO_ROOT / script, os.X_OK), script
    assert "bash scripts/test.sh" in (REPO_ROOT / ".ci" / "run").read_text()
    assert len(readme) < 12_000, "the README is read in five minutes: reference material goes to docs/"
