"""Python client of the generator service.

    from ditserve.client import GeneratorClient
    with GeneratorClient("127.0.0.1:50051") as client:
        result = client.generate({"prompt": "a red fox", "num_inference_steps": 20})
        print(result.sha256, result.video.shape, result.audio.shape, result.cache)

`generate` uses GenerateStream (progress events, result in chunks) and checks the sha256 of
the latents it received against the server's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from ditcore import GenerationRequest, RequestError, latents_sha256
from ditcore.plans import DTYPES
from ditcore.report import CacheReport
from ditruntime.convert import from_proto
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

_TASKS = {"t2va": pb.TASK_T2VA}
ProgressCallback = Callable[[str, Any], None]
"""Called with ("queued", position), ("plans_ready", CacheReport), ("step", (i, n))."""


class IntegrityError(RuntimeError):
    """The received latents do not hash to the sha256 the server reported."""


@dataclass
class ClientResult:
    request_id: str
    generation: int
    sha256: str
    video: torch.Tensor
    """Final video latents (1, 24, F_latent, H/16, W/16) float32, as diffusers returns them."""
    audio: torch.Tensor
    """Final audio latents (2, 32, N) float32."""
    cache: CacheReport
    timings_ms: dict[str, float]
    adaln_mode: str = ""
    events: list[tuple[str, Any]] = field(default_factory=list)


def request_to_proto(
    request: GenerationRequest | Mapping[str, Any], expected_generation: int | None = None
) -> pb.GenerateRequest:
    """Proto of a request, every optional field set (the server validates; a task with no proto value raises
    RequestError here, since no message could carry it)."""
    req = request if isinstance(request, GenerationRequest) else GenerationRequest.from_dict(dict(request))
    if req.task not in _TASKS:
        raise RequestError("task", f"unknown task {req.task!r}; the protocol carries {', '.join(_TASKS)}")
    msg = pb.GenerateRequest(request_id=req.request_id, prompt=req.prompt, task=_TASKS[req.task])
    for f in dataclasses.fields(GenerationRequest):
        if f.name in ("request_id", "task", "prompt"):
            continue
        value = getattr(req, f.name)
        try:
            setattr(msg, f.name, value)
        except (TypeError, ValueError) as e:  # out of the field's integer range, or the wrong type
            raise RequestError(f.name, f"{value!r} does not fit the GenerateRequest field ({e})") from e
    if expected_generation is not None:
        msg.expected_generation = expected_generation
    return msg


SCHEDULE_HEADER = "x-ditserve-schedule"
"""Metadata carrying the request's schedule, for load balancers with schedule affinity."""


def schedule_affinity_key(request: GenerationRequest | Mapping[str, Any]) -> str:
    """task/num_inference_steps/flow_shift/audio_flow_shift, e.g. `t2va/50/12/3`: a request's plan keys depend on
    these alone, so requests with equal keys share every plan on one checkpoint."""
    req = request if isinstance(request, GenerationRequest) else GenerationRequest.from_dict(dict(request))
    return f"{req.task}/{req.num_inference_steps}/{req.flow_shift:g}/{req.audio_flow_shift:g}"


def _timings(t: pb.StageTimings) -> dict[str, float]:
    return {f.name: getattr(t, f.name) for f in pb.StageTimings.DESCRIPTOR.fields}


def _tensor(t: pb.Tensor, data: bytes) -> torch.Tensor:
    if t.dtype not in DTYPES:
        raise IntegrityError(f"tensor {t.name!r} has dtype {t.dtype!r}; expected one of {sorted(DTYPES)}")
    dtype = DTYPES[t.dtype]
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(tuple(t.shape)).clone()


def result_from_response(resp: pb.GenerateResponse, data: Mapping[str, bytes] | None = None) -> ClientResult:
    tensors = {t.name: _tensor(t, data[t.name] if data is not None else t.data) for t in resp.tensors}
    missing = sorted({"video", "audio"} - set(tensors))
    if missing:
        raise IntegrityError(f"request {resp.request_id}: the result carries no {' or '.join(missing)} tensor")
    result = ClientResult(
        request_id=resp.request_id,
        generation=resp.generation,
        sha256=resp.sha256,
        video=tensors["video"],
        audio=tensors["audio"],
        cache=from_proto(resp.cache, CacheReport),
        timings_ms=_timings(resp.timings),
        adaln_mode=pb.AdalnMode.Name(resp.adaln_mode),
    )
    got = latents_sha256(result.video, result.audio)
    if got != result.sha256:
        raise IntegrityError(
            f"request {result.request_id}: received latents hash to {got}, server said {result.sha256}"
        )
    return result


class GeneratorClient:
    def __init__(
        self, target: str, credentials: grpc.ChannelCredentials | None = None, max_message_bytes: int = 64 * 2**20
    ) -> None:
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self.channel = (
            grpc.secure_channel(target, credentials, options) if credentials else grpc.insecure_channel(target, options)
        )
        self.stub = pb_grpc.GeneratorStub(self.channel)

    def __enter__(self) -> GeneratorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate(
        self,
        request: GenerationRequest | Mapping[str, Any],
        expected_generation: int | None = None,
        progress: ProgressCallback | None = None,
        timeout: float | None = None,
        metadata: list[tuple[str, str]] | None = None,
    ) -> ClientResult:
        """Run one request over GenerateStream; raises grpc.RpcError with the server's status."""
        msg = pb.GenerateStreamRequest(request=request_to_proto(request, expected_generation))
        metadata = [*(metadata or []), (SCHEDULE_HEADER, schedule_affinity_key(request))]
        header: pb.GenerateResponse | None = None
        data: dict[str, bytearray] = {}
        events: list[tuple[str, Any]] = []
        for ev in self.stub.GenerateStream(msg, timeout=timeout, metadata=metadata):
            kind = ev.WhichOneof("event")
            payload: Any = None
            if kind == "queued":
                payload = ev.queued.position
            elif kind == "plans_ready":
                payload = from_proto(ev.plans_ready.cache, CacheReport)
            elif kind == "step":
                payload = (ev.step.step, ev.step.total)
            elif kind == "result":
                header = ev.result
                data = {t.name: bytearray() for t in header.tensors}
                continue
            elif kind == "chunk":
                buf = data[ev.chunk.name]
                if ev.chunk.offset != len(buf):
                    raise IntegrityError(f"chunk of {ev.chunk.name} at offset {ev.chunk.offset}, expected {len(buf)}")
                buf.extend(ev.chunk.data)
                continue
            events.append((kind, payload))
            if progress is not None:
                progress(kind, payload)
        if header is None:
            raise IntegrityError("the stream ended without a result")
        result = result_from_response(header, {k: bytes(v) for k, v in data.items()})
        result.events = events
        return result

    def generate_unary(
        self,
        request: GenerationRequest | Mapping[str, Any],
        expected_generation: int | None = None,
        timeout: float | None = None,
    ) -> ClientResult:
        md = [(SCHEDULE_HEADER, schedule_affinity_key(request))]
        resp = self.stub.Generate(request_to_proto(request, expected_generation), timeout=timeout, metadata=md)
        return result_from_response(resp)

    def status(self, timeout: float = 10.0) -> pb.GetStatusResponse:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=timeout)
