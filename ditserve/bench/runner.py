"""`ditserve bench [--quick] [--out DIR] [--checkpoint DIR] [--device cpu|cuda]`.

Starts real service pairs (sidecar + generator over a unix socket) on the `bench` preset
(or `tiny` with --quick, or a given checkpoint), runs the eight scenarios in one process
run, prints the table, writes OUT/bench.json and OUT/bench.png.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ditcore import get_preset, write_checkpoint
from ditcore.checkpoint import is_checkpoint_dir

from . import report, scenarios
from .harness import Record


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny preset, few steps: under two minutes")
    p.add_argument("--out", default="bench-out", help="output directory (default %(default)s)")
    p.add_argument("--checkpoint", default=None, help="checkpoint to serve (default: a generated bench/tiny one)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="denoise steps per request (default 50; 8 with --quick)")
    p.add_argument(
        "--preset", default=None, help="preset of the generated checkpoint (default bench; tiny with --quick)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads per service (default: cores / 2)")


def cmd_bench(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = args.steps or (8 if args.quick else 50)
    threads = args.threads or max(1, (os.cpu_count() or 2) // 2)  # two services share the cores
    preset = args.preset or ("tiny" if args.quick else "h3lite" if args.device.startswith("cuda") else "bench")
    if args.checkpoint:
        ckpt = Path(args.checkpoint)
    else:
        ckpt = out / f"checkpoint-{preset}"
        if not is_checkpoint_dir(ckpt):
            write_checkpoint(get_preset(preset), ckpt, seed=0)
    records: list[Record] = []
    ctx = scenarios.BenchContext(
        checkpoint=ckpt, steps=steps, device=args.device, threads=threads, workdir=out,
        repeats=2 if args.quick else 3, records=records, log=lambda m: print(m, file=sys.stderr, flush=True),
    )  # fmt: skip
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    ctx.log("1. repeat vs first-seen")
    results["repeat_vs_first_seen"] = scenarios.repeat_vs_first_seen(ctx)
    first_seen = [r for r in records if r.arm == "repeat" and r.tier == "built"]
    ctx.log("2-3. host tier and alternating schedules")
    host, alt = scenarios.alternating(ctx)
    results["host_tier"] = host
    results["alternating"] = alt
    ctx.log("4-5. cached vs resident, sidecar overhead (interleaved)")
    results["cached_vs_resident"], results["sidecar_overhead"] = scenarios.steady_state(ctx)
    ctx.log("6. PreparePlans latency")
    results["prepare_latency"] = scenarios.prepare_latency(ctx, calls=100 if args.quick else 300)
    ctx.log("7. rebuild efficiency")
    bit_exact = bool(alt["sha256_identical"] and results["cached_vs_resident"]["sha256_identical"])
    results["rebuild_efficiency"] = scenarios.rebuild_efficiency(ctx, first_seen, bit_exact)
    ctx.log("8. rebuild overlap")
    results["rebuild_overlap"] = scenarios.rebuild_overlap(ctx)
    meta = {
        "checkpoint": str(ckpt), "preset": preset, "steps": steps, "device": args.device, "threads": threads,
        "quick": args.quick, "seconds": round(time.perf_counter() - t0, 1), "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }  # fmt: skip
    report.write_json(out / "bench.json", results, records, meta)
    report.chart(out / "bench.png", records)
    print(report.table(results))
    print(f"\nwrote {out / 'bench.json'} and {out / 'bench.png'} ({meta['seconds']} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ditserve bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_bench_flags(p)
    return cmd_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
