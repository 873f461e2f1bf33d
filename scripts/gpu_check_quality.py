"""The quality-audit check of scripts/gpu_check.py: cached-abab's `ditserve serve` started with a quality-levels file
of one FirstBlockCache level, an audit directory and an admin token, then `ditserve audit-quality` of a one-request
file on it (lossless and at the level, as frames_and_wav), the check's line carrying the audit's numbers per request.

The canvas: on cuda the released canvas, 768 x 1344, at its shortest duration, 124 frames (5 s). The released
envelope's 345 frames does not fit the check's budget: the audit's measures (SSIM over every frame, the PNG round
trip of both results) grow with the frames as the transformer's attention grows with their square, and the service
checks share DITSERVE_GPU_CHECK_BUDGET_S (270 s); DITSERVE_GPU_CHECK_AUDIT_CANVAS=768x1344x345 runs it with a larger
budget. The line says which canvas ran and whether it is the full envelope. On the CPU (the dry run) 32 x 32 x 124.

The level's threshold is the one that skips about half of the bench preset's block forwards on a 50-point schedule
(0.05: bench scenario 18); the tiny preset's few steps skip only above 0.5. On random weights the numbers mean nothing
for quality: the check passes when the audit ran every request (none refused), wrote one record each where the server
reads them, and the level skipped blocks; the verdict against the thresholds is printed, not required.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from gpu_check_common import DITSERVE, PRESET, PROMPT, ROOT, STEPS, check, left

LEVEL = "fast"
RELEASED_CANVAS = (768, 1344, 345)
CUDA_CANVAS = (768, 1344, 124)
CPU_CANVAS = (32, 32, 124)
THRESHOLDS = {"min_psnr_db": 28.0, "min_ssim": 0.92, "min_audio_snr_db": 10.0, "min_audio_corr": 0.9}
"""The issue's example level's thresholds (docs/quality.md): the verdict printed, not required (random weights)."""
TOKEN = "gpu-check-audit-admin-token"  # an audit run needs the admin token (>= 16 characters)


def audit_canvas(device: str) -> tuple[int, int, int]:
    """(height, width, num_frames): DITSERVE_GPU_CHECK_AUDIT_CANVAS (HxWxF), else CUDA_CANVAS or CPU_CANVAS."""
    raw = os.environ.get("DITSERVE_GPU_CHECK_AUDIT_CANVAS", "")
    if raw:
        h, w, f = (int(v) for v in raw.lower().split("x"))
        return h, w, f
    return CUDA_CANVAS if device.startswith("cuda") else CPU_CANVAS


def audit_threshold() -> float:
    """FirstBlockCache's threshold: DITSERVE_GPU_CHECK_AUDIT_THRESHOLD, else one that skips blocks on the preset."""
    raw = os.environ.get("DITSERVE_GPU_CHECK_AUDIT_THRESHOLD", "")
    return float(raw) if raw else {"tiny": 0.5}.get(PRESET, 0.05)


def levels_toml(threshold: float, canvas: tuple[int, int, int]) -> str:
    h, w, f = canvas
    audit = ", ".join(f"{k} = {v}" for k, v in THRESHOLDS.items())
    return (f'[levels.{LEVEL}]\ndescription = "FirstBlockCache at {threshold:g} (the GPU check)"\n'
            f'cache = {{ kind = "first_block", threshold = {threshold} }}\ntasks = ["t2va"]\nsteps = [{STEPS}]\n'
            f"max_height = {h}\nmax_width = {w}\nmax_num_frames = {f}\nworld_sizes = [1]\n"
            f'unaudited = "refuse"\naudit = {{ {audit} }}\n')  # fmt: skip


class QualityAudit:
    """The audit's files under `work`/quality (the levels file, the admin token, the request, the audit directory),
    the flags that serve them (`flags`, added to cached-abab's serve: the audit needs no serve of its own), and the
    audit itself on that serve (`run`)."""

    def __init__(self, work: Path, device: str) -> None:
        self.canvas = audit_canvas(device)
        h, w, f = self.canvas
        if self.canvas == RELEASED_CANVAS:
            self.where = f"{h}x{w}x{f}, the released envelope"
        elif device.startswith("cuda"):
            envelope = "x".join(map(str, RELEASED_CANVAS))
            self.where = f"{h}x{w}x{f}, not the released envelope {envelope}: it does not fit the check's budget"
        else:
            self.where = f"{h}x{w}x{f}, the CPU dry run"
        self.threshold = audit_threshold()
        folder = work / "quality"
        self.audits = folder / "audits"
        self.audits.mkdir(parents=True, exist_ok=True)
        (folder / "levels.toml").write_text(levels_toml(self.threshold, self.canvas))
        self.token = folder / "admin-token"
        self.token.write_text(TOKEN + "\n")
        self.token.chmod(0o600)
        self.requests = folder / "audit.jsonl"
        request = {"request_id": "Q1", "prompt": PROMPT, "num_inference_steps": STEPS, "seed": 1, "height": h,
                   "width": w, "num_frames": f}  # fmt: skip
        self.requests.write_text(json.dumps(request) + "\n")
        self.flags = ("--quality-levels", str(folder / "levels.toml"), "--quality-audit-dir", str(self.audits),
                      "--admin-token-file", str(self.token))  # fmt: skip

    def run(self, target: str) -> None:
        """`ditserve audit-quality` on the serve at `target` (started with `flags`), then the check's line."""
        proc = subprocess.run([*DITSERVE, "audit-quality", "--target", target, "--level", LEVEL, "--requests",
                               str(self.requests), "--audit-dir", str(self.audits), "--token-file", str(self.token)],
                              cwd=ROOT, capture_output=True, text=True, timeout=left(600))  # fmt: skip
        out = [json.loads(s) for s in proc.stdout.splitlines() if s.strip().startswith("{")]
        per_request = [r for r in out if "request_id" in r]
        path = self.audits / f"{LEVEL}.jsonl"
        records = path.read_text().splitlines() if path.exists() else []
        ran = [r for r in per_request if "measures" in r]
        ok = (proc.returncode in (0, 1) and len(ran) == len(per_request) == 1 and len(records) == 1
              and all(r["measures"]["skipped_fraction"] > 0 for r in ran))  # fmt: skip
        verdicts = ", ".join(f"{r['request_id']} {'passed' if r.get('passed') else 'failed'}" for r in ran) or "none"
        check("quality-audit", ok,
              f"level {LEVEL} (FirstBlockCache {self.threshold:g}) on {self.where}, {STEPS} steps, cached: audit "
              f"exit {proc.returncode}, {len(ran)}/{len(per_request)} request(s) measured, {len(records)} record(s) "
              f"written; verdict {verdicts}; " + "; ".join(map(_numbers, per_request))
              + ("" if ok else f"; {proc.stderr.strip()[-300:]}"))  # fmt: skip


def _numbers(r: dict[str, Any]) -> str:
    """One audited request's numbers, or why the level refused it."""
    if "measures" not in r:
        return f"{r['request_id']} shape {r.get('shape')}: refused: {r.get('refused')}"
    m = r["measures"]
    return (f"{r['request_id']} shape {r['shape']}: latency ratio {m['latency_ratio']:.3f} (denoise "
            f"{m['denoise_ratio']:.3f}), skipped fraction {m['skipped_fraction']:.3f}, PSNR {m['psnr_db']:.2f} dB, "
            f"SSIM {m['ssim']:.4f}, audio corr {m['audio_corr']:.4f}, audio SNR {m['audio_snr_db']:.2f} dB; "
            f"{'passed' if r['passed'] else 'failed: ' + ', '.join(r['misses'])}")  # fmt: skip
