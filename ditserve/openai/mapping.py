"""OpenAI's Videos API <-> ditserve's Jobs: the pure mapping the HTTP facade (ditserve.openai.app) uses.

- A create body (`prompt`, `model`, `seconds`, `size`, plus H3's own fields under their proto names) becomes a
  GenerateRequest: `seconds` -> the nearest valid `num_frames` (17n + 5 at 24 fps, 5 to 15 s), `size` "WIDTHxHEIGHT"
  -> width, height; the output type is MP4 (what `/content` serves). JSON is parsed strictly: a number that is not
  finite (`NaN`, `Infinity`, `1e999`) is refused naming its field, an integer field takes only integers. vLLM-Omni's
  `lora` (`{"name", "scale"}` or a list of them) names adapters of the generator's --adapter-dir (no `local_path`);
  `quality` (sglang's and vLLM-Omni's per-request field) names a quality level of its --quality-levels.
- A Job becomes OpenAI's `Video` object: status queued | in_progress | completed | failed (a cancelled job is
  `failed` with error code "cancelled"), progress from the steps actually finished in any state (100 only once
  completed), `seconds` as the client asked it (the real length in `duration_seconds`), `expires_at` from the
  retention policy, with ditserve's own fields beside OpenAI's (`ditserve_state`, `queue_position`, `stage`,
  `steps_done`, `steps_total`, `sha256`).
- An error becomes OpenAI's body `{"error": {"message", "type", "param", "code"}}` and HTTP status (`code` never
  null); a gRPC status through the one table `_HTTP`.
"""

from __future__ import annotations

import base64
import binascii
import json
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
INT_FIELDS = {"seed": (0, 2**63 - 1), "num_inference_steps": (1, 2**31 - 1)}
"""H3's integer request fields a create body may carry beside OpenAI's, with what the proto holds (the generator
checks its own limits after)."""
FLOAT_FIELDS = ("flow_shift", "audio_flow_shift")
"""H3's number request fields a create body may carry beside OpenAI's."""
EXTRA_FIELDS = (*INT_FIELDS, *FLOAT_FIELDS)
FILE_PARTS = ("input_reference", "first_frame", "last_frame")
"""The multipart parts that may be files (the keyframes); another file part is refused naming it."""
CREATE_FIELDS = frozenset({"prompt", "model", "seconds", "size", "input_reference", "first_frame", "last_frame",
                           "output_type", "idempotency_key", "lora", "quality", *EXTRA_FIELDS})  # fmt: skip
"""Every field a create body may carry (another is refused naming it, not ignored)."""
_SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")
_INTEGER = re.compile(r"[+-]?\d{1,20}")
_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.S)
_STATUS = {
    pb.JOB_STATE_QUEUED: "queued", pb.JOB_STATE_RUNNING: "in_progress", pb.JOB_STATE_SUCCEEDED: "completed",
    pb.JOB_STATE_FAILED: "failed", pb.JOB_STATE_CANCELLED: "failed",
}  # fmt: skip


_CODES = {
    400: "invalid_value", 401: "invalid_api_key", 403: "permission_denied", 404: "not_found",
    405: "method_not_allowed", 409: "conflict", 413: "request_too_large", 415: "unsupported_media_type",
    422: "invalid_value", 429: "rate_limit_exceeded", 500: "internal_error", 503: "service_unavailable",
    504: "timeout",
}  # fmt: skip
"""An error's `code` when nothing more specific names it, by HTTP status."""
_KINDS = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
"""OpenAI's error `type` by HTTP status (other 4xx: invalid_request_error, 5xx: server_error)."""


def error_kind(status: int) -> str:
    return _KINDS.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_code(status: int) -> str:
    return _CODES.get(status, "server_error" if status >= 500 else "invalid_request")


class ApiError(Exception):
    """An HTTP error in OpenAI's shape; `code` and `kind` (the body's `type`) default from the status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code, self.kind = code or error_code(status), kind or error_kind(status)
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


def seconds_label(num_frames: int) -> str:
    """A job's `seconds` when the client's own text is not at hand: the whole seconds that map to its frame count
    (what an OpenAI-style "5" asked), else its real length."""
    for whole in range(int(MIN_SECONDS), int(MAX_SECONDS) + 1):
        if frames_for_seconds(whole) == num_frames:
            return str(whole)
    return f"{num_frames / FPS:.2f}".rstrip("0").rstrip(".")


@dataclass(frozen=True)
class CreateBody:
    """A parsed create request: the GenerateRequest, the model named, the idempotency key, `seconds` as given."""

    request: pb.GenerateRequest
    model: str
    idempotency_key: str
    seconds: str | None = None
    """The client's `seconds` as text ("5" for 5 or "5"), echoed in the answer; None when not given."""


class _NonFinite:
    """A JSON number that is not finite (`NaN`, `Infinity`, `1e999`), held until its field is named."""

    def __init__(self, text: str) -> None:
        self.text = text


def _finite_float(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _non_finite_in(value: Any) -> _NonFinite | None:
    """The first non-finite number anywhere in a parsed JSON value (walked without recursion)."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, _NonFinite):
            return v
        if isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A JSON create body as its fields: an object, every number finite (else 400 naming the field)."""
    try:
        fields = json.loads(raw, parse_constant=_NonFinite, parse_float=_finite_float)
    except (ValueError, RecursionError):
        raise ApiError(400, "the body is not valid JSON (UTF-8)", None, "invalid_json") from None
    if not isinstance(fields, dict):
        raise ApiError(400, f"the body must be a JSON object, got a JSON {type(fields).__name__}", None, "invalid_json")
    for name, value in fields.items():
        bad = _non_finite_in(value)
        if bad is not None:
            raise ApiError(400, f"{name} must be a finite number, got {bad.text}", name)
    return fields


def integer_field(name: str, value: Any, low: int, high: int) -> int:
    """An integer field: a JSON integer or (multipart) its decimal text, in [low, high]; 1.5, "1.5" and true are
    refused naming `name`, never rounded."""
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(400, f"{name} must be an integer in [{low}, {high}], got {value!r}", name)
    return value


def number_field(name: str, value: Any) -> float:
    """A number field: a JSON number or (multipart) its text, finite; ApiError naming `name`."""
    try:
        number = float(value) if isinstance(value, int | float | str) and not isinstance(value, bool) else math.nan
    except (ValueError, OverflowError):
        number = math.nan
    if not math.isfinite(number):
        raise ApiError(400, f"{name} must be a finite number, got {value!r}", name)
    return number


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


LORA_KEYS = ("name", "scale")
"""The keys of one `lora` entry (vLLM-Omni's extra field): an adapter of the generator's --adapter-dir by name, at its
scale; a `local_path` is refused (the generator serves only its own directory's adapters, by name)."""


def lora_adapters(value: Any) -> list[pb.AdapterUse]:
    """vLLM-Omni's `lora`: one `{"name": ..., "scale": ...}` object or a list of them (multipart: that JSON as text)
    -> the request's AdapterUses, in order; ApiError naming `lora` for another shape (the generator checks the names,
    scales and contracts)."""
    if isinstance(value, str):  # a multipart field: its JSON text
        try:
            value = json.loads(value, parse_constant=_NonFinite, parse_float=_finite_float)
        except (ValueError, RecursionError):
            raise ApiError(400, 'lora must be {"name": ..., "scale": ...} or a list of them (JSON)', "lora") from None
    entries = value if isinstance(value, list) else [value]
    out = []
    for i, entry in enumerate(entries):
        where = f"lora[{i}]" if isinstance(value, list) else "lora"
        if not isinstance(entry, dict):
            raise ApiError(400, f'{where} must be an object {{"name": ..., "scale": ...}}, got {entry!r:.100}', "lora")
        if "local_path" in entry:
            raise ApiError(400, f"{where}: local_path is not served: name an adapter of the generator's --adapter-dir "
                           "(GET its list with `ditserve adapters`)", "lora")  # fmt: skip
        extra = sorted(set(entry) - set(LORA_KEYS))
        if extra:
            raise ApiError(400, f"{where}: unknown key {extra[0]!r}; allowed: {', '.join(LORA_KEYS)}", "lora")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"{where}.name must be an adapter's name (a non-empty string), got {name!r:.100}",
                           "lora")  # fmt: skip
        use = pb.AdapterUse(name=name)
        if entry.get("scale") is not None:
            scale = entry["scale"]
            if isinstance(scale, _NonFinite | bool) or not isinstance(scale, int | float):
                shown = scale.text if isinstance(scale, _NonFinite) else repr(scale)
                raise ApiError(400, f"{where}.scale must be a finite number, got {shown:.100}", "lora")
            use.scale = float(scale)
        out.append(use)
    return out


LORA_FORM_ENTRIES = 64
"""The most `lora[][KEY]` entries a multipart form may carry (--max-adapters-per-request's upper bound): the
server refuses more than its own limit, naming it."""
_LORA_PART = re.compile(r"(?:(\d{0,2})\]\[)?([A-Za-z_]{1,32})\]")
"""A multipart part name's rest after `lora[`: `name]` (one object) or `][name]` / `0][name]` (a list's)."""


def form_lora(parts: list[tuple[str, str]]) -> dict[str, Any] | list[dict[str, Any]]:
    """`lora` as the openai client sends `extra_body={"lora": ...}` in a multipart body (its bracket form): one
    object as `lora[name]`, `lora[scale]`; a list as `lora[0][name]`, ... or as the openai client's
    `lora[][name]`, `lora[][scale]`, ... (it sends each key's values together, all names then all scales: the i-th of
    each key is the i-th entry's, so every entry must give the same keys). `parts`: (the part name after `lora[`, its
    text). A scale's text becomes its number; ApiError naming `lora` for anything else (lora_adapters checks the
    rest)."""
    single: dict[str, Any] = {}
    listed: list[dict[str, Any]] = []
    for sub, text in parts:
        m = _LORA_PART.fullmatch(sub)
        if m is None:
            raise ApiError(400, f"unknown part 'lora[{sub:.100}': give lora as JSON text, lora[KEY] or lora[][KEY]",
                           "lora")  # fmt: skip
        index, key = m.group(1), m.group(2)
        value: Any = text
        if key == "scale":
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not math.isfinite(value):
                raise ApiError(400, f"lora scale must be a finite number, got {text!r:.100}", "lora")
        if index is None:
            if listed or key in single:
                raise ApiError(400, f"the part 'lora[{key}]' is given more than once", "lora")
            single[key] = value
            continue
        if single:
            raise ApiError(400, "give lora as one object (lora[KEY]) or a list (lora[][KEY]), not both", "lora")
        i = sum(key in e for e in listed) if index == "" else int(index)  # lora[][KEY]: its i-th occurrence
        while len(listed) <= i:
            listed.append({})
        if key in listed[i]:
            raise ApiError(400, f"the part 'lora[{index}][{key}]' is given more than once", "lora")
        listed[i][key] = value
    if any(set(e) != set(listed[0]) for e in listed):
        raise ApiError(400, "in a multipart form every lora[][KEY] entry must give the same keys (which entry a "
                       "part belongs to is its order); or send lora as JSON text", "lora")  # fmt: skip
    return listed if listed else single


def create_body(fields: dict[str, Any], first_frame: bytes = b"", last_frame: bytes = b"") -> CreateBody:
    unknown = sorted(set(fields) - CREATE_FIELDS)
    if unknown:
        raise ApiError(400, f"unknown parameter {unknown[0]!r}; allowed: {', '.join(sorted(CREATE_FIELDS))}",
                       unknown[0], "unknown_parameter")  # fmt: skip
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt is required: a non-empty string", "prompt")
    model = fields.get("model") or MODELS[0]
    if model not in MODELS:
        raise ApiError(400, f"model must be one of {', '.join(MODELS)}, got {model!r}", "model", "model_not_found")
    req = pb.GenerateRequest(prompt=prompt, output_type=pb.OUTPUT_TYPE_MP4, first_frame=first_frame,
                             last_frame=last_frame)  # fmt: skip
    if fields.get("seconds") not in (None, ""):
        req.num_frames = frames_for_seconds(fields["seconds"])
    if fields.get("size") not in (None, ""):
        req.height, req.width = parse_size(fields["size"])
    for name, (low, high) in INT_FIELDS.items():
        if fields.get(name) not in (None, ""):
            setattr(req, name, integer_field(name, fields[name], low, high))
    for name in FLOAT_FIELDS:
        if fields.get(name) not in (None, ""):
            setattr(req, name, number_field(name, fields[name]))
    if fields.get("lora") not in (None, "", []):
        req.adapters.extend(lora_adapters(fields["lora"]))
    quality = fields.get("quality")
    if quality not in (None, ""):
        if not isinstance(quality, str):
            raise ApiError(400, f"quality must be a quality level's name (a string), got {quality!r:.100}", "quality")
        req.quality = quality  # the generator checks the level and its rules
    if fields.get("output_type") not in (None, "", "mp4"):
        raise ApiError(400, f"output_type must be mp4 here (what /content serves), got {fields['output_type']!r}",
                       "output_type")  # fmt: skip
    key = fields.get("idempotency_key") or ""
    if not isinstance(key, str):
        raise ApiError(400, f"idempotency_key must be a string, got {key!r}", "idempotency_key")
    asked = fields.get("seconds")
    seconds = None if asked in (None, "") else asked if isinstance(asked, str) else json.dumps(asked)
    return CreateBody(req, model, key, seconds)


def video_object(job: pb.Job, model: str = MODELS[0], seconds: str | None = None) -> dict[str, Any]:
    """The job as OpenAI's Video; `seconds` the client's own text when at hand (create), else `seconds_label`."""
    spec, p = job.spec, job.progress
    status = _STATUS.get(job.state, "queued")
    # the steps done whatever the state (a job cancelled at step 6 of 99 says 6); 100 only once completed
    done = min(99, int(99 * p.steps_done / p.steps_total)) if p.steps_total else 0
    progress = 100 if status == "completed" else done
    error = None
    if job.state == pb.JOB_STATE_CANCELLED:
        error = {"code": "cancelled", "message": job.error.message or "the job was cancelled"}
    elif job.state == pb.JOB_STATE_FAILED:
        error = {"code": job.error.reason.lower() or "failed", "message": job.error.message}
    return {
        "id": job.job_id, "object": "video", "model": model, "status": status, "progress": progress,
        "created_at": job.created_at.seconds, "completed_at": job.finished_at.seconds if status == "completed" else None,
        "expires_at": job.expires_at.seconds if job.HasField("expires_at") else None, "prompt": spec.prompt,
        "seconds": seconds if seconds is not None else seconds_label(spec.num_frames),
        "duration_seconds": round(spec.num_frames / FPS, 3), "size": f"{spec.width}x{spec.height}", "error": error, "remixed_from_video_id": None,
        "ditserve_state": pb.JobState.Name(job.state).removeprefix("JOB_STATE_").lower(),
        "queue_position": job.queue_position if job.HasField("queue_position") else None,
        "stage": pb.JobStage.Name(p.stage).removeprefix("JOB_STAGE_").lower(),
        "steps_done": p.steps_done, "steps_total": p.steps_total, "num_frames": spec.num_frames,
        "sha256": job.result.content.sha256 or None,
    }  # fmt: skip


_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_argument"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "out_of_range"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "already_exists"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "invalid_request_error", "failed_precondition"),
    grpc.StatusCode.ABORTED: (409, "invalid_request_error", "aborted"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "backend_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "backend_timeout"),
}
"""gRPC status -> (HTTP status, OpenAI error type, the code when the status carries no ErrorInfo reason); anything
else is 500 server_error, `backend_error`. UNAUTHENTICATED is always `invalid_api_key` (what OpenAI's clients test)."""
_UNEXPLAINED = {
    500: "the generator failed on this request", 503: "the generator is unavailable; try again",
    504: "the generator did not answer in time",
}  # fmt: skip
"""A 5xx without the services' own ErrorInfo came from the gRPC runtime or an unexpected fault: its text (addresses,
internals) stays in the facade, the client gets these."""
_DEFAULT_RETRY_AFTER_S = 1


def from_rpc_error(err: grpc.RpcError) -> ApiError:
    """The gRPC failure as OpenAI's error: the field a BadRequest names as `param`, the ErrorInfo reason as `code`,
    RetryInfo as a Retry-After header (a 429 always has one)."""
    status, kind, code = _HTTP.get(err.code(), (500, "server_error", "backend_error"))
    param, reason, headers = None, None, {}
    try:
        details = rpc_status.from_call(err)  # type: ignore[arg-type]
    except (ValueError, AttributeError):  # a status whose details contradict it: the code alone
        details = None
    for d in details.details if details is not None else ():
        info, bad, retry = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest(), error_details_pb2.RetryInfo()
        if d.Unpack(info):
            reason = info.reason.lower()
        elif d.Unpack(bad) and bad.field_violations:
            param = bad.field_violations[0].field
        elif d.Unpack(retry):
            headers["Retry-After"] = str(max(1, math.ceil(retry.retry_delay.ToNanoseconds() / 1e9)))
    if status == 429:
        headers.setdefault("Retry-After", str(_DEFAULT_RETRY_AFTER_S))
    message = err.details() or err.code().name
    if status >= 500 and reason is None:
        message = _UNEXPLAINED.get(status, _UNEXPLAINED[500])
    if reason and err.code() != grpc.StatusCode.UNAUTHENTICATED:
        code = reason
    return ApiError(status, message, param, code, kind, headers)
