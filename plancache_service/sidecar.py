"""The sidecar's core (no gRPC): one generator session over a PlanCache, and the generation.

A session is tied to an open Attach stream: `attach()` opens it (refused while another is
live), `detach()` releases every lease it holds. Plan calls must name the live session.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ditcore.plans import PlanKey

from .cache import CacheStats, Lease, PlanCache
from .errors import NotServingError, SessionError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    client_name: str


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


class Sidecar:
    def __init__(self, cache: PlanCache) -> None:
        self.cache = cache
        self._lock = threading.Lock()
        self._session: SessionInfo | None = None
        self._not_serving = ""

    # ---------------------------------------------------------------- sessions
    def attach(self, client_name: str) -> SessionInfo:
        with self._lock:
            if self._session is not None:
                raise SessionError(
                    f"a generator session is already attached ({self._session.client_name}); one session at a time"
                )
            self._session = SessionInfo(uuid.uuid4().hex, client_name)
            log.info("session %s attached by %s", self._session.session_id, client_name)
            return self._session

    def detach(self, session_id: str) -> int:
        """End the session; release its leases. Returns how many were released."""
        with self._lock:
            if self._session is None or self._session.session_id != session_id:
                return 0
            self._session = None
        released = self.cache.release_owner(session_id)
        log.info("session %s detached; released %d lease(s)", session_id, released)
        return released

    def _check_session(self, session_id: str) -> None:
        live = self._session
        if live is None or live.session_id != session_id:
            raise SessionError(f"session {session_id!r} is not the attached session; Attach first")

    # ---------------------------------------------------------------- plans
    def prepare(self, session_id: str, generation: int, keys: Sequence[PlanKey]) -> Lease:
        self._check_session(session_id)
        if self._not_serving:
            raise NotServingError(f"not serving plans: {self._not_serving}")
        return self.cache.prepare(generation, keys, owner=session_id)

    def release(self, session_id: str, lease_id: int) -> None:
        self._check_session(session_id)
        self.cache.release(lease_id)

    def set_not_serving(self, reason: str) -> None:
        self._not_serving = reason

    # ---------------------------------------------------------------- state
    @property
    def weights_path(self) -> Path:
        return self.cache.source.info.path

    def state(self) -> SidecarState:
        stats = self.cache.stats()
        return SidecarState(
            generation=self.cache.generation,
            weights_path=str(self.weights_path),
            fingerprint=self.cache.source.fingerprint,
            leases_held=stats.leases_held,
            session=self._session,
            stats=stats,
            serving=not self._not_serving,
            not_serving_reason=self._not_serving,
        )
