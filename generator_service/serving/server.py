"""The generator's gRPC server: the Generator and Jobs servicers on one port, health (from the one ServingState),
reflection, TLS credentials and graceful stop. Its collaborators are built by `app.build_server`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ditruntime.auth import plaintext_admin_warning
from ditruntime.decode_guard import DecodeGuard
from ditruntime.obs import MetricsServer, RpcMetrics
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

from ..backends.base import Backend
from ..config import GeneratorConfig
from ..execution.executor import Executor
from ..execution.registry import RunRegistry
from ..health import ServingState
from ..jobs.service import JobService
from ..metrics import GeneratorMetrics
from ..updates import UpdateCoordinator
from .auth import JobsAuth
from .jobs_servicer import SERVICE_NAME as JOBS_SERVICE
from .jobs_servicer import JobsServicer
from .servicer import SERVICE_NAME, GeneratorServicer
from .streams import HandlerSlots, SendWatchdog, UploadWatchSlots
from .uploads import UploadStore

log = logging.getLogger(__name__)


def server_credentials(cfg: GeneratorConfig) -> grpc.ServerCredentials:
    """TLS for the public port; with a client CA, clients must present certificates (mTLS)."""
    assert cfg.tls_cert is not None and cfg.tls_key is not None
    pair = [(cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())]
    if cfg.tls_client_ca is not None:
        return grpc.ssl_server_credentials(
            pair, root_certificates=cfg.tls_client_ca.read_bytes(), require_client_auth=True
        )
    return grpc.ssl_server_credentials(pair)


class HealthPublisher:
    """The gRPC health service; `publish` is the ServingState's listener (whole server and Generator)."""

    def __init__(self) -> None:
        self.servicer = health.HealthServicer()

    def publish(self, serving: bool, reason: str) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME, JOBS_SERVICE):
            self.servicer.set(name, status)
        log.debug("health: %s", "SERVING" if serving else f"NOT_SERVING ({reason})")


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
        upload_watch = UploadWatchSlots(cfg.upload_watch_workers, cfg.upload_stall_s, cfg.upload_max_s, cfg.watch_max_s)
        self.slots = HandlerSlots(cfg.workers, cfg.control_workers, upload_watch)  # budgets within the pool's threads
        self.watchdog = SendWatchdog(
            cfg.stream_stall_s, cfg.stream_transfer_s, lambda why: metrics.streams_cancelled.labels(why).inc()
        )
        self.uploads = UploadStore(cfg.max_upload_bytes, cfg.upload_ttl_s)
        servicer = GeneratorServicer(
            cfg, backend, executor, updates, metrics, self.slots, self.watchdog, registry, self.uploads
        )
        pb_grpc.add_GeneratorServicer_to_server(servicer, self.server)
        auth = JobsAuth(
            cfg.client_keys, cfg.admin_secret, client_certs=cfg.tls_client_ca is not None,
            tls=cfg.tls_cert is not None, allow_plaintext_admin=cfg.allow_plaintext_admin,
        )  # fmt: skip
        jobs_servicer = JobsServicer(
            jobs, self.slots, self.watchdog, cfg.chunk_bytes, self.uploads, auth, cfg.adapter_registry
        )
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
