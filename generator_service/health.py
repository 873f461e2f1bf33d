"""The generator's serving state, derived in one place: SERVING unless detached from the
sidecar, updating weights, stopping, or a rank of its replica is gone. The sidecar link, the update coordinator and the
server write into it; one listener (the gRPC health adapter) hears every change. No grpc here.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass

HealthListener = Callable[[bool, str], None]
"""Called as (serving, reason) on construction and after every change; reason is "" when serving."""


@dataclass(frozen=True)
class Serving:
    """A snapshot of the three conditions."""

    attached: bool
    updating: bool
    stopping: bool
    rank_lost: bool = False

    @property
    def serving(self) -> bool:
        return self.attached and not self.updating and not self.stopping and not self.rank_lost

    @property
    def reason(self) -> str:
        if self.rank_lost:
            return "a rank of this replica is gone; the replica restarts as a unit"
        if self.stopping:
            return "stopping"
        if self.updating:
            return "updating weights"
        if not self.attached:
            return "not attached to the plan-cache sidecar"
        return ""


class ServingState:
    """Thread-safe; `attached` starts True in resident mode (no sidecar) and False in cached mode."""

    def __init__(self, attached: bool, listener: HealthListener) -> None:
        self._lock = threading.Lock()
        self._state = Serving(attached=attached, updating=False, stopping=False)
        self._listener = listener
        listener(self._state.serving, self._state.reason)

    @property
    def serving(self) -> bool:
        return self._state.serving

    def set_attached(self, attached: bool) -> None:
        self._set(attached=attached)

    def set_updating(self, updating: bool) -> None:
        self._set(updating=updating)

    def set_stopping(self) -> None:
        self._set(stopping=True)

    def set_rank_lost(self) -> None:
        """For good: the process exits for a restart of the whole replica."""
        self._set(rank_lost=True)

    def _set(self, **change: bool) -> None:
        with self._lock:  # the listener hears changes in the order they were made
            self._state = dataclasses.replace(self._state, **change)
            self._listener(self._state.serving, self._state.reason)
