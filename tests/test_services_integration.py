"""Integration tests: a real plan-cache sidecar and a real generator, in this process.

The two servers talk over a unix socket and share the slab through /dev/shm exactly as the
deployed processes do; the tests drive them through gRPC (the Python client, raw stubs and
grpc.health.v1) and compare results with ditcore's resident generation (the reference) and, for
the latents, with diffusers' own MiniMax-H3 pipeline (tests/oracle.py).
"""

from __future__ import annotations

import io
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from oracle import diffusers_request_latents
from servicekit import (
    FOX_REQUEST,
    GENERATOR_SERVICE,
    PLANCACHE_SERVICE,
    RAIN_REQUEST,
    SERVING,
    Pair,
    distinct_plans,
    health_status,
    narrow_request,
    png_bytes,
    png_header,
    ref_sha,
    request_keys,
    resident_result,
    status_details,
    wait_for,
)

from ditcore import GenerationRequest, validate_checkpoint
from ditcore.request import MAX_KEYFRAME_PIXELS, MAX_PROMPT_BYTES, MAX_SIDE
from ditserve.client import GeneratorClient
from ditserve.client_requests import request_to_proto
from generator_service.config import MIB
from generator_service.execution import runner as runner_mod
from generator_service.execution.runs import Run
from protos.ditserve.generator.v1 import generator_pb2 as gen_pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as gen_grpc
from protos.ditserve.plancache.v1 import plancache_pb2 as cache_pb
from protos.ditserve.plancache.v1 import plancache_pb2_grpc as cache_grpc

GPU_PLANS = 64
SLOW_GPU_PLANS = 1000
KEYFRAME_BYTES = 1 * MIB  # the pair's --max-keyframe-mb (H3's own: 20)
KEYFRAME_PIXELS = 1_000_000  # the pair's --max-keyframe-pixels (H3's own: 4096 x 4096)
# Keeps the executor busy for a while: 999 forwards (width-1 plans: the slow pair's slots hold one page).
SLOW_REQUEST: dict[str, Any] = narrow_request(999, request_id="slow", prompt="slow")
NARROW: dict[str, Any] = narrow_request(3, request_id="narrow")  # fits the slow pair's slots


@pytest.fixture(scope="module")
def pair(svc_ckpt: Path) -> Iterator[Pair]:
    """Sidecar (64 slots, width 2) + generator with a small chunk size (multi-chunk results) and keyframe limits
    under H3's own."""
    with Pair(
        svc_ckpt, gpu_plans=GPU_PLANS, plan_width=2, chunk_bytes=1024, max_queue_depth=8,
        max_keyframe_bytes=KEYFRAME_BYTES, max_keyframe_pixels=KEYFRAME_PIXELS,
    ) as p:  # fmt: skip
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


def _jpeg(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.frombytes("RGB", (width, height), bytes(range(256)) * (width * height * 3 // 256 + 1)).save(buf, "JPEG")
    return buf.getvalue()


def _finished_requests(pair: Pair) -> dict[str, float]:
    """The generator's finished-request counter by outcome (requests that reached the executor)."""
    return {
        s.labels["outcome"]: s.value
        for m in pair.generator.metrics.registry.collect()
        if m.name == "ditserve_generator_requests"
        for s in m.samples
        if s.name.endswith("_total")
    }


def stream_events(responses: Any) -> list[tuple[str, Any]]:
    """(kind, message) of every GenerateStreamResponse, in order."""
    out = []
    for ev in responses:
        kind = ev.WhichOneof("event")
        out.append((kind, getattr(ev, kind)))
    return out


# ----------------------------------------------------------------------------- results
@pytest.mark.parametrize("req", [FOX_REQUEST, RAIN_REQUEST], ids=["fox", "rain"])
def test_generate_matches_resident_reference(pair: Pair, svc_ckpt: Path, req: dict[str, Any]) -> None:
    with GeneratorClient(pair.target) as client:
        res = client.generate_unary(req, timeout=60)  # checks the tensors hash to res.sha256
    ref = resident_result(svc_ckpt, req)
    assert res.sha256 == ref.sha256
    assert torch.equal(res.video, ref.video) and torch.equal(res.audio, ref.audio)
    assert res.video.shape[:2] == (1, 24) and res.video.shape[3:] == (req["height"] // 16, req["width"] // 16)
    assert res.audio.shape[:2] == (2, 32)
    assert res.request_id == req["request_id"]
    assert res.generation == 1
    assert res.adaln_mode == "ADALN_MODE_CACHED"
    assert res.cache.plans == distinct_plans(svc_ckpt, req)


def test_stream_event_order_and_chunks_equal_unary(
    pair: Pair, svc_ckpt: Path, gen_stub: gen_grpc.GeneratorStub
) -> None:
    req = {**RAIN_REQUEST, "request_id": "stream-1", "num_inference_steps": 6}
    n = req["num_inference_steps"] - 1  # transformer forwards
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
    assert ready.cache.gpu_hit_plans + ready.cache.host_hit_plans + ready.cache.built_plans == distinct_plans(
        svc_ckpt, req
    )
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


def test_repeated_request_is_all_slot_hits(pair: Pair, svc_ckpt: Path) -> None:
    req = {**FOX_REQUEST, "request_id": "repeat", "num_inference_steps": 5, "flow_shift": 4.25}
    n = distinct_plans(svc_ckpt, req)
    with GeneratorClient(pair.target) as client:
        first = client.generate(req, timeout=60)
        assert first.cache.built_plans >= 1, first.cache  # a schedule no other test uses
        assert first.cache.plans == n
        second = client.generate(req, timeout=60)
    ready = dict(second.events)["plans_ready"]
    assert ready.gpu_hit_plans == n and ready.built_plans == 0 and ready.host_hit_plans == 0, ready
    assert second.cache.gpu_hit_plans == n and second.cache.built_plans == 0
    assert second.sha256 == first.sha256


# ----------------------------------------------------------------------------- oracle: diffusers' own loop
@pytest.mark.parametrize("precision", ["mixed", "float32"])
def test_latents_through_the_pair_equal_diffusers(precision: str, tiny_ckpt: Path, tiny_ckpt_f32: Path) -> None:
    """Generate through a sidecar + generator pair returns, cold build, slab hit and host swap-in alike, exactly
    the latents of diffusers' own MiniMax-H3 pipeline called directly on the repository (tests/oracle.py)."""
    ckpt = tiny_ckpt if precision == "mixed" else tiny_ckpt_f32
    fox = {**FOX_REQUEST, "request_id": f"oracle-fox-{precision}", "num_inference_steps": 5}
    rain = {**RAIN_REQUEST, "request_id": f"oracle-rain-{precision}", "num_inference_steps": 5, "num_frames": 124}
    slots = distinct_plans(ckpt, fox)
    assert distinct_plans(ckpt, rain) == slots and set(request_keys(ckpt, fox)) != set(request_keys(ckpt, rain))
    want = {r["request_id"]: diffusers_request_latents(ckpt, r) for r in (fox, rain)}
    # as many slots as one request needs: rain evicts fox's plans, which come back from the host tier
    with Pair(ckpt, gpu_plans=slots, plan_width=2, host_cache_bytes=10**7) as p:
        p.start()
        seen = []
        with GeneratorClient(p.target) as client:
            for req in (fox, fox, rain, fox):
                res = client.generate(req, timeout=60)
                video, audio = want[req["request_id"]]
                assert torch.equal(res.video, video), (req["request_id"], res.cache)
                assert torch.equal(res.audio, audio), (req["request_id"], res.cache)
                seen.append(res.cache)
            st = client.status()
    cold, hit, _, swapped = seen
    assert cold.built_plans == slots and cold.gpu_hit_plans == 0, cold
    assert hit.gpu_hit_plans == slots and hit.built_plans == 0, hit
    assert swapped.host_hit_plans > 0 and swapped.built_plans == 0, swapped
    assert st.precision == precision
    assert st.slab.dtype == ("bfloat16" if precision == "mixed" else "float32")


# ----------------------------------------------------------------------------- status and state
def test_get_status_fields(pair: Pair, svc_ckpt: Path, gen_stub: gen_grpc.GeneratorStub) -> None:
    info = validate_checkpoint(svc_ckpt)
    dtype = info.projection_dtype
    st = gen_stub.GetStatus(gen_pb.GetStatusRequest(), timeout=10)
    assert st.generation == 1
    assert st.adaln_mode == gen_pb.ADALN_MODE_CACHED
    assert st.sidecar_connected and st.serving
    assert st.sidecar_target == pair.sidecar_target
    assert Path(st.weights_path).resolve() == svc_ckpt.resolve()
    assert st.fingerprint == info.fingerprint
    assert (st.model_preset, st.precision) == ("tiny", "mixed")
    assert st.max_queue_depth == 8 and st.queue_depth == 0
    # the cached transformer holds none of the checkpoint's plan tensors
    m = st.memory
    assert m.plan_tensor_bytes == len(info.partitions) * info.layout.plan_tensor_bytes(dtype) > 0  # both partitions
    assert (m.held_plan_bytes, m.saved_bytes, m.saved_fraction) == (0, m.plan_tensor_bytes, 1.0)
    assert m.transformer_bytes > 0
    assert st.HasField("slab")
    assert (st.slab.num_slots, st.slab.width) == (GPU_PLANS, 2)
    assert st.slab.page_numel == info.layout.page_numel and st.slab.page_bytes == info.layout.page_bytes(dtype)
    assert (st.slab.dtype, st.slab.device, st.slab.transport) == ("bfloat16", "cpu", "shm")


def test_sidecar_state_over_unix_socket(pair: Pair, svc_ckpt: Path) -> None:
    with GeneratorClient(pair.target) as client:
        client.generate({**FOX_REQUEST, "request_id": "state-1"}, timeout=60)
        client.generate_unary({**RAIN_REQUEST, "request_id": "state-2"}, timeout=60)
    info = validate_checkpoint(svc_ckpt)
    st = pair.state()
    assert st.leases_held == 0 and st.stats.slots_leased == 0
    assert st.session_attached and st.serving and st.not_serving_reason == ""
    assert st.generation == 1
    assert Path(st.weights_path).resolve() == svc_ckpt.resolve()
    assert st.fingerprint == info.fingerprint
    assert st.stats.num_slots == GPU_PLANS and st.stats.slot_width == 2
    assert st.stats.page_bytes == info.layout.page_bytes(info.projection_dtype)
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
        assert client.generate({**FOX_REQUEST, "request_id": "after-intruder"}, timeout=60).sha256


def _keys_proto(ckpt: Path, req: dict[str, Any]) -> list[cache_pb.PlanKey]:
    return [cache_pb.PlanKey(timestep_bits=list(k.bits)) for k in request_keys(ckpt, req)]


def test_prepare_plans_wrong_generation_is_aborted(
    pair: Pair, svc_ckpt: Path, cache_stub: cache_grpc.PlanCacheStub
) -> None:
    session_id = pair.generator.backend.link.attachment.session_id  # the live session
    before = pair.state().stats.prepares
    keys = _keys_proto(svc_ckpt, FOX_REQUEST)
    req = cache_pb.PreparePlansRequest(session_id=session_id, generation=7, plan_keys=keys)
    err = _rpc_error(cache_stub.PreparePlans, req, timeout=10)
    assert err.code() == grpc.StatusCode.ABORTED, err
    info, _ = status_details(err)
    assert info is not None and info.reason == "GENERATION_MISMATCH"
    assert info.metadata["current_generation"] == "1"
    st = pair.state()
    assert st.leases_held == 0 and st.stats.prepares == before


def test_prepare_plans_bogus_session_is_refused(
    cache_stub: cache_grpc.PlanCacheStub, pair: Pair, svc_ckpt: Path
) -> None:
    keys = _keys_proto(svc_ckpt, FOX_REQUEST)
    req = cache_pb.PreparePlansRequest(session_id="not-a-session", generation=1, plan_keys=keys)
    err = _rpc_error(cache_stub.PreparePlans, req, timeout=10)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    assert "Attach" in (err.details() or "")
    assert pair.state().leases_held == 0
    rel = cache_pb.ReleasePlansRequest(session_id="not-a-session", lease_id=1)
    assert _rpc_error(cache_stub.ReleasePlans, rel, timeout=10).code() == grpc.StatusCode.FAILED_PRECONDITION


# ----------------------------------------------------------------------------- request errors
# MiniMax-H3's rules (ditcore.request): every bad field is refused INVALID_ARGUMENT naming it, before any work.
PNG = png_bytes(48, 32)
JPEG = _jpeg(48, 32)
BAD_FIELDS: list[tuple[str, dict[str, Any]]] = [
    ("request_id", {"request_id": "bad id!"}),
    ("request_id", {"request_id": "x" * 129}),
    ("task", {"task": 7}),  # no such enum value
    ("task", {"task": 1}),  # the reserved TASK_T2V: text to video without audio is not a MiniMax-H3 task
    ("prompt", {"prompt": ""}),
    ("prompt", {"prompt": " \t\n"}),
    ("prompt", {"prompt": "p" * (MAX_PROMPT_BYTES + 1)}),
    ("prompt", {"prompt": "é" * (MAX_PROMPT_BYTES // 2 + 1)}),  # counted in UTF-8 bytes, not characters
    ("num_inference_steps", {"num_inference_steps": 1}),  # one grid point drives no forward
    ("num_inference_steps", {"num_inference_steps": 0}),
    ("num_inference_steps", {"num_inference_steps": -3}),
    ("num_inference_steps", {"num_inference_steps": 1001}),
    ("flow_shift", {"flow_shift": 0.0}),
    ("flow_shift", {"flow_shift": -1.0}),
    ("flow_shift", {"flow_shift": float("nan")}),
    ("flow_shift", {"flow_shift": float("inf")}),
    ("flow_shift", {"flow_shift": 1000.5}),
    ("audio_flow_shift", {"audio_flow_shift": float("nan")}),
    ("audio_flow_shift", {"audio_flow_shift": 0.0}),
    ("seed", {"seed": -1}),
    ("num_frames", {"num_frames": 125}),  # not 17n + 5
    ("num_frames", {"num_frames": 123}),
    ("num_frames", {"num_frames": 107}),  # 17n + 5, but under 5 seconds
    ("num_frames", {"num_frames": 362}),  # 17n + 5, but over 15 seconds
    ("num_frames", {"num_frames": 0}),
    ("height", {"height": 48}),  # not a multiple of 32
    ("height", {"height": 16}),
    ("height", {"height": 0}),
    ("height", {"height": MAX_SIDE + 32}),
    ("width", {"width": 40}),
    ("width", {"width": -32}),
    ("width", {"height": 32, "width": 160}),  # aspect 5:1
    ("width", {"height": 160, "width": 32}),  # aspect 1:5
    ("output_type", {"output_type": 9}),  # no such enum value
    # keyframes (fl2va; the task unset means fl2va when one is given): checked by header and structure at admission,
    # never queued when bad
    ("first_frame", {"task": 3}),  # TASK_FL2VA with no keyframe (both empty)
    ("first_frame", {"first_frame": b"not an image"}),
    ("first_frame", {"first_frame": b"GIF89a" + bytes(64)}),  # an image, but not PNG or JPEG
    ("first_frame", {"first_frame": PNG[: len(PNG) // 2]}),  # truncated
    ("first_frame", {"first_frame": PNG[:8]}),  # a PNG signature and nothing else
    ("first_frame", {"first_frame": png_header(0, 32)}),  # zero width
    ("first_frame", {"first_frame": png_header(60000, 60000)}),  # a decompression bomb's header
    ("first_frame", {"first_frame": png_bytes(200, 10)}),  # aspect 20:1
    ("first_frame", {"first_frame": PNG + bytes(KEYFRAME_BYTES)}),  # over --max-keyframe-mb
    ("first_frame", {"task": 2, "first_frame": PNG}),  # t2va takes no keyframe
    ("last_frame", {"task": 2, "last_frame": PNG}),
    ("last_frame", {"first_frame": PNG, "last_frame": JPEG[:-40]}),  # a good first frame, a truncated JPEG
    ("last_frame", {"task": 3, "last_frame": png_bytes(10, 200)}),  # aspect 1:20
]


@pytest.mark.parametrize(("field", "values"), BAD_FIELDS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_FIELDS)])
def test_bad_field_is_invalid_argument_with_field_violation(
    pair: Pair, gen_stub: gen_grpc.GeneratorStub, field: str, values: dict[str, Any]
) -> None:
    msg = gen_pb.GenerateRequest(**{"request_id": "bad-field", "prompt": "a fox", "num_inference_steps": 4, **values})
    before, status_before = pair.state().stats, gen_stub.GetStatus(gen_pb.GetStatusRequest(), timeout=10)
    finished_before = _finished_requests(pair)
    for call in (
        lambda: gen_stub.Generate(msg, timeout=10),
        lambda: list(gen_stub.GenerateStream(gen_pb.GenerateStreamRequest(request=msg), timeout=10)),
    ):
        err = _rpc_error(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
        assert (err.details() or "").startswith(f"{field}: "), err.details()
        info, violations = status_details(err)
        assert info is not None and info.reason == "INVALID_REQUEST" and info.domain == "ditserve"
        assert [f for f, _ in violations] == [field], violations
        assert violations[0][1], "the violation carries a description"
    after, status_after = pair.state().stats, gen_stub.GetStatus(gen_pb.GetStatusRequest(), timeout=10)
    assert (after.prepares, after.failed_prepares) == (before.prepares, before.failed_prepares), "no work was done"
    assert status_after == status_before, "nothing changed"
    assert _finished_requests(pair) == finished_before, "nothing reached the executor"


@pytest.mark.parametrize(
    ("frame", "flag"),
    [
        (PNG + bytes(KEYFRAME_BYTES), f"--max-keyframe-mb is {KEYFRAME_BYTES // MIB}"),
        (png_header(1200, 1000), f"--max-keyframe-pixels is {KEYFRAME_PIXELS}"),
        (png_header(4097, 4096), f"--max-keyframe-pixels is {KEYFRAME_PIXELS}"),  # over H3's own limit too
    ],
    ids=["bytes", "pixels", "pixels-over-h3"],
)
def test_keyframe_over_an_operator_limit_names_the_flag(
    gen_stub: gen_grpc.GeneratorStub, frame: bytes, flag: str
) -> None:
    assert 1200 * 1000 <= MAX_KEYFRAME_PIXELS < 4097 * 4096
    msg = gen_pb.GenerateRequest(request_id="big-frame", prompt="a fox", num_inference_steps=4, first_frame=frame)
    err = _rpc_error(gen_stub.Generate, msg, timeout=10)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    details = err.details() or ""
    assert details.startswith("first_frame: ") and f"(this server's {flag})" in details, details


def test_request_that_never_fits_the_slab_is_failed_precondition(
    pair: Pair, svc_ckpt: Path, gen_stub: gen_grpc.GeneratorStub
) -> None:
    too_many = {**FOX_REQUEST, "request_id": "too-many", "num_inference_steps": GPU_PLANS + 2}
    assert distinct_plans(svc_ckpt, too_many) == GPU_PLANS + 1
    before = pair.state().stats
    err = _rpc_error(gen_stub.Generate, _proto(too_many), timeout=10)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    assert "--gpu-plans" in (err.details() or "")
    info, _ = status_details(err)
    assert info is not None and info.reason == "PLAN_CAPACITY_EXCEEDED"
    after = pair.state().stats
    assert (after.prepares, after.failed_prepares) == (before.prepares, before.failed_prepares)
    # exactly as many distinct plans as slots fits
    fits = {**too_many, "request_id": "fits", "num_inference_steps": GPU_PLANS + 1}
    assert distinct_plans(svc_ckpt, fits) == GPU_PLANS
    with GeneratorClient(pair.target) as client:
        ok = client.generate_unary(fits, timeout=120)
    assert ok.cache.plans == GPU_PLANS


def test_request_wider_than_a_slot_is_failed_precondition(slow_pair: Pair) -> None:
    """Unequal video and audio shifts give plans two timesteps wide; the slow pair's slots hold one page."""
    with slow_pair.channel() as ch:
        err = _rpc_error(gen_grpc.GeneratorStub(ch).Generate, _proto(FOX_REQUEST), timeout=10)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    assert "--plan-width" in (err.details() or "")


def test_expected_generation_mismatch_is_aborted(pair: Pair, gen_stub: gen_grpc.GeneratorStub) -> None:
    msg = _proto(FOX_REQUEST)
    msg.expected_generation = 2
    err = _rpc_error(gen_stub.Generate, msg, timeout=10)
    assert err.code() == grpc.StatusCode.ABORTED, err
    info, _ = status_details(err)
    assert info is not None and info.reason == "GENERATION_MISMATCH"
    assert info.metadata["current_generation"] == "1"
    with GeneratorClient(pair.target) as client:
        assert client.generate_unary(FOX_REQUEST, expected_generation=1, timeout=60).generation == 1


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
            err = _rpc_error(stub.Generate, _proto(NARROW, request_id="refused"), timeout=10)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            info, _ = status_details(err)
            assert info is not None and info.reason == "QUEUE_FULL"
            st = stub.GetStatus(gen_pb.GetStatusRequest(), timeout=10)
            assert (st.queue_depth, st.max_queue_depth) == (1, 1)
        finally:
            call.cancel()
        wait_for(lambda: stub.GetStatus(gen_pb.GetStatusRequest()).queue_depth == 0, 5, what="the queue to drain")
        # the queue has room again
        ok = stub.Generate(_proto(NARROW, request_id="admitted"), timeout=60)
        assert ok.sha256


def test_cancel_stream_stops_executor_within_one_step(slow_pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = slow_pair.generator.backend
    checks: list[float] = []  # one per denoise step (the executor checks the session every step)
    cancelled_at: list[int] = []
    real_alive, real_cancel = backend.alive, Run.cancel
    lock = threading.Lock()

    def alive(lease: Any) -> bool:
        with lock:
            checks.append(time.monotonic())
        return real_alive(lease)

    def cancel(job: Any) -> None:
        if job.request.request_id == "to-cancel":  # not a late cancel of an earlier test's job on this pair
            with lock:
                cancelled_at.append(len(checks))
        real_cancel(job)

    monkeypatch.setattr(backend, "alive", alive)
    monkeypatch.setattr(Run, "cancel", cancel)

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
    assert n_checks < SLOW_REQUEST["num_inference_steps"]
    time.sleep(0.3)
    assert len(checks) == n_checks, "no step ran after the executor stopped"
    st = slow_pair.state()
    assert st.leases_held == 0 and st.stats.slots_leased == 0 and st.session_attached
    # the executor is free for the next request
    with GeneratorClient(slow_pair.target) as client:
        assert client.generate_unary({**NARROW, "request_id": "after-cancel"}, timeout=60).sha256


def test_sequential_requests_on_a_queue_of_one_are_never_refused(slow_pair: Pair) -> None:
    """A client that waits for each result may always send the next request (depth 1)."""
    req = narrow_request(1)
    with GeneratorClient(slow_pair.target) as client:
        shas = {client.generate_unary({**req, "request_id": f"seq-{i}"}, timeout=30).sha256 for i in range(8)}
        shas |= {client.generate({**req, "request_id": f"seqs-{i}"}, timeout=30).sha256 for i in range(4)}
    assert len(shas) == 1


def test_deadline_stops_the_executor(slow_pair: Pair) -> None:
    """A request past its deadline fails DEADLINE_EXCEEDED; the executor stops it within a step and releases its
    lease, and the next request runs."""
    with slow_pair.channel() as ch:
        stub = gen_grpc.GeneratorStub(ch)
        t0 = time.monotonic()
        err = _rpc_error(stub.Generate, _proto(SLOW_REQUEST, request_id="late"), timeout=1.5)
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
        wait_for(lambda: slow_pair.state().leases_held == 0, 3, what="the lease to be released")
        wait_for(lambda: stub.GetStatus(gen_pb.GetStatusRequest()).queue_depth == 0, 3, what="the executor to stop")
        assert time.monotonic() - t0 < 6
        assert stub.Generate(_proto(NARROW, request_id="after-deadline"), timeout=60).sha256


def test_next_request_is_prefetched_while_one_denoises(
    pair: Pair, svc_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a request denoises, the prefetch thread leases the next queued request's plans (both leases held at
    once); both results are exact."""
    first = narrow_request(6, request_id="prefetch-first", flow_shift=2.75, audio_flow_shift=2.75)
    second = {**FOX_REQUEST, "request_id": "prefetch-second", "flow_shift": 9.5}
    both_leased = threading.Event()
    real_generate = runner_mod.generate

    def held_after_step_1(model: Any, request: GenerationRequest, plans: Any = None, on_step: Any = None, **kw: Any):
        def step(done: int, total: int) -> None:
            if on_step is not None:
                on_step(done, total)
            if request.request_id == "prefetch-first" and done == 1:
                both_leased.wait(30)  # the first request stays mid-denoise until the test has seen both leases

        return real_generate(model, request, plans, on_step=step, **kw)

    monkeypatch.setattr(runner_mod, "generate", held_after_step_1)
    with pair.channel() as ch:
        stub = gen_grpc.GeneratorStub(ch)
        _, events, it = _start_stream(stub, first)
        try:
            _read_until_step(it, events, 1)
            queued = stub.Generate.future(_proto(second), timeout=120)
            wait_for(lambda: pair.state().leases_held == 2, 30, what="the second request's plans to be leased early")
        finally:
            both_leased.set()
        rest = [ev.WhichOneof("event") for ev in it]
        assert "result" in rest, rest
        assert queued.result().sha256 == ref_sha(svc_ckpt, second)
    assert pair.state().leases_held == 0


def test_session_lost_after_the_last_step_fails_the_request(slow_pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The session is checked again after the request's reads are known finished (generate() synchronizes before it
    releases): a session that ends between the last step's check and then fails the request with UNAVAILABLE instead
    of returning a result whose slots may have been retired and refilled; the next request is served."""
    backend = slow_pair.generator.backend
    real_alive = backend.alive
    forwards = NARROW["num_inference_steps"] - 1
    calls: list[int] = []

    def alive(lease: Any) -> bool:
        calls.append(1)
        # verify() before step 1, then one check per step: all live; the check after the reads finished: lost
        return real_alive(lease) and len(calls) <= 1 + forwards

    monkeypatch.setattr(backend, "alive", alive)
    with slow_pair.channel() as ch:
        stub = gen_grpc.GeneratorStub(ch)
        err = _rpc_error(stub.Generate, _proto(NARROW, request_id="lost-at-end"), timeout=60)
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert "before the request's reads finished" in (err.details() or "")
        assert len(calls) == 2 + forwards
        monkeypatch.setattr(backend, "alive", real_alive)
        assert stub.Generate(_proto(NARROW, request_id="after-lost"), timeout=60).sha256
