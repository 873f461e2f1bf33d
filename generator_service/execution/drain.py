"""Step bounds and the drain (no gRPC): how long one denoise step of a request may take (every lease carries it, so
the sidecar knows how long a vanished session's slots stay pinned), how long the rest of a run takes, and the drain a
weight update waits on.

Every lease carries a bound on one of the request's steps (`step_bound_s`: the modeled step time x a factor, or the
slowest step seen, whichever is larger), and a weight update's drain waits for the running run as long as its own
remaining time, re-estimated after each of its steps: a run that keeps stepping is waited for, one that stalls is not.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from ditcore import GenerationRequest
from ditcore.sizing import MAX_STEP_BOUND_S

from ..backends.base import Backend
from .policy import SizingPolicy
from .queue import DRAIN_SLACK_S, RunQueue
from .runs import Run

DRAIN_POLL_S = 0.1
"""How often a drain re-reads its clock (and a derived one re-estimates the running request's remaining time)."""


@dataclass
class Progress:
    """The steps of the run that is denoising (under the executor's lock). The run is held weakly: a finished run's
    request and events are not kept alive by its progress."""

    run: weakref.ref[Run]
    done: int
    at: float  # the executor's clock at the last step
    slowest_s: float = 0.0  # its slowest step so far (from its second step: the first one includes the encoding)


class StepBounds:
    """The running run's progress and the slowest step seen on this server, under the executor's `lock`; `clock`
    (monotonic seconds) times the steps (tests inject one)."""

    def __init__(
        self, backend: Backend, sizing: SizingPolicy, lock: threading.Condition, clock: Callable[[], float]
    ) -> None:
        self.backend = backend
        self.sizing = sizing
        self._lock = lock
        self._clock = clock
        self._progress: Progress | None = None
        self._slowest_step_s = 0.0  # the slowest step observed on this server

    def remaining_s(self, request: GenerationRequest, progress: Progress | None = None) -> float:
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

    def observe_step(self, run: Run, done: int) -> None:
        """After each forward of the running run: its progress, and its step time from its second step on."""
        now = self._clock()
        with self._lock:
            progress = self._progress
            if progress is None or progress.run() is not run:
                self._progress = Progress(weakref.ref(run), done, now)
            else:
                step_s = (now - progress.at) / max(1, done - progress.done)
                progress.slowest_s = max(progress.slowest_s, step_s)
                self._slowest_step_s = max(self._slowest_step_s, step_s)
                progress.done, progress.at = done, now
            self._lock.notify_all()  # a derived drain re-estimates

    def deadline(self, run: Run, start: float) -> float:
        """When a derived drain gives up on `run` (under lock): its last step (or the drain's start) plus its
        remaining time."""
        progress = self._progress if self._progress is not None and self._progress.run() is run else None
        since = max(start, progress.at) if progress is not None else start
        return since + self.remaining_s(run.request, progress)


def drain(queue: RunQueue, bounds: StepBounds, clock: Callable[[], float], timeout_s: float | None = None) -> bool:
    """Wait for the running run to finish and release every prefetched lease (after the queue was paused).

    `timeout_s` bounds the wait; None waits as long as the running run's own remaining time (`remaining_s`,
    re-estimated after each of its steps), and then up to DRAIN_SLACK_S for a prefetch in flight. False when the bound
    passes with the run still running (or a prefetch still holding a lease)."""
    start = clock()
    with queue.lock:
        while queue.running is not None:
            now = clock()
            end = start + timeout_s if timeout_s is not None else bounds.deadline(queue.running, start)
            if now >= end:
                return False
            queue.lock.wait(min(end - now, DRAIN_POLL_S))  # re-read on the executor's clock
        waiting = list(queue.queued)
    end = start + timeout_s if timeout_s is not None else clock() + DRAIN_SLACK_S
    for run in waiting:
        if run.prefetching and not run.prefetch_done.wait(max(0.0, end - clock())):
            return False  # a prefetch still holds (or is about to hold) a lease
        lease, run.prefetched = run.prefetched, None
        if lease is not None:
            lease.release()
    return True
