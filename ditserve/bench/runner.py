"""`ditserve bench [--quick] [--out DIR] [--checkpoint DIR] [--preset P] [--dtype D] [--device cpu|cuda]`.

Starts real service pairs (sidecar + generator over a unix socket) on a MiniMax-H3 repository of the `bench` preset
in the released mixed precision (or `tiny` with --quick, or a given checkpoint), runs the scenarios in one process
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

from ditcore import PresetError, write_repository
from ditcore.checkpoint_files import is_repository_dir
from ditcore.presets import DTYPES
from ditruntime.paths import prepare_dir

from . import adapters, context, disk_tier, quality, read_path, replica, report, scenarios
from .harness import Record
from .jobs_scenario import job_overhead


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny preset, 8-step requests: a few minutes")
    p.add_argument("--out", default="bench-out", help="output directory (default %(default)s)")
    p.add_argument("--checkpoint", default=None, help="repository to serve (default: a generated one, see --preset)")
    p.add_argument(
        "--preset", default=None, help="preset of the generated repository (default bench; tiny with --quick)"
    )
    p.add_argument(
        "--dtype", default="mixed", choices=DTYPES, help="precision of the generated repository (default %(default)s)"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default %(default)s)")
    p.add_argument(
        "--num-inference-steps",
        type=int,
        default=None,
        help="schedule points per request, N - 1 forwards (default 50; 8 with --quick)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads per service (default: cores / 2)")


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cmd_bench(args: argparse.Namespace) -> int:
    out = prepare_dir(args.out, "--out")
    steps = args.num_inference_steps or (8 if args.quick else 50)
    if steps < 3:
        raise SystemExit("ditserve bench: --num-inference-steps must be at least 3 (two forwards)")
    threads = args.threads or max(1, (os.cpu_count() or 2) // 2)  # two services share the cores
    preset = args.preset or ("tiny" if args.quick else "bench")
    if args.checkpoint:
        ckpt = Path(args.checkpoint)
    else:
        ckpt = out / f"checkpoint-{preset}-{args.dtype}"
        if not is_repository_dir(ckpt):
            try:
                write_repository(ckpt, preset, seed=0, dtype=args.dtype)
            except PresetError as e:
                raise SystemExit(f"ditserve bench: --preset: {e}") from e
    records: list[Record] = []
    ctx = context.BenchContext(
        checkpoint=ckpt, num_inference_steps=steps, device=args.device, threads=threads, workdir=out,
        repeats=2 if args.quick else 3, records=records, log=lambda m: print(m, file=sys.stderr, flush=True),
    )  # fmt: skip
    t0 = time.perf_counter()
    load_start = _loadavg()
    info = ctx.model().info
    results: dict[str, dict[str, Any]] = {}
    ctx.log("1. repeat vs first-seen")
    results["repeat_vs_first_seen"] = scenarios.repeat_vs_first_seen(ctx)
    first_seen = [r for r in records if r.arm == "repeat" and r.tier == "built"]
    ctx.log("2-3. host tier and alternating schedules")
    host, alt = scenarios.alternating(ctx)
    results["host_tier"] = host
    results["alternating"] = alt
    ctx.log("4-5, 9. cached vs resident, sidecar overhead (interleaved); generator memory")
    results["cached_vs_resident"], results["sidecar_overhead"], memory = scenarios.steady_state(ctx)
    ctx.log("6. PreparePlans latency")
    results["prepare_latency"] = scenarios.prepare_latency(ctx, calls=100 if args.quick else 300)
    ctx.log("7. rebuild efficiency")
    bit_exact = bool(alt["sha256_identical"] and results["cached_vs_resident"]["sha256_identical"])
    results["rebuild_efficiency"] = scenarios.rebuild_efficiency(ctx, first_seen, bit_exact)
    ctx.log("16. rebuild read path and host tier copies against plain reads and copies")
    results["read_path"] = read_path.read_path(ctx, rounds=3 if args.quick else 9, released_pages=not args.quick)
    ctx.log("17. a known schedule after a restart: from the disk tier against a rebuild")
    results["restart_from_disk"] = disk_tier.restart_from_disk(ctx)
    ctx.log("8. rebuild overlap")
    results["rebuild_overlap"] = scenarios.rebuild_overlap(ctx)
    results["generator_memory"] = memory
    ctx.log("10. decode + mux share of an MP4 request")
    results["media_share"] = scenarios.media_share(ctx)
    ctx.log("11. fl2va plans over repeated requests")
    results["fl2va_cache"] = scenarios.fl2va_cache(ctx, _keyframe_png())
    ctx.log("14. ref2va plans over repeated requests; one generator with both partitions")
    results["ref2va_cache"] = scenarios.ref2va_cache(ctx, _references())
    ctx.log("12. a job against a synchronous Generate")
    results["job_overhead"] = job_overhead(ctx)
    ctx.log("13. one replica across 2 ranks")
    results["replica"] = replica.replica_two_ranks(ctx)
    ctx.log("18. quality levels: FirstBlockCache skipping a third and two thirds of the block forwards")
    results["quality_levels"] = quality.quality_levels(ctx, rounds=1 if args.quick else 2)
    ctx.log("15. per-request adapters on one cached pair with the host tier")
    results["adapters"] = adapters.adapters(ctx, base_points=20 if args.quick else 50)
    meta = {
        "checkpoint": str(ckpt), "preset": info.preset, "precision": info.precision,
        "num_inference_steps": steps, "forwards": ctx.forwards, "device": args.device, "threads": threads,
        "quick": args.quick, "seconds": round(time.perf_counter() - t0, 1), "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_start": load_start, "loadavg_end": _loadavg(),
    }  # fmt: skip
    report.write_json(out / "bench.json", results, records, meta)
    report.chart(out / "bench.png", records)
    print(report.table(results))
    print("\n" + adapters.section(results["adapters"]))
    print(f"\nwrote {out / 'bench.json'} and {out / 'bench.png'} ({meta['seconds']} s)")
    return 0


def _references() -> list[dict[str, Any]]:
    """The ref2va scenario's references: the fl2va keyframe PNG, a 1.25 s MP4 (H.264 + stereo AAC at 32 kHz, noise
    frames) and a 1 s mono WAV at 32 kHz, made here (ditcore.media writes the MP4: the same encoder as an output)."""
    import io
    import wave

    import numpy as np

    from ditcore.media import DecodedMedia, encode

    rng = np.random.RandomState(0)
    frames = (rng.rand(30, 48, 64, 3) * 255).astype(np.uint8)
    t = np.arange(40000) / 32000
    stereo = np.stack([0.3 * np.sin(2 * np.pi * 220 * t), 0.3 * np.sin(2 * np.pi * 330 * t)]).astype(np.float32)
    with encode(DecodedMedia(frames=frames, audio=stereo, sampling_rate=32000), "mp4") as media:
        mp4 = media.read_all()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(32000)
        w.writeframes((0.3 * np.sin(2 * np.pi * 440 * t[:32000]) * 32767).astype("<i2").tobytes())
    return [{"data": _keyframe_png(), "kind": "image"}, {"data": mp4, "kind": "video"}, {"data": buf.getvalue()}]


def _keyframe_png() -> bytes:
    """The fl2va scenario's first frame: a fixed 64 x 48 gradient PNG."""
    import io

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:48, 0:64]
    pixels = np.stack([x * 4, y * 5, (x + y) * 2], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ditserve bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_bench_flags(p)
    return cmd_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
