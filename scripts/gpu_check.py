"""One-shot accelerator check (run by scripts/gpu_check.sh): one summary line per check, with its numbers, then a
verdict.

Checks, in order (each line starts with PASS, FAIL or SKIP):
  gpu-tests        the `gpu`-marked tests (pytest -m gpu on the test files that have them); two of them report numbers
                   (test properties in the JUnit XML) on lines of their own:
  syncs-per-step   host syncs per denoise step (transformer forward + scheduler steps, sync debug mode "warn"),
                   cached vs resident: the cache must add none
  pinned-bytes     pinned host-tier bytes vs configured bytes (the just-over-4-GiB test)
  cached-abab      `ditserve serve --adaln-mode cached` on a bf16 (mixed) bench repository, requests A, B, A, B:
                   builds then host-tier hits, host tier pinned
  swap-in          host-to-device swap-in bandwidth of those host hits (GB/s)
  sidecar-kill     on a cached serve whose slab is at least 1 GiB (on cuda): `kill -9` of the sidecar mid-request:
                   the request fails UNAVAILABLE, serve restarts the sidecar, the same request then gives the same
                   sha256; the generator logs that it closed the old slab mapping (its storage freed), and device
                   memory did not grow by half a slab (a leaked slab would add all of it)
  resident-abab    the same requests on `--adaln-mode resident`: sha256 equal to cached
  fl2va            request A as fl2va from a first (PNG) and last (JPEG) frame made with Pillow, on the cached serve
                   after A, B, A, B and on the resident one: sha256 equal, and not t2va A's
  ref2va           request A as ref2va with two image references (a PNG and a JPEG made with Pillow; video and
                   audio references need PyAV, which the offline device lacks), on the cached serve after A, B, A, B
                   and on the resident one: sha256 equal, and not t2va A's (transformer_ref/ and the references used)
  adapters         request A with a LoRA on every target group (`ditserve make-adapter --targets all`, musubi layout,
                   rank 4) at scale 0.8, on the cached serve (trunk in PEFT layers, modulation in plans its sidecar
                   builds) and on the resident one (PEFT everywhere): sha256 equal, and not A's
  quality-audit    cached-abab's serve, started with a quality-levels file (one FirstBlockCache level), an audit
                   directory and an admin token: after its requests, `ditserve audit-quality` of one t2va request
                   on it (lossless and at the level, as frames_and_wav): its latency ratio, skipped fraction,
                   PSNR / SSIM, audio corr / SNR and verdict; on cuda on the released canvas 768 x 1344 at 124
                   frames (the 345-frame envelope does not fit the budget: DITSERVE_GPU_CHECK_AUDIT_CANVAS=
                   768x1344x345 with a larger one), 32 x 32 on the CPU;
                   passes when every request was measured, one record each was written and the level skipped blocks
                   (the verdict is printed, not required: random weights)
  multi-device     with 2+ GPUs visible: `ditserve serve --nproc D` (D = 4 with 4+ GPUs, else 2; Ulysses D,
                   --ulysses-anything on NCCL) cached and resident on request A: sha256 equal, and the per-step time
                   against cached-abab's one device; skipped with one line otherwise

`--out DIR` keeps what the checks measure there: the gpu tests' JUnit XML (gpu-tests.xml) and, when a service check
failed, the tails of the serve logs (serve-logs.txt). DITSERVE_GPU_CHECK_SERVICES (default
cached,kill,resident,quality,replica) picks the service checks: cached-abab and swap-in always run (the others compare
with their sha256); leaving out kill, resident, quality or replica skips sidecar-kill, resident-abab with fl2va, ref2va
and adapters, quality-audit, or multi-device.
Every service runs as `python -m ditserve` (no console scripts), so the offline layout (scripts/gpu_check.sh --offline:
the repository root and the carried wheels on PYTHONPATH, no venv) runs them as the venv does.

Without any GPU (`nvidia-smi -L` lists none) every check is skipped (exit 0). A GPU that torch cannot use
(`nvidia-smi -L` lists one, `torch.cuda.is_available()` is False: a CPU build of torch, a driver too old for its CUDA)
is a FAIL (exit 1). DITSERVE_GPU_CHECK_DEVICE=cpu runs the service checks on the CPU (a slow test does, so this
script cannot rot); the pytest part needs CUDA. The whole run has a time budget (DITSERVE_GPU_CHECK_BUDGET_S,
default 270 s); a check still running when it is spent fails.

This file is the entry point (is there a GPU torch can use? then each part, then the verdict); its parts, beside it:
gpu_check_common.py (settings, output lines, budget), gpu_check_tests.py (gpu-tests), gpu_check_serve.py (the
services' processes), gpu_check_services.py (the service checks) and gpu_check_quality.py (quality-audit).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package: its parts sit beside it
from gpu_check_common import SELECTED, SERVICES, failures, line
from gpu_check_serve import keep_serve_logs
from gpu_check_services import services
from gpu_check_tests import NAMED_TESTS, gpu_tests

CHECKS = ("gpu-tests", *NAMED_TESTS, "cached-abab", "swap-in", "quality-audit", "sidecar-kill", "resident-abab",
          "fl2va", "ref2va", "adapters", "multi-device")  # fmt: skip


# ------------------------------------------------------------------ is there a GPU?
def nvidia_smi_gpus() -> list[str]:
    """The GPUs `nvidia-smi -L` lists ("GPU 0: NVIDIA H200 (UUID: GPU-...)"); none without the tool or a driver."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [s.strip() for s in out.stdout.splitlines() if s.strip().startswith("GPU ")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="keep the JUnit XML (and failed checks' serve logs) here")
    args = parser.parse_args(argv)
    unknown = sorted(set(SELECTED) - set(SERVICES))
    if unknown:
        parser.error(f"DITSERVE_GPU_CHECK_SERVICES: {', '.join(unknown)} not among {', '.join(SERVICES)}")
    import torch

    device = os.environ.get("DITSERVE_GPU_CHECK_DEVICE", "cuda")
    cuda = torch.cuda.is_available()
    print(f"gpu_check: device {device}; torch {torch.__version__} (CUDA {torch.version.cuda}); cuda available: "
          f"{cuda}" + (f" ({torch.cuda.get_device_name(0)})" if cuda else ""), flush=True)  # fmt: skip
    if device.startswith("cuda") and not cuda:
        gpus = nvidia_smi_gpus()
        if gpus:
            line("FAIL", "cuda", f"nvidia-smi lists {len(gpus)} GPU(s) ({gpus[0]}) but torch {torch.__version__} "
                 f"(built for CUDA {torch.version.cuda}) cannot use them: torch.cuda.is_available() is False; "
                 "install the CUDA build of torch (scripts/bootstrap.sh) and check the driver")  # fmt: skip
            for name in CHECKS:
                line("SKIP", name, "torch cannot use the GPU")
            print("gpu_check: FAIL: cuda", flush=True)
            return 1
        for name in CHECKS:
            line("SKIP", name, "no GPU (nvidia-smi -L lists none; torch.cuda.is_available() is False)")
        return 0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-", dir="/tmp") as tmp:
        work = Path(tmp)
        out = args.out or work
        out.mkdir(parents=True, exist_ok=True)
        steps: list[Callable[[], None]] = [lambda: gpu_tests(out, cuda), lambda: services(work, device)]
        for step in steps:
            try:
                step()
            except Exception as e:  # a broken check is a failure line, never a silent skip
                line("FAIL", "error", f"{type(e).__name__}: {e}")
        if failures and args.out:
            keep_serve_logs(work, args.out)
    verdict = "FAIL: " + ", ".join(failures) if failures else "all checks passed"
    print(f"gpu_check: {verdict} in {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
