"""Prefetch: while one run denoises, the prefetch thread leases the plans of the run that is next in the queue, so a
rebuild overlaps compute (no gRPC). Both leases must fit the slab; if not, the next run simply prepares when it starts.
Only a backend that leases plans (cached mode) is helped; resident mode starts no prefetch thread.
"""

from __future__ import annotations

import logging
import threading
import time

from ..backends.base import Backend, ServedLease
from .drain import StepBounds
from .queue import RunQueue
from .runs import Run

log = logging.getLogger(__name__)


def lease_plans(backend: Backend, bounds: StepBounds, run: Run) -> ServedLease | None:
    """The run's plans, leased now; None in resident mode (the model has no plans to lease)."""
    t0 = time.perf_counter()
    lease = backend.acquire(run.request, bounds.step_bound_s(run.request))
    if lease is not None:
        run.prepare_ms += (time.perf_counter() - t0) * 1000
    return lease


class Prefetcher:
    """The prefetch thread: `wake()` when the queue's head may have changed or a run started denoising."""

    def __init__(self, queue: RunQueue, backend: Backend, bounds: StepBounds) -> None:
        self._queue = queue
        self._backend = backend
        self._bounds = bounds
        self._wakeup = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="prefetch", daemon=True)

    def wake(self) -> None:
        self._wakeup.set()

    def _loop(self) -> None:
        q = self._queue
        while True:
            self._wakeup.wait()
            self._wakeup.clear()
            with q.lock:
                if q.stopping:
                    return
                if q.paused:
                    continue
                run = next((r for r in q.queued if not r.prefetching and r.prefetched is None), None)
                if run is None or q.queued[0] is not run or run.cancelled.is_set():
                    continue
                run.prefetching = True
                # a run can be prefetched again (drain released its lease, or a prefetch failed):
                # waiters must wait for *this* prefetch, not see the last one's event still set
                run.prefetch_done.clear()
            try:
                run.prefetched = lease_plans(self._backend, self._bounds, run)
            except Exception as e:  # e.g. both leases do not fit: the run prepares when it starts
                log.debug("prefetch for %s skipped: %s", run.request.request_id, e)
            finally:
                run.prefetching = False
                run.prefetch_done.set()
            if run.cancelled.is_set():
                with q.lock:  # withdraw takes the lease under the lock too: one of the two releases it
                    lease = None
                    if run not in q.queued:
                        lease, run.prefetched = run.prefetched, None
                if lease is not None:
                    lease.release()
