"""The live jobs of this generator: who owns each admitted job while it is queued, running or being delivered.

A job is registered when it is submitted and leaves when its owner is done with it (`release`: a Generate call
sent its result or ended; the jobs service stored the result). Cancel is the job's, through the registry: it sets
the job's flag (the executor stops at its next step boundary, between decode chunks, in the encoders' frame loops)
and takes a job still waiting out of the queue at once. No grpc here.
"""

from __future__ import annotations

import threading

from .executor import Executor
from .jobs import Job


class JobRegistry:
    """Jobs by `job_id` (jobs API) while they are live; Generate calls' jobs ("" ids) pass through unnamed."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._lock = threading.Lock()
        self._named: dict[str, Job] = {}

    def submit(self, job: Job) -> int:
        """Admit `job` to the executor (its queue position), registered until `release`; nothing stays registered
        when admission refuses it."""
        with self._lock:
            if job.job_id and job.job_id in self._named:
                raise ValueError(f"job {job.job_id} is already live")
            if job.job_id:
                self._named[job.job_id] = job
        try:
            return self.executor.submit(job)
        except BaseException:
            self._forget(job)
            raise

    def cancel(self, job: Job) -> bool:
        """Stop the job: out of the queue at once (True) if it still waits there, else at its next check."""
        job.cancel()
        return self.executor.withdraw(job)

    def release(self, job: Job) -> None:
        """Its owner is done with it (idempotent): the result's queue slot is free, the job forgotten."""
        self.executor.delivered(job)
        self._forget(job)

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._named.get(job_id)

    def _forget(self, job: Job) -> None:
        with self._lock:
            if job.job_id and self._named.get(job.job_id) is job:
                del self._named[job.job_id]
