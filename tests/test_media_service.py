"""Media through a started sidecar + generator pair (in this process): fl2va keyframes in, MP4 and frames+WAV out.

The requests are built as raw GenerateRequest messages (the wire contract itself, not a client's conversion). An
MP4 is opened with PyAV, a ZIP with zipfile; fl2va latents are compared with diffusers' own MiniMax-H3 pipeline
called directly on the repository with the same keyframes decoded by Pillow (tests/oracle.py).
"""

from __future__ import annotations

import hashlib
import io
import threading
import wave
import zipfile
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from oracle import diffusers_request_latents
from PIL import Image
from refmedia import spliced_video
from servicekit import (
    Pair,
    audio_sampling_rate,
    distinct_plans,
    png_bytes,
    probe_mp4,
    request_keys,
    status_details,
    wait_for,
)

from generator_service.config import MIB
from generator_service.execution import mux as mux_mod
from protos.ditserve.generator.v1 import generator_pb2 as gen_pb

FPS = 24
CHUNK = 64 * 1024
SMALL_LIMIT = 1 * MIB  # the smallest --max-message-mb
# 3 forwards on the smallest canvas and clip; H3's default shifts (unequal: t2va plans 2 wide, fl2va 3 wide)
BASE: dict[str, Any] = {
    "prompt": "a red fox in the snow", "num_inference_steps": 4, "seed": 5, "num_frames": 124, "height": 32,
    "width": 32, "flow_shift": 12.0, "audio_flow_shift": 3.0,
}  # fmt: skip
FIRST = png_bytes(64, 48, seed=1)
LAST = png_bytes(40, 40, seed=2)
_TASKS = {"": gen_pb.TASK_UNSPECIFIED, "t2va": gen_pb.TASK_T2VA, "fl2va": gen_pb.TASK_FL2VA}
_OUTPUTS = {
    "latents": gen_pb.OUTPUT_TYPE_LATENTS,
    "mp4": gen_pb.OUTPUT_TYPE_MP4,
    "frames_and_wav": gen_pb.OUTPUT_TYPE_FRAMES_AND_WAV,
}


def to_proto(req: dict[str, Any]) -> gen_pb.GenerateRequest:
    """A request dict (GenerationRequest names; task "" = unset) as the GenerateRequest message."""
    fields = dict(req)
    fields["task"] = _TASKS[fields.get("task", "")]
    fields["output_type"] = _OUTPUTS[fields.get("output_type", "latents")]
    return gen_pb.GenerateRequest(**fields)


def stream(pair: Pair, req: dict[str, Any]) -> list[tuple[str, Any]]:
    """(kind, message) of every GenerateStream event, in order."""
    call = pair.stub.GenerateStream(gen_pb.GenerateStreamRequest(request=to_proto(req)), timeout=120)
    return [(ev.WhichOneof("event"), getattr(ev, ev.WhichOneof("event"))) for ev in call]


def latents(resp: gen_pb.GenerateResponse) -> dict[str, torch.Tensor]:
    assert resp.output_type == gen_pb.OUTPUT_TYPE_LATENTS and not resp.HasField("media")
    return {
        t.name: torch.frombuffer(bytearray(t.data), dtype=torch.float32).reshape(tuple(t.shape)) for t in resp.tensors
    }


def stage_count(pair: Pair, stage: str) -> float:
    value = pair.generator.metrics.registry.get_sample_value(
        "ditserve_generator_request_stage_seconds_count", {"stage": stage}
    )
    return value or 0.0


@pytest.fixture(scope="module")
def pair(svc_ckpt: Path) -> Iterator[Pair]:
    """Sidecar (64 slots, width 3: fl2va plans fit) + generator streaming 64 KiB chunks."""
    with Pair(svc_ckpt, gpu_plans=64, plan_width=3, chunk_bytes=CHUNK) as p:
        yield p.start()


@pytest.fixture(scope="module")
def narrow_pair(svc_ckpt: Path) -> Iterator[Pair]:
    """Sidecar with width-2 slots + a generator whose message limit is the smallest allowed (1 MiB)."""
    with Pair(svc_ckpt, gpu_plans=16, plan_width=2, chunk_bytes=CHUNK, max_message_bytes=SMALL_LIMIT) as p:
        yield p.start()


@pytest.fixture(scope="module")
def latents_sha(pair: Pair) -> str:
    """The latents' sha256 of BASE (t2va), asked for as latents."""
    resp = pair.stub.Generate(to_proto({**BASE, "request_id": "media-latents", "task": "t2va"}), timeout=120)
    assert resp.tensors and resp.total_bytes == 0 and not resp.HasField("media")
    assert (resp.timings.decode_ms, resp.timings.mux_ms) == (0, 0)
    return resp.sha256


# ----------------------------------------------------------------------------- media out
def test_unary_mp4(pair: Pair, svc_ckpt: Path, latents_sha: str) -> None:
    mux_before, decode_before = stage_count(pair, "mux"), stage_count(pair, "decode")
    resp = pair.stub.Generate(to_proto({**BASE, "request_id": "media-mp4", "output_type": "mp4"}), timeout=120)
    assert resp.output_type == gen_pb.OUTPUT_TYPE_MP4
    assert not resp.tensors and resp.total_bytes == 0
    m = resp.media
    assert m.content_type == "video/mp4" and m.filename == "media-mp4.mp4"
    assert m.size_bytes == len(m.data) > 0
    assert m.sha256 == hashlib.sha256(m.data).hexdigest()
    assert resp.sha256 == latents_sha, "sha256 names the latents, whatever the output type"
    assert resp.timings.decode_ms > 0 and resp.timings.mux_ms > 0
    assert resp.timings.total_ms >= resp.timings.denoise_ms + resp.timings.decode_ms + resp.timings.mux_ms

    info = probe_mp4(m.data)
    assert (info.video_streams, info.audio_streams) == (1, 1)
    assert info.video_codec == "h264" and info.fps == Fraction(FPS) and info.pix_fmt == "yuv420p"
    assert info.frames == BASE["num_frames"]
    assert (info.height, info.width) == (BASE["height"], BASE["width"])
    assert info.audio_codec == "aac" and info.channels == 2
    assert info.sample_rate == audio_sampling_rate(svc_ckpt)
    assert info.duration_s == pytest.approx(BASE["num_frames"] / FPS, abs=0.1)
    # the per-stage histograms saw one more decode and mux
    assert (stage_count(pair, "mux"), stage_count(pair, "decode")) == (mux_before + 1, decode_before + 1)


def test_stream_frames_and_wav(pair: Pair, svc_ckpt: Path, latents_sha: str) -> None:
    req = {**BASE, "request_id": "media-zip", "output_type": "frames_and_wav"}
    events = stream(pair, req)
    kinds = [k for k, _ in events]
    n = BASE["num_inference_steps"] - 1
    # queued -> plans_ready -> step 1..N -> decoding -> result header -> chunks
    assert kinds[: 3 + n] == ["queued", "plans_ready", *["step"] * n, "decoding"], kinds
    assert events[2 + n][1].output_type == gen_pb.OUTPUT_TYPE_FRAMES_AND_WAV
    assert kinds[3 + n] == "result" and set(kinds[4 + n :]) == {"chunk"}, kinds
    header = events[3 + n][1]
    assert header.output_type == gen_pb.OUTPUT_TYPE_FRAMES_AND_WAV and not header.tensors
    assert header.sha256 == latents_sha
    m = header.media
    assert m.data == b"" and m.content_type == "application/zip" and m.filename == "media-zip.zip"

    data = bytearray()
    chunks = [c for _, c in events[4 + n :]]
    for c in chunks:
        assert c.name == "media" and c.offset == len(data), "chunks arrive in order, without gaps"
        assert 0 < len(c.data) <= CHUNK
        data.extend(c.data)
    assert len(chunks) > 1
    assert header.total_bytes == m.size_bytes == len(data) == sum(len(c.data) for c in chunks)
    assert hashlib.sha256(data).hexdigest() == m.sha256

    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        names = z.namelist()
        frames = [f"frames/{i:06d}.png" for i in range(BASE["num_frames"])]
        assert names == [*frames, "audio.wav"]
        for name in (frames[0], frames[-1]):
            with Image.open(io.BytesIO(z.read(name))) as im:
                assert (im.format, im.mode, im.size) == ("PNG", "RGB", (BASE["width"], BASE["height"]))
        with wave.open(io.BytesIO(z.read("audio.wav"))) as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (2, 2, audio_sampling_rate(svc_ckpt))
            assert w.getnframes() / w.getframerate() == pytest.approx(BASE["num_frames"] / FPS, abs=0.1)


def test_unary_over_the_message_limit_is_resource_exhausted(narrow_pair: Pair) -> None:
    """A result larger than --max-message-mb is refused in one message, naming GenerateStream, which delivers it;
    the server serves on."""
    req = {**BASE, "request_id": "too-big", "output_type": "frames_and_wav"}
    with pytest.raises(grpc.RpcError) as ei:
        narrow_pair.stub.Generate(to_proto(req), timeout=120)
    err = ei.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    details = err.details() or ""
    assert "GenerateStream" in details and "-max-msg-sz" in details and str(SMALL_LIMIT) in details, details
    info, _ = status_details(err)
    assert info is not None and info.reason == "RESULT_TOO_LARGE"
    assert int(info.metadata["max_message_bytes"]) == SMALL_LIMIT
    size = int(info.metadata["result_bytes"])
    assert f"{size} bytes" in details and size > SMALL_LIMIT - 4096
    assert narrow_pair.status().queue_depth == 0

    events = stream(narrow_pair, req)  # the same request, in chunks
    header = next(msg for kind, msg in events if kind == "result")
    data = b"".join(msg.data for kind, msg in events if kind == "chunk")
    assert header.total_bytes == len(data) == header.media.size_bytes > SMALL_LIMIT - 4096
    assert hashlib.sha256(data).hexdigest() == header.media.sha256
    ok = narrow_pair.stub.Generate(to_proto({**BASE, "request_id": "fits"}), timeout=120)
    assert ok.sha256 == header.sha256 and ok.tensors


def test_a_reference_bomb_is_invalid_argument_naming_the_reference(pair: Pair) -> None:
    """A video reference that probes at 64 x 64 (its header and first frame) and decodes 1080p from frame 2 passes
    admission and is refused when the run decodes it, at that frame (ditcore.references); the server serves on."""
    bomb = spliced_video([(64, 64, 1), (1920, 1080, 16)])
    req = {**BASE, "request_id": "ref-bomb", "references": [gen_pb.Reference(data=bomb)]}
    with pytest.raises(grpc.RpcError) as ei:
        pair.stub.Generate(to_proto(req), timeout=120)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
    details = ei.value.details() or ""
    assert details.startswith("references[0]: its video frame 2 cannot be decoded"), details
    assert "larger than the 64 x 64 its header and first frame give" in details
    info, _ = status_details(ei.value)
    assert info is not None and info.reason == "INVALID_REQUEST"
    assert pair.status().queue_depth == 0
    assert pair.stub.Generate(to_proto({**BASE, "request_id": "after-bomb"}), timeout=120).tensors


def test_next_request_denoises_while_one_muxes(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Muxing needs no model: the executor hands a decoded job to the mux thread and runs the next one meanwhile;
    the muxing job keeps its queue slot until its result is sent."""
    muxing, next_stepped = threading.Event(), threading.Event()
    real_encode = mux_mod.encode

    def held_encode(media: Any, output_type: str, check: Any = None) -> Any:
        muxing.set()
        assert next_stepped.wait(30), "the next request did not step while this one muxed"
        return real_encode(media, output_type, check)

    monkeypatch.setattr(mux_mod, "encode", held_encode)
    first = pair.stub.Generate.future(to_proto({**BASE, "request_id": "mux-a", "output_type": "mp4"}), timeout=120)
    assert muxing.wait(60), "the first request never reached its mux"
    assert pair.status().queue_depth == 1  # muxing
    call = pair.stub.GenerateStream(
        gen_pb.GenerateStreamRequest(request=to_proto({**BASE, "request_id": "mux-b"})), timeout=120
    )
    kinds = []
    for ev in call:
        kinds.append(ev.WhichOneof("event"))
        if kinds[-1] == "step" and not next_stepped.is_set():
            assert pair.status().queue_depth == 2  # one muxing, one denoising
            next_stepped.set()
    assert "result" in kinds, kinds
    resp = first.result()
    assert resp.media.content_type == "video/mp4" and resp.media.size_bytes > 0
    wait_for(lambda: pair.status().queue_depth == 0, 10, "the queue to drain")


def test_mux_failure_is_internal_and_the_server_serves_on(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(media: Any, output_type: str, check: Any = None) -> Any:
        raise RuntimeError("this PyAV/FFmpeg build has no H.264 encoder")

    monkeypatch.setattr(mux_mod, "encode", broken)
    with pytest.raises(grpc.RpcError) as ei:
        pair.stub.Generate(to_proto({**BASE, "request_id": "mux-broken", "output_type": "mp4"}), timeout=120)
    assert ei.value.code() == grpc.StatusCode.INTERNAL, ei.value
    assert "encoding the mp4 failed" in (ei.value.details() or "") and "H.264" in (ei.value.details() or "")
    info, _ = status_details(ei.value)
    assert info is not None and info.reason == "MEDIA_ENCODE_FAILED"
    monkeypatch.undo()
    assert pair.status().queue_depth == 0
    ok = pair.stub.Generate(to_proto({**BASE, "request_id": "mux-fixed", "output_type": "mp4"}), timeout=120)
    assert ok.media.size_bytes > 0


# ----------------------------------------------------------------------------- keyframes in (fl2va)
def test_fl2va_plans_are_three_wide(narrow_pair: Pair, svc_ckpt: Path) -> None:
    """fl2va keys each step at {video t, audio t, max(video t, 0.999)}: 3 wide, where t2va's are 2; a sidecar with
    2-wide slots cannot serve it, and says which flag to raise."""
    fl2va = {**BASE, "task": "fl2va", "first_frame": FIRST}
    widths = [len(k.bits) for k in request_keys(svc_ckpt, fl2va)]
    assert max(widths) == 3, widths
    assert max(len(k.bits) for k in request_keys(svc_ckpt, {**BASE, "task": "t2va"})) == 2
    with pytest.raises(grpc.RpcError) as ei:
        narrow_pair.stub.Generate(to_proto({**fl2va, "request_id": "too-wide"}), timeout=30)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION, ei.value
    assert "--plan-width" in (ei.value.details() or "")


FL2VA_CASES: list[dict[str, Any]] = [
    {"first_frame": FIRST, "flow_shift": 5.5, "audio_flow_shift": 2.5},  # task unset: inferred fl2va
    {"task": "fl2va", "first_frame": FIRST, "last_frame": LAST, "flow_shift": 6.5, "audio_flow_shift": 1.5},
]


def test_fl2va_through_the_pair_equals_diffusers(pair: Pair, svc_ckpt: Path) -> None:
    """PNG keyframes (a first frame; a first and a last frame) through the cached pair give exactly diffusers' own
    fl2va latents (keyframes decoded by Pillow), on a cold build and again from the slab. The two schedules are no
    other test's; they share their first step's plan (t = 1 whatever the shift), which the second finds built."""
    t2va_keys = set(request_keys(svc_ckpt, {**BASE, "task": "t2va"}))
    seen: set[Any] = set()
    for case in FL2VA_CASES:
        req = {**BASE, **case}
        keys = set(request_keys(svc_ckpt, {**req, "task": "fl2va"}))
        assert not keys & t2va_keys, "fl2va steps are keyed apart from t2va's"
        n, new = len(keys), len(keys - seen)
        assert n == distinct_plans(svc_ckpt, {**req, "task": "fl2va"}) and new >= 1
        video, audio = diffusers_request_latents(svc_ckpt, req)
        reports = []
        for i in range(2):
            resp = pair.stub.Generate(to_proto({**req, "request_id": f"fl2va-{len(seen)}-{i}"}), timeout=120)
            got = latents(resp)
            assert torch.equal(got["video"], video) and torch.equal(got["audio"], audio), (case.keys(), resp.cache)
            reports.append(resp.cache)
        cold, warm = reports
        assert cold.built_plans == new and cold.gpu_hit_plans == n - new and cold.host_hit_plans == 0, cold
        assert warm.built_plans == 0 and warm.host_hit_plans == 0 and warm.gpu_hit_plans == n, warm
        seen |= keys
    assert len(seen) < sum(len(request_keys(svc_ckpt, {**BASE, **c, "task": "fl2va"})) for c in FL2VA_CASES)
    assert pair.status().slab.width == 3
