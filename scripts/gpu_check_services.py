"""The service checks of scripts/gpu_check.py on one bench checkpoint: cached-abab and swap-in, sidecar-kill,
resident-abab, fl2va, ref2va, adapters, quality-audit (gpu_check_quality.py) and multi-device (see its docstring), each
as one summary line."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_check_common import (
    DITSERVE,
    GIB,
    KEYFRAMES,
    MIB,
    PRESET,
    REF_IMAGES,
    REQUESTS,
    ROOT,
    SELECTED,
    STEPS,
    check,
    fl2va_request,
    left,
    line,
    ref2va_request,
)
from gpu_check_quality import QualityAudit
from gpu_check_serve import Serve, device_memory_mib, generate, shm_slabs, sidecar_host_pinned

CLOSED_LINE = re.compile(r"closed the slab mapping of session (\S+): its storage is freed")
STILL_REFERENCED = "is still referenced after close"

ADAPTER = "lora"
"""The adapter the check writes (ditserve make-adapter) and names."""


@dataclass(frozen=True)
class CachedRun:
    """What the cached serve of cached-abab answered: the A, B, A, B results, the fl2va and ref2va ones (task ->
    (result, "") or (None, why not)), and its slab's page bytes and width."""

    out: list[Any]
    tasks: dict[str, tuple[dict[str, Any] | None, str]]
    page_bytes: int
    width: int


def kill_check_slab_bytes(device: str) -> int:
    """The sidecar-kill check's minimum slab: 1 GiB on cuda (a leaked slab must stand out of the noise of
    whole-GPU memory), as small as the A/B check's on the CPU (a /dev/shm file there)."""
    default = GIB if device.startswith("cuda") else 0
    return int(os.environ.get("DITSERVE_GPU_CHECK_KILL_SLAB_BYTES", str(default)))


def services(work: Path, device: str) -> None:
    ckpt = work / "ckpt"
    subprocess.run([*DITSERVE, "make-checkpoint", "--preset", PRESET, "--dtype", "mixed", "--out", str(ckpt)],
                   cwd=ROOT, check=True, capture_output=True, timeout=left(300))  # fmt: skip
    base_port = 50000 + os.getpid() % 4000
    adapters = work / "adapters"  # LoRA on every target group (its trunk in PEFT, its modulation in plans) and
    # full-parameter deltas on the time embedder (FastH3's shape: in the plans the sidecar builds)
    adapters.mkdir(exist_ok=True)
    subprocess.run([*DITSERVE, "make-adapter", "--checkpoint", str(ckpt), "--targets", "all", "--deltas", "time",
                    "--layout", "ai-toolkit", "--rank", "4", "--alpha", "4", "--seed", "5",
                    "--out", str(adapters / f"{ADAPTER}.safetensors")],
                   cwd=ROOT, check=True, capture_output=True, timeout=left(120))  # fmt: skip
    with_adapters = ("--adapter-dir", str(adapters))
    tasks = {"fl2va": fl2va_request(work), "ref2va": ref2va_request(work), "adapters": adapter_request()}
    skipped = f"not selected (DITSERVE_GPU_CHECK_SERVICES={','.join(SELECTED)})"
    audit = QualityAudit(work, device) if "quality" in SELECTED else None
    run = _cached_abab(work, ckpt, device, base_port, tasks, with_adapters, audit)
    if audit is None:
        line("SKIP", "quality-audit", skipped)
    out, page_bytes, width = run.out, run.page_bytes, run.width
    if "kill" not in SELECTED:
        line("SKIP", "sidecar-kill", skipped)
    else:
        kill_plans = max(STEPS, math.ceil(kill_check_slab_bytes(device) / (width * page_bytes)))
        big = Serve(work, ckpt, "kill", "cached", device, base_port + 1, kill_plans)
        try:
            big.wait_serving()
            _kill_sidecar(big, work, out[0]["sha256"] if out else "", kill_plans * width * page_bytes)
        finally:
            big.stop()
    if "resident" not in SELECTED:
        line("SKIP", "resident-abab", skipped)
        for task in tasks:
            line("SKIP", task, skipped)
    else:
        resident = Serve(work, ckpt, "resident", "resident", device, base_port + 2, STEPS, with_adapters)
        try:
            resident.wait_serving()
            rc, res_out, err = generate(resident.target, REQUESTS, work)
            same = rc == 0 and [r["sha256"] for r in res_out] == [r["sha256"] for r in out]
            check("resident-abab", same, f"sha256 {'equal to' if same else 'DIFFERENT from'} cached for A, B, A, B"
                  + ("" if rc == 0 else f"; {err.strip()[-300:]}"))  # fmt: skip
            for task, request in tasks.items():
                _task_check(task, run, _generate_one(resident.target, request, work), out[0]["sha256"] if out else "")
        finally:
            resident.stop()
    if "replica" not in SELECTED:
        line("SKIP", "multi-device", skipped)
    else:
        multi_device(work, ckpt, device, base_port + 3, out[0] if out else None)


def step_ms(result: dict[str, Any]) -> float:
    return float(result["timings_ms"]["denoise_ms"]) / max(1, STEPS - 1)


def multi_device(work: Path, ckpt: Path, device: str, port: int, one: dict[str, Any] | None) -> None:
    """One replica across D GPUs, cached and resident, on request A (see scripts/gpu_check.py's docstring)."""
    import torch

    count = torch.cuda.device_count() if device.startswith("cuda") else 0
    if count < 2:
        line("SKIP", "multi-device", f"needs 2+ GPUs ({count} visible on {device})")
        return
    degree = 4 if count >= 4 else 2
    devices = ",".join(f"cuda:{i}" for i in range(degree))
    extra = ("--nproc", str(degree), "--devices", devices, "--ulysses-anything")
    results: dict[str, Any] = {}
    for i, mode in enumerate(("cached", "resident")):
        srv = Serve(work, ckpt, f"replica-{mode}", mode, device, port + 10 * i, STEPS, extra)
        try:
            srv.wait_serving()
            rc, out, err = generate(srv.target, REQUESTS[:1], work)
            if rc != 0 or not out:
                line("FAIL", "multi-device", f"{mode} on {devices}: {err.strip()[-300:]}")
                return
            results[mode] = out[0]
        finally:
            srv.stop()
    same = results["cached"]["sha256"] == results["resident"]["sha256"]
    timing = f"per step {step_ms(results['cached']):.1f} ms on {degree} GPUs"
    if one is not None:
        timing += f" vs {step_ms(one):.1f} ms on one ({step_ms(results['cached']) / step_ms(one):.2f}x)"
    check("multi-device", same, f"Ulysses {degree} on {devices}: cached sha256 {'equal to' if same else 'DIFFERENT from'}"
          f" resident; {timing}")  # fmt: skip


def _generate_one(target: str, request: dict[str, Any], work: Path) -> tuple[dict[str, Any] | None, str]:
    """One request's result line, or None and why not (the tail of the client's stderr)."""
    rc, out, err = generate(target, [request], work)
    if rc != 0 or len(out) != 1:
        return None, f"exit {rc}: {err.strip()[-300:]}"
    return out[0], ""


def adapter_request() -> dict[str, Any]:
    """Request A with the check's adapter (every target group) at scale 0.8."""
    return {**REQUESTS[0], "request_id": "L1", "adapters": [{"name": ADAPTER, "scale": 0.8}]}


def _task_check(task: str, cached: CachedRun, resident: tuple[dict[str, Any] | None, str], sha_a: str) -> None:
    """fl2va / ref2va / adapters: request A with keyframes / image references / an adapter on every target group gives
    the same sha256 cached and resident, and another than t2va A's (the keyframes, the references and
    transformer_ref/, or the adapter's trunk and modulation plans, were used)."""
    (got, err), (res, res_err) = cached.tasks[task], resident
    if task == "adapters":
        what = f"adapter {ADAPTER} (LoRA on every group + time-embedder deltas; ai-toolkit, rank 4) at 0.8"
    else:
        files = KEYFRAMES if task == "fl2va" else REF_IMAGES
        what = f"{'keyframes' if task == 'fl2va' else 'references'} " + ", ".join(
            f"{fmt} {w}x{h}" for fmt, w, h in files.values()
        )
    if got is None or res is None:
        line("FAIL", task, f"{what}: cached {err or 'ok'}; resident {res_err or 'ok'}")
        return
    sha_c, sha_r = got["sha256"], res["sha256"]
    tasks = {got.get("task"), res.get("task")}
    task_name = "t2va" if task == "adapters" else task
    built = got.get("cache", {}).get("built_plans")
    check(task, sha_c == sha_r and tasks == {task_name} and sha_c != sha_a,
          f"{what}: cached sha256 {sha_c}, resident {sha_r} ({'equal' if sha_c == sha_r else 'DIFFERENT'}); "
          f"task {'/'.join(sorted(map(str, tasks)))}; {'differs from' if sha_c != sha_a else 'SAME as'} t2va A; "
          f"cached built {built} plans")  # fmt: skip


def _cached_abab(
    work: Path,
    ckpt: Path,
    device: str,
    port: int,
    tasks: dict[str, dict[str, Any]],
    extra: tuple[str, ...] = (),
    audit: QualityAudit | None = None,
) -> CachedRun:
    """cached-abab and swap-in, then the fl2va, ref2va and adapter requests on the same serve (their checks compare
    them with resident's), then, with `audit`, quality-audit on it (served with the audit's flags)."""
    cached = Serve(work, ckpt, "cached", "cached", device, port, STEPS, (*extra, *(audit.flags if audit else ())))
    try:
        st = cached.wait_serving()
        page_bytes, width = st.slab.page_bytes, st.slab.width
        rc, out, err = generate(cached.target, REQUESTS, work)
        cache = {r["request_id"]: r["cache"] for r in out}
        forwards = STEPS - 1
        ok = (rc == 0 and len(out) == 4 and cache["A1"]["built_plans"] == forwards
              and cache["B1"]["built_plans"] == forwards - 1
              and all(cache[k]["built_plans"] == 0 and cache[k]["host_hit_plans"] >= forwards // 2 for k in ("A2", "B2"))
              and out[0]["sha256"] == out[2]["sha256"] and out[1]["sha256"] == out[3]["sha256"])  # fmt: skip
        pinned = sidecar_host_pinned(cached.run_dir)
        check("cached-abab", ok and (pinned is True or not device.startswith("cuda")),
              f"built {[cache.get(k, {}).get('built_plans') for k in ('A1', 'B1', 'A2', 'B2')]}, host hits "
              f"{[cache.get(k, {}).get('host_hit_plans') for k in ('A1', 'B1', 'A2', 'B2')]}, host tier pinned: "
              f"{pinned}{'' if rc == 0 else '; ' + err.strip()[-300:]}")  # fmt: skip
        hits = [cache[k] for k in ("A2", "B2") if k in cache and cache[k]["swap_in_s"] > 0]
        if hits:
            gbps = [h["host_hit_plans"] * page_bytes / h["swap_in_s"] / 1e9 for h in hits]
            check("swap-in", min(gbps) > 0, f"{', '.join(f'{g:.1f}' for g in gbps)} GB/s ({page_bytes} B pages)")
        else:
            line("FAIL", "swap-in", "no host-tier hit to measure")
        done = {task: _generate_one(cached.target, request, work) for task, request in tasks.items()
                if "resident" in SELECTED}  # fmt: skip
        if audit is not None:
            audit.run(cached.target)
    finally:
        cached.stop()
    return CachedRun(out, done, page_bytes, width)


def _kill_sidecar(serve: Serve, work: Path, sha_a: str, slab_bytes: int) -> None:
    import grpc

    from ditserve.client import GeneratorClient

    pid = serve.sidecar_pid()
    if pid is None:
        line("FAIL", "sidecar-kill", "no sidecar process found under serve")
        return
    # A's schedule, on a bigger canvas so the kill lands well before the last step; the warm-up request runs that
    # canvas once first, so the generator's allocator already holds its activations when memory is measured
    long_request = {**REQUESTS[0], "request_id": "K1", "seed": 2, "height": 256, "width": 256}
    rc, _, err = generate(serve.target, [{**long_request, "request_id": "K0", "seed": 3}], work)
    if rc != 0:
        line("FAIL", "sidecar-kill", f"the warm-up request failed: {err.strip()[-300:]}")
        return
    before_mem, before_shm = device_memory_mib(), shm_slabs()
    killed: list[int] = []

    def kill_on_first_step(kind: str, payload: Any) -> None:
        if kind == "step" and not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    code = "OK"
    with GeneratorClient(serve.target) as client:
        try:
            client.generate(long_request, progress=kill_on_first_step, timeout=left(600))
        except grpc.RpcError as e:
            code = e.code().name
    serve.wait_serving(timeout=240)
    rc, out, _ = generate(serve.target, [{**REQUESTS[0], "request_id": "A3"}], work)
    same = rc == 0 and bool(out) and out[0]["sha256"] == sha_a
    after_mem, after_shm = device_memory_mib(), shm_slabs()
    log = serve.generator_log()
    closed = CLOSED_LINE.findall(log)
    mapping_closed = bool(closed) and STILL_REFERENCED not in log
    slab_mib = slab_bytes / MIB
    if before_mem is None or after_mem is None:
        mem_ok, mem = True, "device memory not measured (no nvidia-smi)"
    else:
        mem_ok = after_mem - before_mem < slab_mib / 2
        mem = (f"device memory {before_mem} -> {after_mem} MiB ({after_mem - before_mem:+d}; slab {slab_mib:.0f} MiB, "
               f"a leaked one would add it all)")  # fmt: skip
    check("sidecar-kill", bool(killed) and code == "UNAVAILABLE" and same and mapping_closed and mem_ok
          and after_shm <= before_shm,
          f"killed mid-request: {bool(killed)}; the request got {code}; after restart sha256 same: {same}; generator "
          f"closed the old slab mapping (storage freed): {mapping_closed}; {mem}; /dev/shm files {before_shm} -> "
          f"{after_shm}")  # fmt: skip
