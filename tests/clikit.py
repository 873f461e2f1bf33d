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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def run_cli_inprocess(argv: Sequence[str]) -> CliResult:
    """`ditserve.cli.main(argv)` in this process, capturing stdout/stderr and the exit code."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main([str(a) for a in argv])
        except SystemExit as e:  # argparse errors and --help/--version
            code = e.code if isinstance(e.code, int) else 1
    return CliResult(code, out.getvalue(), err.getvalue())


def run_cli_subprocess(argv: Sequence[str], cwd: Path | None = None, timeout: float = 120) -> CliResult:
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


CliRunner = Callable[[Sequence[str]], CliResult]
