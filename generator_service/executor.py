"""Request queue and the one denoise executor (no gRPC).

Admission runs only cheap checks, the queue's capacity first (a flood against a full queue is refused in
milliseconds): then H3's rules and the operator's limits (keyframes by their headers and structure only: their pixels
are decoded when the job runs, one job at a time, on the executor thread), check the request can ever
fit the slab, check its modeled activation peak (ditcore.sizing) against the device's free memory
(RequestTooLargeForDeviceError), check `expected_generation`, then enqueue (bounded; full ->
QueueFullError). Every lease carries a bound on one of the request's steps (`step_bound_s`: the
modeled step time x a factor, or the slowest step seen, whichever is larger), and a weight update's
drain waits for the running request as long as its own remaining time (`drain`). One
executor thread runs jobs in order: lease plans (or take the prefetched lease), check the
lease's slot-table rows, run `ditcore.generate` (diffusers' t2va loop) with cancellation /
deadline / sidecar-session checks after every transformer forward, release the lease in every
outcome. The release comes after the reading is finished: `generate` waits for an event
recorded after the last kernel that reads a leased slot (`ditcore.model.reads_finished`)
before it releases, in every outcome. On session loss (the check after a step fails) the job
stops issuing work, `generate` synchronizes, and only then is the lease released and the
failure acknowledged to the client. While a job denoises, a prefetch thread prepares the next queued job's plans, so a
rebuild overlaps compute (both leases must fit the slab; if not, the next job simply prepares
when it starts).

Media output types ("mp4", "frames_and_wav"): `generate` decodes (under the model lock, after the
lease is released); encoding the file ("mux", `ditcore.media.encode`) needs no model, so a mux
thread does it while the executor thread starts the next job. At most one job muxes at a time
(a finished job waits for the mux thread before the executor takes another, which bounds the
decoded media held at two jobs'). Cancel and the deadline are checked between decode chunks and in the encoders'
frame loops too.

A finished job keeps its queue slot until its RPC says the result was sent or the call ended (`delivered`): a client
that reads its result slowly, or not at all, holds a slot, so such clients cannot pile up results beyond
`max_queue_depth` (the server's send watchdog ends a stalled one: generator_service.streams). A cancelled job that is
still queued leaves the queue at once (`withdraw`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ditcore import GenerationRequest, GenerationResult, H3Model, PlanKey, RequestError, RequestLimits, generate
from ditcore.keyframes import MediaError
from ditcore.media import EncodedMedia, encode
from ditcore.model import StepCallback
from ditcore.request import KEYFRAME_FIELDS, forget_decoded_keyframes
from ditcore.sizing import MAX_STEP_BOUND_S
from ditruntime.errors import GenerationMismatchError

from .backend import Backend, ServedLease, check_prompt_tokens
from .config import LIMITED_FIELDS, MIB, SizingPolicy
from .errors import (
    CancelledError,
    DeadlineExceededError,
    GeneratorError,
    LeaseCheckError,
    MediaEncodeError,
    NotServingError,
    QueueFullError,
    SidecarUnavailableError,
)
from .jobs import Decoding, Failed, Finished, Job, JobEvent, JobResult, Muxing, PlansReady, Queued, Started, StepDone

log = logging.getLogger(__name__)

FinishListener = Callable[[Job, JobResult | None, BaseException | None], None]
"""Called once per job that ran: (job, result, None) or (job, None, error)."""
DRAIN_SLACK_S = 30.0
"""Added to a derived drain bound (scheduling, the lease release, a prefetch still in flight)."""
DRAIN_POLL_S = 0.1
"""How often a drain re-reads its clock (and a derived one re-estimates the running request's remaining time)."""
DRAIN_RATE_WINDOW = 16
"""Queue slots freed (jobs done) the drain rate is measured over."""
RETRY_AFTER_S = (1.0, 600.0)
"""The bounds of the retry delay a full queue suggests (RetryInfo)."""


Denoise = Callable[
    [H3Model, GenerationRequest, "ServedLease | None", StepCallback, RequestLimits, Callable[[], None]],
    GenerationResult,
]
"""The executor's denoise step: (model, request, lease, on_step, limits, check) -> result, the lease released in
every outcome. One device: `denoise_here` (ditcore.generate); a replica of N ranks: ReplicaLink.run."""


def denoise_here(
    model: H3Model,
    request: GenerationRequest,
    lease: ServedLease | None,
    on_step: StepCallback,
    limits: RequestLimits,
    check: Callable[[], None],
) -> GenerationResult:
    """One device's denoise step: ditcore.generate (it releases the lease in every outcome once acquired)."""
    provider = _Prefetched(lease) if lease is not None else None
    return generate(model, request, provider, on_step=on_step, limits=limits, check=check)


def check_request(request: GenerationRequest, limits: RequestLimits) -> None:
    """H3's rules and the operator's limits; a refusal over an operator limit names its flag."""
    try:
        request.validate(limits)
    except RequestError as e:
        note = _operator_limit(request, limits, e)
        if note:
            raise RequestError(e.field, f"{e.description} (this server's {note})") from e
        raise


def _operator_limit(request: GenerationRequest, limits: RequestLimits, e: RequestError) -> str:
    """'--flag is value' of the operator limit `e` broke ("" if it broke H3's own rule or a format rule)."""
    if e.field in KEYFRAME_FIELDS:  # the limit ditcore.media names on the MediaError behind it
        broken = e.__cause__.limit if isinstance(e.__cause__, MediaError) else ""
        if broken == "max_bytes":
            return f"--max-keyframe-mb is {limits.max_keyframe_bytes / MIB:g}"
        if broken == "max_pixels":
            return f"--max-keyframe-pixels is {limits.max_keyframe_pixels}"
        return ""
    if e.field.startswith("references"):  # ditcore.references' limit names, behind the MediaError
        broken = e.__cause__.limit if isinstance(e.__cause__, MediaError) else ""
        flags = {
            "max_bytes": f"--max-reference-mb is {limits.max_reference_bytes / MIB:g}",
            "max_total_bytes": f"--max-references-mb is {limits.max_references_bytes / MIB:g}",
            "max_seconds": f"--max-reference-seconds is {limits.max_reference_seconds:g}",
            "max_frame_pixels": f"--max-reference-frame-pixels is {limits.max_reference_frame_pixels}",
            "max_decoded_bytes": f"--max-reference-decoded-mb is {limits.max_reference_decoded_bytes / MIB:g}",
            "max_pixels": f"--max-keyframe-pixels is {limits.max_keyframe_pixels}",
        }
        return flags.get(broken, "")
    if e.field == "num_frames" and request.height * request.width * request.num_frames > limits.max_video_pixels:
        return f"--max-video-pixels is {limits.max_video_pixels}"
    attr = LIMITED_FIELDS.get(e.field)
    if attr is None:
        return ""
    value = getattr(request, e.field)
    size = len(value.encode("utf-8")) if isinstance(value, str) else value
    limit = getattr(limits, attr)
    if isinstance(size, int) and size > limit:  # a side over its own limit is named before the area
        return "--" + attr.replace("_", "-") + f" is {limit}"
    if e.field in ("height", "width") and request.height * request.width > limits.max_pixels:
        return f"--max-canvas-pixels is {limits.max_pixels}"
    return ""


@dataclass
class _Denoised:
    """A job whose loop (and decoding, for media) is done: what finishing it needs."""

    job: Job
    result: GenerationResult
    generation: int
    started: float  # perf_counter when the executor took the job


class _Prefetched:
    """A PlanProvider that hands out an already-prepared lease (for the keys it was prepared for)."""

    def __init__(self, lease: ServedLease) -> None:
        self._lease = lease

    def acquire(self, keys: Sequence[PlanKey]) -> ServedLease:
        if list(keys) != list(self._lease.keys):
            raise LeaseCheckError("the leased plans are not the request's plan keys")
        return self._lease


@dataclass
class _Progress:
    """The steps of the job that is denoising (under the executor's lock). The job is held weakly: a finished job's
    request and events are not kept alive by its progress."""

    job: weakref.ref[Job]
    done: int
    at: float  # the executor's clock at the last step
    slowest_s: float = 0.0  # its slowest step so far (from its second step: the first one includes the encoding)


class Executor:
    """`prefetch` only helps a backend that leases plans (cached mode). Every request is validated
    against `limits` (H3's rules, tightened by the operator's flags) and, with `sizing.memory_check`,
    its modeled activation peak against the device's free memory. `clock` (monotonic seconds) times
    the steps and the drain; tests inject one."""

    def __init__(
        self,
        backend: Backend,
        max_queue_depth: int,
        prefetch: bool,
        on_finish: FinishListener | None = None,
        limits: RequestLimits | None = None,
        sizing: SizingPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        denoise: Denoise | None = None,
    ) -> None:
        self.backend = backend
        self._run_request: Denoise = denoise if denoise is not None else denoise_here
        self.limits = limits if limits is not None else RequestLimits()
        self.sizing = sizing if sizing is not None else SizingPolicy()
        self._clock = clock
        self._progress: _Progress | None = None
        self._slowest_step_s = 0.0  # the slowest step observed on this server
        self._on_finish: FinishListener = on_finish or (lambda *_: None)
        self.max_queue_depth = max_queue_depth
        self.prefetch = prefetch
        self._lock = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._delivering: set[Job] = set()  # finished jobs whose results their RPCs are still sending
        self._freed: collections.deque[float] = collections.deque(maxlen=DRAIN_RATE_WINDOW)  # when slots freed
        self._stopping = False
        self._paused = False
        self._thread = threading.Thread(target=self._loop, name="executor", daemon=True)
        self._prefetch_wakeup = threading.Event()
        self._prefetch_thread = threading.Thread(target=self._prefetch_loop, name="prefetch", daemon=True)
        self._muxing: _Denoised | None = None  # handed to the mux thread (under _lock)
        self._mux_stopping = False
        self._mux_thread = threading.Thread(target=self._mux_loop, name="mux", daemon=True)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()
        self._mux_thread.start()
        if self.prefetch:
            self._prefetch_thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._stopping = True
            pending = list(self._queue)
            self._queue.clear()
            self._lock.notify_all()
        for job in pending:
            self._drop(job, NotServingError("the generator is shutting down"))
        self._prefetch_wakeup.set()
        end = time.monotonic() + timeout
        self._thread.join(timeout)
        with self._lock:  # the mux thread finishes the job it holds, then exits
            self._mux_stopping = True
            self._lock.notify_all()
        if self._mux_thread.is_alive():
            self._mux_thread.join(max(0.0, end - time.monotonic()))

    # ---------------------------------------------------------------- admission
    @property
    def queue_depth(self) -> int:
        """Jobs waiting, running, muxing or being sent (each holds a queue slot until its result is sent)."""
        with self._lock:
            return self._depth()

    def _depth(self) -> int:  # under _lock
        return len(self._queue) + (self._running is not None) + (self._muxing is not None) + len(self._delivering)

    def _check_capacity(self) -> int:  # under _lock
        if self._stopping:
            raise NotServingError("the generator is shutting down")
        depth = self._depth()
        if depth >= self.max_queue_depth:
            raise QueueFullError(
                f"the queue is full ({depth} of {self.max_queue_depth} requests, --max-queue-depth); retry later",
                self._retry_after_s(),
                "--max-queue-depth",
                {"queue_depth": str(depth), "max_queue_depth": str(self.max_queue_depth)},
            )
        return depth

    @property
    def has_room(self) -> bool:
        """A submit now would not be refused for the queue's capacity."""
        with self._lock:
            return not self._stopping and self._depth() < self.max_queue_depth

    def retry_after_s(self) -> float:
        """How long until a queue slot is likely free: the measured drain rate's interval between freed slots (the
        last DRAIN_RATE_WINDOW), else the running job's modeled remaining time; within RETRY_AFTER_S."""
        with self._lock:
            return self._retry_after_s()

    def _retry_after_s(self) -> float:  # under _lock
        low, high = RETRY_AFTER_S
        if len(self._freed) >= 2:
            interval = (self._freed[-1] - self._freed[0]) / (len(self._freed) - 1)
        elif self._running is not None:
            interval = self.remaining_s(self._running.request) - DRAIN_SLACK_S
        else:
            interval = low
        return round(min(high, max(low, interval)), 3)

    def _slot_freed(self) -> None:  # under _lock: a job left the running, muxing or delivering slot
        self._freed.append(self._clock())

    def position(self, job: Job) -> int | None:
        """The job's place in the queue (0 = runs next), None when it is not waiting there."""
        with self._lock:
            try:
                return self._queue.index(job)
            except ValueError:
                return None

    def waiting(self, which: Callable[[Job], bool] = lambda job: True) -> int:
        """Jobs waiting in the queue that `which` selects."""
        with self._lock:
            return sum(1 for job in self._queue if which(job))

    def check(self, job: Job) -> None:
        """Admission's checks but the queue's capacity: H3's rules and the operator's limits, the prompt's tokens,
        the slab, the modeled memory, the expected generation. Raises what `submit` would."""
        check_request(job.request, self.limits)
        self.backend.check_partition(job.request)
        tokens = check_prompt_tokens(self.backend, job.request, self.limits)  # the served tokenizer: ~8 ms for 16 KB
        self.backend.check_fits(job.request)
        self.backend.check_split(job.request, tokens)
        if self.sizing.memory_check:
            with self._lock:
                running = self._running.request if self._running is not None else None
            self.backend.check_memory(job.request, running, self.sizing.memory_reserve_bytes)
        self._check_generation(job)

    def submit(self, job: Job) -> int:
        """Admit a job; returns its queue position (0 = runs next). Raises before enqueueing. Only cheap checks run
        here (no keyframe pixel is decoded), the queue's capacity first."""
        with self._lock:
            self._check_capacity()
        self.check(job)
        with self._lock:
            depth = self._check_capacity()
            self._queue.append(job)
            self._lock.notify_all()
        job.emit(Queued(depth))
        self._prefetch_wakeup.set()
        return depth

    def delivered(self, job: Job) -> None:
        """The job's RPC sent its result, or ended (idempotent): its queue slot is free."""
        with self._lock:
            job.rpc_over = True
            if job in self._delivering:
                self._delivering.discard(job)
                self._slot_freed()
                self._lock.notify_all()

    def withdraw(self, job: Job) -> bool:
        """Cancel a job and take it out of the queue at once (True), if it is still waiting there. Never waits (grpc
        calls this when an RPC ends): a prefetch still running for it releases the lease it gets (_prefetch_loop);
        either side takes the lease under the lock, so exactly one releases it."""
        job.cancel()
        with self._lock:
            if job not in self._queue:
                return False
            self._queue.remove(job)
            lease, job.prefetched = job.prefetched, None
            self._lock.notify_all()
        if lease is not None:
            lease.release()
        job.emit(Failed(CancelledError(f"request {job.request.request_id} was cancelled while queued")))
        return True

    def _emit_finished(self, job: Job, final: JobEvent) -> None:
        """Send the job's final event; a result keeps the job's queue slot until `delivered` (under _lock: the
        caller frees the running or muxing slot in the same critical section)."""
        if isinstance(final, Finished) and not job.rpc_over:
            self._delivering.add(job)
        else:
            self._slot_freed()

    def _check_generation(self, job: Job) -> None:
        if job.expected_generation is not None:
            current = self.backend.generation()
            if current != job.expected_generation:
                raise GenerationMismatchError(current, job.expected_generation)

    # ---------------------------------------------------------------- drain (weight updates)
    def pause(self) -> None:
        """Stop starting queued jobs (they wait); the running one goes on."""
        with self._lock:
            self._paused = True

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for the running job to finish and release every prefetched lease.

        Call after `pause()`. `timeout_s` bounds the wait; None (the default) waits as long as the running job's own
        remaining time (`remaining_s`, re-estimated after each of its steps), so a job that keeps stepping is waited
        for and one that stalls is not, and then up to DRAIN_SLACK_S for a prefetch in flight. Returns False when
        the bound passes with the job still running (or a prefetch still holding a lease).
        """
        start = self._clock()
        with self._lock:
            while self._running is not None:
                now = self._clock()
                end = start + timeout_s if timeout_s is not None else self._drain_deadline(self._running, start)
                if now >= end:
                    return False
                self._lock.wait(min(end - now, DRAIN_POLL_S))  # re-read on the executor's clock
            jobs = list(self._queue)
        end = start + timeout_s if timeout_s is not None else self._clock() + DRAIN_SLACK_S
        for job in jobs:
            if job.prefetching and not job.prefetch_done.wait(max(0.0, end - self._clock())):
                return False  # a prefetch still holds (or is about to hold) a lease
            lease, job.prefetched = job.prefetched, None
            if lease is not None:
                lease.release()
        return True

    def _drain_deadline(self, job: Job, start: float) -> float:
        """When a derived drain gives up on `job` (under _lock): its last step (or the drain's start) plus its
        remaining time."""
        progress = self._progress if self._progress is not None and self._progress.job() is job else None
        since = max(start, progress.at) if progress is not None else start
        return since + self.remaining_s(job.request, progress)

    def remaining_s(self, request: GenerationRequest, progress: _Progress | None = None) -> float:
        """A bound on the rest of a request: (steps left x its slowest observed step, else the modeled one, + the
        encoding before its first step + its decode) x `sizing.step_time_factor`, + DRAIN_SLACK_S."""
        sizer = self.backend.sizer()
        done = progress.done if progress is not None else 0
        if progress is not None and progress.slowest_s > 0:
            step_s = progress.slowest_s
        else:
            step_s = sizer.step_s(request) if sizer is not None else 0.0
        left = max(0, request.steps - done) * step_s
        if sizer is not None:
            left += (sizer.encode_s(request) if done == 0 else 0.0) + sizer.decode_s(request)
        return left * self.sizing.step_time_factor + DRAIN_SLACK_S

    def step_bound_s(self, request: GenerationRequest) -> float:
        """The bound on one denoise step of `request` each PreparePlans carries: the larger of its modeled step time x
        `sizing.step_time_factor` and the slowest step observed on this server (at most MAX_STEP_BOUND_S)."""
        sizer = self.backend.sizer()
        modeled = sizer.step_s(request) * self.sizing.step_time_factor if sizer is not None else 0.0
        with self._lock:
            observed = self._slowest_step_s
        return min(max(modeled, observed), MAX_STEP_BOUND_S)

    def _observe_step(self, job: Job, done: int) -> None:
        """After each forward of the running job: its progress, and its step time from its second step on."""
        now = self._clock()
        with self._lock:
            progress = self._progress
            if progress is None or progress.job() is not job:
                self._progress = _Progress(weakref.ref(job), done, now)
            else:
                step_s = (now - progress.at) / max(1, done - progress.done)
                progress.slowest_s = max(progress.slowest_s, step_s)
                self._slowest_step_s = max(self._slowest_step_s, step_s)
                progress.done, progress.at = done, now
            self._lock.notify_all()  # a derived drain re-estimates

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._lock.notify_all()
        self._prefetch_wakeup.set()

    # ---------------------------------------------------------------- executor
    def _loop(self) -> None:
        while True:
            with self._lock:
                while (not self._queue or self._paused) and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
                self._running = job
            final: JobEvent | _Denoised
            try:
                final = self._run(job)
                if isinstance(final, _Denoised) and not final.job.request.decodes:
                    final = self._finish(final)
            except BaseException as e:  # never let the executor die
                log.exception("executor: unexpected error")
                final = Failed(e)
            if isinstance(final, _Denoised):
                self._hand_to_muxer(final)
            else:
                with self._lock:  # a failure frees the queue slot before the client hears back; a result keeps it
                    self._running = None
                    self._emit_finished(job, final)
                    self._lock.notify_all()
                job.emit(final)  # a Failed error leaves with its traceback's frame locals cleared (Job.emit)
            # This frame runs until the server stops: the job, its result or its error (whose traceback reached the
            # loop's view of the slab) must not stay in it until the next job; nor its decoded keyframes.
            del job, final
            forget_decoded_keyframes()

    def _run(self, job: Job) -> JobEvent | _Denoised:
        """Run one job's loop; returns its failure, or what finishing it (muxing, results) needs."""
        started = time.perf_counter()
        job.emit(Started())
        if job.prefetching:
            job.prefetch_done.wait()
        lease = job.prefetched
        job.prefetched = None
        try:
            self._check_live(job)
            self._check_generation(job)
            job.request.keyframes(self.limits)  # their pixels, decoded here (one job at a time), before any lease
            if lease is None:
                lease = self._acquire(job)
            if lease is not None:
                self.backend.verify(lease)
                job.emit(PlansReady(lease.report, lease.generation))
            self._prefetch_wakeup.set()  # the next job's plans can build while this one denoises
            result, generation = self._denoise(job, lease)
        except BaseException as e:
            if lease is not None:
                lease.release()
            self._on_finish(job, None, e)
            return Failed(e)
        return _Denoised(job, result, generation, started)

    def _finish(self, done: _Denoised, media: EncodedMedia | None = None, mux_ms: float = 0.0) -> Finished:
        """The job's result: timings, the log line, the finish listener."""
        job, result, generation = done.job, done.result, done.generation
        timings = {
            "queue_ms": round((done.started - job.admitted_at) * 1000, 3),
            "prepare_ms": round(job.prepare_ms, 3),
            "encode_ms": result.timings_ms.get("encode", 0.0),
            "denoise_ms": result.timings_ms.get("denoise", 0.0),
            "decode_ms": result.timings_ms.get("decode", 0.0),
            "mux_ms": round(mux_ms, 3),
            "total_ms": round((time.perf_counter() - job.admitted_at) * 1000, 3),
        }
        output = job.request.output_type
        log.info(
            "request %s done: generation %d sha256 %s output %s%s timings %s attention %s cache %s",
            job.request.request_id, generation, result.sha256[:16], output,
            f" ({media.size} bytes)" if media is not None else "", timings, result.attention_backend, result.cache,
            extra={"request_id": job.request.request_id, "generation": generation, "sha256": result.sha256,
                   "timings_ms": timings, "attention_backend": result.attention_backend,
                   "cache": result.cache.to_dict() if result.cache else None,
                   "task": job.request.task, "steps": job.request.steps, "output_type": output,
                   "media_bytes": media.size if media is not None else None},
        )  # fmt: skip
        finished = JobResult(dataclasses.replace(result, media=None), generation, timings, media)
        self._on_finish(job, finished, None)
        return Finished(finished)

    # ---------------------------------------------------------------- mux (media output types)
    def _hand_to_muxer(self, done: _Denoised) -> None:
        """Give a decoded job to the mux thread once it is free (the job moves from running to muxing)."""
        with self._lock:
            while self._muxing is not None and not self._mux_stopping:
                self._lock.wait()
            if not self._mux_stopping:
                self._running, self._muxing = None, done
                self._lock.notify_all()
                return
        final = self._mux(done)  # shutting down: no mux thread to take it
        with self._lock:
            self._running = None
            self._emit_finished(done.job, final)
            self._lock.notify_all()
        done.job.emit(final)

    def _mux_loop(self) -> None:
        while True:
            with self._lock:
                while self._muxing is None and not self._mux_stopping:
                    self._lock.wait()
                done = self._muxing
                if done is None:
                    return
            final: JobEvent
            try:
                final = self._mux(done)
            except BaseException as e:  # never let the mux thread die
                log.exception("mux: unexpected error")
                final = Failed(e)
            with self._lock:  # as in _loop: a result keeps the queue slot until it is sent
                self._muxing = None
                self._emit_finished(done.job, final)
                self._lock.notify_all()
            done.job.emit(final)
            del done, final  # as in _loop: nothing of the job (its media, its error) waits here for the next one

    def _mux(self, done: _Denoised) -> JobEvent:
        """Encode the decoded media as the request's output type and finish the job."""
        job, media = done.job, done.result.media
        try:
            self._check_live(job)  # a cancelled or late request is not encoded for nobody
            if media is None:
                raise MediaEncodeError(f"request {job.request.request_id} has no decoded media to encode")
            job.emit(Muxing(job.request.output_type))
            t0 = time.perf_counter()
            try:
                encoded = encode(media, job.request.output_type, check=lambda: self._check_live(job))
            except GeneratorError:  # cancelled or past its deadline while encoding
                raise
            except Exception as e:
                raise MediaEncodeError(f"encoding the {job.request.output_type} failed: {e}") from e
            mux_ms = (time.perf_counter() - t0) * 1000
        except BaseException as e:
            self._on_finish(job, None, e)
            return Failed(e)
        return self._finish(done, encoded, mux_ms)

    def _acquire(self, job: Job) -> ServedLease | None:
        """The job's plans, leased now; None in resident mode (the model has no plans to lease)."""
        t0 = time.perf_counter()
        lease = self.backend.acquire(job.request, self.step_bound_s(job.request))
        if lease is not None:
            job.prepare_ms += (time.perf_counter() - t0) * 1000
        return lease

    def _denoise(self, job: Job, lease: ServedLease | None) -> tuple[GenerationResult, int]:
        def on_step(done: int, total: int) -> None:
            self._observe_step(job, done)
            self._check_live(job, lease)
            job.emit(StepDone(done, total))
            if done == total and job.request.decodes:  # the loop is done: decoding starts next
                job.emit(Decoding(job.request.output_type))

        with self.backend.model_lock:
            generation = lease.generation if lease is not None else self.backend.generation()
            # the denoise step releases the lease in every outcome
            model = self.backend.model()
            result = self._run_request(model, job.request, lease, on_step, self.limits, lambda: self._check_live(job))
        if lease is not None and not self.backend.alive(lease):
            # The session ended between the last step's check and the end of its reads (generate() waits for
            # them before releasing): the slots may have been retired and refilled, so the result is not trusted.
            raise SidecarUnavailableError("the plan-cache sidecar session ended before the request's reads finished")
        return result, generation

    def _check_live(self, job: Job, lease: ServedLease | None = None) -> None:
        if job.cancelled.is_set():
            raise CancelledError(f"request {job.request.request_id} was cancelled")
        if job.deadline is not None and time.monotonic() > job.deadline:
            raise DeadlineExceededError(f"request {job.request.request_id} ran past its deadline")
        if lease is not None and not self.backend.alive(lease):
            raise SidecarUnavailableError("the plan-cache sidecar went away during the request")

    def _drop(self, job: Job, err: GeneratorError) -> None:
        lease, job.prefetched = job.prefetched, None
        if lease is not None:
            lease.release()
        job.emit(Failed(err))

    # ---------------------------------------------------------------- prefetch
    def _prefetch_loop(self) -> None:
        while True:
            self._prefetch_wakeup.wait()
            self._prefetch_wakeup.clear()
            with self._lock:
                if self._stopping:
                    return
                if self._paused:
                    continue
                job = next((j for j in self._queue if not j.prefetching and j.prefetched is None), None)
                if job is None or self._queue[0] is not job or job.cancelled.is_set():
                    continue
                job.prefetching = True
                # a job can be prefetched again (drain released its lease, or a prefetch failed):
                # waiters must wait for *this* prefetch, not see the last one's event still set
                job.prefetch_done.clear()
            try:
                job.prefetched = self._acquire(job)
            except Exception as e:  # e.g. both leases do not fit: the job prepares when it runs
                log.debug("prefetch for %s skipped: %s", job.request.request_id, e)
            finally:
                job.prefetching = False
                job.prefetch_done.set()
            if job.cancelled.is_set():
                with self._lock:  # withdraw takes the lease under the lock too: one of the two releases it
                    lease = None
                    if job not in self._queue:
                        lease, job.prefetched = job.prefetched, None
                if lease is not None:
                    lease.release()
