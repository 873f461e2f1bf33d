"""The sidecar's core (no gRPC): one generator session over a PlanCache and its leases, whether plans are served,
and the weight generation (its two-phase update and persistence: `updates.WeightUpdates`).

A session is tied to an open Attach stream: `attach()` opens it (refused while another is
live) with a slab export of its own (`SlabMemory.export`), `detach()` retires that export from
the sidecar's books (bookkeeping only: torch keeps a CUDA export's registration until the slab is
freed, a small per-Attach cost, see `SlabMemory.export`), drops an uncommitted update and *retires* the session's leases: their slots stay pinned (never
evicted nor refilled, still readable as slot hits) until the peer process is known to be gone
or its grace has passed, because a vanished session's kernels may still read them
(docs/architecture.md, "The slab and the lease protocol"). The grace is max(`grace_s`,
`grace_steps` x the largest step bound its leases' PreparePlans carried): the generator's bound on
one denoise step of each request, so the wait scales with the requests. Retired leases are reaped lazily,
before every attach, prepare, commit and state query. Plan calls
must name the live session.

No lease outlives its session: a lease is *granted* (recorded for the live session) under the sidecar's lock at the
moment its PreparePlans returns, and detach retires exactly the granted ones. A prepare still running when its session
ends, or whose request id ReleasePlans named meanwhile (the caller gave up on the answer: a client deadline, a dropped
connection), releases its lease at once instead and fails (SessionError, LeaseAbandonedError); `release_request`
releases a granted lease by (session, request id) when its answer was lost (`Sidecar.prepare`).

Weight updates (`updates.WeightUpdates`): `prepare_update` validates the new rebuild source and changes nothing
served; `commit_update` persists (generation + 1, path, digests) first, then invalidates every tier and retargets
rebuilds (docs/architecture.md, "Weight generations and UpdateWeights"). Whether plans are served is one state here
(`serving`); every change of it goes to the `on_serving_change` listener given at construction.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ditcore.plans import PlanKey
from ditcore.sizing import MAX_STEP_BOUND_S
from ditruntime.slab import SlabDescriptor

from .cache import CacheStats, Lease, PartitionState, PlanCache
from .config import SidecarConfig
from .device import SlabExport
from .errors import (
    CheckpointChangedError,
    InvalidPlanRequestError,
    LeaseAbandonedError,
    SessionError,
    UnknownLeaseError,
)
from .rebuild import RebuildSource
from .updates import Committed, UpdateOutcomes, WeightUpdates

log = logging.getLogger(__name__)

DEFAULT_SESSION_GRACE_S = float(next(f.default for f in fields(SidecarConfig) if f.name == "session_grace_s"))  # type: ignore[arg-type]
"""SidecarConfig.session_grace_s's default (`--session-grace-s`)."""
DEFAULT_GRACE_STEPS = float(next(f.default for f in fields(SidecarConfig) if f.name == "session_grace_steps"))  # type: ignore[arg-type]
"""SidecarConfig.session_grace_steps's default (`--session-grace-steps`)."""
MAX_ABANDONED_IDS = 1024
"""Request ids that ReleasePlans named, remembered for the live session so that their PreparePlans, still running or
arriving late, hands out no lease (oldest forgotten first)."""


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    client_name: str
    slabs: tuple[SlabDescriptor, ...]  # this session's descriptors, one per device (on cuda: its own IPC exports)

    @property
    def slab(self) -> SlabDescriptor:
        """The first slab's descriptor (the single-device case)."""
        return self.slabs[0]


@dataclass(frozen=True)
class Grant:
    """A lease handed to the live session: its PreparePlans' request id ("" when none) and step bound (0: unknown)."""

    session_id: str
    request_id: str
    step_bound_s: float


@dataclass(frozen=True)
class RetiredSession:
    """A vanished session whose leases still pin their slots (see the module doc)."""

    session_id: str
    client_name: str
    leases: int
    deadline: float  # on the sidecar's clock: the grace period's end
    peer_pid: int | None  # the peer process, when the transport knows it (unix-socket credentials)
    grace_s: float = 0.0  # max(grace_s, grace_steps x the largest step bound of its leases)


def process_gone(pid: int) -> bool:
    """True when no process `pid` runs any more (or only its zombie: it issues no work). A pid that looks alive
    (possibly reused) is not proof of anything: the grace period still bounds the wait."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


ServingListener = Callable[[bool], None]
"""Told `serving` (True or False) each time the sidecar starts or stops serving plans."""


@dataclass(frozen=True)
class SidecarState:
    generation: int
    weights_path: str
    fingerprint: str
    leases_held: int
    session: SessionInfo | None
    stats: CacheStats
    serving: bool
    not_serving_reason: str
    pending_weights_path: str
    partitions: tuple[PartitionState, ...] = ()


class Sidecar:
    def __init__(
        self,
        cache: PlanCache,
        state_dir: Path | None = None,
        on_serving_change: ServingListener | None = None,
        *,
        grace_s: float = DEFAULT_SESSION_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        peer_gone: Callable[[int], bool] = process_gone,
        grace_steps: float = DEFAULT_GRACE_STEPS,
    ) -> None:
        """`grace_s` (SidecarConfig.session_grace_s): the floor of how long a vanished session's slots stay pinned
        when its process is not known to be gone; `grace_steps` (session_grace_steps): how many of its leases'
        step bounds they stay pinned at least; `clock` and `peer_gone` are injected by tests."""
        self.cache = cache
        self.grace_s = grace_s
        self.grace_steps = grace_steps
        self._grants: dict[int, Grant] = {}  # lease id -> the live session's grant (guarded by `_lock`)
        self._in_flight: dict[str, int] = {}  # session id -> its prepares running now
        self._abandoned: OrderedDict[str, None] = OrderedDict()  # the live session's request ids ReleasePlans named
        self._clock = clock
        self._peer_gone = peer_gone
        self._retired: dict[str, RetiredSession] = {}
        self._peer_pids: dict[str, int] = {}
        self.state_dir = state_dir
        self._on_serving_change = on_serving_change
        self._lock = threading.Lock()
        self._session: SessionInfo | None = None
        self._export: SlabExport | None = None
        self._not_serving = ""
        self.updates = WeightUpdates(cache, state_dir)  # writes the state file (generation, source) first

    # ---------------------------------------------------------------- sessions
    def attach(self, client_name: str, peer_pid: int | None = None) -> SessionInfo:
        """Open the session; `peer_pid` is the peer process when the transport knows it (unix-socket
        credentials), so that its leases end as soon as it is gone once the session vanishes."""
        self.reap()
        with self._lock:
            if self._session is not None:
                raise SessionError(
                    f"a generator session is already attached ({self._session.client_name}); one session at a time"
                )
            export = self.cache.memory.export()
            self._session = SessionInfo(uuid.uuid4().hex, client_name, tuple(export.descriptors))
            self._export = export
            self._abandoned.clear()
            if peer_pid is not None:
                self._peer_pids[self._session.session_id] = peer_pid
            log.info("session %s attached by %s", self._session.session_id, client_name)
            return self._session

    def detach(self, session_id: str, peer_pid: int | None = None) -> int:
        """End the session: close its export (bookkeeping), drop its uncommitted update and retire its granted leases
        (released at once only when its peer process is known to be gone, or `grace_s` is 0). Returns how many leases
        it held. A prepare of this session still running grants nothing: it releases its own lease when it returns.

        `peer_pid` (or the one given to attach) names the peer process; without one the grace period alone decides.
        """
        with self._lock:
            if self._session is None or self._session.session_id != session_id:
                return 0
            client_name = self._session.client_name
            self._session = None  # from here no prepare of this session grants a lease (`_end_prepare`)
            self.updates.discard()
            self._abandoned.clear()
            export, self._export = self._export, None
            pid = peer_pid if peer_pid is not None else self._peer_pids.pop(session_id, None)
            self._peer_pids.pop(session_id, None)
            granted = [i for i, g in self._grants.items() if g.session_id == session_id]
            bound = max((self._grants.pop(i).step_bound_s for i in granted), default=0.0)
            in_flight = self._in_flight.get(session_id, 0)
        if export is not None:
            export.close()
        if in_flight:
            log.info(
                "session %s detached with %d prepare(s) running: each releases its lease when it returns", session_id,
                in_flight,
            )  # fmt: skip
        held = len(granted)
        if held == 0:
            log.info("session %s detached; it held no lease", session_id)
            return 0
        grace = self.session_grace_s(bound)
        with self._lock:
            self._retired[session_id] = RetiredSession(session_id, client_name, held, self._clock() + grace, pid, grace)
        why = f"max(--session-grace-s {self.grace_s:g}, {self.grace_steps:g} x step bound {bound:g} s)"
        log.info(
            "session %s detached holding %d lease(s): their slots stay pinned until %s (%s)",
            session_id, held, f"process {pid} is gone or {grace:g} s pass" if pid else f"{grace:g} s pass", why,
        )  # fmt: skip
        self.reap()
        return held

    def session_grace_s(self, step_bound_s: float) -> float:
        """How long a vanished session's slots stay pinned when its leases' largest step bound is `step_bound_s`."""
        return max(self.grace_s, self.grace_steps * step_bound_s)

    def reap(self) -> int:
        """Release the leases of every retired session whose peer is gone or whose grace period ended; returns how
        many leases were released."""
        now = self._clock()
        with self._lock:
            done = [
                r
                for r in self._retired.values()
                if now >= r.deadline or (r.peer_pid is not None and self._peer_gone(r.peer_pid))
            ]
            for r in done:
                del self._retired[r.session_id]
        released = 0
        for r in done:
            n = self.cache.release_owner(r.session_id)
            released += n
            why = "its grace period ended" if now >= r.deadline else f"its process {r.peer_pid} is gone"
            log.info("session %s: released %d lease(s): %s", r.session_id, n, why)
        return released

    def retired(self) -> list[RetiredSession]:
        """Vanished sessions whose leases still pin their slots (after reaping)."""
        self.reap()
        with self._lock:
            return list(self._retired.values())

    def _check_session(self, session_id: str) -> None:
        live = self._session
        if live is None or live.session_id != session_id:
            raise SessionError(f"session {session_id!r} is not the attached session; Attach first")

    # ---------------------------------------------------------------- plans
    def prepare(
        self,
        session_id: str,
        generation: int,
        keys: Sequence[PlanKey],
        step_bound_s: float = 0.0,
        request_id: str = "",
        adapters: Sequence[Any] = (),
    ) -> Lease:
        """Lease the plans of `keys` (those with an adapters digest built with `adapters`: AdapterPlans). `step_bound_s` (0: unknown) is the generator's bound on one denoise step of the
        request: should the session vanish, the lease's slots stay pinned `session_grace_s(step_bound_s)`.
        `request_id` tags the lease so that `release_request` can end it should this answer be lost.

        The lease is granted only if, when the cache returns it, its session is still the live one and ReleasePlans has
        not named `request_id`; otherwise it is released at once (SessionError, LeaseAbandonedError). At once, not
        after a grace like a detached session's leases: this call has not answered, so no process has been told these
        slots under this lease and no kernel can be reading them through it (a slot also leased by a granted lease
        keeps that lease's pin and its grace).
        """
        self._check_session(session_id)
        if not (math.isfinite(step_bound_s) and 0 <= step_bound_s <= MAX_STEP_BOUND_S):
            raise InvalidPlanRequestError(
                "step_bound_s", f"must be finite and in [0, {MAX_STEP_BOUND_S:g}] seconds, got {step_bound_s}"
            )
        self.reap()
        if self._not_serving:
            # The one reason not to serve is a rebuild source that changed on disk: the same
            # (non-retryable) FAILED_PRECONDITION the first refusal had, not UNAVAILABLE, so a
            # request's status does not depend on whether another prepare (e.g. the generator's
            # prefetch) saw the change first.
            raise CheckpointChangedError(f"not serving plans: {self._not_serving}")
        self.cache.source.adapter_plans.register(adapters, keys)
        self._begin_prepare(session_id, request_id)
        lease: Lease | None = None
        try:
            lease = self.cache.prepare(generation, keys, owner=session_id)
        except CheckpointChangedError as e:
            self.set_not_serving(str(e))
            raise
        finally:
            refusal = self._end_prepare(session_id, request_id, lease, step_bound_s)
        if refusal is not None:
            assert lease is not None
            self._release_quietly(lease.lease_id)
            log.info("lease %d (request %s) released at once: %s", lease.lease_id, request_id or "-", refusal)
            raise refusal
        assert lease is not None
        return lease

    def _begin_prepare(self, session_id: str, request_id: str) -> None:
        with self._lock:
            self._check_session(session_id)
            if request_id and request_id in self._abandoned:
                raise LeaseAbandonedError(f"request {request_id}: ReleasePlans already released it; nothing prepared")
            self._in_flight[session_id] = self._in_flight.get(session_id, 0) + 1

    def _end_prepare(
        self, session_id: str, request_id: str, lease: Lease | None, step_bound_s: float
    ) -> SessionError | LeaseAbandonedError | None:
        """Under the lock: grant `lease` to the live session, or say why not (see `prepare`)."""
        with self._lock:
            left = self._in_flight.pop(session_id) - 1
            if left:
                self._in_flight[session_id] = left
            if lease is None:
                return None
            live = self._session
            if live is None or live.session_id != session_id:
                return SessionError(f"session {session_id!r} ended while its PreparePlans ran; the lease is released")
            if request_id and request_id in self._abandoned:
                return LeaseAbandonedError(
                    f"request {request_id}: ReleasePlans released it while its PreparePlans ran; the lease is released"
                )
            self._grants[lease.lease_id] = Grant(session_id, request_id, step_bound_s)
            return None

    def _release_quietly(self, lease_id: int) -> None:
        """Release a lease if it is still live (a retired session's reap, or a release racing this one, may have
        ended it already)."""
        with contextlib.suppress(UnknownLeaseError):
            self.cache.release(lease_id)

    def release(self, session_id: str, lease_id: int) -> None:
        """End one lease granted to the live session `session_id` (UnknownLeaseError for any other)."""
        with self._lock:
            self._check_session(session_id)
            grant = self._grants.get(lease_id)
            if grant is None or grant.session_id != session_id:
                raise UnknownLeaseError(f"no live lease {lease_id} of session {session_id!r}")
            del self._grants[lease_id]
        self.cache.release(lease_id)

    def release_request(self, session_id: str, request_id: str) -> int:
        """End every lease granted to `session_id` under `request_id`, and refuse any PreparePlans of it still running
        or still to come: its caller lost the answer (a client deadline, a dropped connection), so no kernel reads
        these slots and they are released at once. Returns how many leases it ended; 0 is not an error."""
        if not request_id:
            raise InvalidPlanRequestError("request_id", "must not be empty")
        with self._lock:
            self._check_session(session_id)
            ids = [i for i, g in self._grants.items() if g.session_id == session_id and g.request_id == request_id]
            for i in ids:
                del self._grants[i]
            self._abandoned[request_id] = None
            self._abandoned.move_to_end(request_id)
            while len(self._abandoned) > MAX_ABANDONED_IDS:
                self._abandoned.popitem(last=False)
            in_flight = self._in_flight.get(session_id, 0)
        for i in ids:
            self._release_quietly(i)
        log.info(
            "request %s: released %d lease(s) by request id (answer lost; %d prepare(s) of the session running)",
            request_id, len(ids), in_flight,
        )  # fmt: skip
        return len(ids)

    @property
    def serving(self) -> bool:
        """Whether plans are served (False once the rebuild source changed on disk)."""
        return not self._not_serving

    def set_not_serving(self, reason: str) -> None:
        """Stop serving plans for `reason`; "" serves again (a committed update)."""
        was = self._not_serving
        self._not_serving = reason
        if reason and not was:
            log.error("NOT_SERVING: %s", reason)
        if bool(reason) != bool(was) and self._on_serving_change is not None:
            self._on_serving_change(not reason)

    def check_source(self) -> None:
        """Turn NOT_SERVING if the rebuild source changed on disk (checked at start too)."""
        changed = self.cache.source.changed_files()
        if changed:
            self.set_not_serving(
                f"rebuild source {self.cache.source.path} changed on disk since generation "
                f"{self.cache.generation} was committed (changed: {', '.join(changed)})"
            )

    # ---------------------------------------------------------------- weight updates
    def prepare_update(self, from_generation: int, weights_path: str) -> RebuildSource:
        """Validate a new rebuild source (`WeightUpdates.prepare`); changes nothing served."""
        return self.updates.prepare(from_generation, weights_path)

    def commit_update(self, from_generation: int, weights_path: str) -> Committed:
        """Persist generation + 1, then retarget (`WeightUpdates.commit`); plans are served again."""
        return self.updates.commit(
            from_generation, weights_path, reap=self.reap, serve=lambda: self.set_not_serving("")
        )

    def abort_update(self, weights_path: str = "") -> bool:
        return self.updates.abort(weights_path)

    @property
    def update_outcomes(self) -> UpdateOutcomes:
        """Weight-update outcomes since the sidecar started (the metrics' `outcome` label)."""
        return self.updates.outcomes

    # ---------------------------------------------------------------- state
    def state(self) -> SidecarState:
        self.reap()
        stats = self.cache.stats()
        pending = self.updates.pending
        return SidecarState(
            generation=self.cache.generation,
            weights_path=str(self.cache.source.path),
            fingerprint=self.cache.source.fingerprint,
            leases_held=stats.leases_held,
            session=self._session,
            stats=stats,
            serving=self.serving,
            not_serving_reason=self._not_serving,
            pending_weights_path=str(pending.path) if pending is not None else "",
            partitions=self.cache.partition_states(),
        )
