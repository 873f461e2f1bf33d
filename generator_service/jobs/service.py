"""The jobs API's core: jobs that outlive their connection, on this generator's one executor: create, get, list,
watch, cancel, delete, content (no grpc here).

A job is stored before it is answered (CreateJob), `queued` in the job store (generator_service.jobs.store); the
dispatcher runs it from there and the recorder writes its progress and outcome (generator_service.jobs.dispatch).
Cancel: a queued job nobody holds is cancelled in the store; a job this replica runs is cancelled through the
registry (out of the queue, or at its next step boundary); one another replica runs gets `cancel_requested`, which its
owner sees at its next renewal. Delete cancels first and removes the record once the job has stopped. Retention:
`ttl_s` removes finished jobs, `results_max_bytes` removes the oldest content first, never content being read.

Owners: every call names its caller's owner (`Owner`: a name, or None for an admin, who sees every job); another
owner's job is JobNotFoundError, exactly as an unknown one. An idempotent retry is found by (owner, key) before any
admission step (`find_retry`), so a retry whose upload expired meanwhile still gets its job back.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import BinaryIO

from ..errors import (
    JobNotFoundError,
    JobQueueFullError,
    JobStateError,
    NotServingError,
    OffsetError,
)  # fmt: skip
from ..execution.executor import Executor
from ..execution.registry import RunRegistry
from ..execution.runs import Run
from .dispatch import Dispatcher, Recorder
from .live import LiveJobs
from .results import ContentRef, ResultStore
from .retention import Retention, RetentionPolicy
from .schema import TERMINAL, Job
from .store import JobStore, idempotent_retry
from .types import Classifier, Decoder, JobsObserver, JobsPolicy, JobView, NewJob

log = logging.getLogger(__name__)

Owner = str | None
"""Whose jobs a call may see: an owner's name, or None (an admin: every job)."""


def new_job_id() -> str:
    return f"job_{uuid.uuid4().hex}"


class JobService:
    """The jobs API over the store, with this replica's live state over it; the dispatcher runs the jobs."""

    def __init__(
        self,
        store: JobStore,
        results: ResultStore,
        registry: RunRegistry,
        decode: Decoder,
        classify: Classifier,
        policy: JobsPolicy,
        observer: JobsObserver | None = None,
        clock: Callable[[], float] = time.time,
        serving: Callable[[], bool] = lambda: True,
    ) -> None:
        self.observer = observer or JobsObserver()
        self.store, self.results, self.registry = store, results, registry
        self.executor: Executor = registry.executor
        self.policy, self._clock = policy, clock
        self._live = LiveJobs()
        retention = RetentionPolicy(policy.ttl_s, policy.results_max_bytes, policy.unsucceeded_ttl_s)
        self._retention = Retention(store, results, retention, self.now, self._live.changed)
        recorder = Recorder(
            store, results, registry, classify, policy, self.observer, self._retention, self._live, self.now
        )
        self._dispatcher = Dispatcher(
            store, registry, decode, policy, self._retention, self._live, recorder, self.now, serving
        )

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._dispatcher.start()

    def stopping(self) -> None:
        """From now on jobs that fail are not recorded (the executor drops its queue when it stops): they stay ours
        and are queued again by the next start."""
        self._live.stop()

    def stop(self, timeout: float = 30.0) -> None:
        """After the executor stopped: record what finished, then end both threads."""
        self.stopping()
        self._dispatcher.stop(timeout)
        self.store.close()

    def now(self) -> float:
        return self._clock()

    def retention(self) -> None:
        """One retention pass now (the dispatcher runs one every 10 s): generator_service.jobs.retention."""
        self._retention.run()

    # ---------------------------------------------------------------- the API
    def find_retry(self, owner: str, key: str, meaning: Callable[[Job], str]) -> JobView | None:
        """The job `owner` created under `key`, when `meaning(job)` (the retried request's meaning, read with what
        the job knows of its uploads) is the job's; None when the key is free. IdempotencyConflictError when the key
        holds another request, or a job being deleted."""
        record = self.store.find_key(owner, key)
        if record is None:
            return None
        sha = record.request_sha256 if record.deleted else meaning(record)  # a deleted one: refused as such
        return self._view(idempotent_retry(record, key, sha))

    def create(self, new: NewJob, idempotency_key: str | None, owner: str) -> tuple[JobView, bool]:
        """Check the request as Generate would (but the queue's capacity), store it queued for `owner`; or, for an
        idempotent retry, return the job the first call made."""
        self.executor.check(Run(new.request, expected_generation=new.expected_generation))
        self._retention.check_room(self.executor.retry_after_s)
        try:
            record, created = self.store.create(
                job_id=new.job_id, request=new.request_bytes, request_sha256=new.request_sha256,
                idempotency_key=idempotency_key, spec=new.spec, steps_total=new.request.steps, now=self._clock(),
                max_queued=self.policy.max_queued, owner=owner, parts=new.parts,
            )  # fmt: skip
        except JobQueueFullError as e:
            e.retry_after_s = self.executor.retry_after_s()
            e.quota_violation = ("--max-queued-jobs", str(e))
            raise
        if created:
            log.info("job %s created (request %s, owner %s)", record.job_id, new.request.request_id, owner,
                     extra={"job_id": record.job_id, "request_id": new.request.request_id})  # fmt: skip
        self._live.changed()
        return self._view(record), created

    def get(self, job_id: str, owner: Owner = None) -> JobView:
        return self._view(self._record_of(job_id, owner))

    def list(
        self, states: Sequence[str], limit: int, after_seq: int | None, oldest_first: bool, owner: Owner = None
    ) -> tuple[list[JobView], int | None]:
        """A page of `owner`'s jobs and the seq to continue after (None on the last page)."""
        records = self.store.list(
            states=states, limit=limit + 1, after_seq=after_seq, oldest_first=oldest_first, owner=owner
        )
        more = len(records) > limit
        page = [self._view(r) for r in records[:limit]]
        return page, (records[limit - 1].seq if more else None)

    def watch(self, job_id: str, alive: Callable[[], bool], owner: Owner = None) -> Iterator[JobView]:
        """The job now and after each change, until it is final (or `alive` says the watcher went away)."""
        last: tuple[object, ...] | None = None
        while alive():
            version = self._live.version()
            view = self.get(job_id, owner)
            if view.change_key() != last:
                last = view.change_key()
                yield view
            if view.terminal:
                return
            # a change here wakes us; another replica's shows at the next poll
            if self._live.wait_moved(version, self.policy.poll_s):
                raise NotServingError("the generator is shutting down")

    def _record_of(self, job_id: str, owner: Owner) -> Job:
        return _found(self.store.get(job_id, owner), job_id)

    def cancel(self, job_id: str, owner: Owner = None) -> JobView:
        """Cancel a queued or running job: CANCELLED at once unless another replica runs it (then
        `cancel_requested` until its owner stops it)."""
        record = self._record_of(job_id, owner)
        if record.state in ("succeeded", "failed"):
            raise JobStateError(
                f"job {job_id} already {record.state}: only a queued or running job can be cancelled",
                {"job_id": job_id, "state": record.state},
            )
        if record.state != "cancelled":
            self._dispatcher.cancel_here(job_id)  # out of our executor's queue first: it cannot start after this
            self.store.request_cancel(job_id, self._clock(), self.policy.replica)
            self._live.changed()
        return self.get(job_id, owner)

    def delete(self, job_id: str, owner: Owner = None) -> bool:
        """True when the record and content are gone now (a final or a queued job); False when it still runs
        (cancelled; removed once it stopped)."""
        _found(self.store.get(job_id, owner), job_id)
        record = _found(self.store.mark_deleted(job_id), job_id)
        self._live.changed()
        if record.state in TERMINAL:
            self._retention.remove(job_id)
            return True
        self._dispatcher.cancel_here(job_id)
        self.store.request_cancel(job_id, self._clock(), self.policy.replica)
        now = self.store.get_any(job_id)
        if now is not None and now.state in TERMINAL:  # it was queued (or its replica gone): cancelled at once
            self._retention.remove(job_id)
            return True
        return False

    @contextmanager
    def content(self, job_id: str, offset: int, owner: Owner = None) -> Iterator[tuple[ContentRef, Iterator[bytes]]]:
        """A succeeded job's content from `offset`, held against retention while the caller reads it."""
        view = self.get(job_id, owner)
        r = view.record
        if view.state != "succeeded":
            raise JobStateError(
                f"job {job_id} is {view.state}: content exists only once it has succeeded",
                {"job_id": job_id, "state": view.state},
            )
        if not r.content_available or r.content_sha256 is None:
            raise JobStateError(
                f"job {job_id}'s content was removed by retention (--results-max-gb); the record stays",
                {"job_id": job_id, "state": view.state},
            )
        ref = ContentRef(r.content_sha256, int(r.content_bytes or 0), r.content_type or "", r.content_filename or "")
        if not 0 <= offset <= ref.size:
            raise OffsetError(f"offset: must be in [0, {ref.size}] (the content's total_bytes), got {offset}")
        with self.results.reading(ref.sha256):
            f = self.results.open(ref.sha256)
            try:
                yield ref, _read_from(f, offset)
            finally:
                f.close()

    # ---------------------------------------------------------------- views
    def _view(self, record: Job) -> JobView:
        overlay = self._live.snapshot(record.job_id)
        state, stage = record.state, record.stage
        done, total = record.steps_done, record.steps_total
        if overlay is not None and record.state not in TERMINAL:
            state, stage, done, total = overlay.state, overlay.stage, overlay.steps_done, overlay.steps_total or total
        position = None
        if state == "queued":
            position = self._position(record, overlay.run if overlay is not None else None)
        expires = self._retention.expires_at(record.state, record.finished_at)
        return JobView(record, state, stage, done, total, position, expires)

    def _position(self, record: Job, run: Run | None) -> int:
        """Jobs that start before it: its place in the executor's queue, or the store's queued jobs ahead of it
        (ours waiting in the executor among them) plus the Generate calls waiting there."""
        if run is not None:
            here = self.executor.position(run)
            if here is not None:
                return here
        ahead = self.store.queue_position(record.job_id) or 0
        return ahead + self.executor.waiting(lambda j: not j.job_id)


def _found(record: Job | None, job_id: str) -> Job:
    if record is None:
        raise JobNotFoundError(f"job_id: no job {job_id!r} (unknown, or deleted)", {"job_id": job_id})
    return record


def _read_from(f: BinaryIO, offset: int, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
    f.seek(offset)
    yield from iter(partial(f.read, chunk_bytes), b"")
