"""The client's request side: a GenerationRequest or a mapping of its fields -> the GenerateRequest proto (the task
inferred, a fresh request id when it has none, its adapters as `AdapterUse` messages), the protocol's task / kind /
output-type tables, and the schedule affinity key sent as `x-ditserve-schedule`."""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Collection, Mapping
from typing import Any

from ditcore.request import DEFAULTED, AdapterUse, GenerationRequest, RequestError
from protos.ditserve.generator.v1 import generator_pb2 as pb

_TASKS = {"t2va": pb.TASK_T2VA, "fl2va": pb.TASK_FL2VA, "ref2va": pb.TASK_REF2VA}
REFERENCE_KINDS = {
    "": pb.REFERENCE_KIND_UNSPECIFIED,
    "image": pb.REFERENCE_KIND_IMAGE,
    "video": pb.REFERENCE_KIND_VIDEO,
    "audio": pb.REFERENCE_KIND_AUDIO,
}
_OUTPUT_TYPES = {
    "latents": pb.OUTPUT_TYPE_LATENTS,
    "mp4": pb.OUTPUT_TYPE_MP4,
    "frames_and_wav": pb.OUTPUT_TYPE_FRAMES_AND_WAV,
}
OUTPUT_NAMES = {v: k for k, v in _OUTPUT_TYPES.items()} | {pb.OUTPUT_TYPE_UNSPECIFIED: "latents"}


def new_request_id() -> str:
    """A fresh request id as the server names an id-less request: "req-" and 12 hex digits of a random UUID."""
    return f"req-{uuid.uuid4().hex[:12]}"


def as_request(request: GenerationRequest | Mapping[str, Any]) -> GenerationRequest:
    """A GenerationRequest; an empty task (or, in a mapping, a missing one) becomes `infer_task`'s, and an empty
    request_id (or, in a mapping, a missing one) a fresh `new_request_id`."""
    if isinstance(request, GenerationRequest):
        req = request
    else:
        data = dict(request)
        # without a request_id of its own, from_dict would give every such request the default "req-0"
        req = GenerationRequest.from_dict({**data, "task": data.get("task") or "", "request_id": data.get("request_id")
                                           or ""})  # fmt: skip
    if not req.request_id:
        req = dataclasses.replace(req, request_id=new_request_id())
    return req.with_task_inferred()


def unset_fields(request: GenerationRequest | Mapping[str, Any], unset: Collection[str] = ()) -> frozenset[str]:
    """`unset`, and for a mapping the contract-defaultable fields it does not give."""
    absent = (f for f, _ in DEFAULTED if f not in request) if isinstance(request, Mapping) else ()
    return frozenset((*unset, *absent))


def request_to_proto(
    request: GenerationRequest | Mapping[str, Any], expected_generation: int | None = None,
    unset: Collection[str] = (),
) -> pb.GenerateRequest:  # fmt: skip
    """Proto of a request, every optional field set but, on a request naming adapters, the contract-defaultable
    fields (num_inference_steps, flow_shift, audio_flow_shift) in `unset` or, for a mapping, absent from it: those
    are sent unset, so the server applies the adapters' contract defaults (else H3's). The server validates; a task
    or output type with no proto value raises RequestError here, since no message could carry it."""
    unset = unset_fields(request, unset)
    req = as_request(request)
    if req.task not in _TASKS:
        raise RequestError("task", f"unknown task {req.task!r}; the protocol carries {', '.join(_TASKS)}")
    if req.output_type not in _OUTPUT_TYPES:
        raise RequestError(
            "output_type", f"unknown output type {req.output_type!r}; the protocol carries {', '.join(_OUTPUT_TYPES)}"
        )
    msg = pb.GenerateRequest(
        request_id=req.request_id, prompt=req.prompt, task=_TASKS[req.task], output_type=_OUTPUT_TYPES[req.output_type]
    )
    for ref in req.references:
        if ref.kind not in REFERENCE_KINDS:
            raise RequestError("references", f"unknown reference kind {ref.kind!r}; allowed: image, video, audio")
        msg.references.append(pb.Reference(data=ref.data, kind=REFERENCE_KINDS[ref.kind]))
    for use in req.adapters:
        msg.adapters.append(adapter_to_proto(use))
    for f in dataclasses.fields(GenerationRequest):
        if f.name in ("request_id", "task", "prompt", "output_type", "references", "adapters"):
            continue
        value = getattr(req, f.name)
        try:
            setattr(msg, f.name, value)
        except (TypeError, ValueError) as e:  # out of the field's integer range, or the wrong type
            raise RequestError(f.name, f"{value!r} does not fit the GenerateRequest field ({e})") from e
    if req.adapters:
        for name, _ in DEFAULTED:
            if name in unset:
                msg.ClearField(name)
    if expected_generation is not None:
        msg.expected_generation = expected_generation
    return msg


def adapter_to_proto(use: AdapterUse) -> pb.AdapterUse:
    """One adapter of a request as the proto's AdapterUse, its scale always set (RequestError naming `adapters`
    when the name or scale cannot be carried; the server checks the rest)."""
    if not isinstance(use, AdapterUse) or not isinstance(use.name, str):
        raise RequestError("adapters", f"must be a list of {{name, scale}}, got {use!r}")
    scale = use.scale
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise RequestError("adapters", f"{use.name}: scale must be a number, got {scale!r}")
    return pb.AdapterUse(name=use.name, scale=float(scale))


def kind_name(value: int) -> str:
    return next(name for name, v in REFERENCE_KINDS.items() if v == value)


SCHEDULE_HEADER = "x-ditserve-schedule"
"""Metadata carrying the request's schedule, for load balancers with schedule affinity."""


def schedule_affinity_key(request: GenerationRequest | Mapping[str, Any]) -> str:
    """task/num_inference_steps/flow_shift/audio_flow_shift, e.g. `t2va/50/12/3`: a request's plan keys depend on
    these alone (and, for ref2va, on whether a reference brings audio: its rows sit at t = 1.0 and widen every
    plan, so that schedule is `ref2va+audio/...`), so requests with equal keys share every plan on one checkpoint.
    References that cannot be read get the plain key (the server refuses them)."""
    req = as_request(request)
    task = req.task
    if task == "ref2va":
        with contextlib.suppress(RequestError):
            task += "+audio" if req.has_reference_audio() else ""
    return f"{task}/{req.num_inference_steps}/{req.flow_shift:g}/{req.audio_flow_shift:g}"
