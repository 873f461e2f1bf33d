"""One-shot accelerator check (run by scripts/gpu_check.sh): one summary line per check, then a verdict.

Checks, in order (each line starts with PASS, FAIL or SKIP):
  gpu-tests        the `gpu`-marked tests (pytest -m gpu), with the named ones reported on their own lines:
  syncs-per-step   host syncs in a cached denoise step (the sync-debug test)
  pinned-bytes     pinned host-tier bytes vs configured (the just-over-4-GiB test)
  cached-abab      `ditserve serve --adaln-mode cached` on a bf16 (mixed) bench repository, requests A, B, A, B:
                   builds then host-tier hits, host tier pinned
  swap-in          host-to-device swap-in bandwidth of those host hits (GB/s)
  resident-abab    the same requests on `--adaln-mode resident`: sha256 equal to cached
  sidecar-kill     `kill -9` of the sidecar mid-request: the request fails UNAVAILABLE, serve restarts the
                   sidecar, the same request then gives the same sha256, no device memory leaked

Without CUDA every check is skipped (exit 0). DITSERVE_GPU_CHECK_DEVICE=cpu runs the service checks on the CPU (the
default suite does, so this script cannot rot); the pytest part needs CUDA.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DITSERVE = [sys.executable, "-m", "ditserve"]
NAMED_TESTS = {  # summary line -> test-name substring in the gpu test run
    "syncs-per-step": "sync",
    "pinned-bytes": "pins_less_than",
}
PROMPT = "a red fox runs through the snow"
STEPS = int(os.environ.get("DITSERVE_GPU_CHECK_STEPS", "50"))
PRESET = os.environ.get("DITSERVE_GPU_CHECK_PRESET", "bench")
REQUESTS = [
    {"request_id": "A1", "prompt": PROMPT, "num_inference_steps": STEPS, "seed": 1},
    {"request_id": "B1", "prompt": PROMPT, "num_inference_steps": STEPS, "seed": 1, "flow_shift": 7.0},
    {"request_id": "A2", "prompt": PROMPT, "num_inference_steps": STEPS, "seed": 1},
    {"request_id": "B2", "prompt": PROMPT, "num_inference_steps": STEPS, "seed": 1, "flow_shift": 7.0},
]
failures: list[str] = []


def line(status: str, name: str, detail: str) -> None:
    print(f"{status:<4} {name:<15} {detail}", flush=True)
    if status == "FAIL":
        failures.append(name)


def check(name: str, ok: bool, detail: str) -> None:
    line("PASS" if ok else "FAIL", name, detail)


# ------------------------------------------------------------------ pytest -m gpu
def gpu_tests(work: Path, cuda: bool) -> None:
    if not cuda:
        line("SKIP", "gpu-tests", "needs CUDA")
        for name in NAMED_TESTS:
            line("SKIP", name, "needs CUDA")
        return
    xml = work / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}", "tests"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    cases = ET.parse(xml).getroot().iter("testcase") if xml.exists() else iter(())
    outcome: dict[str, str] = {}
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        outcome[name] = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
    counts = {k: sum(v == k for v in outcome.values()) for k in ("passed", "failed", "skipped")}
    detail = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    check("gpu-tests", proc.returncode == 0 and counts["failed"] == 0 and counts["passed"] > 0, detail)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    for label, needle in NAMED_TESTS.items():
        hits = {n: o for n, o in outcome.items() if needle in n}
        if not hits:
            line("FAIL", label, f"no gpu test matching {needle!r}")
        else:
            check(label, all(o == "passed" for o in hits.values()), ", ".join(f"{n}: {o}" for n, o in hits.items()))


# ------------------------------------------------------------------ the services
class Serve:
    """`ditserve serve` as a subprocess, on free ports, in its own run dir."""

    def __init__(self, work: Path, checkpoint: Path, mode: str, device: str, port: int) -> None:
        self.run_dir = work / f"run-{mode}"
        self.port, self.mode = port, mode
        self.log = open(work / f"serve-{mode}.log", "w")  # noqa: SIM115 (closed in stop)
        argv = [*DITSERVE, "serve", "--checkpoint", str(checkpoint), "--adaln-mode", mode, "--device", device,
                "--port", str(port), "--run-dir", str(self.run_dir), "--no-metrics", "--gpu-plans", str(STEPS),
                "--host-cache-gb", "1"]  # fmt: skip
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.target = f"127.0.0.1:{port}"

    def status(self) -> Any:
        from ditserve.client import GeneratorClient

        with GeneratorClient(self.target) as client:
            return client.status(timeout=5)

    def wait_serving(self, timeout: float = 240) -> Any:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve ({self.mode}) exited {self.proc.returncode}; see {self.log.name}")
            try:
                st = self.status()
                if st.serving:
                    return st
            except Exception:  # not up yet
                pass
            time.sleep(0.5)
        raise RuntimeError(f"serve ({self.mode}) not serving after {timeout} s; see {self.log.name}")

    def sidecar_pid(self) -> int | None:
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid), "-f", "plancache_service"], capture_output=True, text=True
        )
        pids = [int(p) for p in out.stdout.split()]
        return pids[0] if pids else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def generate(
    target: str, requests: list[dict[str, Any]], work: Path, timeout: float = 600
) -> tuple[int, list[Any], str]:
    path = work / f"requests-{requests[0]['request_id']}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    proc = subprocess.run([*DITSERVE, "generate", "--target", target, "--requests", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    lines = [json.loads(s) for s in proc.stdout.splitlines() if s.strip().startswith("{")]
    return proc.returncode, lines, proc.stderr


def device_memory_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        return int(out.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def shm_slabs() -> int:
    return len([p for p in Path("/dev/shm").glob("ditserve-*")])


def services(work: Path, device: str) -> None:
    from ditserve.launcher import terminate  # noqa: F401 (import check: the launcher is importable)

    ckpt = work / "ckpt"
    subprocess.run([*DITSERVE, "make-checkpoint", "--preset", PRESET, "--dtype", "mixed", "--out", str(ckpt)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)  # fmt: skip
    cached = Serve(work, ckpt, "cached", device, 50000 + os.getpid() % 5000)
    try:
        st = cached.wait_serving()
        page_bytes = st.slab.page_bytes
        rc, out, err = generate(cached.target, REQUESTS, work)
        cache = {r["request_id"]: r["cache"] for r in out}
        forwards = STEPS - 1
        ok = (rc == 0 and len(out) == 4 and cache["A1"]["built_plans"] == forwards
              and cache["B1"]["built_plans"] == forwards - 1
              and all(cache[k]["built_plans"] == 0 and cache[k]["host_hit_plans"] >= forwards // 2 for k in ("A2", "B2"))
              and out[0]["sha256"] == out[2]["sha256"] and out[1]["sha256"] == out[3]["sha256"])  # fmt: skip
        pinned = _sidecar_host_pinned(cached.run_dir)
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
        _kill_sidecar(cached, work, out[0]["sha256"] if out else "")
    finally:
        cached.stop()
    resident = Serve(work, ckpt, "resident", device, 55000 + os.getpid() % 5000)
    try:
        resident.wait_serving()
        rc, res_out, err = generate(resident.target, REQUESTS, work)
        same = rc == 0 and [r["sha256"] for r in res_out] == [r["sha256"] for r in out]
        check("resident-abab", same, f"sha256 {'equal to' if same else 'DIFFERENT from'} cached for A, B, A, B"
              + ("" if rc == 0 else f"; {err.strip()[-300:]}"))  # fmt: skip
    finally:
        resident.stop()


def _sidecar_host_pinned(run_dir: Path) -> bool | None:
    import grpc

    from protos.ditserve.plancache.v1 import plancache_pb2 as pb
    from protos.ditserve.plancache.v1 import plancache_pb2_grpc as pb_grpc

    sock = next(iter(sorted(run_dir.glob("**/*.sock"))), None)
    if sock is None:
        return None
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        state = pb_grpc.PlanCacheStub(ch).GetState(pb.GetStateRequest(), timeout=10)
    return bool(state.stats.host_pinned)


def _kill_sidecar(serve: Serve, work: Path, sha_a: str) -> None:
    import grpc

    from ditserve.client import GeneratorClient

    pid = serve.sidecar_pid()
    if pid is None:
        line("FAIL", "sidecar-kill", "no sidecar process found under serve")
        return
    before_mem, before_shm = device_memory_mib(), shm_slabs()
    killed: list[int] = []

    def kill_on_first_step(kind: str, payload: Any) -> None:
        if kind == "step" and not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    code = "OK"
    # A's schedule (its plans fit the slab), on a bigger canvas so the kill lands well before the last step
    long_request = {**REQUESTS[0], "request_id": "K1", "seed": 2, "height": 256, "width": 256}
    with GeneratorClient(serve.target) as client:
        try:
            client.generate(long_request, progress=kill_on_first_step, timeout=600)
        except grpc.RpcError as e:
            code = e.code().name
    serve.wait_serving(timeout=240)
    rc, out, _ = generate(serve.target, [{**REQUESTS[0], "request_id": "A3"}], work)
    same = rc == 0 and bool(out) and out[0]["sha256"] == sha_a
    after_mem, after_shm = device_memory_mib(), shm_slabs()
    leak_ok = after_shm <= before_shm and (
        before_mem is None or after_mem is None or after_mem <= before_mem * 1.1 + 256
    )
    check("sidecar-kill", bool(killed) and code == "UNAVAILABLE" and same and leak_ok,
          f"killed mid-request: {bool(killed)}; the request got {code}; after restart sha256 same: {same}; "
          f"device memory {before_mem} -> {after_mem} MiB; /dev/shm slabs {before_shm} -> {after_shm}")  # fmt: skip


def main() -> int:
    import torch

    device = os.environ.get("DITSERVE_GPU_CHECK_DEVICE", "cuda")
    cuda = torch.cuda.is_available()
    print(f"gpu_check: device {device}; torch {torch.__version__}; cuda available: {cuda}"
          + (f" ({torch.cuda.get_device_name(0)})" if cuda else ""), flush=True)  # fmt: skip
    if device.startswith("cuda") and not cuda:
        for name in ("gpu-tests", *NAMED_TESTS, "cached-abab", "swap-in", "resident-abab", "sidecar-kill"):
            line("SKIP", name, "no CUDA device (torch.cuda.is_available() is False)")
        return 0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-", dir="/tmp") as tmp:
        work = Path(tmp)
        steps: list[Callable[[], None]] = [lambda: gpu_tests(work, cuda), lambda: services(work, device)]
        for step in steps:
            try:
                step()
            except Exception as e:  # a broken check is a failure line, never a silent skip
                line("FAIL", "error", f"{type(e).__name__}: {e}")
    verdict = "FAIL: " + ", ".join(failures) if failures else "all checks passed"
    print(f"gpu_check: {verdict} in {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
