"""The sidecar's gRPC adapter: PlanCache servicer, health, reflection, graceful stop.

Thin: converts proto <-> core objects and maps errors through `ditruntime.rpc_errors`.
Health is derived in one place (`SidecarHealth`). Listens on a unix socket in a 0700
directory by default, whose peers must run as the sidecar's uid (`ditruntime.peercred.UdsRelay`
checks SO_PEERCRED at accept; `CallGuard` refuses calls that did not come through it). TCP is
opt-in and only with mutual TLS; there the weight-update RPCs also need the admin token.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from ditcore.adapter_contract import AdapterError, AdapterNotFoundError
from ditcore.checkpoint_files import CheckpointError
from ditcore.plans import PARTITION_CODES, PlanKey
from ditruntime.auth import LOOPBACK, check_bearer
from ditruntime.convert import to_proto
from ditruntime.decode_guard import DecodeGuard
from ditruntime.errors import ServiceError
from ditruntime.obs import MetricsServer, RpcMetrics
from ditruntime.peercred import PeerCred, PeerRefusedError, UdsRelay
from ditruntime.rpc_errors import abort
from ditruntime.slab import descriptor_to_proto
from protos.ditserve.plancache.v1 import plancache_pb2 as pb
from protos.ditserve.plancache.v1 import plancache_pb2_grpc as pb_grpc

from .cache import CacheStats, PartitionState
from .errors import InvalidPlanRequestError
from .sidecar import Sidecar

_DIGEST = re.compile(r"[0-9a-f]{64}")
"""An adapters digest as plan keys carry it (ditcore.adapter_plans.modulation_digest)."""
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


class CallGuard:
    """Who may call. On the unix socket (`relay` set): a connection the relay admitted, i.e. whose
    peer runs as the sidecar's uid; its credentials are returned. Over TCP (`relay` None): mutual
    TLS already verified the client's certificate; the weight-update RPCs also need the admin
    token (`admin_token` not None; empty refuses them all)."""

    def __init__(self, relay: UdsRelay | None, admin_token: str | None) -> None:
        self.relay = relay
        self.admin_token = admin_token

    def peer(self, context: grpc.ServicerContext) -> PeerCred | None:
        if self.relay is None:
            return None
        cred = self.relay.peer(context.peer())
        if cred is None:  # reached the private socket some other way: refuse
            abort(context, PeerRefusedError("the call did not come through the sidecar's checked unix socket"))
        return cred

    def admin(self, context: grpc.ServicerContext, what: str) -> None:
        self.peer(context)
        if self.admin_token is None:
            return  # the unix socket: the peer's uid is the credential
        try:
            check_bearer(self.admin_token, dict(context.invocation_metadata()).get("authorization"), what)
        except ServiceError as e:
            log.warning("refused %s from %s: %s", what, context.peer(), e)
            abort(context, e)


class PlanCacheServicer(pb_grpc.PlanCacheServicer):
    def __init__(
        self, sidecar: Sidecar, heartbeat_s: float, stopping: threading.Event, guard: CallGuard | None = None
    ) -> None:
        self.sidecar = sidecar
        self.heartbeat_s = heartbeat_s
        self.stopping = stopping
        self.guard = guard or CallGuard(None, None)
        self.session_peers: dict[str, PeerCred] = {}
        """The kernel's credentials (pid, uid, gid) of each live session's peer (unix socket only)."""

    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> Iterator[pb.AttachResponse]:
        peer = self.guard.peer(context)
        try:
            session = self.sidecar.attach(
                request.client_name or context.peer(), peer_pid=peer.pid if peer is not None and peer.pid > 0 else None
            )  # pid 0: the peer is in a pid namespace this one cannot see
        except ServiceError as e:
            abort(context, e)
        if peer is not None:
            self.session_peers[session.session_id] = peer
            log.info("session %s: peer pid %d uid %d", session.session_id, peer.pid, peer.uid)
        ended = threading.Event()
        context.add_callback(ended.set)
        try:
            st = self.sidecar.state()
            yield pb.AttachResponse(
                session=pb.Session(
                    session_id=session.session_id,
                    slab=descriptor_to_proto(session.slab),
                    slabs=[descriptor_to_proto(d) for d in session.slabs],
                    generation=st.generation,
                    weights_path=st.weights_path,
                    fingerprint=st.fingerprint,
                    partitions=partitions_to_proto(st.partitions),
                )
            )
            while not ended.wait(self.heartbeat_s) and not self.stopping.is_set():
                yield pb.AttachResponse(heartbeat=pb.Heartbeat(generation=self.sidecar.cache.generation))
        finally:
            self.sidecar.detach(session.session_id)
            self.session_peers.pop(session.session_id, None)

    def PreparePlans(self, request: pb.PreparePlansRequest, context: grpc.ServicerContext) -> pb.PreparePlansResponse:
        self.guard.peer(context)
        try:
            keys = plan_keys_from(request.plan_keys)
            lease = self.sidecar.prepare(
                request.session_id, request.generation, keys, request.step_bound_s, request.request_id,
                request.adapters,
            )  # fmt: skip
        except (ServiceError, AdapterError, AdapterNotFoundError) as e:
            abort(context, e)
        log.debug(
            "request %s: lease %d (step bound %g s) %s",
            request.request_id, lease.lease_id, request.step_bound_s, lease.report,
        )  # fmt: skip
        return pb.PreparePlansResponse(
            lease_id=lease.lease_id,
            slots=list(lease.slots),
            generation=lease.generation,
            report=to_proto(lease.report, pb.CacheReport),
        )

    def ReleasePlans(self, request: pb.ReleasePlansRequest, context: grpc.ServicerContext) -> pb.ReleasePlansResponse:
        self.guard.peer(context)
        try:
            if request.request_id and request.lease_id:
                raise InvalidPlanRequestError("request_id", "give lease_id or request_id, not both")
            if request.request_id:
                self.sidecar.release_request(request.session_id, request.request_id)
            else:
                self.sidecar.release(request.session_id, request.lease_id)
        except ServiceError as e:
            abort(context, e)
        return pb.ReleasePlansResponse()

    def GetState(self, request: pb.GetStateRequest, context: grpc.ServicerContext) -> pb.GetStateResponse:
        self.guard.peer(context)
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
            partitions=partitions_to_proto(st.partitions),
        )

    def PrepareWeightUpdate(
        self, request: pb.PrepareWeightUpdateRequest, context: grpc.ServicerContext
    ) -> pb.PrepareWeightUpdateResponse:
        self.guard.admin(context, "PrepareWeightUpdate")
        try:
            source = self.sidecar.prepare_update(request.from_generation, request.weights_path)
        except (ServiceError, CheckpointError) as e:
            abort(context, e)
        return pb.PrepareWeightUpdateResponse(fingerprint=source.fingerprint)

    def CommitWeightUpdate(
        self, request: pb.CommitWeightUpdateRequest, context: grpc.ServicerContext
    ) -> pb.CommitWeightUpdateResponse:
        self.guard.admin(context, "CommitWeightUpdate")
        try:
            done = self.sidecar.commit_update(request.from_generation, request.weights_path)
        except (ServiceError, CheckpointError, OSError) as e:  # a state file that cannot be written: StateFileError
            abort(context, e)
        return pb.CommitWeightUpdateResponse(
            generation=done.generation, fingerprint=done.fingerprint, kept_partitions=list(done.kept_partitions)
        )

    def AbortWeightUpdate(
        self, request: pb.AbortWeightUpdateRequest, context: grpc.ServicerContext
    ) -> pb.AbortWeightUpdateResponse:
        self.guard.admin(context, "AbortWeightUpdate")
        self.sidecar.abort_update(request.weights_path)
        return pb.AbortWeightUpdateResponse()


class SidecarServer:
    """A running sidecar: the grpc server over an assembled `Sidecar`, its health, the stop event.

    `address` 'unix:PATH': the public socket is a `UdsRelay` (peer uid checked) in front of the
    grpc server's private socket. 'HOST:PORT': TCP, only with `tls` (mutual TLS server
    credentials); the weight-update RPCs then also need `admin_token` (empty: refused)."""

    def __init__(
        self,
        sidecar: Sidecar,
        health: SidecarHealth,
        registry: CollectorRegistry,
        address: str,
        heartbeat_s: float = 1.0,
        metrics_port: int | None = None,
        *,
        tls: grpc.ServerCredentials | None = None,
        admin_token: str = "",
        metrics_host: str = LOOPBACK,
        reflection: bool = True,
    ) -> None:
        self.sidecar = sidecar
        self.metrics_host = metrics_host
        self.reflection = reflection
        self.health = health
        self.registry = registry
        self.stopping = threading.Event()
        self.socket_path: Path | None = None
        self.relay: UdsRelay | None = None
        if address.startswith("unix:"):
            self.socket_path = Path(address[len("unix:") :])
            self.relay = UdsRelay(self.socket_path)  # replaces a stale socket from a crashed sidecar
        elif tls is None:
            raise ValueError(f"--listen {address}: TCP needs mutual TLS (--tls-cert, --tls-key, --tls-client-ca)")
        try:
            self._build(address, heartbeat_s, tls, admin_token)
        except BaseException:
            if self.relay is not None:
                self.relay.close()
            raise
        self.metrics_port = metrics_port
        self.metrics: MetricsServer | None = None
        self.address = address

    def _build(self, address: str, heartbeat_s: float, tls: grpc.ServerCredentials | None, admin_token: str) -> None:
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="plancache"),
            interceptors=[RpcMetrics(self.registry, "ditserve_plancache"), DecodeGuard()],
            options=SERVER_OPTIONS,
        )
        guard = CallGuard(self.relay, None if self.relay is not None else admin_token)
        self.servicer = PlanCacheServicer(self.sidecar, heartbeat_s, self.stopping, guard)
        pb_grpc.add_PlanCacheServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self.server)
        if self.reflection:
            reflection.enable_server_reflection(
                (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
                self.server,
            )
        if self.relay is not None:
            self.port = self.server.add_insecure_port(self.relay.backend_address)  # private: 0700 dir
        else:
            assert tls is not None
            self.port = self.server.add_secure_port(address, tls)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")

    def session_peer(self, session_id: str) -> PeerCred | None:
        """The kernel's credentials of a live session's peer (unix socket; None over TCP)."""
        return self.servicer.session_peers.get(session_id)

    def start(self) -> None:
        self.metrics = MetricsServer(self.registry, self.metrics_port, self.metrics_host)
        self.server.start()
        if self.relay is not None:
            self.relay.start()
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
        if self.relay is not None:
            self.relay.close()
        if self.metrics is not None:
            self.metrics.close()
        self.sidecar.cache.close()
        if self.socket_path is not None:
            for leftover in (self.socket_path, Path(f"{self.socket_path}.shm-files")):
                if leftover.exists():
                    os.unlink(leftover)
        log.info("plancache sidecar stopped")


def plan_keys_from(messages: Iterable[pb.PlanKey]) -> list[PlanKey]:
    """PreparePlans' keys; InvalidPlanRequestError naming `plan_keys[i].partition` for an unknown partition."""
    keys = []
    for i, k in enumerate(messages):
        partition = k.partition or "base"
        if partition not in PARTITION_CODES:
            raise InvalidPlanRequestError(
                f"plan_keys[{i}].partition",
                f"must be one of {', '.join(PARTITION_CODES)} (empty: base), got {k.partition!r}",
            )
        if k.adapters and not _DIGEST.fullmatch(k.adapters):
            raise InvalidPlanRequestError(
                f"plan_keys[{i}].adapters", "must be empty or a sha256 digest (64 hex digits)"
            )
        keys.append(PlanKey(tuple(k.timestep_bits), partition, k.adapters))
    return keys


def partitions_to_proto(parts: Iterable[PartitionState]) -> list[pb.Partition]:
    return [
        pb.Partition(
            name=p.name,
            folder=p.folder,
            fingerprint=p.fingerprint,
            slots_ready=p.slots_ready,
            slots_allowed=p.slots_allowed,
        )
        for p in parts
    ]
