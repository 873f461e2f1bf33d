"""The bounded queue and the slots runs hold (no gRPC): waiting, running, muxing and delivering, all under one
condition variable that the executor's threads share.

A finished run keeps its queue slot until its RPC says the result was sent or the call ended (`delivered`): a client
that reads its result slowly, or not at all, holds a slot, so such clients cannot pile up results beyond
`max_depth` (the server's send watchdog ends a stalled one: generator_service.serving.streams). A cancelled run that
is still queued leaves the queue at once (`withdraw`). A full queue is refused in milliseconds, with a retry delay
measured from how fast slots free up.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from ditcore import GenerationRequest

from ..backends.base import ServedLease
from ..errors import CancelledError, GeneratorError, NotServingError, QueueFullError
from .runs import Denoised, Failed, Finished, Run, RunEvent

DRAIN_SLACK_S = 30.0
"""Added to a derived drain bound (scheduling, the lease release, a prefetch still in flight)."""
DRAIN_RATE_WINDOW = 16
"""Queue slots freed (runs done) the drain rate is measured over."""
RETRY_AFTER_S = (1.0, 600.0)
"""The bounds of the retry delay a full queue suggests (RetryInfo)."""


class RunQueue:
    """Every slot a run holds, guarded by `lock` (a Condition the executor's threads wait on). Attributes named
    without an underscore are read and written by those threads under `lock` only."""

    def __init__(
        self,
        lock: threading.Condition,
        max_depth: int,
        clock: Callable[[], float],
        remaining_s: Callable[[GenerationRequest], float],
    ) -> None:
        self.lock = lock
        self.max_depth = max_depth
        self._clock = clock
        self._remaining_s = remaining_s  # the running request's bound on the rest of it (drain.StepBounds)
        self.queued: collections.deque[Run] = collections.deque()
        self.running: Run | None = None
        self.muxing: Denoised | None = None  # handed to the mux thread
        self.delivering: set[Run] = set()  # finished runs whose results their RPCs are still sending
        self._freed: collections.deque[float] = collections.deque(maxlen=DRAIN_RATE_WINDOW)  # when slots freed
        self.stopping = False
        self.paused = False

    # ---------------------------------------------------------------- capacity (under lock)
    def depth(self) -> int:
        """Runs waiting, running, muxing or being sent (under lock)."""
        return len(self.queued) + (self.running is not None) + (self.muxing is not None) + len(self.delivering)

    def check_capacity(self) -> int:
        """The depth now, or NotServingError / QueueFullError (under lock)."""
        if self.stopping:
            raise NotServingError("the generator is shutting down")
        depth = self.depth()
        if depth >= self.max_depth:
            raise QueueFullError(
                f"the queue is full ({depth} of {self.max_depth} requests, --max-queue-depth); retry later",
                self.retry_after_s(),
                "--max-queue-depth",
                {"queue_depth": str(depth), "max_queue_depth": str(self.max_depth)},
            )
        return depth

    def retry_after_s(self) -> float:
        """How long until a queue slot is likely free (under lock): the measured drain rate's interval between freed
        slots (the last DRAIN_RATE_WINDOW), else the running run's modeled remaining time; within RETRY_AFTER_S."""
        low, high = RETRY_AFTER_S
        if len(self._freed) >= 2:
            interval = (self._freed[-1] - self._freed[0]) / (len(self._freed) - 1)
        elif self.running is not None:
            interval = self._remaining_s(self.running.request) - DRAIN_SLACK_S
        else:
            interval = low
        return round(min(high, max(low, interval)), 3)

    def slot_freed(self) -> None:
        """A run left the running, muxing or delivering slot (under lock)."""
        self._freed.append(self._clock())

    def settle(self, run: Run, final: RunEvent) -> None:
        """The run's final event is about to be sent; a result keeps its queue slot until `delivered` (under lock:
        the caller frees the running or muxing slot in the same critical section)."""
        if isinstance(final, Finished) and not run.rpc_over:
            self.delivering.add(run)
        else:
            self.slot_freed()
        self.lock.notify_all()

    # ---------------------------------------------------------------- what callers ask (they take the lock)
    def admit(self, run: Run) -> int:
        """Enqueue `run` (its position; 0 = runs next), or refuse it for the queue's capacity."""
        with self.lock:
            depth = self.check_capacity()
            self.queued.append(run)
            self.lock.notify_all()
        return depth

    def position(self, run: Run) -> int | None:
        with self.lock:
            try:
                return self.queued.index(run)
            except ValueError:
                return None

    def count(self, which: Callable[[Run], bool]) -> int:
        with self.lock:
            return sum(1 for run in self.queued if which(run))

    def delivered(self, run: Run) -> None:
        """The run's RPC sent its result, or ended (idempotent): its queue slot is free."""
        with self.lock:
            run.rpc_over = True
            if run in self.delivering:
                self.delivering.discard(run)
                self.slot_freed()
                self.lock.notify_all()

    def withdraw(self, run: Run) -> bool:
        """Cancel a run and take it out of the queue at once (True), if it is still waiting there. Never waits (grpc
        calls this when an RPC ends): a prefetch still running for it releases the lease it gets
        (generator_service.execution.prefetch); either side takes the lease under the lock, so exactly one releases
        it."""
        run.cancel()
        with self.lock:
            if run not in self.queued:
                return False
            self.queued.remove(run)
            lease, run.prefetched = run.prefetched, None
            self.lock.notify_all()
        _fail(run, lease, CancelledError(f"request {run.request.request_id} was cancelled while queued"))
        return True

    def close(self, error: GeneratorError) -> None:
        """Refuse everything from now on; the runs that were waiting fail with `error`."""
        with self.lock:
            self.stopping = True
            pending = [(run, run.prefetched) for run in self.queued]
            for run in self.queued:
                run.prefetched = None
            self.queued.clear()
            self.lock.notify_all()
        for run, lease in pending:
            _fail(run, lease, error)

    # ---------------------------------------------------------------- state the executor reports and sets
    def has_room(self) -> bool:
        """A submit now would not be refused for the queue's capacity."""
        with self.lock:
            return not self.stopping and self.depth() < self.max_depth

    def running_request(self) -> GenerationRequest | None:
        """The request denoising now (admission models its activations beside a new one's)."""
        with self.lock:
            return self.running.request if self.running is not None else None

    def set_paused(self, paused: bool) -> None:
        """Paused: the executor starts no queued run (the running one goes on)."""
        with self.lock:
            self.paused = paused
            self.lock.notify_all()


def _fail(run: Run, lease: ServedLease | None, error: GeneratorError) -> None:
    """A run that leaves the queue without running: its prefetched lease released, its final event sent."""
    if lease is not None:
        lease.release()
    run.emit(Failed(error))
