"""Public proto messages -> the model layer's values: a GenerateRequest as a GenerationRequest (Generate,
GenerateStream, CreateJob and a restarted job all parse it here), a pushed tensor (UpdateWeights)."""

from __future__ import annotations

import math
import uuid
from typing import Any

import torch

from ditcore import GenerationRequest, RequestError
from ditcore.plans import DTYPES
from ditcore.request import infer_task
from protos.ditserve.generator.v1 import generator_pb2 as pb


def tensor_from_proto(t: pb.Tensor) -> torch.Tensor:
    """A pushed tensor (UpdateWeights): raw little-endian bytes of `dtype` in `shape`."""
    if t.dtype not in DTYPES:
        raise RequestError("tensors", f"{t.name}: dtype {t.dtype!r} not in {sorted(DTYPES)}")
    dtype = DTYPES[t.dtype]
    if any(d < 0 for d in t.shape) or len(t.data) != math.prod(t.shape) * dtype.itemsize:
        raise RequestError("tensors", f"{t.name}: {len(t.data)} bytes do not hold {t.dtype}{list(t.shape)}")
    if not t.data:
        return torch.empty(tuple(t.shape), dtype=dtype)
    return torch.frombuffer(bytearray(t.data), dtype=dtype).reshape(tuple(t.shape))


_TASKS = {pb.TASK_T2VA: "t2va", pb.TASK_FL2VA: "fl2va"}  # TASK_UNSPECIFIED: inferred from the keyframes
_OUTPUT_TYPES = {
    pb.OUTPUT_TYPE_UNSPECIFIED: "latents",
    pb.OUTPUT_TYPE_LATENTS: "latents",
    pb.OUTPUT_TYPE_MP4: "mp4",
    pb.OUTPUT_TYPE_FRAMES_AND_WAV: "frames_and_wav",
}
OUTPUT_ENUMS = {name: value for value, name in _OUTPUT_TYPES.items() if value != pb.OUTPUT_TYPE_UNSPECIFIED}
_OPTIONAL = ("num_inference_steps", "flow_shift", "audio_flow_shift", "seed", "num_frames", "height", "width")


def _allowed(enum: Any, default: str) -> str:
    names = [v.name for v in enum.DESCRIPTOR.values if v.number != 0]
    return f"{', '.join(names)} (or {enum.Name(0)}, meaning {default})"


def request_from_proto(msg: pb.GenerateRequest) -> tuple[GenerationRequest, int | None]:
    """(request, expected_generation); unset optional fields take GenerationRequest defaults. An unset task is
    fl2va when a keyframe is given, else t2va; an unset output type is latents."""
    if msg.task != pb.TASK_UNSPECIFIED and msg.task not in _TASKS:
        raise RequestError(
            "task",
            f"unknown task enum value {msg.task}; allowed: "
            + _allowed(pb.Task, "TASK_FL2VA with a first_frame or last_frame, else TASK_T2VA"),
        )
    if msg.output_type not in _OUTPUT_TYPES:
        raise RequestError(
            "output_type",
            f"unknown output_type enum value {msg.output_type}; allowed: "
            + _allowed(pb.OutputType, "OUTPUT_TYPE_LATENTS"),
        )
    has_keyframes = bool(msg.first_frame or msg.last_frame)
    kwargs: dict[str, Any] = {
        "request_id": msg.request_id or f"req-{uuid.uuid4().hex[:12]}",
        "task": infer_task(_TASKS.get(msg.task), has_keyframes),
        "prompt": msg.prompt,
        "output_type": _OUTPUT_TYPES[msg.output_type],
        "first_frame": msg.first_frame,
        "last_frame": msg.last_frame,
    }
    for name in _OPTIONAL:
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    expected = msg.expected_generation if msg.HasField("expected_generation") else None
    return GenerationRequest(**kwargs), expected
