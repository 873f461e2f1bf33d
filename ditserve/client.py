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

This module is the transport (`GeneratorClient`) and the client's public API; the request side (request -> proto, the
affinity key) is `client_requests`, the result side (results, their assembly and checks) `client_results`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

import grpc

from ditcore.report import CacheReport
from ditcore.request import GenerationRequest, RequestError
from ditruntime.auth import bearer_metadata
from ditruntime.convert import from_proto
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

from .client_requests import (
    OUTPUT_NAMES,
    REFERENCE_KINDS,
    SCHEDULE_HEADER,
    as_request,
    kind_name,
    new_request_id,
    request_to_proto,
    schedule_affinity_key,
    unset_fields,
)
from .client_results import (
    MEDIA_CHUNK,
    ClientMedia,
    ClientResult,
    IntegrityError,
    MediaFile,
    ResultAssembly,
    check_output_type,
    result_from_response,
)

__all__ = [  # the Python client's API (docs/api.md): this module's own names and its two halves' public ones
    "MEDIA_CHUNK",
    "SCHEDULE_HEADER",
    "UPLOAD_CHUNK_BYTES",
    "ClientMedia",
    "ClientResult",
    "GeneratorClient",
    "IntegrityError",
    "ProgressCallback",
    "as_request",
    "new_request_id",
    "open_channel",
    "request_to_proto",
    "result_from_response",
    "schedule_affinity_key",
]

UPLOAD_CHUNK_BYTES = 1024 * 1024
"""Bytes per UploadReference message."""
_ENVELOPE_BYTES = 64 * 1024
"""What a request message keeps free of its limit for everything but its references."""
ProgressCallback = Callable[[str, Any], None]
"""Called with ("queued", position), ("plans_ready", CacheReport), ("step", (i, n)), ("decoding", output_type) and,
while the result's bytes arrive, ("receiving", (bytes received, total bytes)) after each chunk."""


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
        if kind not in REFERENCE_KINDS:
            raise RequestError("references", f"unknown reference kind {kind!r}; allowed: image, video, audio")

        def chunks() -> Any:
            for start in range(0, max(len(data), 1), UPLOAD_CHUNK_BYTES):
                yield pb.UploadReferenceRequest(
                    chunk=data[start : start + UPLOAD_CHUNK_BYTES],
                    kind=REFERENCE_KINDS[kind] if start == 0 else pb.REFERENCE_KIND_UNSPECIFIED,
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
            ref.upload_id = self.upload_reference(ref.data, kind_name(ref.kind), timeout).upload_id
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
        unset: Collection[str] = (),
    ) -> ClientResult:
        """Run one request over GenerateStream; raises grpc.RpcError with the server's status, IntegrityError when
        what arrived does not check out. `media_path`: a media result (mp4, frames_and_wav) is written there as it
        arrives instead of being held (through a temporary file beside it, renamed into place once its size and
        sha256 check out; nothing is left there otherwise); its ClientMedia then has `path` set and no `data`. A
        latents result ignores it. `unset` (and, for a mapping, the keys it lacks): num_inference_steps, flow_shift
        and audio_flow_shift left for the server to default from the request's adapters' contracts."""
        media_file = MediaFile(media_path) if media_path is not None else None
        try:
            result = self._generate_stream(as_request(request), expected_generation, progress, timeout, metadata,
                                           media_file, unset_fields(request, unset))  # fmt: skip
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
        media_file: MediaFile | None,
        unset: frozenset[str] = frozenset(),
    ) -> ClientResult:
        msg = pb.GenerateStreamRequest(request=self._fit(request_to_proto(req, expected_generation, unset), timeout))
        metadata = [*(metadata or []), (SCHEDULE_HEADER, schedule_affinity_key(req))]
        assembly: ResultAssembly | None = None
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
                payload = OUTPUT_NAMES.get(ev.decoding.output_type, "latents")
            elif kind == "result":
                if assembly is not None:
                    raise IntegrityError("the stream carried a second result header")
                assembly = ResultAssembly(ev.result, media_file)
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
        check_output_type(assembly.header, req.output_type)
        result = assembly.result()
        result.events = events
        return result

    def generate_unary(
        self,
        request: GenerationRequest | Mapping[str, Any],
        expected_generation: int | None = None,
        timeout: float | None = None,
        unset: Collection[str] = (),
    ) -> ClientResult:
        req = as_request(request)
        md = [(SCHEDULE_HEADER, schedule_affinity_key(req))]
        msg = request_to_proto(req, expected_generation, unset_fields(request, unset))
        resp = self.stub.Generate(self._fit(msg, timeout), timeout=timeout, metadata=md)
        return result_from_response(check_output_type(resp, req.output_type))

    def status(self, timeout: float = 10.0) -> pb.GetStatusResponse:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=timeout)

    def list_adapters(self, timeout: float = 10.0) -> pb.ListAdaptersResponse:
        """The adapters of the generator's --adapter-dir (ListAdapters): each one's identity, rank, targets,
        partition, contract and whether it is loaded, and the files it refuses with why."""
        response: pb.ListAdaptersResponse = self.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=timeout)
        return response

    def list_quality_levels(self, timeout: float = 10.0) -> pb.ListQualityLevelsResponse:
        """The quality levels a request may name (ListQualityLevels): lossless first, then the server's
        --quality-levels, each with its step cache, what it may run with, its thresholds and its audits."""
        response: pb.ListQualityLevelsResponse = self.stub.ListQualityLevels(
            pb.ListQualityLevelsRequest(), timeout=timeout
        )
        return response

    def load_adapter(
        self, name: str, identity: str = "", token: str = "", timeout: float | None = 600.0
    ) -> pb.LoadAdapterResponse:
        """Load adapter `name` of the generator's --adapter-dir into its model now (LoadAdapter, admin: `token` is the
        server's --admin-token): its ListAdapters entry. With `identity`, refused (FAILED_PRECONDITION) unless the
        file reads that identity now. It waits for the running request (the call's `timeout` bounds the wait)."""
        response: pb.LoadAdapterResponse = self.stub.LoadAdapter(
            pb.LoadAdapterRequest(name=name, identity=identity), metadata=_admin_metadata(token), timeout=timeout
        )
        return response

    def unload_adapter(self, name: str, token: str = "", timeout: float | None = 600.0) -> pb.UnloadAdapterResponse:
        """Delete adapter `name` from the generator's model (UnloadAdapter, admin; its file stays): `was_loaded` and
        the identities deleted. A later request naming it loads it again at its first use."""
        response: pb.UnloadAdapterResponse = self.stub.UnloadAdapter(
            pb.UnloadAdapterRequest(name=name), metadata=_admin_metadata(token), timeout=timeout
        )
        return response


def _admin_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return bearer_metadata(token) if token else ()
