"""The jobs API's flags: where job records and results live, how long they stay, how many may wait. Nested in
GeneratorConfig (`jobs`), so `ditserve generator` and `ditserve serve` declare them once."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from ditruntime.flags import check_bounds, flag

GB = 1000**3
HOUR_S = 3600


@dataclass(frozen=True)
class JobsConfig:
    state_dir: Path | None = flag(
        None,
        "the job store (jobs/jobs.db) and results (jobs/results/) live here; default: a temporary directory (jobs do not survive a restart; serve: <run-dir>/state)",
    )
    """The generator's state directory: the embedded job store `jobs/jobs.db` (SQLite, WAL) and the results
    `jobs/results/` live under it, locked while one generator runs on it. None: a temporary directory removed at
    stop, so jobs do not survive a restart. `ditserve serve` shares its --state-dir with the sidecar (whose state file is
    beside them)."""
    job_store: str = flag(
        "", "job store URL: sqlite:///PATH or postgresql://USER@HOST[:PORT]/DB, its password from PGPASSWORD or "
        "~/.pgpass (default sqlite:///<state-dir>/jobs/jobs.db)",
    )  # fmt: skip
    """SQLAlchemy URL of the job store. Empty: SQLite in `state_dir`. A PostgreSQL URL lets several replicas share
    one store (each job runs on exactly one: claims are row-locked, SELECT ... FOR UPDATE SKIP LOCKED); they must
    share `results_dir` too. Keep the password out of the URL (libpq reads PGPASSWORD or ~/.pgpass)."""
    results_dir: Path | None = flag(None, "result files of jobs (default <state-dir>/jobs/results)")
    """Content-addressed result files (`<sha256[:2]>/<sha256>`). Replicas sharing a PostgreSQL store share it too
    (a volume every replica mounts)."""
    job_ttl_s: float = flag(
        7 * 24 * 3600.0, "hours a finished job's record and content are kept (default 168: a week)",
        name="--job-ttl", scale=HOUR_S, flag_type=float, low=60, high=10 * 365 * 24 * HOUR_S,
    )  # fmt: skip
    """How long a finished job (succeeded, failed, cancelled) stays, from its finish: then its record and its
    content are removed."""
    failed_job_ttl_s: float = flag(
        24 * 3600.0, "hours a failed or cancelled job's record is kept (default 24; at most --job-ttl)",
        name="--failed-job-ttl", scale=HOUR_S, flag_type=float, low=60, high=10 * 365 * 24 * HOUR_S,
    )  # fmt: skip
    """How long a job that failed or was cancelled stays, from its end (the shorter of this and `job_ttl_s`): its
    request's blobs go with it."""
    job_max_attempts: int = flag(
        3, "fail a job after its runs ended this many times without an outcome (its generator killed, out of memory "
        "or restarted; its sidecar gone), so the jobs behind it run (default %(default)s)", low=1, high=1000,
    )  # fmt: skip
    """A job whose run ends without an outcome, because its generator stopped (a crash, a kill -9, an out-of-memory
    kill, a restart) or its sidecar or a rank went away, is queued again where it was; the `job_max_attempts`-th
    such end fails it (ABORTED, ATTEMPTS_EXHAUSTED), so a job that keeps taking its generator or sidecar down cannot
    block the queue forever. A job refused before it started (the backend not serving yet) does not count."""
    results_max_bytes: int = flag(
        50 * GB, "results kept at most, in GB: the oldest content goes first, never while it is being read "
        "(default 50)", name="--results-max-gb", scale=GB, flag_type=float, low=0, high=10**6 * GB,
    )  # fmt: skip
    """Bytes of result files kept. Above it the oldest finished jobs' content is removed first (their records stay,
    `available` false), never content a GetJobContent is reading; a CreateJob that finds it all being read is
    refused (RESOURCE_EXHAUSTED, RESULTS_FULL)."""
    max_queued_jobs: int = flag(
        1000, "jobs waiting before CreateJob answers RESOURCE_EXHAUSTED (default %(default)s)", low=1, high=10**7
    )
    """Queued jobs (across replicas sharing the store) before CreateJob is refused (RESOURCE_EXHAUSTED,
    JOB_QUEUE_FULL, with RetryInfo)."""
    replica_id: str = flag("", "this generator's name in a shared job store (default: the host name)")
    """Which replica claimed a job. A restarted replica queues again the unfinished jobs it held, so keep it stable
    across restarts (a StatefulSet pod's name); every replica sharing a store needs its own."""
    job_claim_s: float = flag(
        30.0, "seconds a replica's claim on a job lasts unrenewed: another replica takes the jobs of one dead this "
        "long (default %(default)s)", low=1, high=86_400,
    )  # fmt: skip
    """A replica renews its claims every third of this; a replica that died leaves its jobs to the others after it."""

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.job_store and not self.job_store.startswith(("sqlite:", "postgresql:", "postgresql+psycopg:")):
            raise ValueError(
                f"--job-store must be a sqlite:/// or postgresql:// URL, got {self.job_store.split(':')[0]!r}"
            )

    @property
    def replica(self) -> str:
        return self.replica_id or socket.gethostname()

    def store_url(self, state_dir: Path) -> str:
        return self.job_store or f"sqlite:///{state_dir / 'jobs' / 'jobs.db'}"

    def results_path(self, state_dir: Path) -> Path:
        return self.results_dir or state_dir / "jobs" / "results"
