"""What every part of scripts/gpu_check.py shares: its settings (DITSERVE_GPU_CHECK_* environment), the requests it
sends (and the reference images of its ref2va one), and its output: one PASS / FAIL / SKIP line per check, the
failures so far, and the time budget."""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DITSERVE = [sys.executable, "-m", "ditserve"]
PROMPT = "a red fox runs through the snow"
STEPS = int(os.environ.get("DITSERVE_GPU_CHECK_STEPS", "50"))
PRESET = os.environ.get("DITSERVE_GPU_CHECK_PRESET", "bench")
BUDGET_S = float(os.environ.get("DITSERVE_GPU_CHECK_BUDGET_S", "270"))
GIB, MIB = 1024**3, 1024**2
REQUESTS = [
    {"request_id": "A1", "prompt": PROMPT, "num_inference_steps": STEPS, "seed": 1},
    {"request_id": "B1", "prompt": PROMPT, "num_inference_steps": STEPS, "seed": 1, "flow_shift": 7.0},
    {"request_id": "A2", "prompt": PROMPT, "num_inference_steps": STEPS, "seed": 1},
    {"request_id": "B2", "prompt": PROMPT, "num_inference_steps": STEPS, "seed": 1, "flow_shift": 7.0},
]
REF_IMAGES = {"ref-image.png": ("PNG", 80, 48), "ref-image.jpg": ("JPEG", 48, 64)}
"""ref2va's references: file name -> (format, width, height). Images only, made with Pillow (the device image has
it): a video or audio reference is probed with PyAV (ditcore.references), which the offline device lacks."""
KEYFRAMES = {"first-frame.png": ("PNG", 64, 48), "last-frame.jpg": ("JPEG", 48, 64)}
"""fl2va's first and last frames: file name -> (format, width, height), made with Pillow."""
SERVICES = ("cached", "kill", "resident", "quality", "replica")
SELECTED = tuple(s for s in os.environ.get("DITSERVE_GPU_CHECK_SERVICES", ",".join(SERVICES)).split(",") if s)
failures: list[str] = []
deadline = time.monotonic() + BUDGET_S


def line(status: str, name: str, detail: str) -> None:
    print(f"{status:<4} {name:<15} {detail}", flush=True)
    if status == "FAIL":
        failures.append(name)


def check(name: str, ok: bool, detail: str) -> None:
    line("PASS" if ok else "FAIL", name, detail)


def left(want: float) -> float:
    """A timeout of `want` seconds, cut to what is left of the budget (TimeoutError once it is spent)."""
    rest = deadline - time.monotonic()
    if rest <= 1:
        raise TimeoutError(f"the {BUDGET_S:.0f} s budget (DITSERVE_GPU_CHECK_BUDGET_S) is spent")
    return min(want, rest)


def _write_image(path: Path, fmt: str, width: int, height: int, shift: int = 0) -> None:
    """A deterministic RGB pattern (no numpy: every channel its own gradient, so the encoders see structure), saved
    with Pillow (the device image has it)."""
    from PIL import Image

    pixels = bytes(
        (x * 5 + y * 3 + c * 85 + shift) % 256 for y in range(height) for x in range(width) for c in range(3)
    )
    buf = io.BytesIO()
    Image.frombytes("RGB", (width, height), pixels).save(buf, format=fmt)
    path.write_bytes(buf.getvalue())


def ref2va_request(work: Path) -> dict[str, Any]:
    """Request A as ref2va: its prompt, steps and seed with the REF_IMAGES references, written into `work` (where
    the JSONL goes: a JSONL line names its references relative to its own folder)."""
    refs = []
    for name, (fmt, width, height) in REF_IMAGES.items():
        _write_image(work / name, fmt, width, height)
        refs.append(f"image:{name}")
    return {**REQUESTS[0], "request_id": "R1", "task": "ref2va", "references": refs}


def fl2va_request(work: Path) -> dict[str, Any]:
    """Request A as fl2va: its prompt, steps and seed from the KEYFRAMES first and last frames, written into `work`."""
    for i, (name, (fmt, width, height)) in enumerate(KEYFRAMES.items()):
        _write_image(work / name, fmt, width, height, shift=97 * i)
    first, last = KEYFRAMES
    return {**REQUESTS[0], "request_id": "F1", "task": "fl2va", "first_frame": first, "last_frame": last}
