"""How stored jobs reach this generator's executor and their runs' events reach the store: the dispatcher thread
(claims, submits, claim renewals, retention ticks) and the recorder thread (events -> records, results stored).
No grpc here.

The dispatcher claims the oldest queued job when the executor has room and no other job of ours waits there (so the
next job's plans prefetch while one runs, and Generate calls keep their turn), and submits it as a Run; from then on
the run's events drive the job's record: `running` when the executor takes it, progress after every finished step,
the decode and mux stages, then `succeeded` (its result stored as a content-addressed file first:
generator_service.jobs.results), `failed` or `cancelled`. The recorder writes them, so the executor never waits on
the store.

Restart: on start, every job this replica held and did not finish is queued again where it was (its seq), so queued
jobs run in order and a job that was running runs again (deterministic by seed); the `max_attempts`-th run a stop
ended fails it (generator_service.jobs.store.claim_next). Jobs are claimed only while the backend serves (attached
to its sidecar, weights loaded), and a run that failed because the backend went away (UNAVAILABLE: the sidecar
restarting, a rank lost) queues its job again instead of failing it. A replica's claims are leases renewed every
`claim_s / 3`; one whose replica died is claimed by another after `claim_s`, never by its own holder; a run whose
claim another replica took over (ours lapsed) is cancelled here at the next renewal. A job another replica asked
to cancel is cancelled here at the next renewal.

The final write of a job (its outcome) retries with backoff until the store takes it (`FINISH_RETRY_S`), holding
the result file against retention meanwhile: a store that is down for a while delays the record, never loses it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import safetensors.torch

from ..errors import JobStoreUnavailableError, QueueFullError
from ..execution.registry import RunRegistry
from ..execution.runs import Decoding, Failed, Finished, Muxing, Run, RunEvent, RunResult, Started, StepDone
from .live import LiveJobs
from .results import ContentRef, ResultStore
from .retention import Retention
from .schema import TERMINAL, Job
from .store import JobStore
from .types import (
    DISPATCH_AHEAD,
    LATENTS_CONTENT,
    Classifier,
    Decoder,
    JobsObserver,
    JobsPolicy,
    LiveJob,
)  # fmt: skip

log = logging.getLogger(__name__)

T = TypeVar("T")
FINISH_RETRY_S = 600.0
"""How long a job's final write is retried (backoff 0.1 s doubling to 5 s) before the recorder gives up on it; the
job then stays held by this replica, and the next start queues it again."""


def is_transient(code: str) -> bool:
    """A run that failed with this status code ended because the backend went away (the sidecar, a rank, the
    serving state: every such error is UNAVAILABLE), not because of its job."""
    return code == "UNAVAILABLE"


class Recorder:
    """Runs' events -> job records: the live overlay at once (on the executor's or mux thread), the store on the
    recorder's own thread, in order."""

    def __init__(
        self,
        store: JobStore,
        results: ResultStore,
        registry: RunRegistry,
        classify: Classifier,
        policy: JobsPolicy,
        observer: JobsObserver,
        retention: Retention,
        live: LiveJobs,
        clock: Callable[[], float],
    ) -> None:
        self.store, self.results, self.registry = store, results, registry
        self.classify, self.policy, self.observer, self._clock = classify, policy, observer, clock
        self._retention, self._live = retention, live
        self._records: queue.Queue[tuple[Run, RunEvent] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._record_loop, name="jobs-record", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Record what was already heard, then end the thread."""
        self._records.put(None)
        self._thread.join(timeout)

    def on_event(self, run: Run, event: RunEvent) -> None:
        """On the executor's (or mux) thread: the live overlay now, the store by the recorder."""
        with self._live.editing(run.job_id) as live:
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
                if self._live.stopping and not run.cancelled.is_set():
                    self.forget(run)  # dropped by the stopping executor: queued again by the next start
                    return
                classified = self.classify(error)  # once: an unexpected error's traceback is logged by it
                if not run.cancelled.is_set() and is_transient(classified[0]):
                    self._requeue(run, classified[2])
                    return
                state = self.finish_failed(run.job_id, error, classified)
                self.forget(run, state)

    def _requeue(self, run: Run, why: str) -> None:
        """The backend went away under the run: its job waits in the queue (where it was) for it to come back."""
        self._write_durably(run.job_id, lambda: self.store.requeue(run.job_id, self.policy.replica))
        log.info("job %s queued again: %s", run.job_id, why, extra={"job_id": run.job_id})
        self.forget(run)

    def _store_result(self, run: Run, res: RunResult) -> None:
        state = "succeeded"
        try:
            with self._content(run, res) as ref:  # held against retention until its record names it
                result = {
                    "sha256": res.result.sha256, "generation": res.generation,
                    "output_type": run.request.output_type, "timings_ms": res.timings_ms,
                    "attention_backend": res.result.attention_backend,
                    "cache": res.result.cache.to_dict() if res.result.cache is not None else None,
                }  # fmt: skip
                done = self._write_durably(run.job_id, lambda: self.store.finish(
                    run.job_id, self.policy.replica, state="succeeded", now=self._clock(), result=result, content=ref,
                ))  # fmt: skip
            if done is None:  # not counted as succeeded: the record says otherwise (or nothing yet)
                state = ""
                log.warning("job %s: its result was not recorded: another replica holds the job now, it ended "
                            "meanwhile, or the store refused it", run.job_id, extra={"job_id": run.job_id})  # fmt: skip
            else:
                log.info("job %s succeeded: %s (%d bytes, sha256 %s)", run.job_id, ref.filename, ref.size,
                         ref.sha256[:16], extra={"job_id": run.job_id, "sha256": ref.sha256})  # fmt: skip
            self._remove_if_deleted(run.job_id)
        except Exception as e:
            log.exception("job %s: storing its result failed", run.job_id)
            state = self.finish_failed(run.job_id, e)  # removes it too, if deleted
        finally:
            if res.media is not None:
                res.media.close()
            self.forget(run, state)

    def _content(self, run: Run, res: RunResult) -> contextlib.AbstractContextManager[ContentRef]:
        rid = run.request.request_id
        if res.media is not None:
            m = res.media
            return self.results.stored(m.chunks(), m.content_type, f"{rid}{m.suffix}")
        tensors = {n: t.contiguous() for n, t in (("video", res.result.video), ("audio", res.result.audio))
                   if t is not None}  # fmt: skip
        content_type, suffix = LATENTS_CONTENT
        return self.results.stored(safetensors.torch.save(tensors), content_type, f"{rid}{suffix}")

    def _write_durably(self, job_id: str, write: Callable[[], T]) -> T | None:
        """`write()` until the store takes it: JobStoreUnavailableError retried with backoff for FINISH_RETRY_S
        (then logged and given up: the job stays held here, and the next start queues it again)."""
        delay, deadline = 0.1, time.monotonic() + FINISH_RETRY_S
        while True:
            try:
                return write()
            except JobStoreUnavailableError as e:
                if time.monotonic() + delay > deadline:
                    log.error("job %s: the job store refused its final write for %.0f s; the next start of this "
                              "replica queues it again", job_id, FINISH_RETRY_S)  # fmt: skip
                    return None
                log.warning("job %s: %s; retrying its final write in %.1f s", job_id, e, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _write_progress(self, job_id: str) -> None:
        """The live job's stage and steps into its record (nothing once it is no longer live here)."""
        snap = self._live.snapshot(job_id)
        if snap is not None:
            self.store.update_progress(job_id, self.policy.replica, stage=snap.stage, steps_done=snap.steps_done,
                                       steps_total=snap.steps_total)  # fmt: skip

    def finish_failed(self, job_id: str, error: BaseException, classified: tuple[str, str, str] | None = None) -> str:
        """Record the job failed (or cancelled) with `error` (`classified` already, or classified here); its final
        state."""
        code, reason, message = classified or self.classify(error)
        state = "cancelled" if code == "CANCELLED" else "failed"
        with contextlib.suppress(JobStoreUnavailableError):  # the outcome matters here, the progress less
            self._write_progress(job_id)  # the steps it really finished, not the last progress written
        self._write_durably(job_id, lambda: self.store.finish(
            job_id, self.policy.replica, state=state, now=self._clock(), error=(code, reason, message)))  # fmt: skip
        level = logging.DEBUG if state == "cancelled" else logging.INFO  # a cancel: the run's own line says it
        log.log(level, "job %s %s: %s (%s)", job_id, state, message, reason, extra={"job_id": job_id, "reason": reason})
        self._remove_if_deleted(job_id)
        return state

    def forget(self, run: Run, state: str = "") -> None:
        self.registry.release(run)
        live = self._live.pop(run.job_id)
        if state and live is not None and live.started_at is not None:
            self.observer.ran(state, max(0.0, self._clock() - live.started_at))
        self._live.changed()  # watchers see it, and the dispatcher (waiting on the same condition) may take the next

    def _remove_if_deleted(self, job_id: str) -> None:
        record = self.store.get_any(job_id)
        if record is not None and record.deleted and record.state in TERMINAL:
            self._retention.remove(job_id)


class Dispatcher:
    """Stored jobs -> runs on the executor, on the dispatcher's own thread; starts and stops the recorder too."""

    def __init__(
        self,
        store: JobStore,
        registry: RunRegistry,
        decode: Decoder,
        policy: JobsPolicy,
        retention: Retention,
        live: LiveJobs,
        recorder: Recorder,
        clock: Callable[[], float],
        serving: Callable[[], bool] = lambda: True,
    ) -> None:
        self._serving = serving
        """Whether the backend serves now (attached to its sidecar, weights loaded): no claim while it does not."""
        self.store, self.registry, self.executor = store, registry, registry.executor
        self._decode, self.policy, self._clock = decode, policy, clock
        self._retention, self._live, self._recorder = retention, live, recorder
        self._thread = threading.Thread(target=self._dispatch_loop, name="jobs-dispatch", daemon=True)

    def start(self) -> None:
        again = self.store.requeue_owned(self.policy.replica)
        if again:
            log.info("jobs: %d unfinished job(s) of replica %s queued again: %s", len(again), self.policy.replica,
                     ", ".join(again))  # fmt: skip
        self._recorder.start()
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """After the executor stopped and `LiveJobs.stop`: record what finished, then end both threads."""
        self._recorder.stop(timeout)
        self._thread.join(timeout)

    def cancel_here(self, job_id: str) -> None:
        """Cancel the job's run if our executor holds it."""
        run = self.registry.get(job_id)
        if run is not None:
            self.registry.cancel(run)  # withdrawn now (Failed follows), or stopped at its next check

    def _dispatch_loop(self) -> None:
        next_renew = next_retention = 0.0
        while True:
            if not self._live.wait_tick(self.policy.poll_s):
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
        if self._live.stopping or not self.executor.has_room or not self._serving():
            return False
        return self.executor.waiting(lambda j: bool(j.job_id)) < DISPATCH_AHEAD

    def _dispatch_one(self) -> bool:
        """Claim the oldest queued job and submit it as a run; False when there is none."""
        p = self.policy
        record = self.store.claim_next(p.replica, p.claim_s, self._clock(), p.max_attempts)
        if record is None:
            return False
        try:
            run = self._run_of(record)
        except Exception as e:
            self._recorder.finish_failed(record.job_id, e)
            return True
        self._live.add(record.job_id, LiveJob(run, record.created_at, steps_total=record.steps_total))
        run.subscribe(self._recorder.on_event)
        try:
            self.registry.submit(run)
        except Exception as e:
            self._live.pop(record.job_id)
            classified = self._recorder.classify(e)
            if isinstance(e, QueueFullError) or is_transient(classified[0]):
                self.store.unclaim(record.job_id, p.replica)  # a Generate took the room; stopping; backend gone
                return False
            self._recorder.finish_failed(record.job_id, e, classified)  # refused (e.g. expected_generation moved on)
        return True

    def _run_of(self, record: Job) -> Run:
        stored = self.store.request_of(record.job_id)
        if stored is None:
            raise ValueError(f"job {record.job_id}: its stored request is gone")
        request, expected = self._decode(*stored)
        return Run(request, job_id=record.job_id, expected_generation=expected)

    def _renew(self) -> None:
        p = self.policy
        for job_id in self.store.renew_claims(p.replica, p.claim_s, self._clock()):
            self.cancel_here(job_id)
        held = self.store.holding(p.replica)
        for job_id in self._live.ids():
            if job_id not in held:  # our claim lapsed and another replica took the job (or it ended meanwhile)
                log.warning("job %s: another replica holds it now; its run here stops", job_id,
                            extra={"job_id": job_id})  # fmt: skip
                self.cancel_here(job_id)
