"""Shared fixtures: tiny checkpoints (session-scoped, never mutated) and CLI runners."""

from __future__ import annotations

import os

# grpc's fork handlers can deadlock a process that forks (subprocess.Popen) while its own
# channels are busy (grpc/grpc#37259); the tests start service processes from threads that
# also hold channels. Must be set before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import contextlib
import io
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ditcore import get_preset, write_checkpoint
from ditserve.cli import main as cli_main

REPO_ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped (and reported as skipped) on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ----------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset, seed 0, 2 shards. Read-only: copy it (copy_ckpt) before mutating."""
    return write_checkpoint(get_preset("tiny"), tmp_path_factory.mktemp("tiny_ckpt") / "ckpt", seed=0, shards=2)


@pytest.fixture(scope="session")
def tiny_ckpt_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same config and sharding as `tiny_ckpt`, different weights (seed 1)."""
    return write_checkpoint(get_preset("tiny"), tmp_path_factory.mktemp("tiny_ckpt_b") / "ckpt", seed=1, shards=2)


def copy_ckpt(src: Path, dst_parent: Path, name: str = "ckpt") -> Path:
    """A private, mutable copy of a checkpoint directory."""
    dst = dst_parent / name
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------- CLI runners
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


@pytest.fixture
def run_cli() -> CliRunner:
    return run_cli_inprocess


@pytest.fixture
def run_cli_proc() -> CliRunner:
    return run_cli_subprocess
