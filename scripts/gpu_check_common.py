"""What every part of scripts/gpu_check.py shares: its settings (DITSERVE_GPU_CHECK_* environment), the requests it
sends, and its output: one PASS / FAIL / SKIP line per check, the failures so far, and the time budget."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

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
SERVICES = ("cached", "kill", "resident", "replica")
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
