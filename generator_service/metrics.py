"""Generator Prometheus metrics: request latency by stage (decode and mux for media results), plans
by tier as the generator saw them, queue depth, generation, sidecar link, weight-update outcomes,
streams the server cancelled (plus RPC counts from `ditruntime.obs.RpcMetrics`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ditruntime.errors import ServiceError

from .backends.base import Backend
from .execution.executor import Executor
from .execution.runs import Run, RunResult
from .jobs.schema import STATES
from .jobs.service import JobService
from .jobs.types import JobsObserver

P = "ditserve_generator"
STAGES = ("queue", "prepare", "encode", "denoise", "decode", "mux", "total")
"""The `stage` label's values: every StageTimings field (decode and mux are observed for media output types only)."""
LATENT_STAGES = tuple(s for s in STAGES if s not in ("decode", "mux"))
_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class GeneratorMetrics:
    """Counters the executor (`on_finish`) and the adapter (`updates`) move."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.stage = Histogram(
            f"{P}_request_stage_seconds", "Request latency by stage", ["stage"], registry=r, buckets=_BUCKETS
        )
        self.outcomes = Counter(f"{P}_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.plans = Counter(f"{P}_plans", "Plans by the tier that served them", ["tier"], registry=r)
        self.rebuild = Counter(f"{P}_rebuild_seconds", "Rebuild seconds reported to this generator", registry=r)
        self.updates = Counter(f"{P}_weight_updates", "UpdateWeights outcomes", ["outcome"], registry=r)
        self.job_wait = Histogram(
            f"{P}_job_queue_wait_seconds", "Jobs API: time from CreateJob to the executor taking the job",
            registry=r, buckets=_BUCKETS,
        )  # fmt: skip
        self.job_run = Histogram(
            f"{P}_job_run_seconds", "Jobs API: time from the executor taking a job to its final state", ["state"],
            registry=r, buckets=_BUCKETS,
        )  # fmt: skip
        self.streams_cancelled = Counter(
            f"{P}_streams_cancelled", "GenerateStream calls the server cancelled (stall: the client read nothing for "
            "--stream-stall-s; transfer: past --stream-transfer-s)", ["reason"], registry=r,
        )  # fmt: skip

    def on_finish(self, run: Run, result: RunResult | None, error: BaseException | None) -> None:
        if result is None:
            self.outcomes.labels(error.reason if isinstance(error, ServiceError) else type(error).__name__).inc()
            return
        self.outcomes.labels("ok").inc()
        t = result.timings_ms
        stages = STAGES if result.media is not None else LATENT_STAGES  # latents are not decoded or muxed
        for stage in stages:
            self.stage.labels(stage).observe(t.get(f"{stage}_ms", 0.0) / 1000)
        c = result.result.cache
        if c is None:
            return
        tiers = (("slot_hit", c.gpu_hit_plans), ("host_hit", c.host_hit_plans), ("disk_hit", c.disk_hit_plans),
                 ("built", c.built_plans))  # fmt: skip
        for tier, n in tiers:
            if n:
                self.plans.labels(tier).inc(n)
        if c.rebuild_s:
            self.rebuild.inc(c.rebuild_s)

    def jobs_observer(self) -> JobsObserver:
        return JobsObserver(self.job_wait.observe, lambda state, s: self.job_run.labels(state).observe(s))


def register_job_gauges(registry: CollectorRegistry, jobs: JobService) -> None:
    """Job counts by state and the results' bytes, read from the store at scrape time."""
    counts = Gauge(f"{P}_jobs", "Jobs in the job store by state", ["state"], registry=registry)
    for state in STATES:
        counts.labels(state).set_function(partial(_count, jobs, state))
    Gauge(f"{P}_job_results_bytes", "Bytes of job results in the results directory", registry=registry).set_function(
        lambda: _safe(jobs.results.total_bytes)
    )


def register_state_gauges(registry: CollectorRegistry, backend: Backend, executor: Executor) -> None:
    """Gauges read at scrape time from the backend and the executor."""
    Gauge(f"{P}_queue_depth", "Requests waiting or running", registry=registry).set_function(
        lambda: executor.queue_depth
    )
    Gauge(f"{P}_generation", "Weight generation served (0 when unknown)", registry=registry).set_function(
        lambda: _safe(backend.generation)
    )
    Gauge(f"{P}_sidecar_connected", "1 when attached to the sidecar (resident: 1)", registry=registry).set_function(
        lambda: 1 if backend.status().serving else 0
    )


def _count(jobs: JobService, state: str) -> float:
    return _safe(lambda: jobs.store.counts_by_state().get(state, 0))


def _safe(fn: Callable[[], int]) -> float:
    try:
        return float(fn())
    except Exception:
        return 0.0
