"""Python client of the generator service.

    from .client import GeneratorClient
    with GeneratorClient("127.0.0.1:50051") as client:
        result = client.generate({"prompt": "a red fox", "num_inference_steps": 20})
        print(result.sha256, result.video.shape, result.audio.shape, result.cache)
        clip = client.generate({"prompt": "a red fox", "output_type": "mp4"})
        clip.media.write("fox.mp4")          # clip.media.data: the MP4's bytes; .content_type, .sha256
        start = client.generate({"prompt": "a red fox", "first_frame": Path("fox.png").read_bytes()})  # fl2va
        refs = (Reference(Path("fox.png").read_bytes()), Reference(Path("clip.mp4").read_bytes()))
        guided = client.generate({"prompt": "a red fox", "references": refs})   # ref2va (ditcore.references)
        voice = {"data": Path("voice.wav").read_bytes(), "kind": "audio"}   # a mapping works too
        voiced = client.generate({"prompt": "a red fox", "references": [*refs, voice]})

A request is a `GenerationRequest` or a mapping of its fields; in a mapping, a missing (or empty) "task" is inferred
(ref2va with references, fl2va with a first_frame or last_frame, else t2va), and a missing (or empty) "request_id" becomes a fresh
`req-<12 hex digits>`, as the server names an id-less request (a GenerationRequest's own id is sent as it is; give it
request_id="" for a fresh one). `generate` uses GenerateStream (progress events, result in chunks) and checks what
it received: chunk offsets, the header's total_bytes, the latents' sha256 (latents results) or the media's size and
sha256 (mp4 / frames_and_wav results), and that the result is of the output type asked for. A streamed result is
held once: each part (tensor or file) is a buffer of the size the header gives, filled in place as its chunks arrive
(the latents tensors are views of theirs; `ClientMedia.data` is the file's), or the file goes straight to disk
(`generate(..., media_path=...)`). A request whose references make it larger than the message limit has its
largest references sent first with UploadReference (a client stream of chunks), then named by upload_id.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
import torch

from ditcore import GenerationRequest, RequestError, latents_sha256
from ditcore.plans import DTYPES
from ditcore.report import CacheReport
from ditruntime.convert import from_proto
from ditruntime.paths import write_atomically
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

_TASKS = {"t2va": pb.TASK_T2VA, "fl2va": pb.TASK_FL2VA, "ref2va": pb.TASK_REF2VA}
_REFERENCE_KINDS = {
    "": pb.REFERENCE_KIND_UNSPECIFIED,
    "image": pb.REFERENCE_KIND_IMAGE,
    "video": pb.REFERENCE_KIND_VIDEO,
    "audio": pb.REFERENCE_KIND_AUDIO,
}
UPLOAD_CHUNK_BYTES = 1024 * 1024
"""Bytes per UploadReference message."""
_ENVELOPE_BYTES = 64 * 1024
"""What a request message keeps free of its limit for everything but its references."""
_OUTPUT_TYPES = {
    "latents": pb.OUTPUT_TYPE_LATENTS,
    "mp4": pb.OUTPUT_TYPE_MP4,
    "frames_and_wav": pb.OUTPUT_TYPE_FRAMES_AND_WAV,
}
_OUTPUT_NAMES = {v: k for k, v in _OUTPUT_TYPES.items()} | {pb.OUTPUT_TYPE_UNSPECIFIED: "latents"}
MEDIA_CHUNK = "media"
"""The ResultChunk name of an encoded file's bytes."""
ProgressCallback = Callable[[str, Any], None]
"""Called with ("queued", position), ("plans_ready", CacheReport), ("step", (i, n)), ("decoding", output_type) and,
while the result's bytes arrive, ("receiving", (bytes received, total bytes)) after each chunk."""


class IntegrityError(RuntimeError):
    """What arrived is not what the server described: chunks out of order or of an unknown name, a byte count or a
    sha256 that does not match, or another output type than the one asked for."""


@dataclass(frozen=True)
class ClientMedia:
    """An encoded result file (its bytes checked against the server's size and sha256)."""

    output_type: str
    """"mp4" or "frames_and_wav"."""
    content_type: str
    """"video/mp4" or "application/zip"."""
    data: bytes | bytearray
    """The file's bytes (a streamed result's are the buffer its chunks were received into); empty when the file was
    written to `path` as it arrived."""
    sha256: str
    filename: str
    """The server's suggested name, "<request_id>.mp4" or "<request_id>.zip"."""
    path: Path | None = None
    """Where the file was written as it arrived (`GeneratorClient.generate(..., media_path=...)`), else None."""
    size_bytes: int = -1
    """The file's size (-1: len(data))."""

    @property
    def size(self) -> int:
        return self.size_bytes if self.size_bytes >= 0 else len(self.data)

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the file to `path` (through a temporary file in the same directory, renamed into place)."""
        if self.path is not None:
            source = self.path
            return write_atomically(path, lambda tmp: tmp.write_bytes(source.read_bytes()))
        return write_atomically(path, lambda tmp: tmp.write_bytes(self.data))


@dataclass
class ClientResult:
    request_id: str
    generation: int
    sha256: str
    """SHA-256 of the final latents (also for media results, whose latents stay on the server)."""
    video: torch.Tensor | None
    """Final video latents (1, 24, F_latent, H/16, W/16) float32, as diffusers returns them (latents results)."""
    audio: torch.Tensor | None
    """Final audio latents (2, 32, N) float32 (latents results)."""
    cache: CacheReport
    timings_ms: dict[str, float]
    adaln_mode: str = ""
    events: list[tuple[str, Any]] = field(default_factory=list)
    output_type: str = "latents"
    media: ClientMedia | None = None
    """The encoded file (output types "mp4" and "frames_and_wav")."""


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


def request_to_proto(
    request: GenerationRequest | Mapping[str, Any], expected_generation: int | None = None
) -> pb.GenerateRequest:
    """Proto of a request, every optional field set (the server validates; a task or output type with no proto
    value raises RequestError here, since no message could carry it)."""
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
        if ref.kind not in _REFERENCE_KINDS:
            raise RequestError("references", f"unknown reference kind {ref.kind!r}; allowed: image, video, audio")
        msg.references.append(pb.Reference(data=ref.data, kind=_REFERENCE_KINDS[ref.kind]))
    for f in dataclasses.fields(GenerationRequest):
        if f.name in ("request_id", "task", "prompt", "output_type", "references"):
            continue
        value = getattr(req, f.name)
        try:
            setattr(msg, f.name, value)
        except (TypeError, ValueError) as e:  # out of the field's integer range, or the wrong type
            raise RequestError(f.name, f"{value!r} does not fit the GenerateRequest field ({e})") from e
    if expected_generation is not None:
        msg.expected_generation = expected_generation
    return msg


def _kind_name(value: int) -> str:
    return next(name for name, v in _REFERENCE_KINDS.items() if v == value)


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


def _timings(t: pb.StageTimings) -> dict[str, float]:
    return {f.name: getattr(t, f.name) for f in pb.StageTimings.DESCRIPTOR.fields}


def _dtype(t: pb.Tensor) -> torch.dtype:
    if t.dtype not in DTYPES:
        raise IntegrityError(f"tensor {t.name!r} has dtype {t.dtype!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[t.dtype]


def _tensor(t: pb.Tensor, data: bytes | bytearray) -> torch.Tensor:
    """The tensor `t` describes, over `data`: a view of a bytearray (a streamed part: no copy), else over a copy."""
    dtype = _dtype(t)
    buffer = data if isinstance(data, bytearray) else bytearray(data)  # torch.frombuffer needs a writable buffer
    try:
        flat = torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)
        return flat.reshape(tuple(t.shape))
    except (RuntimeError, ValueError) as e:  # a byte count that does not hold the shape
        raise IntegrityError(f"tensor {t.name!r}: {len(data)} bytes do not hold {t.dtype}{list(t.shape)}") from e


def _media(
    resp: pb.GenerateResponse, output_type: str, data: bytes | bytearray, file: _MediaFile | None = None
) -> ClientMedia:
    """The media `resp` describes, checked: `data` (the bytes) or `file` (written as it arrived; `data` empty)."""
    rid, m = resp.request_id, resp.media
    size = file.size if file is not None else len(data)
    if size != m.size_bytes:
        raise IntegrityError(f"request {rid}: received {size} media bytes, the server said {m.size_bytes}")
    got = file.digest.hexdigest() if file is not None else hashlib.sha256(data).hexdigest()
    if got != m.sha256:
        raise IntegrityError(f"request {rid}: the received media hashes to {got}, the server said {m.sha256}")
    if file is not None:
        return ClientMedia(output_type, m.content_type, b"", m.sha256, m.filename, file.target, size)
    return ClientMedia(output_type, m.content_type, data, m.sha256, m.filename)


def result_from_response(
    resp: pb.GenerateResponse, data: Mapping[str, bytes | bytearray] | None = None, media_file: _MediaFile | None = None
) -> ClientResult:
    """The checked result of a Generate response (`data`: the streamed bytes by chunk name; None: inline bytes;
    `media_file`: where a streamed media result was written instead)."""
    output_type = _OUTPUT_NAMES.get(resp.output_type)
    if output_type is None:
        raise IntegrityError(f"request {resp.request_id}: unknown output type enum value {resp.output_type}")
    result = ClientResult(
        request_id=resp.request_id,
        generation=resp.generation,
        sha256=resp.sha256,
        video=None,
        audio=None,
        cache=from_proto(resp.cache, CacheReport),
        timings_ms=_timings(resp.timings),
        adaln_mode=pb.AdalnMode.Name(resp.adaln_mode),
        output_type=output_type,
    )
    if output_type != "latents":
        if not resp.HasField("media"):
            raise IntegrityError(f"request {resp.request_id}: a {output_type} result carries no media")
        inline = data.get(MEDIA_CHUNK, b"") if data is not None else resp.media.data
        result.media = _media(resp, output_type, inline, media_file)
        return result
    tensors = {t.name: _tensor(t, data.get(t.name, b"") if data is not None else t.data) for t in resp.tensors}
    missing = sorted({"video", "audio"} - set(tensors))
    if missing:
        raise IntegrityError(f"request {resp.request_id}: the result carries no {' or '.join(missing)} tensor")
    result.video, result.audio = tensors["video"], tensors["audio"]
    if data is not None and isinstance(data.get("video"), bytearray) and isinstance(data.get("audio"), bytearray):
        # the received bytes are the tensors' own (they are views of them): hashed in place, as latents_sha256 would
        digest = hashlib.sha256(data["video"])
        digest.update(data["audio"])
        got = digest.hexdigest()
    else:
        got = latents_sha256(result.video, result.audio)
    if got != result.sha256:
        raise IntegrityError(
            f"request {result.request_id}: received latents hash to {got}, server said {result.sha256}"
        )
    return result


def _check_output_type(resp: pb.GenerateResponse, asked: str) -> pb.GenerateResponse:
    got = _OUTPUT_NAMES.get(resp.output_type, f"enum value {resp.output_type}")
    if got != asked:
        raise IntegrityError(
            f"request {resp.request_id}: asked for output type {asked}, the server returned {got} "
            "(a server older than output types?)"
        )
    return resp


class _MediaFile:
    """A streamed media result written to `target` as it arrives: into a temporary file beside it (same directory,
    so same filesystem), hashed as written, renamed into place by `commit` once the result checks out; `discard`
    removes what is left otherwise."""

    def __init__(self, target: str | os.PathLike[str]) -> None:
        self.target = Path(target)
        self.tmp = self.target.with_name(f".{self.target.name}.partial-{uuid.uuid4().hex[:12]}")
        self.size = 0
        self.digest = hashlib.sha256()
        self._file: IO[bytes] | None = None

    def write(self, data: bytes) -> None:
        if self._file is None:
            self._file = self.tmp.open("xb")
        self._file.write(data)
        self.digest.update(data)
        self.size += len(data)

    def commit(self) -> Path:
        self._close()
        if not self.tmp.exists():  # an empty file: no chunk came
            self.tmp.touch()
        os.replace(self.tmp, self.target)
        return self.target

    def discard(self) -> None:
        self._close()
        self.tmp.unlink(missing_ok=True)

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class _Assembly:
    """The streamed result: its header, then each named part's chunks in order, checked against the header. Each
    part is received in place: a buffer of the size the header gives it (a tensor's shape and dtype, the media's
    size_bytes), allocated once and filled chunk by chunk (never a list of chunks joined, nor a growing buffer
    copied), or, for the media with a `media_file`, that file."""

    def __init__(self, header: pb.GenerateResponse, media_file: _MediaFile | None = None) -> None:
        self.header = header
        self.media_file = media_file if header.HasField("media") else None
        self.sizes = {t.name: math.prod(t.shape) * _dtype(t).itemsize for t in header.tensors}
        if header.HasField("media"):
            self.sizes[MEDIA_CHUNK] = header.media.size_bytes
        parts, total = sum(self.sizes.values()), header.total_bytes
        if total and parts != total:
            than = f"more than the header's total_bytes, {total}" if parts > total else f"the header said {total}"
            raise IntegrityError(f"request {header.request_id}: the result header's parts hold {parts} bytes, {than}")
        in_file = MEDIA_CHUNK if self.media_file is not None else None
        self.parts: dict[str, bytearray] = {n: bytearray(size) for n, size in self.sizes.items() if n != in_file}
        self.filled = dict.fromkeys(self.sizes, 0)
        self.received = 0

    def add(self, chunk: pb.ResultChunk) -> None:
        name = chunk.name
        if name not in self.sizes:
            raise IntegrityError(f"a chunk of {name!r}, which the result header does not name")
        start = self.filled[name]
        if chunk.offset != start:
            raise IntegrityError(f"chunk of {name} at offset {chunk.offset}, expected {start}")
        end = start + len(chunk.data)
        if end > self.sizes[name]:
            raise IntegrityError(
                f"chunk of {name} runs to byte {end}, past the {self.sizes[name]} bytes the result header gives it"
            )
        if name in self.parts:
            memoryview(self.parts[name])[start:end] = chunk.data
        else:
            assert self.media_file is not None
            self.media_file.write(chunk.data)
        self.filled[name] = end
        self.received += len(chunk.data)

    def result(self) -> ClientResult:
        total = self.header.total_bytes
        media = self.header.HasField("media") or _OUTPUT_NAMES.get(self.header.output_type, "latents") != "latents"
        if (total or media) and self.received != total:
            raise IntegrityError(
                f"request {self.header.request_id}: the stream carried {self.received} result bytes, the header "
                f"said {total}"
            )
        for name, size in self.sizes.items():
            if self.filled[name] != size:
                raise IntegrityError(
                    f"request {self.header.request_id}: the stream carried {self.filled[name]} bytes of {name}, the "
                    f"result header gives it {size}"
                )
        return result_from_response(self.header, self.parts, self.media_file)


def open_channel(
    target: str, credentials: grpc.ChannelCredentials | None = None, max_message_bytes: int = 64 * 2**20
) -> grpc.Channel:
    """A channel to a generator: TLS with `credentials` (plaintext without), messages up to `max_message_bytes`."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    return grpc.secure_channel(target, credentials, options) if credentials else grpc.insecure_channel(target, options)


class GeneratorClient:
    def __init__(
        self, target: str, credentials: grpc.ChannelCredentials | None = None, max_message_bytes: int = 64 * 2**20
    ) -> None:
        self.channel = open_channel(target, credentials, max_message_bytes)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.max_message_bytes = max_message_bytes

    def upload_reference(self, data: bytes, kind: str = "", timeout: float | None = None) -> pb.UploadReferenceResponse:
        """Send one reference file with UploadReference (UPLOAD_CHUNK_BYTES per message); returns its upload."""
        if kind not in _REFERENCE_KINDS:
            raise RequestError("references", f"unknown reference kind {kind!r}; allowed: image, video, audio")

        def chunks() -> Any:
            for start in range(0, max(len(data), 1), UPLOAD_CHUNK_BYTES):
                yield pb.UploadReferenceRequest(
                    chunk=data[start : start + UPLOAD_CHUNK_BYTES],
                    kind=_REFERENCE_KINDS[kind] if start == 0 else pb.REFERENCE_KIND_UNSPECIFIED,
                )

        response: pb.UploadReferenceResponse = self.stub.UploadReference(chunks(), timeout=timeout)
        return response

    def _fit(self, msg: pb.GenerateRequest, timeout: float | None) -> pb.GenerateRequest:
        """`msg`, its largest references uploaded and named by upload_id until it fits the message limit."""
        limit = self.max_message_bytes - _ENVELOPE_BYTES
        while msg.ByteSize() > limit:
            inline = [r for r in msg.references if r.WhichOneof("source") == "data"]
            if not inline:
                break
            ref = max(inline, key=lambda r: len(r.data))
            ref.upload_id = self.upload_reference(ref.data, _kind_name(ref.kind), timeout).upload_id
        return msg

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
        media_path: str | os.PathLike[str] | None = None,
    ) -> ClientResult:
        """Run one request over GenerateStream; raises grpc.RpcError with the server's status, IntegrityError when
        what arrived does not check out. `media_path`: a media result (mp4, frames_and_wav) is written there as it
        arrives instead of being held (through a temporary file beside it, renamed into place once its size and
        sha256 check out; nothing is left there otherwise); its ClientMedia then has `path` set and no `data`. A
        latents result ignores it."""
        media_file = _MediaFile(media_path) if media_path is not None else None
        try:
            result = self._generate_stream(as_request(request), expected_generation, progress, timeout, metadata,
                                           media_file)  # fmt: skip
            if media_file is not None and result.media is not None:
                media_file.commit()
            return result
        finally:
            if media_file is not None:
                media_file.discard()  # nothing left after a commit

    def _generate_stream(
        self,
        req: GenerationRequest,
        expected_generation: int | None,
        progress: ProgressCallback | None,
        timeout: float | None,
        metadata: list[tuple[str, str]] | None,
        media_file: _MediaFile | None,
    ) -> ClientResult:
        msg = pb.GenerateStreamRequest(request=self._fit(request_to_proto(req, expected_generation), timeout))
        metadata = [*(metadata or []), (SCHEDULE_HEADER, schedule_affinity_key(req))]
        assembly: _Assembly | None = None
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
            elif kind == "decoding":
                payload = _OUTPUT_NAMES.get(ev.decoding.output_type, "latents")
            elif kind == "result":
                if assembly is not None:
                    raise IntegrityError("the stream carried a second result header")
                assembly = _Assembly(ev.result, media_file)
                continue
            elif kind == "chunk":
                if assembly is None:
                    raise IntegrityError(f"a chunk of {ev.chunk.name!r} before the result header")
                assembly.add(ev.chunk)
                if progress is not None:
                    progress("receiving", (assembly.received, assembly.header.total_bytes))
                continue
            events.append((kind, payload))
            if progress is not None:
                progress(kind, payload)
        if assembly is None:
            raise IntegrityError("the stream ended without a result")
        _check_output_type(assembly.header, req.output_type)
        result = assembly.result()
        result.events = events
        return result

    def generate_unary(
        self,
        request: GenerationRequest | Mapping[str, Any],
        expected_generation: int | None = None,
        timeout: float | None = None,
    ) -> ClientResult:
        req = as_request(request)
        md = [(SCHEDULE_HEADER, schedule_affinity_key(req))]
        resp = self.stub.Generate(
            self._fit(request_to_proto(req, expected_generation), timeout), timeout=timeout, metadata=md
        )
        return result_from_response(_check_output_type(resp, req.output_type))

    def status(self, timeout: float = 10.0) -> pb.GetStatusResponse:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=timeout)
