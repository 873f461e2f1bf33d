"""One-shot accelerator check (run by scripts/gpu_check.sh): one summary line per check, with its numbers, then a
verdict.

Checks, in order (each line starts with PASS, FAIL or SKIP):
  gpu-tests        the `gpu`-marked tests (pytest -m gpu on the test files that have them); two of them report numbers
                   (test properties in the JUnit XML) on lines of their own:
  syncs-per-step   host syncs per denoise step (transformer forward + scheduler steps, sync debug mode "warn"),
                   cached vs resident: the cache must add none
  pinned-bytes     pinned host-tier bytes vs configured bytes (the just-over-4-GiB test)
  cached-abab      `ditserve serve --adaln-mode cached` on a bf16 (mixed) bench repository, requests A, B, A, B:
                   builds then host-tier hits, host tier pinned
  swap-in          host-to-device swap-in bandwidth of those host hits (GB/s)
  sidecar-kill     on a cached serve whose slab is at least 1 GiB (on cuda): `kill -9` of the sidecar mid-request:
                   the request fails UNAVAILABLE, serve restarts the sidecar, the same request then gives the same
                   sha256; the generator logs that it closed the old slab mapping (its storage freed), and device
                   memory did not grow by half a slab (a leaked slab would add all of it)
  resident-abab    the same requests on `--adaln-mode resident`: sha256 equal to cached
  multi-device     with 2+ GPUs visible: `ditserve serve --nproc D` (D = 4 with 4+ GPUs, else 2; Ulysses D,
                   --ulysses-anything on NCCL) cached and resident on request A: sha256 equal, and the per-step time
                   against cached-abab's one device; skipped with one line otherwise

`--out DIR` keeps what the checks measure there: the gpu tests' JUnit XML (gpu-tests.xml) and, when a service check
failed, the tails of the serve logs (serve-logs.txt). DITSERVE_GPU_CHECK_SERVICES (default
cached,kill,resident,replica) picks the service checks: cached-abab and swap-in always run (the others compare with
their sha256); leaving out kill, resident or replica skips sidecar-kill, resident-abab or multi-device. Every service runs as `python -m ditserve` (no console
scripts), so the offline layout (scripts/gpu_check.sh --offline: the repository root and the carried wheels on
PYTHONPATH, no venv) runs them as the venv does.

Without any GPU (`nvidia-smi -L` lists none) every check is skipped (exit 0). A GPU that torch cannot use
(`nvidia-smi -L` lists one, `torch.cuda.is_available()` is False: a CPU build of torch, a driver too old for its CUDA)
is a FAIL (exit 1). DITSERVE_GPU_CHECK_DEVICE=cpu runs the service checks on the CPU (a slow test does, so this
script cannot rot); the pytest part needs CUDA. The whole run has a time budget (DITSERVE_GPU_CHECK_BUDGET_S,
default 270 s); a check still running when it is spent fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
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
DITSERVE = [sys.executable, "-m", "ditserve"]
NAMED_TESTS = {  # summary line -> test-name substring in the gpu test run
    "syncs-per-step": "sync",
    "pinned-bytes": "pins_less_than",
}
CHECKS = ("gpu-tests", *NAMED_TESTS, "cached-abab", "swap-in", "sidecar-kill", "resident-abab", "multi-device")
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
CLOSED_LINE = re.compile(r"closed the slab mapping of session (\S+): its storage is freed")
STILL_REFERENCED = "is still referenced after close"
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


# ------------------------------------------------------------------ is there a GPU?
def nvidia_smi_gpus() -> list[str]:
    """The GPUs `nvidia-smi -L` lists ("GPU 0: NVIDIA H200 (UUID: GPU-...)"); none without the tool or a driver."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [s.strip() for s in out.stdout.splitlines() if s.strip().startswith("GPU ")]


# ------------------------------------------------------------------ pytest -m gpu
def gpu_test_files() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.gpu" in p.read_text()
    )


def _case_properties(case: ET.Element) -> dict[str, str]:
    return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}


def gpu_tests(out: Path, cuda: bool) -> None:
    if not cuda:
        for name in ("gpu-tests", *NAMED_TESTS):
            line("SKIP", name, "needs CUDA")
        return
    xml = out / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}",
           "-o", "junit_family=xunit1", *gpu_test_files()]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=left(170))
    cases = list(ET.parse(xml).getroot().iter("testcase")) if xml.exists() else []
    outcome: dict[str, str] = {}
    props: dict[str, dict[str, str]] = {}
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        outcome[name] = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        props[name] = _case_properties(case)
    counts = {k: sum(v == k for v in outcome.values()) for k in ("passed", "failed", "skipped")}
    detail = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    check("gpu-tests", proc.returncode == 0 and counts["failed"] == 0 and counts["passed"] > 0, detail)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    for label, needle in NAMED_TESTS.items():
        hits = {n: o for n, o in outcome.items() if needle in n}
        if not hits:
            line("FAIL", label, f"no gpu test matching {needle!r}")
            continue
        numbers = "; ".join(_numbers(label, props[n]) for n in hits)
        states = ", ".join(f"{n.rsplit('::', 1)[-1]}: {o}" for n, o in hits.items())
        check(label, all(o == "passed" for o in hits.values()), f"{numbers} ({states})")


def _numbers(label: str, props: dict[str, str]) -> str:
    """The numbers a named test recorded, as one readable phrase."""
    if label == "syncs-per-step" and "syncs_per_step" in props:
        rec = json.loads(props["syncs_per_step"])
        cached, resident = rec.get("cached", []), rec.get("resident", [])

        def summary(xs: list[int]) -> str:
            return f"{min(xs)}..{max(xs)} (total {sum(xs)} in {len(xs)} steps)" if xs else "none counted"

        return (f"syncs per step: cached {summary(cached)}, resident {summary(resident)}, in the plan reads "
                f"{rec.get('plan_reads', '?')}; per step cached {cached}")  # fmt: skip
    if label == "pinned-bytes" and "pinned_bytes" in props:
        p = {k: int(v) for k, v in props.items() if v.lstrip("-").isdigit()}
        return (f"pinned {p['pinned_bytes']} of configured {p.get('configured_bytes')} bytes "
                f"({p['pinned_bytes'] / GIB:.3f} GiB; tier {p.get('tier_bytes')}; torch's power-of-two allocator would "
                f"pin {2 ** math.ceil(math.log2(p.get('configured_bytes', 1))) / GIB:.0f} GiB; its own pinned bytes "
                f"grew by {p.get('torch_pinned_allocator_growth_bytes')}; RSS +{p.get('rss_growth_bytes')} bytes)")  # fmt: skip
    return "no numbers recorded"


# ------------------------------------------------------------------ the services
class Serve:
    """`ditserve serve` as a subprocess, on free ports, in its own run dir."""

    def __init__(
        self, work: Path, checkpoint: Path, name: str, mode: str, device: str, port: int, gpu_plans: int,
        extra: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.run_dir = work / f"run-{name}"
        self.port, self.name = port, name
        self.log = open(work / f"serve-{name}.log", "w")  # noqa: SIM115 (closed in stop)
        argv = [*DITSERVE, "serve", "--checkpoint", str(checkpoint), "--adaln-mode", mode, "--device", device,
                "--port", str(port), "--run-dir", str(self.run_dir), "--no-metrics", "--gpu-plans", str(gpu_plans),
                "--host-cache-gb", "1", *extra]  # fmt: skip
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.target = f"127.0.0.1:{port}"

    def status(self) -> Any:
        from ditserve.client import GeneratorClient

        with GeneratorClient(self.target) as client:
            return client.status(timeout=5)

    def wait_serving(self, timeout: float = 240) -> Any:
        end = time.monotonic() + left(timeout)
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve ({self.name}) exited {self.proc.returncode}; see {self.log.name}")
            try:
                st = self.status()
                if st.serving:
                    return st
            except Exception:  # not up yet
                pass
            time.sleep(0.5)
        raise RuntimeError(f"serve ({self.name}) not serving after {timeout} s; see {self.log.name}")

    def sidecar_pid(self) -> int | None:
        """The sidecar among serve's children, read from /proc (pgrep may be missing on the device)."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue  # a process that ended meanwhile
            if ppid == self.proc.pid and b"plancache_service" in cmdline:
                return int(stat.parent.name)
        return None

    def generator_log(self) -> str:
        path = self.run_dir / "generator.log"
        return path.read_text(errors="replace") if path.exists() else ""

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
                          capture_output=True, text=True, timeout=left(timeout))  # fmt: skip
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
    out, page_bytes, width = _cached_abab(work, ckpt, device, base_port)
    skipped = f"not selected (DITSERVE_GPU_CHECK_SERVICES={','.join(SELECTED)})"
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
    else:
        resident = Serve(work, ckpt, "resident", "resident", device, base_port + 2, STEPS)
        try:
            resident.wait_serving()
            rc, res_out, err = generate(resident.target, REQUESTS, work)
            same = rc == 0 and [r["sha256"] for r in res_out] == [r["sha256"] for r in out]
            check("resident-abab", same, f"sha256 {'equal to' if same else 'DIFFERENT from'} cached for A, B, A, B"
                  + ("" if rc == 0 else f"; {err.strip()[-300:]}"))  # fmt: skip
        finally:
            resident.stop()
    if "replica" not in SELECTED:
        line("SKIP", "multi-device", skipped)
    else:
        multi_device(work, ckpt, device, base_port + 3, out[0] if out else None)


def step_ms(result: dict[str, Any]) -> float:
    return float(result["timings_ms"]["denoise_ms"]) / max(1, STEPS - 1)


def multi_device(work: Path, ckpt: Path, device: str, port: int, one: dict[str, Any] | None) -> None:
    """One replica across D GPUs, cached and resident, on request A (see the module docstring)."""
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


def _cached_abab(work: Path, ckpt: Path, device: str, port: int) -> tuple[list[Any], int, int]:
    """cached-abab and swap-in; returns the four results, the page bytes and the slab width."""
    cached = Serve(work, ckpt, "cached", "cached", device, port, STEPS)
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
    finally:
        cached.stop()
    return out, page_bytes, width


def keep_serve_logs(work: Path, out: Path) -> None:
    """The tail of every serve log and of the generator's and sidecar's own logs, in one file under `out`."""
    parts = []
    for log in sorted([*work.glob("serve-*.log"), *work.glob("run-*/*.log")]):
        text = log.read_text(errors="replace")
        parts.append(f"===== {log.relative_to(work)} (last 20000 of {len(text)} characters)\n{text[-20000:]}")
    if parts:
        (out / "serve-logs.txt").write_text("\n".join(parts))


def _sidecar_host_pinned(run_dir: Path) -> bool | None:
    import grpc

    from ditruntime.paths import SOCKET_NAME
    from protos.ditserve.plancache.v1 import plancache_pb2 as pb
    from protos.ditserve.plancache.v1 import plancache_pb2_grpc as pb_grpc

    sock = run_dir / SOCKET_NAME  # the public socket (its relay's private one is in .plancache.sock.d/)
    if not sock.exists():
        return None
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        state = pb_grpc.PlanCacheStub(ch).GetState(pb.GetStateRequest(), timeout=10)
    return bool(state.stats.host_pinned)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="keep the JUnit XML (and failed checks' serve logs) here")
    args = parser.parse_args(argv)
    unknown = sorted(set(SELECTED) - set(SERVICES))
    if unknown:
        parser.error(f"DITSERVE_GPU_CHECK_SERVICES: {', '.join(unknown)} not among {', '.join(SERVICES)}")
    import torch

    device = os.environ.get("DITSERVE_GPU_CHECK_DEVICE", "cuda")
    cuda = torch.cuda.is_available()
    print(f"gpu_check: device {device}; torch {torch.__version__} (CUDA {torch.version.cuda}); cuda available: "
          f"{cuda}" + (f" ({torch.cuda.get_device_name(0)})" if cuda else ""), flush=True)  # fmt: skip
    if device.startswith("cuda") and not cuda:
        gpus = nvidia_smi_gpus()
        if gpus:
            line("FAIL", "cuda", f"nvidia-smi lists {len(gpus)} GPU(s) ({gpus[0]}) but torch {torch.__version__} "
                 f"(built for CUDA {torch.version.cuda}) cannot use them: torch.cuda.is_available() is False; "
                 "install the CUDA build of torch (scripts/bootstrap.sh) and check the driver")  # fmt: skip
            for name in CHECKS:
                line("SKIP", name, "torch cannot use the GPU")
            print("gpu_check: FAIL: cuda", flush=True)
            return 1
        for name in CHECKS:
            line("SKIP", name, "no GPU (nvidia-smi -L lists none; torch.cuda.is_available() is False)")
        return 0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-", dir="/tmp") as tmp:
        work = Path(tmp)
        out = args.out or work
        out.mkdir(parents=True, exist_ok=True)
        steps: list[Callable[[], None]] = [lambda: gpu_tests(out, cuda), lambda: services(work, device)]
        for step in steps:
            try:
                step()
            except Exception as e:  # a broken check is a failure line, never a silent skip
                line("FAIL", "error", f"{type(e).__name__}: {e}")
        if failures and args.out:
            keep_serve_logs(work, args.out)
    verdict = "FAIL: " + ", ".join(failures) if failures else "all checks passed"
    print(f"gpu_check: {verdict} in {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
