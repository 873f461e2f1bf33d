"""The generator's gRPC adapter: Generator servicer, health, reflection, graceful stop.

Thin: converts proto <-> `GenerationRequest` / results, submits jobs to the executor, and
maps every error through `ditruntime.rpc_errors` (one table; docs/architecture.md, "Errors").
Its collaborators are built by `app.build_server`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import torch
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ditcore import GenerationRequest, RequestError
from ditcore.checkpoint import PARTITION_TASKS
from ditcore.model import ComponentInfo, H3Model
from ditruntime.auth import check_admin_transport, check_bearer, plaintext_admin_warning
from ditruntime.convert import to_proto
from ditruntime.decode_guard import DecodeGuard
from ditruntime.errors import ServiceError
from ditruntime.obs import MetricsServer, RpcMetrics
from ditruntime.rpc_errors import abort
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

from ..backends.base import Backend
from ..config import GeneratorConfig
from ..errors import HandlersBusyError, ResultTooLargeError
from ..execution.admission import check_request
from ..execution.executor import Executor
from ..execution.registry import RunRegistry
from ..execution.runs import Decoding, Failed, Finished, PlansReady, Queued, Run, RunResult, StepDone
from ..health import ServingState
from ..jobs.service import JobService
from ..metrics import GeneratorMetrics
from ..updates import UpdateCoordinator, resolve_weights_path
from .convert import OUTPUT_ENUMS, reference_kind, request_from_proto, resolve_uploads, tensor_from_proto
from .jobs_servicer import SERVICE_NAME as JOBS_SERVICE
from .jobs_servicer import JobsServicer
from .streams import HandlerSlots, SendWatchdog, StreamWatch
from .uploads import UploadStore

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generator"].full_name
_MODES: dict[str, pb.AdalnMode] = {"cached": pb.ADALN_MODE_CACHED, "resident": pb.ADALN_MODE_RESIDENT}
_ENVELOPE = 4096
"""Bytes a unary response keeps free under --max-message-mb for gRPC's own framing."""


def server_credentials(cfg: GeneratorConfig) -> grpc.ServerCredentials:
    """TLS for the public port; with a client CA, clients must present certificates (mTLS)."""
    assert cfg.tls_cert is not None and cfg.tls_key is not None
    pair = [(cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())]
    if cfg.tls_client_ca is not None:
        return grpc.ssl_server_credentials(
            pair, root_certificates=cfg.tls_client_ca.read_bytes(), require_client_auth=True
        )
    return grpc.ssl_server_credentials(pair)


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
    )
    m = res.media
    if m is not None:
        resp.media.CopyFrom(pb.Media(
            content_type=m.content_type, size_bytes=m.size, sha256=m.sha256, data=m.read_all() if with_data else b"",
            filename=f"{r.request_id}{m.suffix}",
        ))  # fmt: skip
    return resp


class HealthPublisher:
    """The gRPC health service; `publish` is the ServingState's listener (whole server and Generator)."""

    def __init__(self) -> None:
        self.servicer = health.HealthServicer()

    def publish(self, serving: bool, reason: str) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME, JOBS_SERVICE):
            self.servicer.set(name, status)
        log.debug("health: %s", "SERVING" if serving else f"NOT_SERVING ({reason})")


class GeneratorServicer(pb_grpc.GeneratorServicer):
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

    def _submit(self, msg: pb.GenerateRequest, context: grpc.ServicerContext, unary: bool) -> Run:
        try:
            request, expected = request_from_proto(resolve_uploads(msg, self.uploads))
            if unary:
                self._check_unary_size(request)
            remaining = context.time_remaining()
            deadline = time.monotonic() + remaining if remaining is not None else None
            run = Run(request, expected_generation=expected, deadline=deadline)
            context.add_callback(lambda: self._ended(run))  # client cancel / disconnect stops the executor
            self.registry.submit(run)
        except (RequestError, ServiceError) as e:
            abort(context, e)
        return run

    def _ended(self, run: Run) -> None:
        """The RPC ended (sent, failed, cancelled, or its client went away): stop the job and free its slot."""
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
                        resp = response_from_result(result, self.mode)
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
                        header = response_from_result(result, self.mode, with_data=False)
                        watch.start_transfer()
                        yield pb.GenerateStreamResponse(result=header)
                        yield from self._chunks(result)
                    finally:
                        if result.media is not None:
                            result.media.close()  # a stalled or cancelled stream leaves no spooled file behind
                    return

    def _chunks(self, res: RunResult) -> Iterator[pb.GenerateStreamResponse]:
        """The result's bytes in order, `chunk_bytes` at a time: the media file ("media", read from its spooled
        file chunk by chunk), or each tensor (sliced from the tensor's own memory). Nothing is copied whole."""
        step = self.cfg.chunk_bytes
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

    def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: grpc.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        expected = request.expected_generation if request.HasField("expected_generation") else None
        try:
            check_admin_transport(
                context.peer(), self.cfg.tls_cert is not None, self.cfg.allow_plaintext_admin, "UpdateWeights"
            )
            check_bearer(
                self.cfg.admin_secret, dict(context.invocation_metadata()).get("authorization"), "UpdateWeights"
            )
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
        try:
            with self.slots.take():
                chunks = ((m.chunk, reference_kind(m.kind, "kind")) for m in request_iterator)
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
        st = self.backend.status()
        resp = pb.GetStatusResponse(
            adaln_mode=self.mode,
            weights_path=st.weights_path,
            fingerprint=st.fingerprint,
            sidecar_connected=st.sidecar_connected,
            sidecar_target=st.sidecar_target,
            queue_depth=self.executor.queue_depth,
            max_queue_depth=self.cfg.max_queue_depth,
            serving=st.serving,
        )
        if st.serving:
            resp.generation = self.backend.generation()
        model = self.backend.loaded()
        if model is not None:
            resp.model_preset = model.info.preset
            resp.precision = model.precision
            resp.attention_backend, resp.decode_dtype = model.attention_backend, model.decode_dtype
            resp.memory.CopyFrom(pb.ModelMemory(**model.memory().to_dict()))
            resp.components.extend(component_placement(c) for c in model.components())
            resp.partitions.extend(partition_status(model))
        link = self.backend.replica
        if link is not None:
            spec = link.replica.spec
            resp.replica.CopyFrom(pb.ReplicaStatus(
                ranks=link.world_size, ulysses_degree=spec.ulysses_degree, ring_degree=spec.ring_degree,
                rank_placements=[pb.RankPlacement(rank=r.rank, device=r.device, components=[
                    pb.ComponentPlacement(name=c.name, device=c.device, placement=c.placement, dtype=c.dtype,
                                          bytes=c.bytes, device_bytes=c.device_bytes, note=c.note)
                    for c in r.components]) for r in link.reports],
            ))  # fmt: skip
        slab = st.slab
        if slab is not None:
            page_bytes = slab.slab_bytes // max(1, slab.num_slots * slab.width)
            resp.slab.CopyFrom(pb.SlabGeometry(
                num_slots=slab.num_slots, width=slab.width, page_numel=slab.page_numel, page_bytes=page_bytes,
                dtype=slab.dtype, device=slab.device, transport=slab.transport,
            ))  # fmt: skip
        return resp


def partition_status(model: H3Model) -> list[pb.PartitionStatus]:
    """GetStatus' view of the repository's transformer partitions: loaded or not, their tasks and memory."""
    memory = model.partition_memory()
    out = []
    for name, part in model.info.partitions.items():
        status = pb.PartitionStatus(
            name=name, folder=part.folder, loaded=name in memory, tasks=list(PARTITION_TASKS[name]),
            fingerprint=part.fingerprint,
        )  # fmt: skip
        if name in memory:
            status.memory.CopyFrom(pb.ModelMemory(**memory[name].to_dict()))
        out.append(status)
    return out


def component_placement(c: ComponentInfo) -> pb.ComponentPlacement:
    """GetStatus' view of one loaded component (the two share their field names)."""
    return pb.ComponentPlacement(**dataclasses.asdict(c))


def _grpc_server(cfg: GeneratorConfig, metrics: GeneratorMetrics) -> grpc.Server:
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="generator"),
        interceptors=[RpcMetrics(metrics.registry, "ditserve_generator"), DecodeGuard()],
        maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", cfg.max_streams_per_connection),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ],
    )


class GeneratorServer:
    """A running generator: grpc server, executor, health (from the one ServingState)."""

    def __init__(
        self,
        cfg: GeneratorConfig,
        backend: Backend,
        executor: Executor,
        updates: UpdateCoordinator,
        metrics: GeneratorMetrics,
        state: ServingState,
        publisher: HealthPublisher,
        registry: RunRegistry,
        jobs: JobService,
        release_jobs_dir: Callable[[], None] = lambda: None,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.executor = executor
        self.metrics = metrics
        self.state = state
        self.jobs = jobs
        self._release_jobs_dir = release_jobs_dir  # its lock, or the temporary dir itself: at stop
        self.metrics_server: MetricsServer | None = None
        self.server = _grpc_server(cfg, metrics)
        self.slots = HandlerSlots(cfg.request_handlers, cfg.workers)
        self.watchdog = SendWatchdog(
            cfg.stream_stall_s, cfg.stream_transfer_s, lambda why: metrics.streams_cancelled.labels(why).inc()
        )
        self.uploads = UploadStore(cfg.max_upload_bytes, cfg.upload_ttl_s)
        servicer = GeneratorServicer(
            cfg, backend, executor, updates, metrics, self.slots, self.watchdog, registry, self.uploads
        )
        pb_grpc.add_GeneratorServicer_to_server(servicer, self.server)
        jobs_servicer = JobsServicer(jobs, self.slots, self.watchdog, cfg.chunk_bytes, self.uploads)
        pb_grpc.add_JobsServicer_to_server(jobs_servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(publisher.servicer, self.server)
        if cfg.reflection:
            reflection.enable_server_reflection(
                (
                    SERVICE_NAME,
                    JOBS_SERVICE,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                ),
                self.server,
            )
        self.port = (
            self.server.add_secure_port(cfg.listen, server_credentials(cfg))
            if cfg.tls_cert
            else self.server.add_insecure_port(cfg.listen)
        )
        if self.port == 0:
            raise OSError(f"cannot listen on {cfg.listen}")

    def start(self) -> None:
        self.metrics_server = MetricsServer(self.metrics.registry, self.cfg.metrics_port, self.cfg.metrics_bind_host)
        warning = plaintext_admin_warning(
            self.cfg.listen, self.cfg.tls_cert is not None, bool(self.cfg.admin_secret), self.cfg.allow_plaintext_admin
        )
        if warning:
            log.warning("%s", warning)
        self.backend.start()
        self.executor.start()
        self.jobs.start()
        self.watchdog.start()
        self.server.start()
        host = self.cfg.listen.rsplit(":", 1)[0]
        transport = "TLS" if self.cfg.tls_cert else "plaintext"
        log.info("generator listening on %s:%d (%s mode, %s)", host, self.port, self.backend.mode, transport)

    def stop(self, grace_s: float = 10.0) -> None:
        self.state.set_stopping()
        self.jobs.stopping()  # jobs the stopping executor drops stay queued for the next start
        self.server.stop(grace_s).wait()
        self.watchdog.stop()
        self.executor.stop()
        if self.backend.replica is not None:  # the replica's other ranks exit with this one
            self.backend.replica.stop()
        self.jobs.stop()
        self.backend.close()
        self._release_jobs_dir()
        if self.metrics_server is not None:
            self.metrics_server.close()
