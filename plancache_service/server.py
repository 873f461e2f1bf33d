"""The sidecar's gRPC adapter: PlanCache servicer, health, reflection, graceful stop.

Thin: converts proto <-> core objects and maps errors through `ditruntime.rpc_errors`.
Health is derived in one place (`SidecarHealth`). Listens on a unix socket in a 0700
directory by default; TCP is opt-in.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from ditcore.checkpoint import CheckpointError
from ditcore.plans import PlanKey
from ditruntime.convert import to_proto
from ditruntime.errors import ServiceError
from ditruntime.obs import MetricsServer, RpcMetrics
from ditruntime.rpc_errors import abort
from ditruntime.slab import descriptor_to_proto
from protos.ditserve.plancache.v1 import plancache_pb2 as pb
from protos.ditserve.plancache.v1 import plancache_pb2_grpc as pb_grpc

from .cache import CacheStats
from .sidecar import Sidecar
from .state import StateFileError

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PlanCache"].full_name
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),  # pings find a dead generator and end its Attach session
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]


def stats_to_proto(s: CacheStats) -> pb.CacheStats:
    """Every field by name (a field with no counterpart raises); two travel on GetStateResponse."""
    return to_proto(s, pb.CacheStats, elsewhere=("generation", "leases_held"))


class SidecarHealth:
    """The sidecar's gRPC health, derived in one place: SERVING iff the server is up and the
    sidecar serves plans. `plans_serving` is the `Sidecar`'s `on_serving_change` listener."""

    def __init__(self) -> None:
        self.servicer = HealthServicer()
        self._lock = threading.Lock()
        self._up = False
        self._plans = True  # a Sidecar starts serving

    def plans_serving(self, serving: bool) -> None:
        with self._lock:
            self._plans = serving
            self._publish()

    def server_up(self, up: bool) -> None:
        with self._lock:
            self._up = up
            self._publish()

    def _publish(self) -> None:
        serving = self._up and self._plans
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self.servicer.set(name, status)


class PlanCacheServicer(pb_grpc.PlanCacheServicer):
    def __init__(self, sidecar: Sidecar, heartbeat_s: float, stopping: threading.Event) -> None:
        self.sidecar = sidecar
        self.heartbeat_s = heartbeat_s
        self.stopping = stopping

    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> Iterator[pb.AttachResponse]:
        try:
            session = self.sidecar.attach(request.client_name or context.peer())
        except ServiceError as e:
            abort(context, e)
        ended = threading.Event()
        context.add_callback(ended.set)
        try:
            st = self.sidecar.state()
            yield pb.AttachResponse(
                session=pb.Session(
                    session_id=session.session_id,
                    slab=descriptor_to_proto(session.slab),
                    generation=st.generation,
                    weights_path=st.weights_path,
                    fingerprint=st.fingerprint,
                )
            )
            while not ended.wait(self.heartbeat_s) and not self.stopping.is_set():
                yield pb.AttachResponse(heartbeat=pb.Heartbeat(generation=self.sidecar.cache.generation))
        finally:
            self.sidecar.detach(session.session_id)

    def PreparePlans(self, request: pb.PreparePlansRequest, context: grpc.ServicerContext) -> pb.PreparePlansResponse:
        keys = [PlanKey(tuple(k.timestep_bits)) for k in request.plan_keys]
        try:
            lease = self.sidecar.prepare(request.session_id, request.generation, keys)
        except ServiceError as e:
            abort(context, e)
        log.debug("request %s: lease %d %s", request.request_id, lease.lease_id, lease.report)
        return pb.PreparePlansResponse(
            lease_id=lease.lease_id,
            slots=list(lease.slots),
            generation=lease.generation,
            report=to_proto(lease.report, pb.CacheReport),
        )

    def ReleasePlans(self, request: pb.ReleasePlansRequest, context: grpc.ServicerContext) -> pb.ReleasePlansResponse:
        try:
            self.sidecar.release(request.session_id, request.lease_id)
        except ServiceError as e:
            abort(context, e)
        return pb.ReleasePlansResponse()

    def GetState(self, request: pb.GetStateRequest, context: grpc.ServicerContext) -> pb.GetStateResponse:
        st = self.sidecar.state()
        return pb.GetStateResponse(
            generation=st.generation,
            weights_path=st.weights_path,
            fingerprint=st.fingerprint,
            leases_held=st.leases_held,
            session_attached=st.session is not None,
            stats=stats_to_proto(st.stats),
            serving=st.serving,
            not_serving_reason=st.not_serving_reason,
            pending_weights_path=st.pending_weights_path,
        )

    def PrepareWeightUpdate(
        self, request: pb.PrepareWeightUpdateRequest, context: grpc.ServicerContext
    ) -> pb.PrepareWeightUpdateResponse:
        try:
            source = self.sidecar.prepare_update(request.from_generation, request.weights_path)
        except (ServiceError, CheckpointError) as e:
            abort(context, e)
        return pb.PrepareWeightUpdateResponse(fingerprint=source.fingerprint)

    def CommitWeightUpdate(
        self, request: pb.CommitWeightUpdateRequest, context: grpc.ServicerContext
    ) -> pb.CommitWeightUpdateResponse:
        try:
            generation, fingerprint = self.sidecar.commit_update(request.from_generation, request.weights_path)
        except (ServiceError, CheckpointError, StateFileError, OSError) as e:
            abort(context, e)
        return pb.CommitWeightUpdateResponse(generation=generation, fingerprint=fingerprint)

    def AbortWeightUpdate(
        self, request: pb.AbortWeightUpdateRequest, context: grpc.ServicerContext
    ) -> pb.AbortWeightUpdateResponse:
        self.sidecar.abort_update(request.weights_path)
        return pb.AbortWeightUpdateResponse()


class SidecarServer:
    """A running sidecar: the grpc server over an assembled `Sidecar`, its health, the stop event."""

    def __init__(
        self,
        sidecar: Sidecar,
        health: SidecarHealth,
        registry: CollectorRegistry,
        address: str,
        heartbeat_s: float = 1.0,
        metrics_port: int | None = None,
    ) -> None:
        self.sidecar = sidecar
        self.health = health
        self.registry = registry
        self.stopping = threading.Event()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="plancache"),
            interceptors=[RpcMetrics(self.registry, "ditserve_plancache")],
            options=SERVER_OPTIONS,
        )
        pb_grpc.add_PlanCacheServicer_to_server(PlanCacheServicer(sidecar, heartbeat_s, self.stopping), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(health.servicer, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        self.socket_path: Path | None = None
        if address.startswith("unix:"):
            self.socket_path = Path(address[len("unix:") :])
            if self.socket_path.exists():
                self.socket_path.unlink()  # a stale socket from a crashed sidecar
        self.metrics_port = metrics_port
        self.metrics: MetricsServer | None = None
        self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        self.address = address

    def start(self) -> None:
        self.metrics = MetricsServer(self.registry, self.metrics_port)
        self.server.start()
        self.health.server_up(True)
        log.info("plancache sidecar listening on %s", self.address)

    def set_serving(self, serving: bool) -> None:
        """Whether the server accepts work; health also needs the sidecar to serve plans."""
        self.health.server_up(serving)

    def stop(self, grace_s: float = 5.0) -> None:
        """Graceful stop: NOT_SERVING, end sessions, stop the server, remove shm files and socket."""
        self.set_serving(False)
        self.stopping.set()
        self.server.stop(grace_s).wait()
        if self.metrics is not None:
            self.metrics.close()
        self.sidecar.cache.close()
        if self.socket_path is not None:
            for leftover in (self.socket_path, Path(f"{self.socket_path}.shm-files")):
                if leftover.exists():
                    os.unlink(leftover)
        log.info("plancache sidecar stopped")
