"""Integration tests: a real plan-cache sidecar and a real generator, in this process.

The two servers talk over a unix socket and share the slab through /dev/shm exactly as the
deployed processes do; the tests drive them through gRPC (the Python client, raw stubs and
grpc.health.v1) and compare results with ditcore's resident generation (the reference).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from servicekit import (
    GENERATOR_SERVICE,
    PLANCACHE_SERVICE,
    SERVING,
    T2V_REQUEST,
    T2VA_REQUEST,
    TINY,
    Pair,
    health_status,
    ref_sha,
    resident_result,
    status_details,
    wait_for,
)

from ditcore import GenerationRequest, validate_checkpoint
from ditserve.client import GeneratorClient, request_to_proto
from generator_service import executor as executor_mod
from protos.ditserve.generator.v1 import generator_pb2 as gen_pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as gen_grpc
from protos.ditserve.plancache.v1 import plancache_pb2 as cache_pb
from protos.ditserve.plancache.v1 import plancache_pb2_grpc as cache_grpc

GPU_PLANS = 64
SLOW_GPU_PLANS = 1000
# A request that keeps the executor busy for a while: 1000 steps at the largest tiny size.
SLOW_REQUEST: dict[str, Any] = {
    "request_id": "slow",
    "task": "t2v",
    "steps": 1000,
    "flow_shift": 5.0,
    "guidance_scale": 5.0,
    "frames": 17,
    "height": 64,
    "width": 64,
}


@pytest.fixture(scope="module")
def pair(svc_ckpt: Path) -> Iterator[Pair]:
    """Sidecar (64 slots, width 2) + generator with a small chunk size (multi-chunk results)."""
    with Pair(svc_ckpt, gpu_plans=GPU_PLANS, plan_width=2, chunk_bytes=1024, max_queue_depth=8) as p:
        yield p.start()


@pytest.fixture(scope="module")
def slow_pair(svc_ckpt: Path) -> Iterator[Pair]:
    """Sidecar (1000 slots, width 1) + generator with a queue of one."""
    with Pair(svc_ckpt, gpu_plans=SLOW_GPU_PLANS, plan_width=1, max_queue_depth=1) as p:
        yield p.start()


@pytest.fixture
def gen_stub(pair: Pair) -> Iterator[gen_grpc.GeneratorStub]:
    with pair.channel() as ch:
        yield gen_grpc.GeneratorStub(ch)


@pytest.fixture
def cache_stub(pair: Pair) -> Iterator[cache_grpc.PlanCacheStub]:
    with pair.sidecar_channel() as ch:
        yield cache_grpc.PlanCacheStub(ch)


def _proto(req: dict[str, Any], **overrides: Any) -> gen_pb.GenerateRequest:
    return request_to_proto(GenerationRequest.from_dict({**req, **overrides}))


def _rpc_error(fn: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        fn(*args, **kwargs)
    return ei.value


def stream_events(responses: Any) -> list[tuple[str, Any]]:
    """(kind, message) of every GenerateStreamResponse, in order."""
    out = []
    for ev in responses:
        kind = ev.WhichOneof("event")
        out.append((kind, getattr(ev, kind)))
    return out


# ----------------------------------------------------------------------------- results
@pytest.mark.parametrize("req", [T2V_REQUEST, T2VA_REQUEST], ids=["t2v", "t2va"])
def test_generate_matches_resident_reference(pair: Pair, svc_ckpt: Path, req: dict[str, Any]) -> None:
    with GeneratorClient(pair.target) as client:
        res = client.generate_unary(req, timeout=60)  # checks the tensors hash to res.sha256
    ref = resident_result(svc_ckpt, req)
    assert res.sha256 == ref.sha256
    assert torch.equal(res.video, ref.video)
    if req["task"] == "t2va":
        assert res.audio is not None and ref.audio is not None and torch.equal(res.audio, ref.audio)
    else:
        assert res.audio is None
    assert res.request_id == req["request_id"]
    assert res.generation == 1
    assert res.adaln_mode == "ADALN_MODE_CACHED"
    c = res.cache
    assert c.plans == req["steps"]


def test_stream_event_order_and_chunks_equal_unary(
    pair: Pair, svc_ckpt: Path, gen_stub: gen_grpc.GeneratorStub
) -> None:
    req = {**T2VA_REQUEST, "request_id": "stream-1", "frames": 17, "height": 64, "width": 64, "audio_length": 32}
    n = req["steps"]
    events = stream_events(gen_stub.GenerateStream(gen_pb.GenerateStreamRequest(request=_proto(req)), timeout=60))
    kinds = [k for k, _ in events]

    # queued -> plans_ready -> step 1..N -> result header -> chunks
    assert kinds[:2] == ["queued", "plans_ready"], kinds
    assert kinds[2 : 2 + n] == ["step"] * n, kinds
    assert kinds[2 + n] == "result", kinds
    assert set(kinds[3 + n :]) == {"chunk"} and len(kinds) > 3 + n + 2, kinds  # several chunks (1 KiB each)
    assert events[0][1].request_id == "stream-1"
    ready = events[1][1]
    assert ready.generation == 1
    assert ready.cache.gpu_hit_plans + ready.cache.host_hit_plans + ready.cache.built_plans == n
    assert [(s.step, s.total) for _, s in events[2 : 2 + n]] == [(i, n) for i in range(1, n + 1)]

    header = events[2 + n][1]
    assert header.request_id == "stream-1" and header.generation == 1
    assert [t.name for t in header.tensors] == ["video", "audio"]
    assert all(t.data == b"" for t in header.tensors)
    assert header.cache == ready.cache

    data: dict[str, bytearray] = {t.name: bytearray() for t in header.tensors}
    for _, chunk in events[3 + n :]:
        assert chunk.offset == len(data[chunk.name]), "chunks arrive in order, without gaps"
        assert 0 < len(chunk.data) <= 1024
        data[chunk.name].extend(chunk.data)

    assert header.sha256 == ref_sha(svc_ckpt, req)
    unary = gen_stub.Generate(_proto(req), timeout=60)
    assert unary.sha256 == header.sha256
    assert {t.name: t.data for t in unary.tensors} == {k: bytes(v) for k, v in data.items()}
    for t in header.tensors:
        assert t.dtype == "float32" and len(data[t.name]) == 4 * math.prod(t.shape)
    with GeneratorClient(pair.target) as client:  # the client's reassembly checks the hash too
        assert client.generate(req, timeout=60).sha256 == header.sha256


def test_repeated_request_is_all_slot_hits(pair: Pair) -> None:
    req = {**T2V_REQUEST, "request_id": "repeat", "steps": 9, "flow_shift": 4.25}
    with GeneratorClient(pair.target) as client:
        first = client.generate(req, timeout=60)
        assert first.cache.built_plans >= 1, first.cache  # a schedule no other test uses
        assert sum(getattr(first.cache, k) for k in ("gpu_hit_plans", "host_hit_plans", "built_plans")) == 9
        second = client.generate(req, timeout=60)
    ready = dict(second.events)["plans_ready"]
    assert ready.gpu_hit_plans == 9 and ready.built_plans == 0 and ready.host_hit_plans == 0, ready
    assert second.cache.gpu_hit_plans == 9 and second.cache.built_plans == 0
    assert second.sha256 == first.sha256


# ----------------------------------------------------------------------------- status and state
def test_get_status_fields(pair: Pair, svc_ckpt: Path, gen_stub: gen_grpc.GeneratorStub) -> None:
    st = gen_stub.GetStatus(gen_pb.GetStatusRequest(), timeout=10)
    assert st.generation == 1
    assert st.adaln_mode == gen_pb.ADALN_MODE_CACHED
    assert st.sidecar_connected and st.serving
    assert st.sidecar_target == pair.sidecar_target
    assert Path(st.weights_path).resolve() == svc_ckpt.resolve()
    assert st.fingerprint == validate_checkpoint(svc_ckpt).fingerprint
    assert st.model_preset == "tiny"
    assert st.max_queue_depth == 8 and st.queue_depth == 0
    assert st.HasField("slab")
    assert (st.slab.num_slots, st.slab.width) == (GPU_PLANS, 2)
    assert st.slab.page_numel == TINY.page_numel and st.slab.page_bytes == TINY.page_bytes
    assert (st.slab.dtype, st.slab.device, st.slab.transport) == (TINY.dtype, "cpu", "shm")


def test_sidecar_state_over_unix_socket(pair: Pair, svc_ckpt: Path) -> None:
    with GeneratorClient(pair.target) as client:
        client.generate({**T2V_REQUEST, "request_id": "state-1"}, timeout=60)
        client.generate_unary({**T2VA_REQUEST, "request_id": "state-2"}, timeout=60)
    st = pair.state()
    assert st.leases_held == 0 and st.stats.slots_leased == 0
    assert st.session_attached and st.serving and st.not_serving_reason == ""
    assert st.generation == 1
    assert Path(st.weights_path).resolve() == svc_ckpt.resolve()
    assert st.fingerprint == validate_checkpoint(svc_ckpt).fingerprint
    assert st.stats.num_slots == GPU_PLANS and st.stats.slot_width == 2
    assert st.stats.page_bytes == TINY.page_bytes
    assert st.stats.prepares >= 2 and st.stats.slots_ready >= 1


def test_second_attach_is_refused(pair: Pair, cache_stub: cache_grpc.PlanCacheStub) -> None:
    stream = cache_stub.Attach(cache_pb.AttachRequest(client_name="intruder"), timeout=10)
    err = _rpc_error(next, stream)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    info, _ = status_details(err)
    assert info is not None and info.reason == "SESSION_MISMATCH"
    # the live session is untouched
    st = pair.state()
    assert st.session_attached
    with pair.channel() as ch:
        assert gen_grpc.GeneratorStub(ch).GetStatus(gen_pb.GetStatusRequest(), timeout=10).sidecar_connected
    with GeneratorClient(pair.target) as client:
        assert client.generate({**T2V_REQUEST, "request_id": "after-intruder"}, timeout=60).sha256


def _keys_proto(req: dict[str, Any]) -> list[cache_pb.PlanKey]:
    keys = GenerationRequest.from_dict(dict(req)).schedule_spec().plan_keys()
    return [cache_pb.PlanKey(timestep_bits=list(k.bits)) for k in keys]


def test_prepare_plans_wrong_generation_is_aborted(pair: Pair, cache_stub: cache_grpc.PlanCacheStub) -> None:
    session_id = pair.generator.backend.link.attachment.session_id  # the live session
    before = pair.state().stats.prepares
    req = cache_pb.PreparePlansRequest(session_id=session_id, generation=7, plan_keys=_keys_proto(T2V_REQUEST))
    err = _rpc_error(cache_stub.PreparePlans, req, timeout=10)
    assert err.code() == grpc.StatusCode.ABORTED, err
    info, _ = status_details(err)
    assert info is not None and info.reason == "GENERATION_MISMATCH"
    assert info.metadata["current_generation"] == "1"
    st = pair.state()
    assert st.leases_held == 0 and st.stats.prepares == before


def test_prepare_plans_bogus_session_is_refused(cache_stub: cache_grpc.PlanCacheStub, pair: Pair) -> None:
    req = cache_pb.PreparePlansRequest(session_id="not-a-session", generation=1, plan_keys=_keys_proto(T2V_REQUEST))
    err = _rpc_error(cache_stub.PreparePlans, req, timeout=10)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    assert "Attach" in (err.details() or "")
    assert pair.state().leases_held == 0
    rel = cache_pb.ReleasePlansRequest(session_id="not-a-session", lease_id=1)
    assert _rpc_error(cache_stub.ReleasePlans, rel, timeout=10).code() == grpc.StatusCode.FAILED_PRECONDITION


# ----------------------------------------------------------------------------- request errors
BAD_FIELDS: list[tuple[str, dict[str, Any]]] = [
    ("request_id", {"request_id": "bad id!"}),
    ("request_id", {"request_id": "x" * 129}),
    ("task", {"task": 7}),
    ("prompt", {"prompt": "p" * (TINY.text_len + 1)}),
    ("negative_prompt", {"negative_prompt": "é" * TINY.text_len}),
    ("steps", {"steps": 0}),
    ("steps", {"steps": 1001}),
    ("steps", {"steps": -3}),
    ("flow_shift", {"flow_shift": 0.0}),
    ("flow_shift", {"flow_shift": -1.0}),
    ("flow_shift", {"flow_shift": float("nan")}),
    ("flow_shift", {"flow_shift": float("inf")}),
    ("flow_shift", {"flow_shift": 1000.5}),
    ("audio_flow_shift", {"task": gen_pb.TASK_T2VA, "audio_flow_shift": float("nan")}),
    ("audio_flow_shift", {"task": gen_pb.TASK_T2VA, "audio_flow_shift": 0.0}),
    ("guidance_scale", {"guidance_scale": -0.5}),
    ("guidance_scale", {"guidance_scale": 100.5}),
    ("guidance_scale", {"guidance_scale": float("nan")}),
    ("seed", {"seed": -1}),
    ("frames", {"frames": 4}),
    ("frames", {"frames": 0}),
    ("frames", {"frames": TINY.max_frames + 4}),
    ("height", {"height": 24}),
    ("height", {"height": 0}),
    ("height", {"height": TINY.max_height + 16}),
    ("width", {"width": 8}),
    ("audio_length", {"task": gen_pb.TASK_T2VA, "audio_length": 0}),
    ("audio_length", {"task": gen_pb.TASK_T2VA, "audio_length": TINY.max_audio_length + 1}),
]


@pytest.mark.parametrize(("field", "values"), BAD_FIELDS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_FIELDS)])
def test_bad_field_is_invalid_argument_with_field_violation(
    pair: Pair, gen_stub: gen_grpc.GeneratorStub, field: str, values: dict[str, Any]
) -> None:
    msg = gen_pb.GenerateRequest(**{"request_id": "bad-field", "steps": 4, **values})
    before = pair.state().stats
    for call in (
        lambda: gen_stub.Generate(msg, timeout=10),
        lambda: list(gen_stub.GenerateStream(gen_pb.GenerateStreamRequest(request=msg), timeout=10)),
    ):
        err = _rpc_error(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
        assert field in (err.details() or "")
        info, violations = status_details(err)
        assert info is not None and info.reason == "INVALID_REQUEST" and info.domain == "ditserve"
        assert [f for f, _ in violations] == [field], violations
        assert violations[0][1], "the violation carries a description"
    after = pair.state().stats
    assert (after.prepares, after.failed_prepares) == (before.prepares, before.failed_prepares), "no work was done"


def test_request_that_never_fits_the_slab_is_failed_precondition(pair: Pair, gen_stub: gen_grpc.GeneratorStub) -> None:
    before = pair.state().stats
    err = _rpc_error(gen_stub.Generate, _proto(T2V_REQUEST, steps=GPU_PLANS + 1), timeout=10)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    assert "--gpu-plans" in (err.details() or "")
    info, _ = status_details(err)
    assert info is not None and info.reason == "PLAN_CAPACITY_EXCEEDED"
    after = pair.state().stats
    assert (after.prepares, after.failed_prepares) == (before.prepares, before.failed_prepares)
    # exactly as many steps as slots fits
    with GeneratorClient(pair.target) as client:
        ok = client.generate_unary(
            {**T2V_REQUEST, "request_id": "fits", "steps": GPU_PLANS, "guidance_scale": 1.0, "height": 16}, timeout=60
        )
    assert ok.cache.gpu_hit_plans + ok.cache.host_hit_plans + ok.cache.built_plans == GPU_PLANS


def test_request_wider_than_a_slot_is_failed_precondition(slow_pair: Pair) -> None:
    with slow_pair.channel() as ch:
        err = _rpc_error(gen_grpc.GeneratorStub(ch).Generate, _proto(T2VA_REQUEST), timeout=10)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    assert "--plan-width" in (err.details() or "")


def test_expected_generation_mismatch_is_aborted(pair: Pair, gen_stub: gen_grpc.GeneratorStub) -> None:
    msg = _proto(T2V_REQUEST)
    msg.expected_generation = 2
    err = _rpc_error(gen_stub.Generate, msg, timeout=10)
    assert err.code() == grpc.StatusCode.ABORTED, err
    info, _ = status_details(err)
    assert info is not None and info.reason == "GENERATION_MISMATCH"
    assert info.metadata["current_generation"] == "1"
    with GeneratorClient(pair.target) as client:
        assert client.generate_unary(T2V_REQUEST, expected_generation=1, timeout=60).generation == 1


def test_update_weights_without_admin_token_is_refused(pair: Pair, gen_stub: gen_grpc.GeneratorStub) -> None:
    """No --admin-token configured: updates are off (PERMISSION_DENIED) and nothing changes."""
    req = gen_pb.UpdateWeightsRequest(weights_path=str(pair.checkpoint))
    for metadata in (None, [("authorization", "Bearer guess")]):
        err = _rpc_error(gen_stub.UpdateWeights, req, timeout=10, metadata=metadata)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err
        info, _ = status_details(err)
        assert info is not None and info.reason == "UPDATES_DISABLED"
    st = gen_stub.GetStatus(gen_pb.GetStatusRequest(), timeout=10)
    assert st.generation == 1 and st.serving
    assert pair.state().generation == 1 and pair.state().pending_weights_path == ""


def test_health_is_serving_when_attached(pair: Pair) -> None:
    for service in ("", GENERATOR_SERVICE):
        assert health_status(pair.target, service) == SERVING
    for service in ("", PLANCACHE_SERVICE):
        assert health_status(pair.sidecar_target, service) == SERVING
    err = _rpc_error(health_status, pair.target, "no.such.Service")
    assert err.code() == grpc.StatusCode.NOT_FOUND


# ----------------------------------------------------------------------------- queue and cancellation
def _start_stream(stub: gen_grpc.GeneratorStub, req: dict[str, Any]) -> tuple[Any, list[tuple[str, Any]], Any]:
    """Start a GenerateStream; returns (call, events seen so far, iterator)."""
    call = stub.GenerateStream(gen_pb.GenerateStreamRequest(request=_proto(req)), timeout=120)
    return call, [], iter(call)


def _read_until_step(it: Any, events: list[tuple[str, Any]], step: int) -> None:
    for ev in it:
        kind = ev.WhichOneof("event")
        events.append((kind, getattr(ev, kind)))
        if kind == "step" and ev.step.step >= step:
            return
    raise AssertionError(f"the stream ended before step {step}: {[k for k, _ in events]}")


def test_full_queue_is_resource_exhausted(slow_pair: Pair) -> None:
    with slow_pair.channel() as ch:
        stub = gen_grpc.GeneratorStub(ch)
        call, events, it = _start_stream(stub, {**SLOW_REQUEST, "request_id": "occupier"})
        try:
            _read_until_step(it, events, 1)  # running: the queue (depth 1) is full
            err = _rpc_error(stub.Generate, _proto(T2V_REQUEST, request_id="refused"), timeout=10)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            info, _ = status_details(err)
            assert info is not None and info.reason == "QUEUE_FULL"
            st = stub.GetStatus(gen_pb.GetStatusRequest(), timeout=10)
            assert (st.queue_depth, st.max_queue_depth) == (1, 1)
        finally:
            call.cancel()
        wait_for(lambda: stub.GetStatus(gen_pb.GetStatusRequest()).queue_depth == 0, 5, what="the queue to drain")
        # the queue has room again
        ok = stub.Generate(_proto(T2V_REQUEST, request_id="admitted"), timeout=60)
        assert ok.sha256


def test_cancel_stream_stops_executor_within_one_step(slow_pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = slow_pair.generator.backend
    checks: list[float] = []  # one per denoise step (the executor checks the session every step)
    cancelled_at: list[int] = []
    real_alive, real_cancel = backend.alive, executor_mod.Job.cancel
    lock = threading.Lock()

    def alive(lease: Any) -> bool:
        with lock:
            checks.append(time.monotonic())
        return real_alive(lease)

    def cancel(job: Any) -> None:
        with lock:
            cancelled_at.append(len(checks))
        real_cancel(job)

    monkeypatch.setattr(backend, "alive", alive)
    monkeypatch.setattr(executor_mod.Job, "cancel", cancel)

    with slow_pair.channel() as ch:
        stub = gen_grpc.GeneratorStub(ch)
        call, events, it = _start_stream(stub, {**SLOW_REQUEST, "request_id": "to-cancel"})
        _read_until_step(it, events, 2)
        assert slow_pair.state().leases_held == 1
        t_cancel = time.monotonic()
        call.cancel()
        with pytest.raises(grpc.RpcError) as ei:
            for _ in it:
                pass
        assert ei.value.code() == grpc.StatusCode.CANCELLED

        wait_for(lambda: slow_pair.state().leases_held == 0, 2, what="the lease to be released")
        wait_for(lambda: stub.GetStatus(gen_pb.GetStatusRequest()).queue_depth == 0, 2, what="the executor to stop")
        assert time.monotonic() - t_cancel < 2.5
    assert cancelled_at, "the server saw the cancellation"
    n_checks = len(checks)
    # verify() checks once before step 1; every step checks once. At most one more step runs
    # after the server sees the cancellation, then the executor stops.
    assert n_checks - cancelled_at[0] <= 1, (cancelled_at, n_checks)
    assert n_checks < 1 + SLOW_REQUEST["steps"]
    time.sleep(0.3)
    assert len(checks) == n_checks, "no step ran after the executor stopped"
    st = slow_pair.state()
    assert st.leases_held == 0 and st.stats.slots_leased == 0 and st.session_attached
    # the executor is free for the next request
    with GeneratorClient(slow_pair.target) as client:
        assert client.generate_unary({**T2V_REQUEST, "request_id": "after-cancel"}, timeout=60).sha256


def test_sequential_requests_on_a_queue_of_one_are_never_refused(slow_pair: Pair) -> None:
    """A client that waits for each result may always send the next request (depth 1)."""
    req = {**T2V_REQUEST, "steps": 1, "guidance_scale": 1.0, "frames": 1, "height": 16, "width": 16}
    with GeneratorClient(slow_pair.target) as client:
        shas = {client.generate_unary({**req, "request_id": f"seq-{i}"}, timeout=30).sha256 for i in range(30)}
        shas |= {client.generate({**req, "request_id": f"seqs-{i}"}, timeout=30).sha256 for i in range(10)}
    assert len(shas) == 1
