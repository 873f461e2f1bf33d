"""Fault tests with real processes: SIGKILL the sidecar or the generator mid-request, and stop
`ditserve serve` with SIGTERM.

- Sidecar killed during a request: that request fails UNAVAILABLE; a sidecar restarted on the
  same socket and checkpoint is reattached by the generator on its own, and the next request
  is bit-exact with the resident reference.
- Generator killed during a request: the sidecar drops the dead session's leases within
  seconds; a restarted generator finds the plans still hot (slot hits, nothing rebuilt).
- `ditserve serve` stopped by SIGTERM leaves no process and no /dev/shm file of its run.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from servicekit import (
    SERVING,
    SHM_PREFIX,
    Pair,
    ProcessGroup,
    distinct_plans,
    free_port,
    health_status,
    narrow_request,
    pid_alive,
    process_group,
    ref_sha,
    shm_files_of,
    sidecar_state,
    wait_for,
)

from ditcore import GenerationRequest
from ditserve.client import GeneratorClient
from ditserve.client_requests import request_to_proto
from protos.ditserve.generator.v1 import generator_pb2 as gen_pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as gen_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SLOTS = 160
# Long enough to be mid-denoise when the kill lands (the kill follows step 2 of 120 forwards).
ATTACHED = re.compile(r"attached to sidecar \S+ \(session (\w+),")
LONG_REQUEST: dict[str, Any] = narrow_request(120, request_id="long", prompt="long", height=64, width=64)
# Same schedule (same plan keys), cheaper forwards: the smallest canvas.
SAME_SCHEDULE_CHEAP: dict[str, Any] = {**LONG_REQUEST, "height": 32, "width": 32}
CHECK_REQUEST: dict[str, Any] = {
    "request_id": "after-restart",
    "task": "t2va",
    "prompt": "thunder",
    "num_inference_steps": 6,
    "flow_shift": 6.0,
    "audio_flow_shift": 2.0,
    "seed": 3,
    "num_frames": 124,
    "height": 32,
    "width": 32,
}


@pytest.fixture(scope="module")
def module_procs(request: pytest.FixtureRequest) -> Iterator[ProcessGroup]:
    with process_group(request) as group:
        yield group


@pytest.fixture(scope="module")
def kill_pair(module_procs: ProcessGroup, svc_ckpt: Path) -> Pair:
    """Sidecar and generator processes shared by the kill tests (a process start costs seconds of imports); the
    group removes the sidecar's shm files at teardown."""
    return module_procs.pair(svc_ckpt, gpu_plans=SLOTS, host_cache_bytes=50 * 1000**2)


def _serving(pair: Pair) -> Pair:
    """The shared pair with both sides running and SERVING (each kill test restarts what it killed)."""
    if pair.sidecar.proc is None or not pair.sidecar.running():
        pair.start_sidecar(wait=False)
    if pair.generator.proc is None or not pair.generator.running():
        pair.start_generator(wait=False)
    pair.wait_sidecar()
    pair.wait_generator()
    return pair


def _open_stream(target: str, req: dict[str, Any]) -> tuple[grpc.Channel, Any, Any]:
    ch = grpc.insecure_channel(target)
    msg = gen_pb.GenerateStreamRequest(request=request_to_proto(GenerationRequest.from_dict(dict(req))))
    call = gen_grpc.GeneratorStub(ch).GenerateStream(msg, timeout=120)
    return ch, call, iter(call)


def _read_until_step(it: Any, step: int) -> list[str]:
    kinds = []
    for ev in it:
        kinds.append(ev.WhichOneof("event"))
        if kinds[-1] == "step" and ev.step.step >= step:
            return kinds
    raise AssertionError(f"the stream ended before step {step}: {kinds}")


def _drain(it: Any) -> list[str]:
    """Read the rest of a stream; return the kinds seen (raises the stream's RpcError)."""
    return [ev.WhichOneof("event") for ev in it]


# ----------------------------------------------------------------------------- sidecar crash
def test_sidecar_killed_mid_request_then_restarted(kill_pair: Pair, module_procs: ProcessGroup, svc_ckpt: Path) -> None:
    pair, procs = _serving(kill_pair), module_procs
    side, gen, sock, target = pair.sidecar, pair.generator, pair.socket_path, pair.target
    run_files = shm_files_of(side.pid)
    assert len(run_files) == 2, run_files  # the slab and the slot table

    old_session = ATTACHED.findall(gen.log())[-1]
    ch, _call, it = _open_stream(target, LONG_REQUEST)
    with ch:
        _read_until_step(it, 2)
        side.kill9()
        with pytest.raises(grpc.RpcError) as ei:
            _drain(it)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, (ei.value.code(), ei.value.details(), procs.logs())
    since = len(gen.log())

    # detached: NOT_SERVING, and new requests are refused UNAVAILABLE (not queued forever)
    wait_for(lambda: health_status(target) != SERVING, 5, what="the generator to report NOT_SERVING")
    with GeneratorClient(target) as client:
        st = client.status()
        assert not st.sidecar_connected and not st.serving
        with pytest.raises(grpc.RpcError) as ei:
            client.generate_unary(CHECK_REQUEST, timeout=30)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE

    # restart the sidecar on the same socket and checkpoint: the generator reattaches by itself
    pair.start_sidecar()
    t0 = time.monotonic()
    wait_for(lambda: health_status(target) == SERVING, 20, interval=0.1, what="the generator to reattach")
    reattach_s = time.monotonic() - t0
    assert gen.running(), "the generator survived the sidecar crash"
    # the failed request left no reference to the old slab: its mapping was closed with its storage freed (the weak
    # reference SlabMapping keeps expired) before the new slab was mapped, never "still referenced"
    gen.wait_log(ATTACHED.pattern, 20, since)
    log = gen.log()[since:]
    (new_session,) = ATTACHED.findall(log)
    assert new_session != old_session
    freed = log.find(f"closed the slab mapping of session {old_session}: its storage is freed")
    assert 0 <= freed < ATTACHED.search(log).start(), log  # type: ignore[union-attr]
    assert "still referenced" not in gen.log()

    with GeneratorClient(target) as client:
        res = client.generate(CHECK_REQUEST, timeout=60)
        assert client.status().sidecar_connected
    assert res.sha256 == ref_sha(svc_ckpt, CHECK_REQUEST)
    assert res.generation == 1
    assert res.cache.built_plans + res.cache.gpu_hit_plans == distinct_plans(svc_ckpt, CHECK_REQUEST)
    st = sidecar_state(str(sock))
    assert st.session_attached and st.leases_held == 0
    assert reattach_s < 10, f"reattach took {reattach_s:.1f} s"


# ----------------------------------------------------------------------------- generator crash
def test_generator_killed_leases_dropped_and_plans_stay_hot(kill_pair: Pair, svc_ckpt: Path) -> None:
    pair = _serving(kill_pair)
    side, gen, sock, target = pair.sidecar, pair.generator, pair.socket_path, pair.target
    steps = distinct_plans(svc_ckpt, LONG_REQUEST)

    ch, _call, it = _open_stream(target, LONG_REQUEST)
    with ch:
        kinds = _read_until_step(it, 2)
        assert "plans_ready" in kinds
        st = sidecar_state(str(sock))
        assert st.leases_held == 1 and st.stats.slots_leased == steps, st
        gen.kill9()
        t_kill = time.monotonic()
        with pytest.raises(grpc.RpcError) as ei:
            _drain(it)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE

    wait_for(lambda: sidecar_state(str(sock)).leases_held == 0, 5, what="the sidecar to drop the dead session's lease")
    assert time.monotonic() - t_kill < 5
    st = sidecar_state(str(sock))
    assert not st.session_attached and st.stats.slots_leased == 0
    assert st.stats.slots_ready >= steps, "the plans stay in the slab"
    assert side.running()

    pair.start_generator()  # same flags, same port
    with GeneratorClient(target) as client:
        res = client.generate({**SAME_SCHEDULE_CHEAP, "request_id": "again"}, timeout=120)
    ready = dict(res.events)["plans_ready"]
    assert ready.built_plans == 0 and ready.host_hit_plans == 0, ready
    assert ready.gpu_hit_plans == steps, ready
    assert res.cache.gpu_hit_plans == steps and res.cache.built_plans == 0
    st = sidecar_state(str(sock))
    assert st.session_attached and st.leases_held == 0


# ----------------------------------------------------------------------------- ditserve serve
def _processes_mentioning(text: str) -> set[int]:
    """PIDs (other than ours) whose command line contains `text` (like `pgrep -f`)."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and pid_alive(int(d.name)):
            out.add(int(d.name))
    return out


def _children(pid: int) -> set[int]:
    """Live direct children of `pid` (from /proc/<pid>/task/*/children)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out |= {int(x) for x in (task / "children").read_text().split()}
    return {c for c in out if pid_alive(c)}


def _shm_listing() -> set[str]:
    d = Path("/dev/shm")
    return {str(p) for p in d.glob(f"{SHM_PREFIX}*")} if d.is_dir() else set()


def test_serve_sigterm_leaves_no_process_and_no_shm_file(procs: ProcessGroup, svc_ckpt: Path) -> None:
    run_dir = procs.workdir / "run"
    port = free_port()
    shm_before = _shm_listing()
    serve = procs.start("serve", [
        sys.executable, "-m", "ditserve", "serve", "--run-dir", run_dir, "--port", port, "--checkpoint", svc_ckpt,
        "--gpu-plans", "32", "--host-cache-gb", "0.01",
    ])  # fmt: skip
    target = f"127.0.0.1:{port}"
    procs.wait_healthy(target, serve, timeout=120)

    children = wait_for(lambda: len(c := _children(serve.pid)) == 2 and c, 10, what="both children")
    procs.extra_pids |= children
    cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for pid in children}
    assert sorted("plancache_service" in c for c in cmdlines.values()) == [False, True], cmdlines
    assert any("generator_service" in c for c in cmdlines.values()), cmdlines
    assert _processes_mentioning(str(run_dir)) >= children
    run_files = set().union(*(shm_files_of(pid) for pid in children))
    assert len(run_files) == 2 and all(Path(f).exists() for f in run_files), run_files
    procs.leaked_files |= run_files  # removed at teardown should the test fail
    assert (run_dir / "plancache.sock").exists()

    with GeneratorClient(target) as client:
        assert client.generate({**CHECK_REQUEST, "request_id": "serve-1"}, timeout=60).sha256

    serve.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert serve.proc.wait(60) == 0, procs.logs()  # type: ignore[union-attr]
    wait_for(lambda: not any(pid_alive(p) for p in children), 5, what="the children to exit")
    assert not _processes_mentioning(str(run_dir)), "no process of this run is left"
    # The run's files are the ones its processes mapped (other processes on this machine may
    # create /dev/shm/ditserve-* files meanwhile, so a bare before/after diff cannot tell).
    new_files = _shm_listing() - shm_before
    assert not (new_files & run_files), f"left behind: {new_files & run_files}"
    assert not any(Path(f).exists() for f in run_files)
    assert not (run_dir / "plancache.sock").exists()
