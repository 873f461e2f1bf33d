"""Real-page-size probe (run by scripts/gpu_check.sh; runnable alone): one JSON line per part, to stdout and to
DIR/probe.jsonl, each part time-capped; a part that runs past its cap or fails gives a line with "status" "timeout"
or "error" (or "fail": it ran but missed its own target, "pass" false) and the probe goes on with the next.

    python scripts/gpu_probe.py [--out DIR] [--parts slab,swap,block,vae,rebuild,disk,readpath] [--budget-s 150]
    python scripts/gpu_probe.py --describe        # what it measures on an H200, at which sizes

The parts are scripts/gpu_probe_parts.py's (slab, swap, block, vae, rebuild, disk, readpath). They run in one worker
process, in order; the worker is killed when a part passes its cap (`cap_s`, cut to what is left of --budget-s) and a
new one runs the parts left. DITSERVE_GPU_CHECK_DEVICE (default cuda): on cuda the parts run at the released sizes;
on cpu at the `tiny` preset's, each line saying "scaled": true with the sizes used and the full ones. On cuda without
a usable GPU every part is "skipped". Parts disk and readpath write their files under DITSERVE_GPU_PROBE_DIR, else
the temp dir (the repository's folder when the temp dir is tmpfs), and delete them. After the parts, a summary line,
and when disk and rebuild both came out ok, a 50-point schedule's restart from disk against its modeled rebuild pass.
Exit 1 if a part did not come out ok.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
PARTS = ("slab", "swap", "block", "vae", "rebuild", "disk", "readpath")
CAPS_S = {"slab": 45.0, "swap": 45.0, "block": 90.0, "vae": 120.0, "rebuild": 30.0, "disk": 45.0, "readpath": 45.0}
"""Each part's cap on CUDA (its modeled time there is a third of it or less); on the CPU every part gets 120 s."""
STARTUP_S = 90.0
"""The worker's start (importing torch, initializing the device) before the first part's cap starts counting."""
MARK = "@probe "
"""Prefix of the worker's result lines (anything else it prints is passed through)."""
OK_STATUSES = ("ok", "skipped")


def device_name() -> str:
    return os.environ.get("DITSERVE_GPU_CHECK_DEVICE", "cuda")


def cap_s(part: str) -> float:
    """The part's cap: DITSERVE_GPU_PROBE_CAP_S ("30" for every part, or "vae=60,block=20"), else CAPS_S on cuda,
    120 s on the CPU."""
    for item in filter(None, os.environ.get("DITSERVE_GPU_PROBE_CAP_S", "").split(",")):
        name, _, value = item.rpartition("=")
        if name in ("", part):
            return float(value)
    return CAPS_S[part] if device_name().startswith("cuda") else 120.0


# ---------------------------------------------------------------------------- worker (imports torch)
def emit(record: dict[str, Any]) -> None:
    print(MARK + json.dumps(record), flush=True)


def worker(parts: list[str]) -> int:
    import torch

    sys.path.insert(0, str(SCRIPTS))
    from gpu_probe_parts import PARTS as RUN
    from gpu_probe_parts import Context, sizes

    name = device_name()
    scaled = not name.startswith("cuda")
    usable = scaled or torch.cuda.is_available()
    ctx = Context(torch.device(name if usable else "cpu"), scaled)
    if usable and not scaled:
        torch.zeros(1, device=ctx.device)  # the CUDA context, outside the first part's cap
    emit({"ready": True})
    for part in parts:
        base: dict[str, Any] = {"part": part, "device": name, "scaled": scaled, "sizes": sizes(part, scaled)}
        if scaled:
            base["full_sizes"] = sizes(part, False)
        if not usable:
            emit({**base, "status": "skipped", "reason": f"torch {torch.__version__} sees no CUDA device"})
            continue
        t0 = time.monotonic()
        try:
            numbers = RUN[part](ctx)
            status = "fail" if numbers.get("pass") is False else "ok"  # a part's own target missed (a leak, say)
            emit({**base, "status": status, **numbers, "elapsed_s": round(time.monotonic() - t0, 3)})
        except Exception as e:  # a part that fails is one line; the next part still runs
            tb = traceback.format_exc(limit=6)
            emit({**base, "status": "error", "error": f"{type(e).__name__}: {e}"[:2000], "traceback": tb[-3000:],
                  "elapsed_s": round(time.monotonic() - t0, 3)})  # fmt: skip
        finally:
            gc.collect()
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


# ---------------------------------------------------------------------------- parent (no torch)
class Worker:
    """One worker process over `parts`, its result lines on a queue (None at its end)."""

    def __init__(self, parts: list[str], err: IO[str]) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", ",".join(parts)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            if raw.startswith(MARK):
                self.lines.put(json.loads(raw[len(MARK) :]))
            else:
                sys.stdout.write(raw)
        self.lines.put(None)

    def next(self, timeout: float) -> dict[str, Any] | str | None:
        """The next record, None when the worker ended, "timeout" when none came in `timeout` seconds."""
        try:
            return self.lines.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return "timeout"

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the worker and the second process of part slab
        self.proc.wait()


def failed(part: str, status: str, why: str, err_path: Path) -> dict[str, Any]:
    tail = err_path.read_text(errors="replace")[-1500:] if err_path.exists() else ""
    return {"part": part, "device": device_name(), "scaled": not device_name().startswith("cuda"), "status": status,
            "error": why, "stderr_tail": tail}  # fmt: skip


def run(parts: list[str], budget_s: float, out: Path | None) -> list[dict[str, Any]]:
    """Every part's record, in order, each printed (and written to out/probe.jsonl) as it comes."""
    deadline = time.monotonic() + budget_s
    results: list[dict[str, Any]] = []
    with (
        tempfile.NamedTemporaryFile("w+", prefix="gpu-probe-", suffix=".err") as err,
        open(out / "probe.jsonl", "w") if out else contextlib.nullcontext() as sink,
    ):

        def record(rec: dict[str, Any]) -> None:
            results.append(rec)
            line = json.dumps(rec)
            print(line, flush=True)
            if sink is not None:
                sink.write(line + "\n")
                sink.flush()

        todo = list(parts)
        while todo:
            if deadline - time.monotonic() <= 1:
                for part in todo:
                    record(failed(part, "timeout", f"the probe's {budget_s:.0f} s budget is spent", Path(err.name)))
                break
            worker = Worker(todo, err)
            try:
                todo = drive(worker, todo, deadline, record, Path(err.name))
            finally:
                worker.kill()
        err.seek(0)
        sys.stderr.write(err.read()[-4000:])
    return results


def drive(
    worker: Worker, todo: list[str], deadline: float, record: Callable[[dict[str, Any]], None], err: Path
) -> list[str]:
    """Take `worker`'s records until it is done or a part passes its cap or kills it; returns the parts left."""
    ready = worker.next(min(STARTUP_S, deadline - time.monotonic()))
    if not isinstance(ready, dict):
        why = f"the worker did not start in {STARTUP_S:.0f} s" if ready == "timeout" else "the worker exited at start"
        record(failed(todo[0], "error", why, err))
        return todo[1:]
    for i, part in enumerate(todo):
        cap = min(cap_s(part), deadline - time.monotonic())
        rec = worker.next(cap)
        if isinstance(rec, dict):
            record(rec)
            continue
        if rec == "timeout":
            record(failed(part, "timeout", f"passed its {cap:.3g} s cap", err))
        else:
            record(failed(part, "error", f"the worker exited {worker.proc.wait()} during it", err))
        return todo[i + 1 :]
    return []


# ---------------------------------------------------------------------------- what it measures on an H200
def describe() -> str:
    sys.path.insert(0, str(SCRIPTS))
    from gpu_probe_parts import BACKENDS, PCIE_GEN5_GBPS, READ_TARGET, SLOTS, SWAP_TARGET, WIDTH, sizes

    s, b, v, r = sizes("slab", False), sizes("block", False), sizes("vae", False), sizes("rebuild", False)
    d, rp = sizes("disk", False), sizes("readpath", False)
    mib = s["page_bytes"] / 1024**2
    return "\n".join([
        "On an H200 (DITSERVE_GPU_CHECK_DEVICE=cuda) the check measures, at the released sizes:",
        "  gpu-tests       the gpu-marked tests: host syncs per denoise step (cached vs resident), pinned host-tier bytes",
        "  cached-abab     `ditserve serve --adaln-mode cached` on the bench preset, requests A,B,A,B: builds, host hits",
        "  swap-in         GB/s of those host-tier hits; sidecar-kill: kill -9 of the sidecar over a >= 1 GiB slab,"
        " restart, same sha256, the old slab freed; resident-abab: sha256 equal to cached",
        f"  probe slab      {SLOTS} x {WIDTH} pages of {s['page_numel']:,} bf16 ({mib:.2f} MiB) = "
        f"{s['bytes'] / 1024**3:.2f} GiB over CUDA IPC: read GB/s in a second process, close, device memory back",
        f"  probe swap      host-tier swap-in GB/s of {SLOTS * WIDTH} pinned pages vs a plain pinned copy_ (target >= "
        f"{SWAP_TARGET}) and vs PCIe Gen5's {PCIE_GEN5_GBPS:.0f} GB/s",
        f"  probe block     one MiniMaxH3TransformerBlock (hidden {b['hidden']}, {b['heads']} heads x {b['head_dim']}, "
        f"ffn {b['ffn']}) forward at {' and '.join(map(str, b['tokens']))} tokens with each of {', '.join(BACKENDS)}",
        f"  probe vae       AutoencoderKLMiniMaxH3 ({v['config']}) decode of {v['frames']} frames at "
        f"{v['height']}x{v['width']}: seconds per frame, float32 vs bfloat16",
        f"  probe rebuild   one adaln_proj GEMM ({r['rows']} x {r['time_embed_dim']} bf16, M = {r['m']}) vs the "
        f"host-to-device copy of its weight (pinned and pageable)",
        f"  probe disk      the disk tier: one pack of a 50-point schedule's {d['plans']} plans ({d['pages']} pages, "
        f"{d['bytes'] / 1e9:.2f} GB) written from the slab (sha256, fsync), page cache dropped (fadvise), read back"
        " into the slab cold and warm (per-plan sha256, pageable copy): GB/s, the checksum's share, the restart time",
        f"  probe readpath  the rebuild's streamed read (plan_stream, pinned staging, side stream) of {rp['layers']} "
        f"adaln_proj ({rp['bytes'] / 1e9:.2f} GB) onto the device vs one plain sequential read, warm and cold "
        f"(target >= {READ_TARGET})",
    ])  # fmt: skip


def summary(results: list[dict[str, Any]]) -> list[str]:
    """Lines printed after the parts: a 50-point schedule's restart from disk against its rebuild pass when parts
    disk and rebuild both came out ok (at the released size on cuda; scaled numbers on the CPU)."""
    ok = {r["part"]: r for r in results if r.get("status") == "ok"}
    disk, rebuild = ok.get("disk"), ok.get("rebuild")
    if not disk or not rebuild or not rebuild.get("modeled_49_plan_pass_s"):
        return []
    cold, warm = disk["modeled_50_point_restart_s"], disk["modeled_50_point_restart_warm_s"]
    build = rebuild["modeled_49_plan_pass_s"]
    scaled = " (scaled: the CPU's numbers)" if disk.get("scaled") else ""
    return [f"probe: a 50-point schedule from disk {cold:.3g} s cold, {warm:.3g} s warm vs its rebuild pass "
            f"{build:.3g} s (modeled): {cold / build:.3g}x, {warm / build:.3g}x{scaled}"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write probe.jsonl here too")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, in order (default all)")
    parser.add_argument("--budget-s", type=float, default=float(os.environ.get("DITSERVE_GPU_PROBE_BUDGET_S", 150)))
    parser.add_argument("--describe", action="store_true", help="print what the probe measures on an H200")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--consume-slab", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.consume_slab:
        sys.path.insert(0, str(SCRIPTS))
        from gpu_probe_parts import consume_slab

        return consume_slab()
    if args.worker:
        return worker(args.worker.split(","))
    if args.describe:
        print(describe())
        return 0
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: {', '.join(unknown)} not among {', '.join(PARTS)}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    results = run(parts, args.budget_s, args.out)
    bad = [r["part"] for r in results if r["status"] not in OK_STATUSES]
    print(f"probe: {len(results)} parts on {device_name()}: " + ", ".join(f"{r['part']} {r['status']}" for r in results)
          + (f"; not ok: {', '.join(bad)}" if bad else ""), flush=True)  # fmt: skip
    for line in summary(results):
        print(line, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
