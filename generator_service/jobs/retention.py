"""What leaves the job store and the results directory: deleted jobs once they stopped, finished jobs past
`--job-ttl`, and the oldest content above `--results-max-gb` (never content being read; its record stays, its
content marked unavailable). A result file is removed only when no record still names it (content-addressed files
are shared by identical results). No grpc here."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import ResultsFullError
from .results import ResultStore
from .store import JobStore


class Retention:
    def __init__(
        self,
        store: JobStore,
        results: ResultStore,
        ttl_s: float,
        max_bytes: int,
        clock: Callable[[], float],
        changed: Callable[[], None],
    ) -> None:
        self.store, self.results = store, results
        self.ttl_s, self.max_bytes = ttl_s, max_bytes
        self._clock, self._changed = clock, changed

    def remove(self, job_id: str) -> None:
        """A stopped job's record, and its file when no other record names it."""
        record = self.store.remove(job_id)
        if record is not None and record.content_sha256 and self.store.content_refs(record.content_sha256) == 0:
            self.results.remove(record.content_sha256)
        self._changed()

    def run(self) -> None:
        """Remove deleted jobs that stopped and jobs finished longer than `ttl_s` ago; then the oldest content until
        the results fit `max_bytes` (content being read stays)."""
        for record in self.store.deleted_terminal():
            self.remove(record.job_id)
        for record in self.store.expired(self._clock() - self.ttl_s):
            self.remove(record.job_id)
        total = self.results.total_bytes()  # one scan; each file removed below is taken off it
        for record in self.store.content_oldest_first():
            if total <= self.max_bytes:
                return
            sha = record.content_sha256
            if sha is None or self.results.readers(sha):
                continue
            self.store.set_content_unavailable(record.job_id)
            if self.store.content_refs(sha) == 0 and self.results.remove(sha):
                total -= record.content_bytes or 0
            self._changed()

    def check_room(self, retry_after_s: Callable[[], float]) -> None:
        """Refuse a new job (ResultsFullError) when the results stay above `max_bytes` after a pass."""
        if self.results.total_bytes() <= self.max_bytes:
            return
        self.run()
        total = self.results.total_bytes()
        if total > self.max_bytes:
            raise ResultsFullError(
                f"the results directory holds {total} bytes, above --results-max-gb ({self.max_bytes} bytes), "
                "all of it being read; retry later",
                retry_after_s(),
            )
