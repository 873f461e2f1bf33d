"""The jobs API's core: jobs that outlive their connection, on this generator's one executor (no grpc here).

A job is stored before it is answered (CreateJob), `queued` in the job store (generator_service.jobs.store). The
dispatcher thread claims the oldest queued job when the executor has room and no other job of ours waits there (so
the next job's plans prefetch while one runs, and Generate calls keep their turn), and submits it; from then on the
job's events drive its record: `running` when the executor takes it, progress after every finished step, the decode
and mux stages, then `succeeded` (its result stored as a content-addressed file first: generator_service.jobs.results),
`failed` or `cancelled`. The recorder thread writes them, so the executor never waits on the store.

Restart: on start, every job this replica held and did not finish is queued again where it was (its seq), so queued
jobs run in order and a job that was running runs again (deterministic by seed). A replica's claims are leases
renewed every `claim_s / 3`; one whose replica died is claimed by another after `claim_s`. Cancel: a queued job
nobody holds is cancelled in the store; a job this replica runs is cancelled through the registry (out of the queue,
or at its next step boundary); one another replica runs gets `cancel_requested`, which its owner sees at its next
renewal. Delete cancels first and removes the record once the job has stopped. Retention: `ttl_s` removes finished
jobs, `results_max_bytes` removes the oldest content first, never content being read.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import BinaryIO

import safetensors.torch

from ..errors import JobNotFoundError, JobQueueFullError, JobStateError, NotServingError, OffsetError, QueueFullError
from ..execution.executor import Executor
from ..execution.registry import RunRegistry
from ..execution.runs import Decoding, Failed, Finished, Muxing, Run, RunEvent, RunResult, Started, StepDone
from .results import ContentRef, ResultStore
from .retention import Retention
from .schema import TERMINAL, JobRecord
from .store import JobStore
from .types import (
    DISPATCH_AHEAD,
    LATENTS_CONTENT,
    Classifier,
    Decoder,
    JobsObserver,
    JobsPolicy,
    JobView,
    LiveJob,
    NewJob,
)

log = logging.getLogger(__name__)


def new_job_id() -> str:
    return f"job_{uuid.uuid4().hex}"


class JobService:
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
    ) -> None:
        self.observer = observer or JobsObserver()
        self.store, self.results, self.registry = store, results, registry
        self.executor: Executor = registry.executor
        self._decode, self._classify, self.policy, self._clock = decode, classify, policy, clock
        self._cond = threading.Condition()
        self._version = 0  # bumped on every change this replica makes (watchers wait on it)
        self._live: dict[str, LiveJob] = {}
        self._records: queue.Queue[tuple[Run, RunEvent] | None] = queue.Queue()
        self._stopping = False
        self._retention = Retention(store, results, policy.ttl_s, policy.results_max_bytes, self.now, self._changed)
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="jobs-dispatch", daemon=True)
        self._recorder = threading.Thread(target=self._record_loop, name="jobs-record", daemon=True)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        again = self.store.requeue_owned(self.policy.replica)
        if again:
            log.info("jobs: %d unfinished job(s) of replica %s queued again: %s", len(again), self.policy.replica,
                     ", ".join(again))  # fmt: skip
        self._recorder.start()
        self._dispatcher.start()

    def stopping(self) -> None:
        """From now on jobs that fail are not recorded (the executor drops its queue when it stops): they stay ours
        and are queued again by the next start."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def stop(self, timeout: float = 30.0) -> None:
        """After the executor stopped: record what finished, then end both threads."""
        self.stopping()
        self._records.put(None)
        self._recorder.join(timeout)
        self._dispatcher.join(timeout)
        self.store.close()

    def now(self) -> float:
        return self._clock()

    def retention(self) -> None:
        """One retention pass now (the dispatcher runs one every 10 s): generator_service.jobs.retention."""
        self._retention.run()

    # ---------------------------------------------------------------- the API
    def create(self, new: NewJob, idempotency_key: str | None) -> tuple[JobView, bool]:
        """Check the request as Generate would (but the queue's capacity), store it queued; or, for an idempotent
        retry, return the job the first call made."""
        self.executor.check(Run(new.request, expected_generation=new.expected_generation))
        self._retention.check_room(self.executor.retry_after_s)
        job_id = new_job_id()
        request_bytes = new.request_bytes
        spec = {**new.request.to_dict(), "expected_generation": new.expected_generation}
        try:
            record, created = self.store.create(
                job_id=job_id, request=request_bytes, request_sha256=new.request_sha256,
                idempotency_key=idempotency_key, spec=spec, steps_total=new.request.steps, now=self._clock(),
                max_queued=self.policy.max_queued,
            )  # fmt: skip
        except JobQueueFullError as e:
            e.retry_after_s = self.executor.retry_after_s()
            e.quota_violation = ("--max-queued-jobs", str(e))
            raise
        if created:
            log.info("job %s created (request %s)", record.job_id, new.request.request_id,
                     extra={"job_id": record.job_id, "request_id": new.request.request_id})  # fmt: skip
        self._changed()
        return self._view(record), created

    def get(self, job_id: str) -> JobView:
        return self._view(self._record_of(job_id))

    def list(
        self, states: Sequence[str], limit: int, after_seq: int | None, oldest_first: bool
    ) -> tuple[list[JobView], int | None]:
        """A page of jobs and the seq to continue after (None on the last page)."""
        records = self.store.list(states=states, limit=limit + 1, after_seq=after_seq, oldest_first=oldest_first)
        more = len(records) > limit
        page = [self._view(r) for r in records[:limit]]
        return page, (records[limit - 1].seq if more else None)

    def watch(self, job_id: str, alive: Callable[[], bool]) -> Iterator[JobView]:
        """The job now and after each change, until it is final (or `alive` says the watcher went away)."""
        last: tuple[object, ...] | None = None
        while alive():
            with self._cond:
                version = self._version
            view = self.get(job_id)
            if view.change_key() != last:
                last = view.change_key()
                yield view
            if view.terminal:
                return
            with self._cond:  # a change here wakes us; another replica's shows at the next poll
                self._cond.wait_for(partial(self._moved, version), self.policy.poll_s)
                if self._stopping:
                    raise NotServingError("the generator is shutting down")

    def _record_of(self, job_id: str) -> JobRecord:
        return _found(self.store.get(job_id), job_id)

    def _moved(self, version: int) -> bool:  # under _cond
        return self._version != version or self._stopping

    def cancel(self, job_id: str) -> JobView:
        record = self._record_of(job_id)
        if record.state in ("succeeded", "failed"):
            raise JobStateError(
                f"job {job_id} already {record.state}: only a queued or running job can be cancelled",
                {"job_id": job_id, "state": record.state},
            )
        if record.state != "cancelled":
            self.store.request_cancel(job_id, self._clock())
            self._cancel_here(job_id)
            self._changed()
        return self.get(job_id)

    def delete(self, job_id: str) -> bool:
        """True when the record and content are gone now; False when it still runs (cancelled; removed once it
        stopped)."""
        record = _found(self.store.mark_deleted(job_id), job_id)
        self._changed()
        if record.state in TERMINAL:
            self._retention.remove(job_id)
            return True
        self.store.request_cancel(job_id, self._clock())
        self._cancel_here(job_id)
        now = self.store.get_any(job_id)
        if now is not None and now.state in TERMINAL:  # it was queued: cancelled at once
            self._retention.remove(job_id)
            return True
        return False

    @contextmanager
    def content(self, job_id: str, offset: int) -> Iterator[tuple[ContentRef, Iterator[bytes]]]:
        """A succeeded job's content from `offset`, held against retention while the caller reads it."""
        view = self.get(job_id)
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
    def _view(self, record: JobRecord) -> JobView:
        with self._cond:
            live = self._live.get(record.job_id)
            overlay = dataclasses.replace(live) if live is not None else None
        state, stage = record.state, record.stage
        done, total = record.steps_done, record.steps_total
        if overlay is not None and record.state not in TERMINAL:
            state, stage, done, total = overlay.state, overlay.stage, overlay.steps_done, overlay.steps_total or total
        position = None
        if state == "queued":
            position = self._position(record, overlay.run if overlay is not None else None)
        return JobView(record, state, stage, done, total, position)

    def _position(self, record: JobRecord, run: Run | None) -> int:
        """Jobs that start before it: its place in the executor's queue, or the store's queued jobs ahead of it
        (ours waiting in the executor among them) plus the Generate calls waiting there."""
        if run is not None:
            here = self.executor.position(run)
            if here is not None:
                return here
        ahead = self.store.queue_position(record.job_id) or 0
        return ahead + self.executor.waiting(lambda j: not j.job_id)

    def _changed(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    # ---------------------------------------------------------------- dispatch
    def _dispatch_loop(self) -> None:
        next_renew = next_retention = 0.0
        while True:
            with self._cond:
                if self._stopping:
                    return
                self._cond.wait(self.policy.poll_s)
                if self._stopping:
                    return
            try:
                now = time.monotonic()
                if now >= next_renew:
                    self._renew()
                    next_renew = now + self.policy.claim_s / 3
                if now >= next_retention:
                    self._retention.run()
                    next_retention = now + max(self.policy.poll_s, 10.0)
                while self._ready_for_more() and self._dispatch_one():
                    pass
            except Exception:  # the store is down for a moment: try again at the next tick
                log.exception("jobs: dispatch pass failed")

    def _ready_for_more(self) -> bool:
        if self._stopping or not self.executor.has_room:
            return False
        return self.executor.waiting(lambda j: bool(j.job_id)) < DISPATCH_AHEAD

    def _dispatch_one(self) -> bool:
        """Claim and submit the oldest queued job; False when there is none."""
        record = self.store.claim_next(self.policy.replica, self.policy.claim_s, self._clock())
        if record is None:
            return False
        try:
            request, expected = self._decode(record.request)
        except Exception as e:
            self._finish_failed(record.job_id, e)
            return True
        run = Run(request, job_id=record.job_id, expected_generation=expected)
        with self._cond:
            self._live[record.job_id] = LiveJob(run, record.created_at, steps_total=record.steps_total)
        run.subscribe(self._on_event)
        try:
            self.registry.submit(run)
        except (QueueFullError, NotServingError):  # a Generate call took the room, or we are stopping
            with self._cond:
                self._live.pop(record.job_id, None)
            self.store.unclaim(record.job_id, self.policy.replica)
            return False
        except Exception as e:  # refused now (e.g. the weights moved past its expected_generation)
            with self._cond:
                self._live.pop(record.job_id, None)
            self._finish_failed(record.job_id, e)
        return True

    def _renew(self) -> None:
        for job_id in self.store.renew_claims(self.policy.replica, self.policy.claim_s, self._clock()):
            self._cancel_here(job_id)

    def _cancel_here(self, job_id: str) -> None:
        run = self.registry.get(job_id)
        if run is not None:
            self.registry.cancel(run)  # withdrawn now (Failed follows), or stopped at its next check

    # ---------------------------------------------------------------- events -> records
    def _on_event(self, run: Run, event: RunEvent) -> None:
        """On the executor's (or mux) thread: the live overlay now, the store by the recorder."""
        with self._cond:
            live = self._live.get(run.job_id)
            if live is not None:
                match event:
                    case Started():
                        live.state, live.stage, live.started_at = "running", "preparing", self._clock()
                        self.observer.waited(max(0.0, live.started_at - live.created_at))
                    case StepDone(step, total):
                        live.stage, live.steps_done, live.steps_total = "denoising", step, total
                    case Decoding():
                        live.stage = "decoding"
                    case Muxing():
                        live.stage = "muxing"
                    case Finished():
                        live.stage = "storing"
            self._version += 1
            self._cond.notify_all()
        if isinstance(event, Started | StepDone | Decoding | Muxing | Finished | Failed):
            self._records.put((run, event))

    def _record_loop(self) -> None:
        while True:
            item = self._records.get()
            if item is None:
                return
            run, event = item
            try:
                self._record(run, event)
            except Exception:
                log.exception("jobs: recording %s for %s failed", type(event).__name__, run.job_id)
            del run, event, item  # nothing of a result waits here for the next event

    def _record(self, run: Run, event: RunEvent) -> None:
        replica = self.policy.replica
        match event:
            case Started():
                self.store.mark_running(run.job_id, replica, self._clock())
            case StepDone() | Decoding() | Muxing():
                if self._records.empty():  # a later event says more: write only the last
                    self._write_progress(run.job_id)
            case Finished(result):
                self._store_result(run, result)
            case Failed(error):
                if self._stopping and not run.cancelled.is_set():
                    self._forget(run)  # dropped by the stopping executor: queued again by the next start
                    return
                state = self._finish_failed(run.job_id, error)
                self._forget(run, state)

    def _store_result(self, run: Run, res: RunResult) -> None:
        state = "succeeded"
        try:
            ref = self._write_content(run, res)
            result = {
                "sha256": res.result.sha256, "generation": res.generation, "output_type": run.request.output_type,
                "timings_ms": res.timings_ms, "attention_backend": res.result.attention_backend,
                "cache": res.result.cache.to_dict() if res.result.cache is not None else None,
            }  # fmt: skip
            self.store.finish(run.job_id, self.policy.replica, state="succeeded", now=self._clock(), result=result,
                              content=ref)  # fmt: skip
            log.info("job %s succeeded: %s (%d bytes, sha256 %s)", run.job_id, ref.filename, ref.size,
                     ref.sha256[:16], extra={"job_id": run.job_id, "sha256": ref.sha256})  # fmt: skip
            self._remove_if_deleted(run.job_id)
        except Exception as e:
            log.exception("job %s: storing its result failed", run.job_id)
            state = self._finish_failed(run.job_id, e)  # removes it too, if deleted
        finally:
            if res.media is not None:
                res.media.close()
            self._forget(run, state)

    def _write_content(self, run: Run, res: RunResult) -> ContentRef:
        rid = run.request.request_id
        if res.media is not None:
            m = res.media
            return self.results.put_bytes(m.chunks(), m.content_type, f"{rid}{m.suffix}")
        tensors = {n: t.contiguous() for n, t in (("video", res.result.video), ("audio", res.result.audio))
                   if t is not None}  # fmt: skip
        content_type, suffix = LATENTS_CONTENT
        return self.results.put_bytes(safetensors.torch.save(tensors), content_type, f"{rid}{suffix}")

    def _write_progress(self, job_id: str) -> None:
        """The live job's stage and steps into its record (nothing once it is no longer live here)."""
        with self._cond:
            live = self._live.get(job_id)
            snap = dataclasses.replace(live) if live is not None else None
        if snap is not None:
            self.store.update_progress(job_id, self.policy.replica, stage=snap.stage, steps_done=snap.steps_done,
                                       steps_total=snap.steps_total)  # fmt: skip

    def _finish_failed(self, job_id: str, error: BaseException) -> str:
        code, reason, message = self._classify(error)
        state = "cancelled" if code == "CANCELLED" else "failed"
        self._write_progress(job_id)  # the steps it really finished, not the last progress written
        self.store.finish(job_id, self.policy.replica, state=state, now=self._clock(), error=(code, reason, message))
        log.info("job %s %s: %s (%s)", job_id, state, message, reason, extra={"job_id": job_id, "reason": reason})
        self._remove_if_deleted(job_id)
        return state

    def _forget(self, run: Run, state: str = "") -> None:
        self.registry.release(run)
        with self._cond:
            live = self._live.pop(run.job_id, None)
        if state and live is not None and live.started_at is not None:
            self.observer.ran(state, max(0.0, self._clock() - live.started_at))
        self._changed()  # watchers see it, and the dispatcher (waiting on the same condition) may take the next

    # ---------------------------------------------------------------- deletion and retention
    def _remove_if_deleted(self, job_id: str) -> None:
        record = self.store.get_any(job_id)
        if record is not None and record.deleted and record.state in TERMINAL:
            self._retention.remove(job_id)


def _found(record: JobRecord | None, job_id: str) -> JobRecord:
    if record is None:
        raise JobNotFoundError(f"job_id: no job {job_id!r} (unknown, or deleted)", {"job_id": job_id})
    return record


def _read_from(f: BinaryIO, offset: int, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
    f.seek(offset)
    yield from iter(partial(f.read, chunk_bytes), b"")
