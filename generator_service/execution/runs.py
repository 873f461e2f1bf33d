"""A run (one admitted request, from a Generate call or a durable job) and the events it sends, in order, to every
watcher: Queued, Started (the executor took it), PlansReady (cached mode), StepDone per denoise step, Decoding (media
output types: the loop is done, decoding begins), Muxing (decoded; encoding the file begins), and one final Failed or
Finished. `events` is the watcher its creator reads; `watch()` adds more, `subscribe()` a listener called on the
emitting thread. Watchers dispatch on events with `match`. No grpc here.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from ditcore import GenerationRequest, GenerationResult
from ditcore.media import EncodedMedia
from ditcore.pipeline import quiet_block_errors
from ditcore.report import CacheReport

from ..backends.base import ServedLease
from ..errors import CancelledError, DeadlineExceededError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunResult:
    result: GenerationResult
    """The latents (always: their sha256 names the result) and the cache report; its decoded `media` is dropped
    once encoded."""
    generation: int
    timings_ms: dict[str, float]  # queue_ms, prepare_ms, encode_ms, denoise_ms, decode_ms, mux_ms, total_ms
    media: EncodedMedia | None = None
    """The encoded file (output types "mp4" and "frames_and_wav"); None for "latents"."""


@dataclass(frozen=True)
class Queued:
    position: int  # 0 = runs next


@dataclass(frozen=True)
class Started:
    """The executor took the run (it is running from here on)."""


@dataclass(frozen=True)
class PlansReady:
    report: CacheReport
    generation: int


@dataclass(frozen=True)
class StepDone:
    step: int  # steps done so far, 1-based
    total: int


@dataclass(frozen=True)
class Decoding:
    output_type: str  # the last step is done; decoding (then muxing) this output type begins


@dataclass(frozen=True)
class Muxing:
    output_type: str  # decoded; encoding the file begins


@dataclass(frozen=True)
class Failed:
    error: BaseException
    """Emitted with no frame locals left in its traceback (`Run.emit`, `forget_frame_locals`)."""


@dataclass(frozen=True)
class Finished:
    result: RunResult


RunEvent = Queued | Started | PlansReady | StepDone | Decoding | Muxing | Failed | Finished
RunListener = Callable[["Run", RunEvent], None]
"""Told each event on the thread that emits it (the executor's, the mux thread's): must be quick and never raise."""


@dataclass(eq=False)
class Run:
    """One admitted request on its way through the executor, the durable job it runs for (`job_id`: the jobs API's,
    or "" for a Generate call) and the watchers its events flow to. `cancel` is the run's own: the executor checks it
    after every step, and the registry that owns the run also takes it out of the queue
    (generator_service.execution.registry)."""

    request: GenerationRequest
    job_id: str = ""
    expected_generation: int | None = None
    deadline: float | None = None  # time.monotonic() seconds
    admitted_at: float = field(default_factory=time.perf_counter)
    events: queue.Queue[RunEvent] = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    prefetched: ServedLease | None = None
    prefetching: bool = False
    prefetch_done: threading.Event = field(default_factory=threading.Event)
    prepare_ms: float = 0.0
    rpc_over: bool = False  # its RPC ended (the executor's lock guards it): a result no longer holds a queue slot
    _watchers: list[queue.Queue[RunEvent]] = field(default_factory=list, repr=False)
    _listeners: list[RunListener] = field(default_factory=list, repr=False)
    _watch_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stage: str = field(default="queued", repr=False)  # where it is, and its steps done of total: what a stop logs
    _steps: tuple[int, int] = field(default=(0, 0), repr=False)

    def cancel(self) -> None:
        self.cancelled.set()

    def check_live(self) -> None:
        """CancelledError once cancelled, DeadlineExceededError past its deadline: checked after every step, between
        decode chunks and in the encoders' frame loops."""
        if self.cancelled.is_set():
            raise CancelledError(f"request {self.request.request_id} was cancelled")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise DeadlineExceededError(f"request {self.request.request_id} ran past its deadline")

    def watch(self) -> queue.Queue[RunEvent]:
        """Another watcher: a queue of every event from now on."""
        q: queue.Queue[RunEvent] = queue.Queue()
        with self._watch_lock:
            self._watchers.append(q)
        return q

    def unwatch(self, q: queue.Queue[RunEvent]) -> None:
        with self._watch_lock:
            if q in self._watchers:
                self._watchers.remove(q)

    def subscribe(self, listener: RunListener) -> None:
        with self._watch_lock:
            self._listeners.append(listener)

    def emit(self, event: RunEvent) -> None:
        self._note(event)
        if isinstance(event, Failed):  # whoever keeps the error from here on keeps none of the request's tensors
            forget_frame_locals(event.error)
        with self._watch_lock:
            watchers, listeners = list(self._watchers), list(self._listeners)
        self.events.put(event)
        for q in watchers:
            q.put(event)
        for listener in listeners:
            try:
                listener(self, event)
            except Exception:  # a listener's fault must not stop the executor
                log.exception("run %s: event listener failed", self.job_id or self.request.request_id)

    def _note(self, event: RunEvent) -> None:
        """Where the run got to; a stop (cancel, deadline) is a normal end: one line, no traceback."""
        match event:
            case Started():
                self._stage = "preparing"
            case StepDone(step, total):
                self._stage, self._steps = "denoising", (step, total)
            case Decoding():
                self._stage = "decoding"
            case Muxing():
                self._stage = "muxing"
            case Failed(error) if isinstance(error, RUN_STOPS):
                what = "cancelled" if isinstance(error, CancelledError) else "stopped at its deadline"
                job = f" (job {self.job_id})" if self.job_id else ""
                done, total = self._steps
                rid = self.request.request_id
                log.info("request %s%s %s while %s, after step %d of %d", rid, job, what, self._stage, done,
                         total or self.request.steps, extra={"request_id": rid, "job_id": self.job_id})  # fmt: skip


RUN_STOPS = (CancelledError, DeadlineExceededError)
"""What `Run.check_live` raises: a run stopped on purpose, raised from the step callback or the decode's check
through diffusers' blocks."""


def quiet_run_stops() -> None:
    """A run's stop passes diffusers' blocks quietly (Run.emit logs it in one line); any other error's records stay."""
    quiet_block_errors(*RUN_STOPS)


FinishListener = Callable[[Run, RunResult | None, BaseException | None], None]
"""Called once per run that the executor took: (run, result, None) or (run, None, error)."""


@dataclass
class Denoised:
    """A run whose loop (and decoding, for media) is done: what finishing it needs."""

    run: Run
    result: GenerationResult
    generation: int
    started: float  # perf_counter when the executor took the run

    def outcome(self, media: EncodedMedia | None = None, mux_ms: float = 0.0) -> RunResult:
        """The run's result (its stage timings; decoded media dropped, `media` the encoded file), logged."""
        run, result, generation = self.run, self.result, self.generation
        timings = {
            "queue_ms": round((self.started - run.admitted_at) * 1000, 3),
            "prepare_ms": round(run.prepare_ms, 3),
            "encode_ms": result.timings_ms.get("encode", 0.0),
            "denoise_ms": result.timings_ms.get("denoise", 0.0),
            "decode_ms": result.timings_ms.get("decode", 0.0),
            "mux_ms": round(mux_ms, 3),
            "total_ms": round((time.perf_counter() - run.admitted_at) * 1000, 3),
        }
        output = run.request.output_type
        log.info(
            "request %s done: generation %d sha256 %s output %s%s timings %s attention %s cache %s",
            run.request.request_id, generation, result.sha256[:16], output,
            f" ({media.size} bytes)" if media is not None else "", timings, result.attention_backend, result.cache,
            extra={"request_id": run.request.request_id, "generation": generation, "sha256": result.sha256,
                   "timings_ms": timings, "attention_backend": result.attention_backend,
                   "cache": result.cache.to_dict() if result.cache else None,
                   "task": run.request.task, "steps": run.request.steps, "output_type": output,
                   "media_bytes": media.size if media is not None else None},
        )  # fmt: skip
        return RunResult(dataclasses.replace(result, media=None), generation, timings, media)


def forget_frame_locals(error: BaseException) -> None:
    """Clear the local variables of every finished frame in the traceback of `error` and of each exception it chains
    (its cause, its context). The traceback itself (files, lines, functions: what a log prints) and the error's
    type, message and attributes (its gRPC status, reason, metadata) stay.

    A failed request's traceback runs through the denoise loop's frames, which held its tensors (the plan reads'
    view of the mapped slab, the activations, the lease): whoever keeps the error (the client's event, a log
    record) would keep them all. A frame still running is skipped (`traceback.clear_frames`), and a closure the
    traceback ran keeps what it captured (ditcore closes its slab reads itself: `SlotReads.close`)."""
    todo: list[BaseException] = [error]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
