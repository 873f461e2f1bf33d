"""Public proto messages -> the model layer's values: a GenerateRequest as a GenerationRequest (Generate,
GenerateStream, CreateJob and a restarted job all parse it here; references named by upload_id are resolved from
the upload store first: `resolve_uploads`), a pushed tensor (UpdateWeights)."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ditcore import GenerationRequest, RequestError
from ditcore.adapter_contract import DEFAULTED, contract_defaults
from ditcore.plans import DTYPES
from ditcore.references import Reference
from ditcore.request import AdapterUse, infer_task
from protos.ditserve.generator.v1 import generator_pb2 as pb

from ..jobs.types import job_spec, spec_meaning
from .uploads import UploadStore

if TYPE_CHECKING:
    from ditcore.adapters import AdapterRegistry


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


_TASKS = {pb.TASK_T2VA: "t2va", pb.TASK_FL2VA: "fl2va", pb.TASK_REF2VA: "ref2va"}  # UNSPECIFIED: inferred
REFERENCE_KINDS: dict[int, str] = {
    pb.REFERENCE_KIND_UNSPECIFIED: "",
    pb.REFERENCE_KIND_IMAGE: "image",
    pb.REFERENCE_KIND_VIDEO: "video",
    pb.REFERENCE_KIND_AUDIO: "audio",
}
"""ReferenceKind -> ditcore.references' kind ("": by content)."""
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


def reference_kind(value: int, field: str) -> str:
    """A ReferenceKind as ditcore's kind; RequestError naming `field` for an unknown enum value."""
    if value not in REFERENCE_KINDS:
        raise RequestError(field, f"unknown reference kind enum value {value}; allowed: " + _allowed(
            pb.ReferenceKind, "by content"))  # fmt: skip
    return REFERENCE_KINDS[value]


def resolve_uploads(msg: pb.GenerateRequest, uploads: UploadStore | None) -> pb.GenerateRequest:
    """`msg` with every reference that names an upload_id carrying the upload's bytes instead (a copy; `msg` itself
    when it names none), so the request, and a job's stored copy, no longer depend on the upload. RequestError
    naming `references[i].upload_id` for an unknown or expired one."""
    if not any(r.WhichOneof("source") == "upload_id" for r in msg.references):
        return msg
    out = pb.GenerateRequest()
    out.CopyFrom(msg)
    for i, ref in enumerate(out.references):
        if ref.WhichOneof("source") == "upload_id":
            field = f"references[{i}].upload_id"
            if uploads is None:
                raise RequestError(field, "this server takes no uploads")
            ref.data = uploads.get(ref.upload_id, field).reference.data  # the oneof: upload_id is cleared
    return out


def with_adapter_defaults(msg: pb.GenerateRequest, adapters: AdapterRegistry | None) -> pb.GenerateRequest:
    """`msg` with each of num_inference_steps, flow_shift and audio_flow_shift that it leaves unset (no presence) set
    to its adapters' contract default (ditcore.adapter_contract.contract_defaults: the first adapter declaring one
    gives it; two declaring different ones are a RequestError naming the field and both). A copy when anything is
    set, else `msg` itself. An adapter that cannot be read now (not a name, unknown, refused) gives no default:
    admission refuses it, naming why."""
    unset = [f for f, _ in DEFAULTED if not msg.HasField(f)]
    if adapters is None or not msg.adapters or not unset:
        return msg
    values = contract_defaults(adapters.contracts(use.name for use in msg.adapters), unset)
    if not values:
        return msg
    out = pb.GenerateRequest()
    out.CopyFrom(msg)
    for name, value in values.items():
        setattr(out, name, value)
    return out


def resolve_request(
    msg: pb.GenerateRequest, uploads: UploadStore | None, adapters: AdapterRegistry | None
) -> pb.GenerateRequest:
    """What Generate, GenerateStream and CreateJob run (and a job stores): `msg` with its uploads resolved
    (`resolve_uploads`) and the fields it leaves unset that its adapters' contracts default set
    (`with_adapter_defaults`), so a job's spec and meaning carry the values that run. `msg` itself when nothing
    changed (not a copy)."""
    return with_adapter_defaults(resolve_uploads(msg, uploads), adapters)


def request_from_proto(msg: pb.GenerateRequest) -> tuple[GenerationRequest, int | None]:
    """(request, expected_generation); unset optional fields take GenerationRequest defaults. An unset task is
    ref2va when references are given, fl2va when a keyframe is, else t2va; an unset output type is latents. Upload
    ids must have been resolved (resolve_uploads)."""
    if msg.task != pb.TASK_UNSPECIFIED and msg.task not in _TASKS:
        raise RequestError(
            "task",
            f"unknown task enum value {msg.task}; allowed: "
            + _allowed(pb.Task, "TASK_REF2VA with references, TASK_FL2VA with a first_frame or last_frame, else "
                       "TASK_T2VA"),
        )  # fmt: skip
    if msg.output_type not in _OUTPUT_TYPES:
        raise RequestError(
            "output_type",
            f"unknown output_type enum value {msg.output_type}; allowed: "
            + _allowed(pb.OutputType, "OUTPUT_TYPE_LATENTS"),
        )
    has_keyframes = bool(msg.first_frame or msg.last_frame)
    references = []
    for i, ref in enumerate(msg.references):
        if ref.WhichOneof("source") == "upload_id":
            raise RequestError(f"references[{i}].upload_id", "names an upload this call cannot resolve")
        references.append(Reference(ref.data, reference_kind(ref.kind, f"references[{i}].kind")))
    kwargs: dict[str, Any] = {
        "request_id": msg.request_id or f"req-{uuid.uuid4().hex[:12]}",
        "task": infer_task(_TASKS.get(msg.task), has_keyframes, bool(references)),
        "prompt": msg.prompt,
        "output_type": _OUTPUT_TYPES[msg.output_type],
        "first_frame": msg.first_frame,
        "last_frame": msg.last_frame,
        "references": tuple(references),
        "adapters": tuple(AdapterUse(a.name, a.scale if a.HasField("scale") else 1.0) for a in msg.adapters),
        "quality": msg.quality,
        "quality_audit": msg.quality_audit,
    }
    for name in _OPTIONAL:
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    expected = msg.expected_generation if msg.HasField("expected_generation") else None
    return GenerationRequest(**kwargs), expected


KEYFRAME_PARTS = ("first_frame", "last_frame")
UploadDigest = Callable[[str], "tuple[str, int] | None"]
"""An upload_id -> (sha256, bytes) of its file; None when it is unknown (or expired)."""


def split_parts(msg: pb.GenerateRequest) -> tuple[bytes, dict[str, bytes]]:
    """A resolved request as (its bytes without the large parts, the parts by name: "first_frame", "last_frame",
    "references[i]"): what a job stores, the parts once each by content (`join_parts` puts them back). `msg` is the
    caller's own copy: its parts are taken out of it."""
    parts: dict[str, bytes] = {}
    for name in KEYFRAME_PARTS:
        if getattr(msg, name):
            parts[name] = getattr(msg, name)
            msg.ClearField(name)
    for i, ref in enumerate(msg.references):
        if ref.WhichOneof("source") == "data" and ref.data:
            parts[f"references[{i}]"] = ref.data
            ref.data = b""  # the oneof stays "data"
    return msg.SerializeToString(deterministic=True), parts


def join_parts(data: bytes, parts: Mapping[str, bytes]) -> pb.GenerateRequest:
    """`split_parts` undone."""
    msg = pb.GenerateRequest.FromString(data)
    for name, value in parts.items():
        if name in KEYFRAME_PARTS:
            setattr(msg, name, value)
        elif name.startswith("references[") and name.endswith("]"):
            msg.references[int(name[len("references[") : -1])].data = value
        else:
            raise ValueError(f"a stored request part named {name!r} is not one this release writes")
    return msg


def request_meaning(
    msg: pb.GenerateRequest, upload_digest: UploadDigest, adapters: AdapterRegistry | None = None
) -> str:
    """The meaning (generator_service.jobs.types.spec_meaning) of a request not resolved yet, so a retry is matched
    before any admission step: its uploads by `upload_digest`'s sha256, which is what the resolved request's files
    hash to, and its unset fields as its adapters' contracts default them now (`with_adapter_defaults`, as CreateJob
    resolved them). RequestError for an upload `upload_digest` does not know, or a field Generate would refuse."""
    probe = pb.GenerateRequest()
    probe.CopyFrom(with_adapter_defaults(msg, adapters))
    uploaded: dict[int, tuple[str, int]] = {}
    for i, ref in enumerate(probe.references):
        if ref.WhichOneof("source") == "upload_id":
            found = upload_digest(ref.upload_id)
            if found is None:
                raise RequestError(f"references[{i}].upload_id", "names no upload this server holds (unknown or "
                                   "expired: upload the file again)")  # fmt: skip
            uploaded[i] = found
            ref.data = b""
    parsed, expected = request_from_proto(probe)
    spec = job_spec(parsed, expected, {})
    for i, (sha, size) in uploaded.items():
        spec["references"][i].update(sha256=sha, bytes=size)
    return spec_meaning(spec)
