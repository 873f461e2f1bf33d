"""The live runs of this generator: who owns each admitted run while it is queued, running or being delivered.

A run is registered when it is submitted and leaves when its owner is done with it (`release`: a Generate call sent
its result or ended; the jobs service stored the result). A run of a durable job is found by its `job_id`. Cancel is
the run's, through the registry: it sets the run's flag (the executor stops at its next step boundary, between decode
chunks, in the encoders' frame loops) and takes a run still waiting out of the queue at once. No grpc here.
"""

from __future__ import annotations

import threading

from .executor import Executor
from .runs import Run


class RunRegistry:
    """Runs of durable jobs by `job_id` while they are live; Generate calls' runs ("" ids) pass through unnamed."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._lock = threading.Lock()
        self._named: dict[str, Run] = {}

    def submit(self, run: Run) -> int:
        """Admit `run` to the executor (its queue position), registered until `release`; nothing stays registered
        when admission refuses it."""
        with self._lock:
            if run.job_id and run.job_id in self._named:
                raise ValueError(f"job {run.job_id} is already running")
            if run.job_id:
                self._named[run.job_id] = run
        try:
            return self.executor.submit(run)
        except BaseException:
            self._forget(run)
            raise

    def cancel(self, run: Run) -> bool:
        """Stop the run: out of the queue at once (True) if it still waits there, else at its next check."""
        run.cancel()
        return self.executor.withdraw(run)

    def release(self, run: Run) -> None:
        """Its owner is done with it (idempotent): the result's queue slot is free, the run forgotten."""
        self.executor.delivered(run)
        self._forget(run)

    def get(self, job_id: str) -> Run | None:
        """The live run of durable job `job_id`, if any."""
        with self._lock:
            return self._named.get(job_id)

    def _forget(self, run: Run) -> None:
        with self._lock:
            if run.job_id and self._named.get(run.job_id) is run:
                del self._named[run.job_id]
