"""What the jobs API and its dispatcher share on this replica: the live overlay of the jobs our executor holds, one
condition every change notifies (with a version watchers wait on), and whether we are stopping. No grpc here."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .types import LiveJob


class LiveJobs:
    """The live table and its condition. `stopping` is set once and never cleared; it wakes every waiter."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._version = 0  # bumped on every change this replica makes (watchers wait on it)
        self._jobs: dict[str, LiveJob] = {}
        self.stopping = False

    def stop(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify_all()

    def changed(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    def version(self) -> int:
        with self._cond:
            return self._version

    def wait_moved(self, version: int, timeout_s: float) -> bool:
        """Wait until a change after `version` (another replica's shows only at the caller's next poll); True once
        stopping."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != version or self.stopping, timeout_s)
            return self.stopping

    def wait_tick(self, timeout_s: float) -> bool:
        """The dispatcher's pause: up to `timeout_s`, or until a change; False once stopping."""
        with self._cond:
            if self.stopping:
                return False
            self._cond.wait(timeout_s)
            return not self.stopping

    def snapshot(self, job_id: str) -> LiveJob | None:
        """A copy of the job's live state (None unless our executor holds it)."""
        with self._cond:
            live = self._jobs.get(job_id)
            return dataclasses.replace(live) if live is not None else None

    def ids(self) -> list[str]:
        """The jobs our executor holds now."""
        with self._cond:
            return list(self._jobs)

    def add(self, job_id: str, live: LiveJob) -> None:
        with self._cond:
            self._jobs[job_id] = live

    def pop(self, job_id: str) -> LiveJob | None:
        with self._cond:
            return self._jobs.pop(job_id, None)

    @contextmanager
    def editing(self, job_id: str) -> Iterator[LiveJob | None]:
        """The job's live state to change in place (None unless our executor holds it); a change either way."""
        with self._cond:
            yield self._jobs.get(job_id)
            self._version += 1
            self._cond.notify_all()
