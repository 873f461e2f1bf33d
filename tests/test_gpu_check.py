"""scripts/gpu_check.sh, the one-shot accelerator check: without any GPU it skips every check cleanly (exit 0); a GPU
that torch cannot use (`nvidia-smi -L` lists one, `torch.cuda.is_available()` is False) is a FAIL (exit 1), never a
silent skip; and (slow) its service checks pass when run on the CPU, so the script cannot rot between the rare runs
on a GPU. `nvidia-smi` is a stand-in script on PATH here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
CHECKS = ("gpu-tests", "syncs-per-step", "pinned-bytes", "cached-abab", "swap-in", "sidecar-kill", "resident-abab")
no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="with CUDA the script runs every check (scripts/gpu_check.sh)"
)


def run(env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})  # fmt: skip


def fake_nvidia_smi(bin_dir: Path, stdout: str, code: int = 0) -> dict[str, str]:
    """PATH with only a stand-in `nvidia-smi` (printing `stdout`, exiting `code`) on it."""
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "nvidia-smi"
    quoted = stdout.replace("'", "'\\''")
    tool.write_text(f"#!/bin/sh\nprintf '%s\\n' '{quoted}'\nexit {code}\n")  # shell builtins only: PATH is bin_dir
    tool.chmod(0o755)
    return {"PATH": str(bin_dir)}


@no_cuda
@pytest.mark.parametrize(
    "nvidia_smi",
    [
        None,  # no nvidia-smi at all
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 9),
        ("No devices were found", 6),
    ],
)
def test_without_any_gpu_every_check_is_skipped_and_the_exit_is_0(
    tmp_path: Path, nvidia_smi: tuple[str, int] | None
) -> None:
    env = fake_nvidia_smi(tmp_path / "bin", *nvidia_smi) if nvidia_smi else {"PATH": str(tmp_path / "empty")}
    res = run(env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("gpu_check: device cuda;") and "cuda available: False" in lines[0]
    assert [ln.split()[:2] for ln in lines[1:]] == [["SKIP", name] for name in CHECKS]
    assert all("no GPU" in ln for ln in lines[1:])


@no_cuda
def test_a_gpu_torch_cannot_use_is_a_failure_and_the_exit_is_1(tmp_path: Path) -> None:
    listed = "GPU 0: NVIDIA H200 (UUID: GPU-6a0e2c1b-1d7c-4f38-9a3e-4b5c6d7e8f90)"
    res = run(fake_nvidia_smi(tmp_path / "bin", listed), timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[1].split()[:2] == ["FAIL", "cuda"]
    assert f"nvidia-smi lists 1 GPU(s) ({listed})" in lines[1] and "torch.cuda.is_available() is False" in lines[1]
    assert [ln.split()[:2] for ln in lines[2:-1]] == [["SKIP", name] for name in CHECKS]
    assert lines[-1] == "gpu_check: FAIL: cuda"


@pytest.mark.slow
def test_service_checks_pass_on_the_cpu() -> None:
    env = {"DITSERVE_GPU_CHECK_DEVICE": "cpu", "DITSERVE_GPU_CHECK_PRESET": "tiny", "DITSERVE_GPU_CHECK_STEPS": "8",
           "DITSERVE_GPU_CHECK_BUDGET_S": "850"}  # fmt: skip
    res = run(env, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    status = {ln.split()[1]: ln.split()[0] for ln in res.stdout.splitlines()[1:-1]}
    assert {status[n] for n in ("cached-abab", "swap-in", "sidecar-kill", "resident-abab")} == {"PASS"}
    kill = next(ln for ln in res.stdout.splitlines() if ln.split()[1:2] == ["sidecar-kill"])
    assert "closed the old slab mapping (storage freed): True" in kill, kill
    assert res.stdout.splitlines()[-1].startswith("gpu_check: all checks passed")
