"""ditserve.client: every request without an id of its own gets a fresh one (not GenerationRequest's "req-0"), and a
streamed result is held once: each part is received into a buffer of the size its header gives (no list of chunks
joined, no growing buffer copied into bytes), or written straight to a file. The stream is a fake stub yielding real
GenerateStreamResponse messages, made one at a time so that only the client's own memory is measured."""

from __future__ import annotations

import hashlib
import re
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ditcore import GenerationRequest, latents_sha256
from ditserve.client import GeneratorClient
from ditserve.client_requests import as_request, request_to_proto
from ditserve.client_results import MEDIA_CHUNK, IntegrityError
from protos.ditserve.generator.v1 import generator_pb2 as pb

CHUNK = 1 << 20
MEDIA_BYTES = 24 * CHUNK + 12345


def media_bytes(size: int = MEDIA_BYTES) -> bytes:
    return (bytes(range(256)) * (size // 256 + 1))[:size]


class StreamStub:
    """GenerateStream answered by `events(request)`: a generator, so each message exists only while it is sent."""

    def __init__(self, events: Any) -> None:
        self.events = events
        self.sent: list[pb.GenerateStreamRequest] = []

    def GenerateStream(self, msg: pb.GenerateStreamRequest, **_: Any) -> Iterator[pb.GenerateStreamResponse]:
        self.sent.append(msg)
        return self.events(msg)


def media_events(data: bytes, sha256: str | None = None) -> Any:
    digest = sha256 or hashlib.sha256(data).hexdigest()

    def events(msg: pb.GenerateStreamRequest) -> Iterator[pb.GenerateStreamResponse]:
        media = pb.Media(content_type="video/mp4", size_bytes=len(data), sha256=digest, filename="x.mp4")
        yield pb.GenerateStreamResponse(queued=pb.Queued(request_id=msg.request.request_id, position=0))
        yield pb.GenerateStreamResponse(
            result=pb.GenerateResponse(request_id=msg.request.request_id, sha256="ab" * 32, media=media,
                                       output_type=pb.OUTPUT_TYPE_MP4, total_bytes=len(data))
        )  # fmt: skip
        for off in range(0, len(data), CHUNK):
            yield pb.GenerateStreamResponse(
                chunk=pb.ResultChunk(name=MEDIA_CHUNK, offset=off, data=data[off : off + CHUNK])
            )

    return events


def latents_events(video: torch.Tensor, audio: torch.Tensor) -> Any:
    digest = latents_sha256(video, audio)

    def events(msg: pb.GenerateStreamRequest) -> Iterator[pb.GenerateStreamResponse]:
        tensors = [
            pb.Tensor(name=n, dtype="float32", shape=list(t.shape)) for n, t in (("video", video), ("audio", audio))
        ]
        total = (video.numel() + audio.numel()) * 4
        yield pb.GenerateStreamResponse(
            result=pb.GenerateResponse(request_id=msg.request.request_id, sha256=digest,
                                       tensors=tensors, output_type=pb.OUTPUT_TYPE_LATENTS, total_bytes=total)
        )  # fmt: skip
        for name, t in (("video", video), ("audio", audio)):
            raw = t.contiguous().view(torch.uint8).reshape(-1)
            for off in range(0, raw.numel(), CHUNK):
                piece = raw[off : off + CHUNK].numpy().tobytes()
                yield pb.GenerateStreamResponse(chunk=pb.ResultChunk(name=name, offset=off, data=piece))

    return events


def client_with(stub: StreamStub) -> GeneratorClient:
    client = GeneratorClient("127.0.0.1:1")
    client.stub = stub  # type: ignore[assignment]
    return client


def peak_of(run: Any) -> tuple[Any, int]:
    """run()'s result and the peak of Python's allocations while it ran, above what was held before."""
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        out = run()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, peak - base


# ------------------------------------------------------------------------------------------------- request ids
ID = re.compile(r"req-[0-9a-f]{12}")


def test_every_request_without_an_id_gets_its_own() -> None:
    ids = [request_to_proto({"prompt": "a fox"}).request_id for _ in range(50)]
    ids += [request_to_proto({"prompt": "a fox", "request_id": ""}).request_id]
    ids += [request_to_proto(GenerationRequest(request_id="", prompt="a fox")).request_id]
    assert all(ID.fullmatch(i) for i in ids), ids
    assert len(set(ids)) == len(ids)


def test_explicit_ids_are_kept() -> None:
    assert request_to_proto({"prompt": "a fox", "request_id": "mine-1"}).request_id == "mine-1"
    assert as_request(GenerationRequest(request_id="mine-2", prompt="a fox")).request_id == "mine-2"
    # a GenerationRequest's own id is sent as is, its dataclass default included
    assert as_request(GenerationRequest(prompt="a fox")).request_id == "req-0"


def test_generate_sends_one_fresh_id_per_request_and_the_result_names_it() -> None:
    stub = StreamStub(media_events(media_bytes(1000)))
    with client_with(stub) as client:
        results = [client.generate({"prompt": "a fox", "output_type": "mp4"}) for _ in range(3)]
    sent = [m.request.request_id for m in stub.sent]
    assert len(set(sent)) == 3 and all(ID.fullmatch(i) for i in sent)
    assert [r.request_id for r in results] == sent


# -------------------------------------------------------------------------------------------------- memory
def test_a_streamed_media_result_is_held_once() -> None:
    """Peak extra memory while receiving a 24 MB file: the file's own buffer and about one chunk (the old
    client's chunk list or growing buffer, then its bytes() copy, held two files' worth)."""
    data = media_bytes()
    digest = hashlib.sha256(data).hexdigest()
    stub = StreamStub(media_events(data, digest))
    with client_with(stub) as client:
        result, peak = peak_of(lambda: client.generate({"prompt": "a fox", "output_type": "mp4"}))
    assert result.media is not None and result.media.size == len(data) and result.media.sha256 == digest
    assert result.media.data == data
    assert peak < len(data) + 4 * CHUNK, peak / len(data)


def test_streamed_latents_are_held_once_as_views_of_their_buffers() -> None:
    video = torch.randn(1, 24, 8, 32, 32)  # 3 MiB ...
    audio = torch.randn(2, 32, 40000)  # ... and 10 MiB of float32
    total = (video.numel() + audio.numel()) * 4
    stub = StreamStub(latents_events(video, audio))
    with client_with(stub) as client:
        result, peak = peak_of(lambda: client.generate({"prompt": "a fox"}))
    assert torch.equal(result.video, video) and torch.equal(result.audio, audio)
    assert peak < total + 4 * CHUNK, peak / total


def test_a_media_result_can_go_straight_to_a_file(tmp_path: Path) -> None:
    data = media_bytes()
    target = tmp_path / "fox.mp4"
    stub = StreamStub(media_events(data))
    with client_with(stub) as client:
        result, peak = peak_of(lambda: client.generate({"prompt": "a fox", "output_type": "mp4"}, media_path=target))
    assert target.read_bytes() == data and sorted(tmp_path.iterdir()) == [target]
    assert result.media is not None and result.media.path == target and result.media.data == b""
    assert result.media.size == len(data)
    assert peak < 4 * CHUNK, peak  # the file is never held: a chunk or two at a time
    copy = result.media.write(tmp_path / "copy.mp4")
    assert copy.read_bytes() == data


def test_a_media_file_that_does_not_check_out_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "fox.mp4"
    stub = StreamStub(media_events(media_bytes(3 * CHUNK), sha256="00" * 32))
    with client_with(stub) as client, pytest.raises(IntegrityError, match="hashes to"):
        client.generate({"prompt": "a fox", "output_type": "mp4"}, media_path=target)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("size", "total", "expect"),
    [(100, 100 + 5, "the header said"), (100, 10, "more than the header")],
)
def test_a_header_whose_parts_disagree_with_its_total_is_refused(size: int, total: int, expect: str) -> None:
    data = media_bytes(size)

    def events(msg: pb.GenerateStreamRequest) -> Iterator[pb.GenerateStreamResponse]:
        media = pb.Media(content_type="video/mp4", size_bytes=size, sha256=hashlib.sha256(data).hexdigest())
        yield pb.GenerateStreamResponse(
            result=pb.GenerateResponse(request_id="x", media=media, output_type=pb.OUTPUT_TYPE_MP4, total_bytes=total)
        )

    with client_with(StreamStub(events)) as client, pytest.raises(IntegrityError, match=expect):
        client.generate({"prompt": "a fox", "output_type": "mp4"})


def test_a_chunk_past_its_part_is_refused() -> None:
    data = media_bytes(100)

    def events(msg: pb.GenerateStreamRequest) -> Iterator[pb.GenerateStreamResponse]:
        media = pb.Media(content_type="video/mp4", size_bytes=100, sha256=hashlib.sha256(data).hexdigest())
        yield pb.GenerateStreamResponse(
            result=pb.GenerateResponse(request_id="x", media=media, output_type=pb.OUTPUT_TYPE_MP4, total_bytes=100)
        )
        yield pb.GenerateStreamResponse(chunk=pb.ResultChunk(name=MEDIA_CHUNK, offset=0, data=data + b"!"))

    with client_with(StreamStub(events)) as client, pytest.raises(IntegrityError, match="past the 100 bytes"):
        client.generate({"prompt": "a fox", "output_type": "mp4"})
