"""Assembly of the generator: one `build_server(config)` that constructs every part (serving
state, backend and sidecar client, executor, metrics, update coordinator, gRPC server) and
passes each its collaborators; nothing is wired after construction."""

from __future__ import annotations

import tempfile
from pathlib import Path

import grpc
import torch

from ditcore.attention import AttentionBackendError, check_runs
from ditruntime.paths import prepare_dir, require_dir
from ditruntime.tls import mutual_tls_channel_credentials

from .backend import Backend
from .cached import CachedBackend, CachedWeights
from .config import GeneratorConfig
from .executor import Executor
from .health import ServingState
from .job_server import classify_error, decode_request
from .job_service import JobService
from .job_store import JobStore
from .job_types import JobsPolicy
from .metrics import GeneratorMetrics, register_job_gauges, register_state_gauges
from .registry import JobRegistry
from .resident import ResidentBackend
from .results import ResultStore
from .server import GeneratorServer, HealthPublisher
from .sidecar_client import SidecarClient
from .updates import UpdateCoordinator


def sidecar_credentials(cfg: GeneratorConfig) -> grpc.ChannelCredentials | None:
    """Mutual TLS to a TCP sidecar (GeneratorConfig insists on all three files); None on a unix socket."""
    if not cfg.sidecar_tcp:
        return None
    assert cfg.sidecar_tls_ca is not None and cfg.sidecar_tls_cert is not None and cfg.sidecar_tls_key is not None
    return mutual_tls_channel_credentials(
        cfg.sidecar_tls_ca, cfg.sidecar_tls_cert, cfg.sidecar_tls_key, "--sidecar-tls"
    )


def build_server(cfg: GeneratorConfig) -> GeneratorServer:
    if cfg.weights_root is not None:  # read, never created: it must exist
        require_dir(cfg.weights_root, "--weights-root")
    device = torch.device(cfg.device)
    try:  # a named backend that cannot run on the device is refused now, not at the first load or attach
        check_runs(cfg.attention_backend, device)
    except AttentionBackendError as e:
        raise AttentionBackendError(f"--attention-backend: {e}") from e
    publisher = HealthPublisher()
    backend: Backend
    if cfg.adaln_mode == "resident":
        assert cfg.checkpoint is not None  # GeneratorConfig checks it
        state = ServingState(attached=True, listener=publisher.publish)  # no sidecar to attach to
        backend = ResidentBackend(cfg.checkpoint, device, options=cfg.run_options)
        prefetch = False  # nothing to lease ahead
    else:
        state = ServingState(attached=False, listener=publisher.publish)
        weights = CachedWeights(device, cfg.run_options)
        link = SidecarClient(
            cfg.sidecar, cfg.reconnect_s, on_attach=weights.on_attach, state=state,
            credentials=sidecar_credentials(cfg), admin_token=cfg.admin_secret, device=device,
        )  # fmt: skip
        backend = CachedBackend(link, weights)
        prefetch = cfg.prefetch
    metrics = GeneratorMetrics()
    executor = Executor(
        backend, cfg.max_queue_depth, prefetch, on_finish=metrics.on_finish, limits=cfg.limits, sizing=cfg.sizing
    )
    register_state_gauges(metrics.registry, backend, executor)
    updates = UpdateCoordinator(backend, executor, state, cfg.drain_timeout_s)
    registry = JobRegistry(executor)
    jobs, scratch = build_jobs(cfg, registry, metrics)
    register_job_gauges(metrics.registry, jobs)
    return GeneratorServer(cfg, backend, executor, updates, metrics, state, publisher, registry, jobs, scratch)


def build_jobs(
    cfg: GeneratorConfig, registry: JobRegistry, metrics: GeneratorMetrics
) -> tuple[JobService, Path | None]:
    """The jobs core on its store and results directory; a config built in code without a state dir keeps them in
    a temporary directory (the second value), removed when the server stops (the CLI always names one)."""
    scratch = None
    if cfg.jobs.state_dir is None:
        state_dir = scratch = Path(tempfile.mkdtemp(prefix="ditserve-jobs-"))
    else:
        state_dir = prepare_dir(cfg.jobs.state_dir, "--state-dir")
    results = cfg.jobs.results_path(state_dir)
    prepare_dir(results, "--results-dir")
    store = JobStore.open(cfg.jobs.store_url(state_dir))
    j = cfg.jobs
    policy = JobsPolicy(j.replica, j.max_queued_jobs, j.job_ttl_s, j.results_max_bytes, j.job_claim_s)
    observer = metrics.jobs_observer()
    return JobService(store, ResultStore(results), registry, decode_request, classify_error, policy, observer), scratch
