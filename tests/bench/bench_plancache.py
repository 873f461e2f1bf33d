"""Plan-cache core benchmark (issue: plan-cache core). Not part of the default test suite.

    .venv/bin/python tests/bench/bench_plancache.py [--preset bench] [--dtype mixed] [--checkpoint DIR]
                                                    [--num-inference-steps 50]

Prints, from one run on a MiniMax-H3 repository: rebuild seconds vs the time to merely read the plan tensors
(adaln_proj, norm_out.linear) from the checkpoint (ratio), host swap-in bandwidth vs a plain memcpy of the same bytes
(ratio), and the cost of a prepare that is all slot hits (microseconds, p50/p99).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ditcore import GenerationRequest, load_model, validate_checkpoint, write_repository
from ditserve.bench.measure import memcpy_bandwidth, read_plan_tensors_seconds
from plancache_service.cache import PlanCache
from plancache_service.config import CacheConfig
from plancache_service.rebuild import RebuildSource


def run(checkpoint: Path, num_inference_steps: int, prepares: int = 200) -> dict[str, float | str]:
    """Schedules A and B (distinct shifts, width-2 keys) through a cache whose slab holds one of them."""
    info = validate_checkpoint(checkpoint)
    page_bytes = info.layout.page_bytes(info.projection_dtype)
    model = load_model(info, "cached")  # for plan_keys: the schedulers alone, nothing else runs
    a = model.plan_keys(GenerationRequest(prompt="a", num_inference_steps=num_inference_steps, flow_shift=5.0))
    b = model.plan_keys(
        GenerationRequest(prompt="b", num_inference_steps=num_inference_steps, flow_shift=4.0, audio_flow_shift=2.0)
    )
    read_s = read_plan_tensors_seconds(info)
    source = RebuildSource(info, torch.device("cpu"))
    cache = PlanCache(CacheConfig(gpu_plans=len(a), plan_width=2, host_cache_bytes=4 * len(a) * 2 * page_bytes), source)
    try:
        la = cache.prepare(cache.generation, a, "bench")
        rebuild_s = la.report.rebuild_s
        cache.release(la.lease_id)
        lb = cache.prepare(cache.generation, b, "bench")  # evicts A from the slab (host keeps it)
        cache.release(lb.lease_id)
        la = cache.prepare(cache.generation, a, "bench")
        assert la.report.built_plans == 0 and la.report.host_hit_plans > 0, la.report
        swap_s = la.report.swap_in_s
        swapped = sum(k.width for k in dict.fromkeys(a) if k not in set(b)) * page_bytes
        cache.release(la.lease_id)
        memcpy_bw = memcpy_bandwidth(swapped)
        hit_us = []
        for _ in range(prepares):
            t0 = time.perf_counter()
            lease = cache.prepare(cache.generation, a, "bench")
            hit_us.append((time.perf_counter() - t0) * 1e6)
            cache.release(lease.lease_id)
    finally:
        cache.close()
    hit_us.sort()
    swap_bw = swapped / swap_s
    return {
        "num_inference_steps": num_inference_steps,
        "plan_keys": len(a),
        "precision": info.precision,
        "read_plan_tensors_s": round(read_s, 4),
        "rebuild_s": round(rebuild_s, 4),
        "rebuild_over_read": round(rebuild_s / read_s, 2),
        "swap_in_bytes": swapped,
        "swap_in_s": round(swap_s, 6),
        "swap_in_gbps": round(swap_bw / 1e9, 2),
        "memcpy_gbps": round(memcpy_bw / 1e9, 2),
        "swap_over_memcpy_bandwidth": round(swap_bw / memcpy_bw, 2),
        "all_hit_prepare_us_p50": round(statistics.median(hit_us), 1),
        "all_hit_prepare_us_p99": round(hit_us[int(0.99 * (len(hit_us) - 1))], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--dtype", default="mixed", choices=("mixed", "float32"))
    ap.add_argument("--checkpoint", default=None, help="use this repository instead of generating one")
    ap.add_argument("--num-inference-steps", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = (
            Path(args.checkpoint)
            if args.checkpoint
            else write_repository(Path(tmp) / "repo", args.preset, seed=0, dtype=args.dtype)
        )
        out = run(ckpt, args.num_inference_steps)
    width = max(len(k) for k in out)
    for k, v in out.items():
        print(f"{k:<{width}}  {v}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
