"""scripts/gpu_check.sh, the one-shot accelerator check: it skips every check cleanly without CUDA, and (slow) its
service checks pass when run on the CPU, so the script cannot rot between the rare runs on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
CHECKS = ("gpu-tests", "syncs-per-step", "pinned-bytes", "cached-abab", "swap-in", "resident-abab", "sidecar-kill")


def run(env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs every check (scripts/gpu_check.sh)")
def test_without_cuda_every_check_is_skipped_and_the_exit_is_0() -> None:
    res = run({}, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("gpu_check: device cuda;") and "cuda available: False" in lines[0]
    assert [ln.split()[:2] for ln in lines[1:]] == [["SKIP", name] for name in CHECKS]


@pytest.mark.slow
def test_service_checks_pass_on_the_cpu() -> None:
    env = {"DITSERVE_GPU_CHECK_DEVICE": "cpu", "DITSERVE_GPU_CHECK_PRESET": "tiny", "DITSERVE_GPU_CHECK_STEPS": "8"}
    res = run(env, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    status = {ln.split()[1]: ln.split()[0] for ln in res.stdout.splitlines()[1:-1]}
    assert {status[n] for n in ("cached-abab", "swap-in", "resident-abab", "sidecar-kill")} == {"PASS"}
    assert res.stdout.splitlines()[-1].startswith("gpu_check: all checks passed")
