"""Clients that stop reading, and floods, against a real in-process generator (resident, the tiny preset).

- 34 GenerateStream calls read the result header and never read again: Health and GetStatus keep answering
  within 1 s the whole time, the queue admits at most --max-queue-depth of them (a result keeps its queue slot until
  it is sent), the send watchdog cancels each stalled one after --stream-stall-s, and their results are freed.
- A flood of keyframe requests against a full queue is refused before any keyframe pixel is decoded.
"""

from __future__ import annotations

import gc
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import PIL.ImageFile
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image
from servicekit import wait_for

import ditcore.media_cache
from ditcore.media import DecodedMedia, EncodedMedia
from generator_service.app import build_server
from generator_service.config import GeneratorConfig
from generator_service.execution.runs import RunResult
from generator_service.serving.server import GeneratorServer
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

# 256 x 256 x 124 latents are 3.7 MB: more than a client buffers while it reads nothing (BDP probing off)
BIG = {"prompt": "a fox", "height": 256, "width": 256, "num_frames": 124, "num_inference_steps": 2}
CLIENT_OPTIONS = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture
def server(svc_ckpt: Path) -> Iterator[GeneratorServer]:
    cfg = GeneratorConfig(
        adaln_mode="resident", checkpoint=svc_ckpt, listen="127.0.0.1:0", stream_stall_s=2.0, max_queue_depth=16
    )
    srv = build_server(cfg)
    srv.start()
    wait_for(lambda: srv.state.serving, 120, "the resident model to load")
    try:
        yield srv
    finally:
        srv.stop(1)


def _stub(port: int) -> tuple[grpc.Channel, pb_grpc.GeneratorStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_OPTIONS)
    return channel, pb_grpc.GeneratorStub(channel)


def _results_alive() -> int:
    gc.collect()
    return sum(isinstance(o, RunResult) for o in gc.get_objects())


def test_stalled_readers_cannot_freeze_health_or_status_and_are_cancelled(server: GeneratorServer) -> None:
    port = server.port
    channels: list[grpc.Channel] = []
    outcomes: dict[str, list[Any]] = {"header": [], "refused": [], "cancelled": []}
    lock = threading.Lock()
    stop_reading = threading.Event()

    def stalled(i: int) -> None:
        channel, stub = _stub(port)
        channels.append(channel)
        req = pb.GenerateStreamRequest(request=pb.GenerateRequest(request_id=f"stall-{i}", seed=i, **BIG))
        try:
            for msg in stub.GenerateStream(req, timeout=120):
                if msg.HasField("result"):
                    with lock:
                        outcomes["header"].append(i)
                    stop_reading.wait()  # read nothing more: the server's sends back up
                    break
        except grpc.RpcError as e:
            with lock:
                key = "refused" if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "cancelled"
                outcomes[key].append((i, e.code()))

    threads = [threading.Thread(target=stalled, args=(i,), daemon=True) for i in range(34)]
    for t in threads:
        t.start()
    control, stub = _stub(port)
    health = health_pb2_grpc.HealthStub(control)
    worst = 0.0
    saw_stalled = False
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1  # SERVING
            st = stub.GetStatus(pb.GetStatusRequest(), timeout=1)
            worst = max(worst, time.monotonic() - t0)
            assert st.queue_depth <= 16  # a stalled result keeps its slot: never more than the queue holds
            with lock:
                headers = len(outcomes["header"])
            saw_stalled |= headers > 0 and st.queue_depth > 0
            if headers + len(outcomes["refused"]) >= 34 or (headers >= 16 and st.queue_depth == 0):
                break
            time.sleep(0.2)
        # every admitted stream got its header and was then cancelled by the watchdog: the queue drains
        wait_for(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=1).queue_depth == 0, 30, "the queue to drain")
    finally:
        stop_reading.set()
    for t in threads:
        t.join(30)
    with lock:
        admitted, refused = len(outcomes["header"]), len(outcomes["refused"])
    assert saw_stalled
    assert admitted + refused == 34 and 1 <= admitted <= 16, outcomes
    assert server.metrics.streams_cancelled.labels("stall")._value.get() == admitted
    assert worst < 1.0
    assert server.slots.busy == 0 and server.watchdog.watched == 0
    wait_for(lambda: _results_alive() == 0, 10, "the stalled streams' results to be freed")
    for channel in [*channels, control]:
        channel.close()


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


def test_a_keyframe_flood_against_a_full_queue_decodes_no_pixel(
    server: GeneratorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded = []  # every pixel decode goes through Pillow's ImageFile.load (the probe loads only a 2 x 1 skeleton)
    real = PIL.ImageFile.ImageFile.load
    monkeypatch.setattr(PIL.ImageFile.ImageFile, "load", lambda self: decoded.append(self.size) or real(self))
    server.executor.pause()  # nothing runs: the queue fills and stays full
    channel, stub = _stub(server.port)
    flood_channel, flood = _stub(server.port)  # one connection carries at most --max-streams-per-connection calls
    frame = _png()
    futures = [
        stub.Generate.future(pb.GenerateRequest(request_id=f"fill-{i}", prompt="a fox", first_frame=frame), timeout=60)
        for i in range(16)
    ]
    wait_for(lambda: server.executor.queue_depth == 16, 30, "the queue to fill")
    codes, took = [], []
    for i in range(40):
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            flood.Generate(pb.GenerateRequest(request_id=f"flood-{i}", prompt="a fox", first_frame=frame), timeout=10)
        took.append(time.monotonic() - t0)
        codes.append(err.value.code())
    assert set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert (64, 64) not in decoded  # admission decoded no keyframe: pixels are decoded only when a job runs
    assert set(decoded) <= {(2, 1)}
    print(f"40 refusals of a full queue: median {sorted(took)[20] * 1000:.1f} ms, max {max(took) * 1000:.1f} ms")
    for f in futures:
        f.cancel()
    server.executor.resume()
    wait_for(lambda: server.executor.queue_depth == 0, 60, "the cancelled jobs to leave the queue")
    channel.close()
    flood_channel.close()


def _media_alive() -> list[str]:
    gc.collect()
    kinds = (RunResult, DecodedMedia, EncodedMedia)
    return [type(o).__name__ for o in gc.get_objects() if isinstance(o, kinds)]


def test_an_idle_server_holds_no_finished_jobs_frames_or_bytes(server: GeneratorServer) -> None:
    channel, stub = _stub(server.port)
    small = {"prompt": "a fox", "num_inference_steps": 2, "output_type": pb.OUTPUT_TYPE_MP4}
    resp = stub.Generate(pb.GenerateRequest(request_id="unary-mp4", **small), timeout=120)
    assert resp.media.size_bytes > 0
    messages = list(stub.GenerateStream(pb.GenerateStreamRequest(request=pb.GenerateRequest(
        request_id="stream-mp4", output_type=pb.OUTPUT_TYPE_FRAMES_AND_WAV, prompt="a fox", num_inference_steps=2,
    )), timeout=120))  # fmt: skip
    assert messages[-1].HasField("chunk")
    keyframed = pb.GenerateRequest(request_id="fl2va", prompt="a fox", num_inference_steps=2, first_frame=_png())
    assert stub.Generate(keyframed, timeout=120).sha256
    wait_for(lambda: server.executor.queue_depth == 0, 10, "the queue to drain")
    assert _media_alive() == []  # the last media job's frames, file and result are gone while the server idles
    assert ditcore.media_cache.decoded_keyframe.cache_info().currsize == 0  # and no decoded keyframe (nor its bytes)
    channel.close()
