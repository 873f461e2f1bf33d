"""Test helpers for the command line: run `ditserve` in this process or as a subprocess, and
copy a checkpoint before mutating it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from servicekit import REPO_ROOT

from ditserve.cli import main as cli_main


def copy_ckpt(src: Path, dst_parent: Path, name: str = "ckpt") -> Path:
    """A private, mutable copy of a checkpoint directory."""
    dst = dst_parent / name
    shutil.copytree(src, dst)
    return dst


@dataclass(frozen=True)
class CliResult:
    code: int
    out: str
    err: str

    def json_lines(self) -> list[dict[str, Any]]:
        """stdout parsed as one JSON object per non-empty line."""
        return [json.loads(line) for line in self.out.splitlines() if line.strip()]


@contextlib.contextmanager
def _chdir(path: Path | None) -> Iterator[None]:
    """contextlib.chdir (Python 3.11+) for 3.10 too; None stays put."""
    before = Path.cwd()
    if path is not None:
        os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def run_cli_inprocess(argv: Sequence[Any], cwd: Path | None = None) -> CliResult:
    """`ditserve.cli.main(argv)` in this process (in `cwd` if given), capturing stdout/stderr and the exit code."""
    out, err = io.StringIO(), io.StringIO()
    with _chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main([str(a) for a in argv])
        except SystemExit as e:  # argparse errors and --help/--version
            code = e.code if isinstance(e.code, int) else 1
    return CliResult(code, out.getvalue(), err.getvalue())


def run_cli_subprocess(argv: Sequence[Any], cwd: Path | None = None, timeout: float = 120) -> CliResult:
    """`python -m ditserve ARGV` in a fresh interpreter."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "ditserve", *[str(a) for a in argv]],
        capture_output=True,
        text=True,
        cwd=cwd or REPO_ROOT,
        env=env,
        timeout=timeout,
        check=False,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


class CliRunner(Protocol):
    """`run_cli(argv, cwd=None)`: the `ditserve` command line with `argv` (any values; str() is applied)."""

    def __call__(self, argv: Sequence[Any], cwd: Path | None = None) -> CliResult: ...
