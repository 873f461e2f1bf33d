"""A run's result as public proto messages: the whole GenerateResponse (Generate), or a streamed result's header
and its chunks (GenerateStream). No grpc here."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ditruntime.convert import to_proto
from protos.ditserve.generator.v1 import generator_pb2 as pb

from ..execution.runs import RunResult
from .convert import OUTPUT_ENUMS


def _latents(res: RunResult) -> list[tuple[str, torch.Tensor]]:
    """The latents a result carries (output type "latents" only: a media result carries the file instead)."""
    if res.media is not None:
        return []
    return [(name, t) for name, t in (("video", res.result.video), ("audio", res.result.audio)) if t is not None]


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's raw bytes, without a copy (the result's tensors are contiguous CPU tensors)."""
    return t.contiguous().view(-1).numpy().data.cast("B")


def _tensors(res: RunResult, with_data: bool) -> list[pb.Tensor]:
    """The latents as tensors; their data only `with_data` (a unary result: a stream sends it in chunks)."""
    return [
        pb.Tensor(
            name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
            data=bytes(_tensor_bytes(t)) if with_data else b"",
        )
        for name, t in _latents(res)
    ]  # fmt: skip


def _payload_bytes(res: RunResult) -> int:
    """Bytes a streamed result sends in chunks after its header: the media file's, or all tensors'."""
    if res.media is not None:
        return res.media.size
    tensors = (res.result.video, res.result.audio)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def response_from_result(res: RunResult, mode: pb.AdalnMode, with_data: bool = True) -> pb.GenerateResponse:
    """The whole result (`with_data`), or a streamed result's header: no tensor or media bytes, and total_bytes
    says how many follow in chunks."""
    r = res.result
    cache = to_proto(r.cache, pb.CacheReport) if r.cache is not None else pb.CacheReport()
    resp = pb.GenerateResponse(
        request_id=r.request_id,
        generation=res.generation,
        sha256=r.sha256,
        tensors=_tensors(res, with_data),
        cache=cache,
        timings=pb.StageTimings(**res.timings_ms, attention_backend=r.attention_backend),
        adaln_mode=mode,
        output_type=OUTPUT_ENUMS[res.media.output_type if res.media is not None else "latents"],
        total_bytes=0 if with_data else _payload_bytes(res),
        quality=r.quality,
        blocks_skipped=r.blocks_skipped,
        quality_warning=r.quality_warning,
    )
    m = res.media
    if m is not None:
        resp.media.CopyFrom(pb.Media(
            content_type=m.content_type, size_bytes=m.size, sha256=m.sha256, data=m.read_all() if with_data else b"",
            filename=f"{r.request_id}{m.suffix}",
        ))  # fmt: skip
    return resp


def result_chunks(res: RunResult, chunk_bytes: int) -> Iterator[pb.GenerateStreamResponse]:
    """The result's bytes in order, `chunk_bytes` at a time: the media file ("media", read from its spooled
    file chunk by chunk), or each tensor (sliced from the tensor's own memory). Nothing is copied whole."""
    step = chunk_bytes
    if res.media is not None:
        off = 0
        for data in res.media.chunks(step):
            yield pb.GenerateStreamResponse(chunk=pb.ResultChunk(name="media", offset=off, data=data))
            off += len(data)
        if off == 0:
            yield pb.GenerateStreamResponse(chunk=pb.ResultChunk(name="media", offset=0, data=b""))
        return
    for name, t in _latents(res):
        view = _tensor_bytes(t)
        for off in range(0, max(len(view), 1), step):
            chunk = pb.ResultChunk(name=name, offset=off, data=bytes(view[off : off + step]))
            yield pb.GenerateStreamResponse(chunk=chunk)
