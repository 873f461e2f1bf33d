"""The executor: one bounded queue and the threads that work it, behind the one object the server, the jobs
service and the update coordinator hold (no gRPC). Each part lives in its own module:

- admission.py: the cheap checks before a run takes a slot (H3's rules, the operator's limits, slab, memory, split);
- queue.py: the bounded queue and every slot a run holds (waiting, running, muxing, delivering);
- runner.py: the executor thread, one run at a time (lease, check, denoise, release);
- prefetch.py: the prefetch thread (the next run's plans, leased while one denoises);
- mux.py: the mux thread (encoding a decoded run's file while the next one denoises);
- drain.py: step bounds and the drain a weight update waits on.

Submit order: the queue's capacity first (a flood against a full queue is refused in milliseconds), then admission,
then the capacity again and the enqueue. `clock` (monotonic seconds) times the steps and the drain; tests inject one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ditcore import GenerationRequest, RequestLimits

from ..backends.base import Backend
from ..errors import NotServingError
from .admission import Admission
from .drain import Progress, StepBounds, drain
from .mux import Muxer
from .policy import SizingPolicy
from .prefetch import Prefetcher
from .queue import RunQueue
from .runner import Denoise, Runner, denoise_here
from .runs import FinishListener, Queued, Run


class Executor:
    """`prefetch` only helps a backend that leases plans (cached mode). Every request is validated against `limits`
    (H3's rules, tightened by the operator's flags) and, with `sizing.memory_check`, its modeled activation peak
    against the device's free memory."""

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
        self.limits = limits if limits is not None else RequestLimits()
        self.sizing = sizing if sizing is not None else SizingPolicy()
        self.max_queue_depth = max_queue_depth
        self.prefetch = prefetch
        self._clock = clock
        lock = threading.Condition()
        self._bounds = StepBounds(backend, self.sizing, lock, clock)
        self._queue = RunQueue(lock, max_queue_depth, clock, self._bounds.remaining_s)
        self._admission = Admission(backend, self.limits, self.sizing)
        finish: FinishListener = on_finish or (lambda *_: None)
        self._prefetcher = Prefetcher(self._queue, backend, self._bounds)
        self._muxer = Muxer(self._queue, finish)
        self._runner = Runner(
            self._queue, backend, self.limits, self._bounds, self._muxer, self._prefetcher, finish,
            denoise if denoise is not None else denoise_here,
        )  # fmt: skip

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The executor thread, the mux thread and the prefetch thread (started only with `prefetch`)."""
        return self._runner.thread, self._muxer.thread, self._prefetcher.thread

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._runner.thread.start()
        self._muxer.thread.start()
        if self.prefetch:
            self._prefetcher.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._queue.close(NotServingError("the generator is shutting down"))
        self._prefetcher.wake()
        end = time.monotonic() + timeout
        self._runner.thread.join(timeout)
        self._muxer.stop(max(0.0, end - time.monotonic()))

    # ---------------------------------------------------------------- admission and the queue
    @property
    def queue_depth(self) -> int:
        """Runs waiting, running, muxing or being sent (each holds a queue slot until its result is sent)."""
        with self._queue.lock:
            return self._queue.depth()

    @property
    def has_room(self) -> bool:
        """A submit now would not be refused for the queue's capacity."""
        return self._queue.has_room()

    def retry_after_s(self) -> float:
        """How long until a queue slot is likely free (RunQueue.retry_after_s)."""
        with self._queue.lock:
            return self._queue.retry_after_s()

    def position(self, run: Run) -> int | None:
        """The run's place in the queue (0 = runs next), None when it is not waiting there."""
        return self._queue.position(run)

    def waiting(self, which: Callable[[Run], bool] = lambda run: True) -> int:
        """Runs waiting in the queue that `which` selects."""
        return self._queue.count(which)

    def check(self, run: Run) -> None:
        """Admission's checks but the queue's capacity; raises what `submit` would."""
        self._admission.check(run, self._queue.running_request())

    def submit(self, run: Run) -> int:
        """Admit a run; returns its queue position (0 = runs next). Raises before enqueueing. Only cheap checks run
        here (no keyframe pixel is decoded), the queue's capacity first."""
        with self._queue.lock:
            self._queue.check_capacity()
        self.check(run)
        depth = self._queue.admit(run)
        run.emit(Queued(depth))
        self._prefetcher.wake()
        return depth

    def delivered(self, run: Run) -> None:
        """The run's RPC sent its result, or ended (idempotent): its queue slot is free."""
        self._queue.delivered(run)

    def withdraw(self, run: Run) -> bool:
        """Cancel a run and take it out of the queue at once (True), if it is still waiting there."""
        return self._queue.withdraw(run)

    # ---------------------------------------------------------------- drain (weight updates) and step bounds
    def pause(self) -> None:
        """Stop starting queued runs (they wait); the running one goes on."""
        self._queue.set_paused(True)

    def resume(self) -> None:
        self._queue.set_paused(False)
        self._prefetcher.wake()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for the running run to finish and release every prefetched lease (call after `pause()`); see
        drain.drain. False when the bound passes first."""
        return drain(self._queue, self._bounds, self._clock, timeout_s)

    def remaining_s(self, request: GenerationRequest, progress: Progress | None = None) -> float:
        return self._bounds.remaining_s(request, progress)

    def step_bound_s(self, request: GenerationRequest) -> float:
        return self._bounds.step_bound_s(request)
