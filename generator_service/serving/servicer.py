"""The Generator service's RPCs (Generate, GenerateStream, UpdateWeights, UploadReference, GetStatus, ListAdapters,
LoadAdapter, UnloadAdapter, ListQualityLevels): thin, it
converts proto <-> `GenerationRequest` / results, submits runs to the executor, and maps every error through
`ditruntime.rpc_errors` (one table; docs/architecture.md, "Errors")."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from ditcore import GenerationRequest, RequestError
from ditcore.adapter_contract import AdapterError, AdapterNotFoundError
from ditcore.quality import QualityNotAuditedError
from ditruntime.auth import check_admin_transport, check_bearer
from ditruntime.convert import to_proto
from ditruntime.errors import ServiceError
from ditruntime.rpc_errors import abort
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

from ..backends.base import Backend
from ..config import GeneratorConfig
from ..errors import HandlersBusyError, ResultTooLargeError
from ..execution.admission import check_request
from ..execution.executor import Executor
from ..execution.registry import RunRegistry
from ..execution.runs import Decoding, Failed, Finished, PlansReady, Queued, Run, StepDone
from ..metrics import GeneratorMetrics
from ..updates import UpdateCoordinator, resolve_weights_path
from .adapter_admin import AdapterAdmin
from .convert import OUTPUT_ENUMS, reference_kind, request_from_proto, resolve_request, tensor_from_proto
from .responses import response_from_result, result_chunks
from .status import adapter_message, adapters_response, quality_levels_response, status_response
from .streams import HandlerSlots, SendWatchdog, StreamWatch
from .uploads import UploadStore

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generator"].full_name
_MODES: dict[str, pb.AdalnMode] = {"cached": pb.ADALN_MODE_CACHED, "resident": pb.ADALN_MODE_RESIDENT}
_ENVELOPE = 4096
"""Bytes a unary response keeps free under --max-message-mb for gRPC's own framing."""


class GeneratorServicer(pb_grpc.GeneratorServicer):
    """The Generator RPCs: each request is a Run submitted through the registry, its events sent as they come."""

    def __init__(
        self,
        cfg: GeneratorConfig,
        backend: Backend,
        executor: Executor,
        updates: UpdateCoordinator,
        metrics: GeneratorMetrics,
        slots: HandlerSlots,
        watchdog: SendWatchdog,
        registry: RunRegistry,
        uploads: UploadStore,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.backend = backend
        self.executor = executor
        self.uploads = uploads
        self.registry = registry
        self.updates = updates
        self.slots = slots
        self.watchdog = watchdog
        self.mode = _MODES[backend.mode]
        self.adapter_admin = AdapterAdmin(backend, cfg.adapter_registry)

    def _submit(self, msg: pb.GenerateRequest, context: grpc.ServicerContext, unary: bool) -> Run:
        try:
            if msg.quality_audit:  # it runs a level no audit covers yet: the operator's call, not any client's
                self._check_admin(context, "an audit run (quality_audit)")
            request, expected = request_from_proto(resolve_request(msg, self.uploads, self.cfg.adapter_registry))
            if unary:
                self._check_unary_size(request)
            remaining = context.time_remaining()
            deadline = time.monotonic() + remaining if remaining is not None else None
            run = Run(request, expected_generation=expected, deadline=deadline)
            context.add_callback(lambda: self._ended(run))  # client cancel / disconnect stops the executor
            self.registry.submit(run)
        except (
            RequestError,
            ServiceError,
            AdapterError,
            AdapterNotFoundError,
            QualityNotAuditedError,
        ) as e:  # refusals
            abort(context, e)
        return run

    def _ended(self, run: Run) -> None:
        """The RPC ended (sent, failed, cancelled, or its client went away): stop the run and free its slot."""
        self.registry.cancel(run)
        self.registry.release(run)

    def _too_large(self, size: int, what: str) -> ResultTooLargeError:
        limit = self.cfg.max_message_bytes
        return ResultTooLargeError(
            f"{what} is {size} bytes, above this server's {limit}-byte message limit "
            f"(--max-message-mb {limit / 2**20:g}, less {_ENVELOPE} bytes of framing); use "
            "GenerateStream, which sends it in chunks (a client taking large unary results must "
            "raise its own receive limit too, e.g. grpcurl -max-msg-sz)",
            {"result_bytes": str(size), "max_message_bytes": str(limit)},
        )

    def _check_unary_size(self, request: GenerationRequest) -> None:
        """Refuse before any work a unary request whose result cannot fit one message (its latents' size is known
        from the canvas; a media file's only once encoded)."""
        sizer = self.backend.sizer()
        if sizer is None or request.decodes:
            return
        check_request(request, self.executor.limits)  # an invalid canvas is refused for its field, not its size
        size = sizer.latent_bytes(request)
        if size > self.cfg.max_message_bytes - _ENVELOPE:
            raise self._too_large(size, "the result's latents alone")

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        try:
            with self.slots.take():
                run = self._submit(request, context, unary=True)
                try:
                    return self._unary_result(run, context)
                finally:
                    self.registry.release(run)  # grpc sends the returned message on its own
        except HandlersBusyError as e:
            abort(context, e)

    def _unary_result(self, run: Run, context: grpc.ServicerContext) -> pb.GenerateResponse:
        while True:
            match run.events.get():
                case Failed(error):
                    abort(context, error)
                case Finished(result):
                    try:
                        resp = _ran(response_from_result(result, self.mode), run.request)
                    finally:
                        if result.media is not None:
                            result.media.close()
                    size = resp.ByteSize()
                    if size > self.cfg.max_message_bytes - _ENVELOPE:
                        abort(context, self._too_large(size, "the result"))
                    return resp

    def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateStreamResponse]:
        try:
            self.slots.acquire()
        except HandlersBusyError as e:
            abort(context, e)
        watch = self.watchdog.watch(request.request.request_id or "(unnamed)", context.cancel)
        run: Run | None = None
        try:
            run = self._submit(request.request, context, unary=False)
            watch.name = run.request.request_id
            for message in self._stream(run, context, watch):
                watch.sending()
                yield message
                watch.sent()
        finally:
            watch.close()
            if run is not None:
                self.registry.release(run)
            self.slots.release()

    def _stream(
        self, run: Run, context: grpc.ServicerContext, watch: StreamWatch
    ) -> Iterator[pb.GenerateStreamResponse]:
        while True:
            match run.events.get():
                case Queued(position):
                    yield pb.GenerateStreamResponse(
                        queued=pb.Queued(request_id=run.request.request_id, position=position)
                    )
                case PlansReady(report, generation):
                    yield pb.GenerateStreamResponse(
                        plans_ready=pb.PlansReady(cache=to_proto(report, pb.CacheReport), generation=generation)
                    )
                case StepDone(step, total):
                    yield pb.GenerateStreamResponse(step=pb.StepProgress(step=step, total=total))
                case Decoding(output_type):
                    yield pb.GenerateStreamResponse(decoding=pb.Decoding(output_type=OUTPUT_ENUMS[output_type]))
                case Failed(error):
                    abort(context, error)
                case Finished(result):
                    try:
                        header = _ran(response_from_result(result, self.mode, with_data=False), run.request)
                        watch.start_transfer()
                        yield pb.GenerateStreamResponse(result=header)
                        yield from result_chunks(result, self.cfg.chunk_bytes)
                    finally:
                        if result.media is not None:
                            result.media.close()  # a stalled or cancelled stream leaves no spooled file behind
                    return

    def _check_admin(self, context: grpc.ServicerContext, method: str) -> None:
        """The admin RPCs' guard (UpdateWeights, LoadAdapter, UnloadAdapter): never over plaintext beyond loopback
        (unless --allow-plaintext-admin), and `authorization: Bearer <--admin-token>`."""
        check_admin_transport(context.peer(), self.cfg.tls_cert is not None, self.cfg.allow_plaintext_admin, method)
        check_bearer(self.cfg.admin_secret, dict(context.invocation_metadata()).get("authorization"), method)

    def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: grpc.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        expected = request.expected_generation if request.HasField("expected_generation") else None
        try:
            self._check_admin(context, "UpdateWeights")
            if request.tensors:
                if request.weights_path:
                    raise RequestError("tensors", "give weights_path or tensors, not both")
                tensors = {t.name: tensor_from_proto(t) for t in request.tensors}
                if len(tensors) != len(request.tensors):
                    raise RequestError("tensors", "a tensor name is given more than once")
                result = self.updates.update_tensors(tensors, expected)
            else:
                path = resolve_weights_path(self.cfg.weights_root, request.weights_path)
                result = self.updates.update(path, expected, request.request_id or "update")
        except Exception as e:
            self.metrics.updates.labels(e.reason if isinstance(e, ServiceError) else "failed").inc()
            abort(context, e)
        self.metrics.updates.labels("committed").inc()
        log.info(
            "weights updated: generation %d -> %d (%s)",
            result.previous_generation,
            result.generation,
            result.weights_path,
        )
        return pb.UpdateWeightsResponse(
            generation=result.generation,
            previous_generation=result.previous_generation,
            weights_path=result.weights_path,
            fingerprint=result.fingerprint,
            phase_ms=result.phase_ms,
            kept_partitions=list(result.kept_partitions),
        )

    def UploadReference(
        self, request_iterator: Iterator[pb.UploadReferenceRequest], context: grpc.ServicerContext
    ) -> pb.UploadReferenceResponse:
        pool = self.slots.upload_watch  # its own slots: idle uploads never take Generate's threads
        try:
            with pool.take(), pool.receive(request_iterator) as messages:  # --upload-stall-s, --upload-max-s
                chunks = ((m.chunk, reference_kind(m.kind, "kind")) for m in messages)
                upload = self.uploads.put(chunks, self.executor.limits.reference_limits())
        except (RequestError, ServiceError) as e:
            abort(context, e)
        expires = Timestamp()
        expires.FromNanoseconds(int(upload.expires_at * 1e9))
        log.info("upload %s: %d bytes (%s), sha256 %s", upload.upload_id, len(upload.reference.data), upload.kind,
                 upload.sha256[:16])  # fmt: skip
        return pb.UploadReferenceResponse(
            upload_id=upload.upload_id, size_bytes=len(upload.reference.data), sha256=upload.sha256,
            kind=upload.kind, expires_at=expires,
        )  # fmt: skip

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.GetStatusResponse:
        return status_response(self.cfg, self.backend, self.executor, self.mode)

    def ListAdapters(self, request: pb.ListAdaptersRequest, context: grpc.ServicerContext) -> pb.ListAdaptersResponse:
        return adapters_response(self.cfg.adapter_registry, self.backend.loaded())

    def ListQualityLevels(
        self, request: pb.ListQualityLevelsRequest, context: grpc.ServicerContext
    ) -> pb.ListQualityLevelsResponse:
        model = self.backend.loaded()
        levels = model.quality if model is not None else self.cfg.quality
        world_size = self.backend.replica.world_size if self.backend.replica is not None else 1
        return quality_levels_response(levels, model, world_size)

    def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.ServicerContext) -> pb.LoadAdapterResponse:
        try:
            self._check_admin(context, "LoadAdapter")
            done = self.adapter_admin.load(request.name, request.identity, context.time_remaining())
        except Exception as e:  # every error mapped; an unexpected one is INTERNAL, its text only in the log
            abort(context, e)
        return pb.LoadAdapterResponse(
            adapter=adapter_message(done.info, True, done.loaded_bytes), already_loaded=done.already_loaded,
            replaced_identities=list(done.replaced),
        )  # fmt: skip

    def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: grpc.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        try:
            self._check_admin(context, "UnloadAdapter")
            deleted = self.adapter_admin.unload(request.name, context.time_remaining())
        except Exception as e:  # every error mapped; an unexpected one is INTERNAL, its text only in the log
            abort(context, e)
        return pb.UnloadAdapterResponse(was_loaded=bool(deleted), identities=[i.identity for i in deleted])


def _ran(resp: pb.GenerateResponse, request: GenerationRequest) -> pb.GenerateResponse:
    """`resp` with the schedule the request ran (its own values, else its adapters' contract defaults, else H3's)."""
    resp.num_inference_steps = request.num_inference_steps
    resp.flow_shift, resp.audio_flow_shift = request.flow_shift, request.audio_flow_shift
    return resp
