"""The generator's gRPC client of its plan-cache sidecar: the one generator module outside the
adapter and the assembly that imports grpc. Implements `sidecar_port.SidecarSession` and maps
every RpcError to a domain error here, with one set of "the answer was lost" status codes.

A background thread holds the Attach stream open (the session), maps the slab once per
attachment (a read-only /dev/shm mapping on cpu, the CUDA IPC handle on cuda), and reconnects
by itself when the sidecar goes away; the serving state follows the session. Before it maps
anything it checks the descriptor (every field) and that the slab is on the model's device (by
GPU UUID on cuda): a slab on another GPU is refused before its IPC handle is opened.

Every PreparePlans is tagged "<request id>#<n>" (n counts this client's calls, so the tag is unique even when
request ids repeat); when its answer is lost after it was sent (the client's deadline passed, the call was cancelled,
the connection dropped), the client releases whatever it may have granted by that tag, best effort, so no lease is
left held by a live session that never heard of it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import torch

from ditcore.plans import PlanKey
from ditcore.report import CacheReport
from ditruntime.auth import bearer_metadata
from ditruntime.convert import from_proto
from ditruntime.errors import GenerationMismatchError, ServiceError
from ditruntime.rpc_errors import error_info
from ditruntime.slab import SlabMapping, descriptor_from_proto
from protos.ditserve.plancache.v1 import plancache_pb2 as pb
from protos.ditserve.plancache.v1 import plancache_pb2_grpc as pb_grpc

from ..errors import CommitOutcomeUnknownError, LeaseCheckError, SidecarError, SidecarUnavailableError
from .sidecar_port import NOT_ATTACHED, AdapterSpec, AttachedState, Attachment, Committed, RemoteLease, SidecarSession

log = logging.getLogger(__name__)

# The call may not have reached the sidecar, or its answer was lost: the sidecar is unavailable
# (retry after reattaching), and a commit's outcome is unknown.
ANSWER_LOST = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN}
)

# A PreparePlans that failed with one of these may still have granted a lease: release it by its tag.
PREPARE_ANSWER_LOST = frozenset(
    {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE}
)
PREPARE_TIMEOUT_S = 600.0
"""The PreparePlans deadline: above any rebuild pass (one streaming read of the plan tensors)."""


def domain_error(err: grpc.RpcError, sent_generation: int | None = None, field: str = "generation") -> ServiceError:
    """A sidecar RpcError as a generator domain error (the status the client sees is its own)."""
    code = err.code()
    if code in ANSWER_LOST:
        return SidecarUnavailableError(f"plan-cache sidecar unavailable: {err.details()}")
    reason, meta = error_info(err)
    current = meta.get("current_generation", "")
    if reason == GenerationMismatchError.reason and sent_generation is not None and current.isdigit():
        return GenerationMismatchError(int(current), sent_generation, field)
    return SidecarError(code.name, reason, err.details() or code.name, meta)


def _channel(target: str, reconnect_s: float, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    options = [
        ("grpc.max_receive_message_length", 16 * 1024 * 1024),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # gRPC's default reconnect backoff grows to 120 s: after a long sidecar outage the
        # generator would reattach up to minutes late. Cap it near our own retry pause.
        ("grpc.max_reconnect_backoff_ms", max(1000, int(reconnect_s * 2000))),
    ]
    if credentials is not None:
        return grpc.secure_channel(target, credentials, options=options)
    return grpc.insecure_channel(target, options=options)


class SidecarClient(SidecarSession):
    """Keeps a session with the sidecar at `target`; `on_attach` vets each attachment (may raise).

    `device` is the model's (`--device`): a slab elsewhere is refused before it is mapped or its IPC
    handle opened (`ditruntime.slab.check_device`). None skips that early check (`on_attach` still
    checks the mapped slab); the generator always passes it.

    A TCP sidecar needs `credentials` (mutual TLS); its weight-update RPCs then carry
    `admin_token` as `authorization: Bearer` metadata. A unix socket needs neither (the sidecar
    checks this process's uid). `prepare_timeout_s` is the PreparePlans deadline (tests shorten it). `map_slab`
    False: another node's sidecar, whose slabs are not mapped here (generator_service.backends.node_sidecars)."""

    def __init__(
        self,
        target: str,
        reconnect_s: float,
        on_attach: Callable[[Attachment], None],
        state: AttachedState,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        admin_token: str = "",
        device: torch.device | None = None,
        prepare_timeout_s: float = PREPARE_TIMEOUT_S,
        map_slab: bool = True,
    ) -> None:
        self.target = target
        self.map_slab = map_slab
        """False for another node's sidecar (a replica across nodes): its slabs are that node's ranks' to map; this
        client leases and updates only."""
        self.prepare_timeout_s = prepare_timeout_s
        self._calls = itertools.count(1)  # numbers each PreparePlans' tag
        self.device = device
        self._admin_metadata = bearer_metadata(admin_token) if credentials is not None and admin_token else None
        self.reconnect_s = reconnect_s
        self._on_attach = on_attach
        self._state = state
        self._lock = threading.Lock()
        self._att: Attachment | None = None
        self._mapping: SlabMapping | None = None  # the latest mapped slab (released on detach)
        self._mapping_session = ""  # the session `_mapping` belongs to
        self.last_closed: tuple[str, bool] | None = None  # (session, its storage freed) of the last old mapping
        self._epoch = 0
        self._stop = threading.Event()
        self._stream: Any = None  # the Attach call (a grpc iterator that can be cancelled)
        self._last_error = ""
        self._channel = _channel(target, reconnect_s, credentials)
        self._stub = pb_grpc.PlanCacheStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="sidecar-link", daemon=True)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._channel.close()

    def wait_attached(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while self._att is None and time.monotonic() < end:
            time.sleep(0.02)
        return self._att is not None

    @property
    def attachment(self) -> Attachment | None:
        return self._att

    @property
    def last_error(self) -> str:
        return self._last_error

    def _run(self) -> None:
        client = f"generator@{socket.gethostname()}:{os.getpid()}"
        while not self._stop.is_set():
            try:
                self._stream = self._stub.Attach(pb.AttachRequest(client_name=client), wait_for_ready=False)
                first = next(self._stream)
                self._attach(first.session)
                for msg in self._stream:
                    if msg.HasField("heartbeat"):
                        continue
            except grpc.RpcError as e:
                if not self._stop.is_set():
                    self._note_error(f"sidecar {self.target}: {e.code().name}: {e.details()}")
            except Exception as e:  # mapping or model load failed: stay detached, retry
                self._note_error(f"attach to {self.target} failed: {e}")
                log.exception("attach failed")
            finally:
                self._detach()
            self._stop.wait(self.reconnect_s)

    def _note_error(self, msg: str) -> None:
        if msg != self._last_error:
            log.warning("%s", msg)
        self._last_error = msg

    def _attach(self, session: pb.Session) -> None:
        old, self._mapping = self._mapping, None
        if old is not None:  # a sidecar restart: unmap the old slab before mapping the new one
            self._close_old(old)
        slabs = tuple(descriptor_from_proto(d) for d in session.slabs) or (descriptor_from_proto(session.slab),)
        if self.map_slab:  # validates every field, then the device, before anything is mapped or opened
            self._mapping = SlabMapping.open(descriptor_from_proto(session.slab), self.device)
            self._mapping_session = session.session_id
        with self._lock:
            self._epoch += 1
            att = Attachment(
                self._epoch, session.session_id, self._mapping,
                session.generation, session.weights_path, session.fingerprint, slabs,
            )  # fmt: skip
        self._on_attach(att)  # may load weights; raising keeps us detached
        self._att = att
        self._last_error = ""
        log.info("attached to sidecar %s (session %s, generation %d)", self.target, att.session_id, att.generation)
        self._state.set_attached(True)

    def _close_old(self, old: SlabMapping) -> None:
        """Close the previous session's mapping; logged either way (scripts/gpu_check.py reads the log)."""
        freed = old.close()
        self.last_closed = (self._mapping_session, freed)
        if freed:
            log.info("closed the slab mapping of session %s: its storage is freed", self._mapping_session)
        else:
            log.warning("the slab mapping of session %s is still referenced after close", self._mapping_session)

    def _detach(self) -> None:
        was = self._att
        self._att = None
        self._stream = None
        if self._mapping is not None:  # readers of the old session fail from here on
            self._mapping.release()
        if was is not None:
            log.warning("sidecar session %s ended", was.session_id)
            self._state.set_attached(False)

    # ---------------------------------------------------------------- leases
    def prepare(
        self,
        keys: Sequence[PlanKey],
        generation: int,
        request_id: str,
        step_bound_s: float = 0.0,
        adapters: Sequence[AdapterSpec] = (),
    ) -> RemoteLease:
        att = self._att
        if att is None:
            raise SidecarUnavailableError(NOT_ATTACHED)  # its address and the cause: in the log, not to clients
        tag = f"{request_id}#{next(self._calls)}"
        req = pb.PreparePlansRequest(
            session_id=att.session_id,
            generation=generation,
            plan_keys=[
                pb.PlanKey(timestep_bits=list(k.bits), partition=k.partition, adapters=k.adapters) for k in keys
            ],
            request_id=tag,
            step_bound_s=step_bound_s,
            adapters=[pb.AdapterSpec(name=a.name, identity=a.identity, scale=a.scale) for a in adapters],
        )
        try:
            resp = self._stub.PreparePlans(req, timeout=self.prepare_timeout_s)
        except grpc.RpcError as e:
            if e.code() in PREPARE_ANSWER_LOST:
                self._release_tag(att, tag, e.code())
            raise domain_error(e, generation) from e
        report = from_proto(resp.report, CacheReport)
        lease = RemoteLease(self, att, resp.lease_id, keys, resp.slots, report, resp.generation)
        if len(lease.slots) != len(keys):
            lease.release()
            raise LeaseCheckError(f"lease {resp.lease_id}: {len(resp.slots)} slots for {len(keys)} steps")
        return lease

    def _release_tag(self, att: Attachment, tag: str, why: grpc.StatusCode) -> None:
        """Best effort: end any lease the lost PreparePlans `tag` granted (the sidecar also refuses it if still running;
        a session that ended took its leases with it)."""
        try:
            self._stub.ReleasePlans(pb.ReleasePlansRequest(session_id=att.session_id, request_id=tag), timeout=10)
            log.info("PreparePlans %s: %s; released by its request id", tag, why.name)
        except grpc.RpcError as e:
            log.debug("PreparePlans %s: %s; release by request id failed: %s", tag, why.name, e.details())

    def release(self, lease: RemoteLease) -> None:
        att = self._att
        if att is None or att.epoch != lease.epoch:
            return
        try:
            self._stub.ReleasePlans(
                pb.ReleasePlansRequest(session_id=att.session_id, lease_id=lease.lease_id), timeout=10
            )
        except grpc.RpcError as e:
            log.warning("release of lease %d failed: %s", lease.lease_id, e.details())

    # ---------------------------------------------------------------- weight updates
    def prepare_update(self, from_generation: int, weights_path: str) -> str:
        req = pb.PrepareWeightUpdateRequest(from_generation=from_generation, weights_path=weights_path)
        try:
            resp = self._stub.PrepareWeightUpdate(req, timeout=120, metadata=self._admin_metadata)
        except grpc.RpcError as e:
            raise domain_error(e, from_generation, "from_generation") from e
        return str(resp.fingerprint)

    def commit_update(self, from_generation: int, weights_path: str, timeout_s: float) -> Committed:
        req = pb.CommitWeightUpdateRequest(from_generation=from_generation, weights_path=weights_path)
        try:
            resp = self._stub.CommitWeightUpdate(req, timeout=timeout_s, metadata=self._admin_metadata)
        except grpc.RpcError as e:
            if e.code() in ANSWER_LOST:
                raise CommitOutcomeUnknownError(e.code().name) from e
            raise domain_error(e, from_generation, "from_generation") from e
        return Committed(int(resp.generation), str(resp.fingerprint), tuple(resp.kept_partitions))

    def abort_update(self, weights_path: str) -> None:
        try:
            self._stub.AbortWeightUpdate(
                pb.AbortWeightUpdateRequest(weights_path=weights_path), timeout=10, metadata=self._admin_metadata
            )
        except grpc.RpcError as e:
            log.warning("AbortWeightUpdate failed: %s", e.details())

    def adopt(self, generation: int, weights_path: str, fingerprint: str) -> None:
        att = self._att
        if att is not None:
            self._att = dataclasses.replace(
                att, generation=generation, weights_path=weights_path, fingerprint=fingerprint
            )

    def reattach(self) -> None:
        stream = self._stream  # read before _detach clears it: cancelling ends the session
        self._detach()
        if stream is not None:
            stream.cancel()
