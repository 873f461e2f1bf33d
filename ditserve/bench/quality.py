"""Scenario 18, quality levels: FirstBlockCache (ditcore.step_cache) on schedule A in this process (a resident model:
the level's hooks, not the plan cache, are what is measured), at the thresholds that skip about a third and about two
thirds of the block forwards.

The thresholds are found first (one run per candidate, the nearest to each fraction kept). Then lossless and each
level run interleaved (`rounds` each, medians of the denoise stage). A skipped block saves its share of a forward, so
the denoise time a skipped fraction `s` predicts is `1 - s x block_share`, where `block_share` is the blocks' share of
the lossless denoise stage, read off the run that skips the most (every block but the first, `s_max`):
`block_share = (1 - ratio_max) / s_max`. Target: each level's measured ratio within 10 % of its prediction. The
outputs differ from lossless (a lossy level), and a lossless run after the levels equals the first (hooks removed).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from ditcore import generate, load_model, validate_checkpoint
from ditcore.step_cache import StepCache, applied

from .context import BenchContext

CANDIDATES = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.8, 1.5)
"""FirstBlockCache thresholds tried (the mean relative change of block 0's residual below which a step is skipped)."""
TARGETS = (1 / 3, 2 / 3)
TOLERANCE = 0.10


def quality_levels(ctx: BenchContext, rounds: int = 2) -> dict[str, Any]:
    torch.set_num_threads(ctx.threads)
    model = load_model(validate_checkpoint(ctx.checkpoint), "resident", torch.device(ctx.device))
    transformer = model.transformer_of("base")
    request = ctx.generation_request("A", "quality")

    def run(cache: StepCache | None) -> tuple[float, float, str]:
        with applied(transformer, cache) as counts:
            result = generate(model, request)
        return result.timings_ms["denoise"], counts.skipped_fraction, result.sha256

    def fbc(threshold: float) -> StepCache:
        return StepCache("first_block", (("threshold", threshold),))

    lossless_sha = run(None)[2]  # warm-up and the reference bits
    found = {t: run(fbc(t))[1] for t in CANDIDATES}

    def nearest(fraction: float) -> float:
        return min(CANDIDATES, key=lambda t: abs(found[t] - fraction))

    picks = [nearest(f) for f in TARGETS]
    most = max(CANDIDATES, key=lambda t: found[t])
    times: dict[str, list[float]] = {"lossless": []}
    skipped: dict[str, float] = {}
    shas: dict[str, str] = {}
    for _ in range(rounds):
        times["lossless"].append(run(None)[0])
        for t in dict.fromkeys([*picks, most]):
            ms, s, sha = run(fbc(t))
            times.setdefault(f"{t:g}", []).append(ms)
            skipped[f"{t:g}"], shas[f"{t:g}"] = s, sha
    after = run(None)[2]
    base = statistics.median(times["lossless"])
    ratio = {k: statistics.median(v) / base for k, v in times.items() if k != "lossless"}
    s_max, r_max = skipped[f"{most:g}"], ratio[f"{most:g}"]
    share = (1 - r_max) / s_max if s_max > 0 else 0.0
    levels = []
    for t in picks:
        k = f"{t:g}"
        predicted = 1 - skipped[k] * share
        levels.append({"threshold": t, "skipped_fraction": round(skipped[k], 4), "ratio": round(ratio[k], 4),
                       "predicted": round(predicted, 4), "off_by": round(ratio[k] / predicted - 1, 4),
                       "lossy": shas[k] != lossless_sha})  # fmt: skip
    worst = max(abs(lv["off_by"]) for lv in levels)
    return {
        "ratio": round(worst, 4),
        "target": f"each level's denoise ratio within {TOLERANCE:.0%} of 1 - skipped x block share",
        "met": worst <= TOLERANCE,
        "levels": levels,
        "most_skipped": {"threshold": most, "skipped_fraction": round(s_max, 4), "ratio": round(r_max, 4)},
        "block_share": round(share, 4),
        "candidates": {f"{t:g}": round(f, 4) for t, f in found.items()},
        "lossless_denoise_ms": round(base, 3),
        "lossless_after_equal": after == lossless_sha,
        "rounds": rounds,
    }
