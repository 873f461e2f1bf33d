"""What leaves the job store and the results directory: deleted jobs once they stopped, succeeded jobs past
`--job-ttl`, failed and cancelled ones past `--failed-job-ttl`, the oldest content above `--results-max-gb` (never
content being read; its record stays, its content marked unavailable), result files no record names (a crash
between writing a result and recording it, a lost claim) once older than the grace period, and the request blobs no
job names (with the job that named them last). A result file is removed only when no record still names it
(content-addressed files are shared by identical results). After a pass that removed something the store gives the
space back (SQLite's incremental vacuum). No grpc here."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ResultsFullError
from .results import ResultStore
from .store import JobStore

log = logging.getLogger(__name__)

ORPHAN_GRACE_S = 3600.0
"""A result file no record names is removed once this old: long after any write and its record (a final write
retries for at most `FINISH_RETRY_S`)."""


@dataclass(frozen=True)
class RetentionPolicy:
    """The retention flags, in seconds and bytes."""

    ttl_s: float
    """Succeeded jobs stay this long after they finished."""
    max_bytes: int
    """Result bytes kept at most."""
    unsucceeded_ttl_s: float | None = None
    """Failed and cancelled jobs stay this long (None: `ttl_s`)."""
    orphan_grace_s: float = ORPHAN_GRACE_S


class Retention:
    def __init__(
        self,
        store: JobStore,
        results: ResultStore,
        policy: RetentionPolicy,
        clock: Callable[[], float],
        changed: Callable[[], None],
    ) -> None:
        self.store, self.results, self.policy = store, results, policy
        self._clock, self._changed = clock, changed

    @property
    def max_bytes(self) -> int:
        return self.policy.max_bytes

    def expires_at(self, state: str, finished_at: float | None) -> float | None:
        """When a job that ended in `state` at `finished_at` is removed (None while it runs)."""
        if finished_at is None:
            return None
        p = self.policy
        ttl = p.ttl_s if state == "succeeded" or p.unsucceeded_ttl_s is None else min(p.ttl_s, p.unsucceeded_ttl_s)
        return finished_at + ttl

    def remove(self, job_id: str) -> None:
        """A stopped job's record (its blobs with it, when no other job names them), and its file when no other
        record names it."""
        record = self.store.remove(job_id)
        if record is not None and record.content_sha256 and self.store.content_refs(record.content_sha256) == 0:
            self.results.remove(record.content_sha256)
        self._changed()

    def run(self) -> None:
        """Remove deleted jobs that stopped and jobs past their time to live; orphaned result files; then the oldest
        content until the results fit `max_bytes` (content being read stays); then give the space back."""
        now, p = self._clock(), self.policy
        removed = 0
        for record in self.store.deleted_terminal():
            self.remove(record.job_id)
            removed += 1
        unsucceeded = now - p.unsucceeded_ttl_s if p.unsucceeded_ttl_s is not None else None
        for record in self.store.expired(now - p.ttl_s, unsucceeded):
            self.remove(record.job_id)
            removed += 1
        files, n_bytes = self.results.remove_orphans(self.store.named_content, p.orphan_grace_s)
        if files:
            log.info("jobs: removed %d result file(s) no job names (%d bytes)", files, n_bytes)
        total = self.store.content_bytes_total()
        for record in self.store.content_oldest_first():
            if total <= p.max_bytes:
                break
            sha = record.content_sha256
            if sha is None or self.results.readers(sha):
                continue
            self.store.set_content_unavailable(record.job_id)
            if self.store.content_refs(sha) == 0:
                self.results.remove(sha)
            total = self.store.content_bytes_total()
            self._changed()
        if removed:
            self.store.reclaim()

    def check_room(self, retry_after_s: Callable[[], float]) -> None:
        """Refuse a new job (ResultsFullError) when the results the records name stay above `max_bytes` after a
        pass (files no record names never count: they are orphans the next passes remove)."""
        if self.store.content_bytes_total() <= self.policy.max_bytes:
            return
        self.run()
        total = self.store.content_bytes_total()
        if total > self.policy.max_bytes:
            raise ResultsFullError(
                f"the results hold {total} bytes, above --results-max-gb ({self.policy.max_bytes} bytes), all of it "
                "being read; retry later",
                retry_after_s(),
            )
