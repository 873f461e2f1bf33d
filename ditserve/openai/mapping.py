"""OpenAI's Videos API <-> ditserve's Jobs: the pure mapping the HTTP facade (ditserve.openai.app) uses.

- A create body (`prompt`, `model`, `seconds`, `size`, plus H3's own fields under their proto names) becomes a
  GenerateRequest: `seconds` -> the nearest valid `num_frames` (17n + 5 at 24 fps, 5 to 15 s), `size` "WIDTHxHEIGHT"
  -> width, height; the output type is MP4 (what `/content` serves).
- A Job becomes OpenAI's `Video` object: status queued | in_progress | completed | failed (a cancelled job is
  `failed` with error code "cancelled"), progress from the steps actually finished (100 only once completed), with
  ditserve's own fields beside OpenAI's (`ditserve_state`, `queue_position`, `stage`, `steps_done`, `steps_total`,
  `sha256`).
- A gRPC status becomes OpenAI's error body `{"error": {"message", "type", "param", "code"}}` and HTTP status.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from ditcore.request import FPS, FRAMES_OFFSET, FRAMES_PER_CHUNK, MAX_FRAMES, MIN_FRAMES
from protos.ditserve.generator.v1 import generator_pb2 as pb

MODELS = ("minimax-h3",)
"""The model names the facade accepts (`model`; default the first)."""
MIN_SECONDS, MAX_SECONDS = 5.0, 15.0
EXTRA_FIELDS = {"seed": int, "num_inference_steps": int, "flow_shift": float, "audio_flow_shift": float}
"""H3's request fields a create body may carry beside OpenAI's, with their types."""
CREATE_FIELDS = frozenset({"prompt", "model", "seconds", "size", "input_reference", "first_frame", "last_frame",
                           "output_type", "idempotency_key", *EXTRA_FIELDS})  # fmt: skip
"""Every field a create body may carry (another is refused naming it, not ignored)."""
_SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")
_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.S)
_STATUS = {
    pb.JOB_STATE_QUEUED: "queued", pb.JOB_STATE_RUNNING: "in_progress", pb.JOB_STATE_SUCCEEDED: "completed",
    pb.JOB_STATE_FAILED: "failed", pb.JOB_STATE_CANCELLED: "failed",
}  # fmt: skip


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def frames_for_seconds(value: Any) -> int:
    """OpenAI's `seconds` (a string or a number) -> the nearest valid num_frames; ApiError naming `seconds`."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ApiError(400, f"seconds must be a number of seconds, got {value!r}", "seconds") from None
    if not (math.isfinite(seconds) and MIN_SECONDS <= seconds <= MAX_SECONDS):
        raise ApiError(
            400, f"seconds must be in [{MIN_SECONDS:g}, {MAX_SECONDS:g}] (MiniMax-H3 makes 5 to 15 s clips), got "
            f"{value!r}", "seconds",
        )  # fmt: skip
    n = round((seconds * FPS - FRAMES_OFFSET) / FRAMES_PER_CHUNK)
    return min(MAX_FRAMES, max(MIN_FRAMES, FRAMES_PER_CHUNK * n + FRAMES_OFFSET))


def parse_size(value: Any) -> tuple[int, int]:
    """OpenAI's `size` "WIDTHxHEIGHT" -> (height, width); ApiError naming `size`."""
    m = _SIZE.fullmatch(str(value).strip())
    if m is None:
        raise ApiError(400, f"size must be WIDTHxHEIGHT in pixels (e.g. 1344x768), got {value!r}", "size")
    width, height = int(m.group(1)), int(m.group(2))
    return height, width


@dataclass(frozen=True)
class CreateBody:
    """A parsed create request: the GenerateRequest, the model named, the idempotency key."""

    request: pb.GenerateRequest
    model: str
    idempotency_key: str


def reference_image(value: Any, name: str) -> bytes:
    """A keyframe given as text: base64 PNG / JPEG bytes, a `data:image/...;base64,` URL, or OpenAI's image
    reference object `{"image_url": <data URL>}` (a `file_id` or an http URL is refused naming `name`)."""
    if isinstance(value, dict):
        if set(value) != {"image_url"}:
            raise ApiError(400, f"{name}: only {{\"image_url\": \"data:image/...;base64,...\"}} is served (no file "
                           f"ids), got the keys {sorted(value)}", name)  # fmt: skip
        value = value["image_url"]
    if not isinstance(value, str):
        raise ApiError(400, f"{name} must be base64 PNG or JPEG bytes or a data URL", name)
    m = _DATA_URL.fullmatch(value.strip())
    if m is None and value.strip().startswith(("data:", "http:", "https:")):
        raise ApiError(400, f"{name}: only data:image/...;base64, URLs are served (nothing is fetched)", name)
    try:
        return base64.b64decode(m.group(1) if m else value, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{name} must be base64 PNG or JPEG bytes or a data URL", name) from None


def create_body(fields: dict[str, Any], first_frame: bytes = b"", last_frame: bytes = b"") -> CreateBody:
    unknown = sorted(set(fields) - CREATE_FIELDS)
    if unknown:
        raise ApiError(400, f"unknown parameter {unknown[0]!r}; allowed: {', '.join(sorted(CREATE_FIELDS))}",
                       unknown[0], "unknown_parameter")  # fmt: skip
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt is required: a non-empty string", "prompt")
    model = str(fields.get("model") or MODELS[0])
    if model not in MODELS:
        raise ApiError(400, f"model must be one of {', '.join(MODELS)}, got {model!r}", "model", "model_not_found")
    req = pb.GenerateRequest(prompt=prompt, output_type=pb.OUTPUT_TYPE_MP4, first_frame=first_frame,
                             last_frame=last_frame)  # fmt: skip
    if fields.get("seconds") not in (None, ""):
        req.num_frames = frames_for_seconds(fields["seconds"])
    if fields.get("size") not in (None, ""):
        req.height, req.width = parse_size(fields["size"])
    for name, kind in EXTRA_FIELDS.items():
        if fields.get(name) not in (None, ""):
            try:
                setattr(req, name, kind(fields[name]))
            except (TypeError, ValueError):
                raise ApiError(400, f"{name} must be {kind.__name__}, got {fields[name]!r}", name) from None
    if fields.get("output_type") not in (None, "", "mp4"):
        raise ApiError(400, f"output_type must be mp4 here (what /content serves), got {fields['output_type']!r}",
                       "output_type")  # fmt: skip
    key = str(fields.get("idempotency_key") or "")
    return CreateBody(req, model, key)


def video_object(job: pb.Job, model: str = MODELS[0]) -> dict[str, Any]:
    spec, p = job.spec, job.progress
    status = _STATUS.get(job.state, "queued")
    if status == "completed":
        progress = 100
    elif job.state == pb.JOB_STATE_RUNNING and p.steps_total:
        progress = min(99, int(99 * p.steps_done / p.steps_total))
    else:
        progress = 0
    error = None
    if job.state == pb.JOB_STATE_CANCELLED:
        error = {"code": "cancelled", "message": job.error.message or "the job was cancelled"}
    elif job.state == pb.JOB_STATE_FAILED:
        error = {"code": job.error.reason.lower() or "failed", "message": job.error.message}
    return {
        "id": job.job_id, "object": "video", "model": model, "status": status, "progress": progress,
        "created_at": job.created_at.seconds, "completed_at": job.finished_at.seconds if status == "completed" else None,
        "expires_at": None, "prompt": spec.prompt, "seconds": f"{spec.num_frames / FPS:.2f}".rstrip("0").rstrip("."),
        "size": f"{spec.width}x{spec.height}", "error": error, "remixed_from_video_id": None,
        "ditserve_state": pb.JobState.Name(job.state).removeprefix("JOB_STATE_").lower(),
        "queue_position": job.queue_position if job.HasField("queue_position") else None,
        "stage": pb.JobStage.Name(p.stage).removeprefix("JOB_STAGE_").lower(),
        "steps_done": p.steps_done, "steps_total": p.steps_total, "num_frames": spec.num_frames,
        "sha256": job.result.content.sha256 or None,
    }  # fmt: skip


_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "invalid_request_error"),
    grpc.StatusCode.ABORTED: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}
"""gRPC status -> (HTTP status, OpenAI error type); anything else is 500 server_error."""


def from_rpc_error(err: grpc.RpcError) -> ApiError:
    """The gRPC failure as OpenAI's error: the field a BadRequest names as `param`, the ErrorInfo reason as `code`,
    RetryInfo as a Retry-After header."""
    status, kind = _HTTP.get(err.code(), (500, "server_error"))
    param, code, headers = None, None, {}
    details = rpc_status.from_call(err)  # type: ignore[arg-type]
    for d in details.details if details is not None else ():
        info, bad, retry = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest(), error_details_pb2.RetryInfo()
        if d.Unpack(info):
            code = info.reason.lower()
        elif d.Unpack(bad) and bad.field_violations:
            param = bad.field_violations[0].field
        elif d.Unpack(retry):
            headers["Retry-After"] = str(max(1, math.ceil(retry.retry_delay.ToNanoseconds() / 1e9)))
    return ApiError(status, err.details() or err.code().name, param, code, kind, headers)
