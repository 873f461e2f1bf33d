"""The generator's link to its plan-cache sidecar: session, slab mapping, leases.

A background thread holds the Attach stream open (the session), maps the slab once per
attachment (a read-only /dev/shm mapping on cpu, the CUDA IPC handle on cuda), and
reconnects by itself when the sidecar goes away. Every attachment bumps `epoch`; a lease
from an older epoch is dead, and a request holding one fails UNAVAILABLE.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from ditcore.plans import PlanKey
from ditcore.report import CacheReport
from ditruntime.convert import from_proto
from ditruntime.rpc_errors import error_info
from ditruntime.slab import (
    COL_GENERATION,
    COL_LENGTH,
    COL_STATE,
    READY,
    ROW_WORDS,
    SlabDescriptor,
    descriptor_from_proto,
    map_slab,
)
from protos.ditserve.plancache.v1 import plancache_pb2 as pb
from protos.ditserve.plancache.v1 import plancache_pb2_grpc as pb_grpc

from .errors import LeaseCheckError, SidecarError, SidecarUnavailableError

log = logging.getLogger(__name__)

_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass(frozen=True)
class Attachment:
    """One live session: its id, the mapped slab and table, and what the sidecar serves."""

    epoch: int
    session_id: str
    descriptor: SlabDescriptor
    slab: torch.Tensor  # (S, W, P), read-only view
    table: torch.Tensor  # (S, ROW_WORDS + W) int64, read-only view
    generation: int
    weights_path: str
    fingerprint: str
    keepalive: Any = None  # mmaps backing the CPU views


def sidecar_error(err: grpc.RpcError) -> Exception:
    """A sidecar RpcError as a generator error with the same status code."""
    code = err.code()
    if code in _UNAVAILABLE:
        return SidecarUnavailableError(f"plan-cache sidecar unavailable: {err.details()}")
    reason, meta = error_info(err)
    return SidecarError(code.name, reason, err.details() or code.name, meta)


class RemoteLease:
    """A lease on the sidecar's slab; implements ditcore's PlanLease."""

    def __init__(
        self,
        link: SidecarLink,
        att: Attachment,
        lease_id: int,
        keys: Sequence[PlanKey],
        slots: Sequence[int],
        report: CacheReport,
        generation: int,
    ) -> None:
        self._link = link
        self.att = att
        self.lease_id = lease_id
        self.keys = list(keys)
        self.slots = list(slots)
        self.report = report
        self.generation = generation
        self._released = False

    @property
    def epoch(self) -> int:
        return self.att.epoch

    def check_rows(self) -> None:
        """Every leased row must be READY, of this lease's generation, holding its key."""
        for key, slot in zip(self.keys, self.slots, strict=True):
            if not 0 <= slot < self.att.descriptor.num_slots:
                raise LeaseCheckError(f"lease {self.lease_id}: slot {slot} is outside the slab")
            row = self.att.table[slot].tolist()
            words = row[ROW_WORDS : ROW_WORDS + key.width]
            if (
                row[COL_STATE] != READY
                or row[COL_GENERATION] != self.generation
                or row[COL_LENGTH] != key.width
                or tuple(words) != key.bits
            ):
                raise LeaseCheckError(
                    f"lease {self.lease_id}: slot {slot} row {row[:ROW_WORDS]} does not hold plan {key} "
                    f"of generation {self.generation}"
                )

    def pages(self, step: int) -> torch.Tensor:
        return self.att.slab[self.slots[step], : self.keys[step].width]

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._link.release(self)


class SidecarLink:
    """Keeps a session with the sidecar; `prepare` / `release` plan leases over it."""

    def __init__(
        self,
        target: str,
        device: torch.device,
        reconnect_s: float = 0.5,
        on_attach: Callable[[Attachment], None] | None = None,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.target = target
        self.device = device
        self.reconnect_s = reconnect_s
        self._on_attach = on_attach
        self._on_change = on_change
        self._lock = threading.Lock()
        self._att: Attachment | None = None
        self._epoch = 0
        self._stop = threading.Event()
        self._stream: Any = None
        self.last_error = ""
        self._channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.max_receive_message_length", 16 * 1024 * 1024),
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_permit_without_calls", 1),
                # gRPC's default reconnect backoff grows to 120 s: after a long sidecar outage the
                # generator would reattach up to minutes late. Cap it near our own retry pause.
                ("grpc.max_reconnect_backoff_ms", max(1000, int(reconnect_s * 2000))),
            ],
        )
        self._stub = pb_grpc.PlanCacheStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="sidecar-link", daemon=True)

    # ---------------------------------------------------------------- lifecycle
    def set_on_change(self, cb: Callable[[bool], None] | None) -> None:
        self._on_change = cb

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Idempotent: end the session and the channel."""
        if self._stop.is_set():
            return
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        self._thread.join(timeout=5)
        self._channel.close()

    def wait_attached(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while self._att is None and time.monotonic() < end:
            time.sleep(0.02)
        return self._att is not None

    @property
    def attachment(self) -> Attachment | None:
        return self._att

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
        if msg != self.last_error:
            log.warning("%s", msg)
        self.last_error = msg

    def _attach(self, session: pb.Session) -> None:
        desc = descriptor_from_proto(session.slab)
        slab, table, maps = map_slab(desc)
        with self._lock:
            self._epoch += 1
            att = Attachment(
                self._epoch, session.session_id, desc, slab, table,
                session.generation, session.weights_path, session.fingerprint, maps,
            )  # fmt: skip
        if self._on_attach is not None:
            self._on_attach(att)  # may load weights; raising keeps us detached
        self._att = att
        self.last_error = ""
        log.info("attached to sidecar %s (session %s, generation %d)", self.target, att.session_id, att.generation)
        if self._on_change is not None:
            self._on_change(True)

    def _detach(self) -> None:
        was = self._att
        self._att = None
        self._stream = None
        if was is not None:
            log.warning("sidecar session %s ended", was.session_id)
            if self._on_change is not None:
                self._on_change(False)

    # ---------------------------------------------------------------- leases
    def prepare(self, keys: Sequence[PlanKey], generation: int, request_id: str) -> RemoteLease:
        att = self._att
        if att is None:
            raise SidecarUnavailableError(f"not attached to the plan-cache sidecar at {self.target}: {self.last_error}")
        req = pb.PreparePlansRequest(
            session_id=att.session_id,
            generation=generation,
            plan_keys=[pb.PlanKey(timestep_bits=list(k.bits)) for k in keys],
            request_id=request_id,
        )
        try:
            resp = self._stub.PreparePlans(req, timeout=600)
        except grpc.RpcError as e:
            raise sidecar_error(e) from e
        lease = RemoteLease(
            self, att, resp.lease_id, keys, resp.slots, from_proto(resp.report, CacheReport), resp.generation
        )
        if len(lease.slots) != len(keys):
            lease.release()
            raise LeaseCheckError(f"lease {resp.lease_id}: {len(resp.slots)} slots for {len(keys)} steps")
        return lease

    # ---------------------------------------------------------------- weight updates
    def prepare_update(self, from_generation: int, weights_path: str) -> str:
        try:
            resp = self._stub.PrepareWeightUpdate(
                pb.PrepareWeightUpdateRequest(from_generation=from_generation, weights_path=weights_path), timeout=120
            )
        except grpc.RpcError as e:
            raise sidecar_error(e) from e
        return str(resp.fingerprint)

    def commit_update(self, from_generation: int, weights_path: str, timeout_s: float) -> tuple[int, str]:
        """Raises grpc.RpcError as is: the caller must tell 'refused' from 'outcome unknown'."""
        resp = self._stub.CommitWeightUpdate(
            pb.CommitWeightUpdateRequest(from_generation=from_generation, weights_path=weights_path), timeout=timeout_s
        )
        return int(resp.generation), str(resp.fingerprint)

    def abort_update(self, weights_path: str) -> None:
        try:
            self._stub.AbortWeightUpdate(pb.AbortWeightUpdateRequest(weights_path=weights_path), timeout=10)
        except grpc.RpcError as e:
            log.warning("AbortWeightUpdate failed: %s", e.details())

    def adopt(self, generation: int, weights_path: str, fingerprint: str) -> None:
        """The committed update: same session and slab, new generation and weights."""
        att = self._att
        if att is not None:
            self._att = dataclasses.replace(
                att, generation=generation, weights_path=weights_path, fingerprint=fingerprint
            )

    def reattach(self) -> None:
        """Drop the session; the link thread attaches again and learns the sidecar's truth."""
        self._detach()
        stream = self._stream
        if stream is not None:
            stream.cancel()

    def release(self, lease: RemoteLease) -> None:
        """Best effort: a lease of a dead session is already gone at the sidecar."""
        att = self._att
        if att is None or att.epoch != lease.epoch:
            return
        try:
            self._stub.ReleasePlans(
                pb.ReleasePlansRequest(session_id=att.session_id, lease_id=lease.lease_id), timeout=10
            )
        except grpc.RpcError as e:
            log.warning("release of lease %d failed: %s", lease.lease_id, e.details())
