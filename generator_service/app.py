"""Assembly of the generator: one `build_server(config)` that constructs every part (serving
state, backend and sidecar client, executor, metrics, update coordinator, gRPC server) and
passes each its collaborators; nothing is wired after construction."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import grpc
import torch

from ditcore.attention import AttentionBackendError, check_runs
from ditcore.parallel import ParallelSpec, Ranks, collective_backend, init_process_group, ranks_from_env
from ditcore.replica import Replica
from ditruntime.paths import hold_lock, prepare_dir, require_dir
from ditruntime.tls import mutual_tls_channel_credentials

from .backends.base import Backend
from .backends.cached import CachedBackend, CachedWeights
from .backends.node_sidecars import NodeSidecars
from .backends.placement import StartPlacement, largest_canvas
from .backends.resident import ResidentBackend
from .backends.sidecar_client import SidecarClient
from .backends.sidecar_port import AttachedState, Attachment, SidecarSession
from .config import GeneratorConfig
from .execution.executor import Executor
from .execution.registry import RunRegistry
from .health import ServingState
from .jobs.results import ResultStore
from .jobs.service import JobService
from .jobs.store import JobStore
from .jobs.types import JobsPolicy
from .metrics import GeneratorMetrics, register_job_gauges, register_state_gauges
from .replica.follower import Follower, follow
from .replica.link import ReplicaLink
from .replica.work import EXIT_REPLICA_LOST, gather_places, node_sidecars
from .serving.jobs_servicer import classify_error, decode_request
from .serving.server import GeneratorServer, HealthPublisher
from .updates import UpdateCoordinator

log = logging.getLogger(__name__)


def sidecar_credentials(cfg: GeneratorConfig, target: str | None = None) -> grpc.ChannelCredentials | None:
    """Mutual TLS to a TCP sidecar (`target`, else --sidecar; GeneratorConfig insists on all three files for its
    own); None on a unix socket. ValueError for another node's TCP sidecar without them."""
    target = cfg.sidecar if target is None else target
    if target.startswith("unix"):
        return None
    if not cfg.sidecar_tls_given:
        raise ValueError(
            f"a replica node's sidecar {target} is TCP: rank 0 needs --sidecar-tls-ca, --sidecar-tls-cert and "
            "--sidecar-tls-key (mutual TLS) to reach it"
        )
    assert cfg.sidecar_tls_ca is not None and cfg.sidecar_tls_cert is not None and cfg.sidecar_tls_key is not None
    return mutual_tls_channel_credentials(
        cfg.sidecar_tls_ca, cfg.sidecar_tls_cert, cfg.sidecar_tls_key, "--sidecar-tls"
    )


def join_replica(cfg: GeneratorConfig, ranks: Ranks) -> tuple[Replica, list[str]]:
    """This rank's place in its replica: its device (--devices by LOCAL_RANK), the process group joined (torchrun's
    environment), the layout checked (--ulysses-degree x --ring-degree = ranks, the backend) and its mesh built; and
    each node's sidecar target (cached mode), gathered from every rank. Every rank calls it at its start."""
    device = torch.device(cfg.rank_device(ranks.local_rank))
    spec = cfg.parallel_spec(ranks, device)
    spec.check_layout(ranks.world_size, collective_backend(device))
    init_process_group(device, timeout_s=cfg.replica_timeout_s)
    replica = Replica(spec, ranks, device)
    places = gather_places(replica, cfg.sidecar if cfg.adaln_mode == "cached" else "")
    sidecars = node_sidecars(places, ranks.per_node) if cfg.adaln_mode == "cached" else []
    log.info("replica rank %d of %d (node %d of %d, local rank %d) on %s (ulysses %d x ring %d)", ranks.rank,
             ranks.world_size, ranks.node_rank, ranks.nnodes, ranks.local_rank, device, spec.ulysses_degree,
             spec.ring_degree)  # fmt: skip
    return replica, sidecars


def exit_for_restart(state: ServingState, delay_s: float = 2.0) -> Callable[[str], None]:
    """What rank 0 does when a rank is gone: NOT_SERVING at once, then (after the failed request's answer had time
    to leave) exit EXIT_REPLICA_LOST, so the elastic launcher restarts every rank as a unit."""

    def lost(message: str) -> None:
        state.set_rank_lost()

        def exit_now() -> None:
            logging.shutdown()
            os._exit(EXIT_REPLICA_LOST)

        timer = threading.Timer(delay_s, exit_now)
        timer.daemon = True
        timer.start()

    return lost


def start_placement(cfg: GeneratorConfig, device: torch.device, replica: Replica | None) -> StartPlacement:
    """The placement decided at the first load: the memory model at the largest canvas the limits admit."""
    spec, canvas = replica.spec if replica is not None else ParallelSpec(), largest_canvas(cfg.limits)
    return StartPlacement(device, spec, canvas, cfg.adaln_mode, cfg.memory_reserve_bytes)


def refuse_start(e: Exception) -> None:
    """Nothing fits, found at the first attach (cached mode learns its repository from the sidecar): the generator
    exits 2 with the message, as at a bad flag, before it ever serves a request."""
    log.error("no placement fits: %s", e)
    print(f"ditserve generator: error: {e}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(2)


def run_follower(cfg: GeneratorConfig) -> int:
    """A replica rank other than 0: no server; it runs every request's loop with rank 0 (generator_service.replica.follower)."""
    replica, _ = join_replica(cfg, ranks_from_env())
    checkpoint = cfg.checkpoint if cfg.adaln_mode == "resident" else None
    placement = start_placement(cfg, replica.device, replica)  # the same rule as rank 0's, on this rank
    return follow(Follower(replica, cfg.adaln_mode, cfg.run_options, cfg.limits, checkpoint, placement))


def sidecar_session(
    cfg: GeneratorConfig, targets: list[str], device: torch.device, weights: CachedWeights, state: ServingState
) -> SidecarSession:
    """Rank 0's session with its sidecar, or, on a replica across nodes, with every node's (NodeSidecars: node 0's
    maps its slab, the others' are leased and updated only)."""

    credentials = {t: sidecar_credentials(cfg, t) for t in targets}  # a TCP node without mutual TLS: refused now

    def client(node: int, target: str, on_attach: Callable[[Attachment], None], state: AttachedState) -> SidecarClient:
        return SidecarClient(
            target, cfg.reconnect_s, on_attach=on_attach, state=state, credentials=credentials[target],
            admin_token=cfg.admin_secret, device=device if node == 0 else None, map_slab=node == 0,
        )  # fmt: skip

    if len(targets) == 1:
        return client(0, targets[0], weights.on_attach, state)
    log.info("a replica across %d nodes: sidecars %s", len(targets), ", ".join(targets))
    return NodeSidecars(targets, client, weights.on_attach, state)


def build_server(cfg: GeneratorConfig) -> GeneratorServer:
    if cfg.weights_root is not None:  # read, never created: it must exist
        require_dir(cfg.weights_root, "--weights-root")
    ranks = ranks_from_env()
    device = torch.device(cfg.rank_device(ranks.local_rank))
    try:  # a named backend that cannot run on the device is refused now, not at the first load or attach
        check_runs(cfg.attention_backend, device)
    except AttentionBackendError as e:
        raise AttentionBackendError(f"--attention-backend: {e}") from e
    publisher = HealthPublisher()
    backend: Backend
    state = ServingState(attached=cfg.adaln_mode == "resident", listener=publisher.publish)  # resident: no sidecar
    replica, sidecars = None, [cfg.sidecar]
    if ranks.world_size > 1:
        joined, sidecars = join_replica(cfg, ranks)
        replica = ReplicaLink(joined, exit_for_restart(state))
    placement = start_placement(cfg, device, replica.replica if replica is not None else None)
    if cfg.adaln_mode == "resident":
        assert cfg.checkpoint is not None  # GeneratorConfig checks it
        backend = ResidentBackend(cfg.checkpoint, device, options=cfg.run_options, replica=replica, placement=placement)
        prefetch = False  # nothing to lease ahead
    else:
        weights = CachedWeights(device, cfg.run_options, replica, placement, on_refused=refuse_start)
        backend = CachedBackend(sidecar_session(cfg, sidecars, device, weights, state), weights)
        prefetch = cfg.prefetch
    metrics = GeneratorMetrics()
    executor = Executor(
        backend, cfg.max_queue_depth, prefetch, on_finish=metrics.on_finish, limits=cfg.limits, sizing=cfg.sizing,
        denoise=replica.run if replica is not None else None,
    )  # fmt: skip
    register_state_gauges(metrics.registry, backend, executor)
    updates = UpdateCoordinator(backend, executor, state, cfg.drain_timeout_s)
    registry = RunRegistry(executor)
    jobs, jobs_dir = build_jobs(cfg, registry, metrics, lambda: state.serving and backend.loaded() is not None)
    register_job_gauges(metrics.registry, jobs)
    return GeneratorServer(cfg, backend, executor, updates, metrics, state, publisher, registry, jobs, jobs_dir.close)


def build_jobs(
    cfg: GeneratorConfig, registry: RunRegistry, metrics: GeneratorMetrics, serving: Callable[[], bool]
) -> tuple[JobService, JobsDir]:
    """The jobs core on its store and results directory, claiming jobs only while `serving()` (the backend attached
    and its weights loaded). Without a state dir (a config built in code, or `ditserve generator` without
    --state-dir) they live in a temporary directory removed at stop: jobs then do not survive a restart (`ditserve
    serve` always names one). An embedded (SQLite) store is one generator's: its state dir is locked while the
    generator runs."""
    j = cfg.jobs
    if j.state_dir is None:
        state_dir = Path(tempfile.mkdtemp(prefix="ditserve-jobs-"))
        where = JobsDir(state_dir, scratch=True)
        log.warning("jobs: no --state-dir, so jobs live in %s and do not survive a restart", state_dir)
    else:
        state_dir = prepare_dir(j.state_dir, "--state-dir")
        where = JobsDir(state_dir, scratch=False)
    url = j.store_url(state_dir)
    if url.startswith("sqlite"):
        prepare_dir(state_dir / "jobs", "--state-dir")
        where.lock = hold_lock(state_dir / "jobs" / "generator.lock", f"--state-dir {state_dir} (its job store)")
    results = j.results_path(state_dir)
    prepare_dir(results, "--results-dir")
    store = JobStore.open(url)
    policy = JobsPolicy(
        j.replica, j.max_queued_jobs, j.job_ttl_s, j.results_max_bytes, j.job_claim_s,
        max_attempts=j.job_max_attempts, unsucceeded_ttl_s=j.failed_job_ttl_s,
    )  # fmt: skip
    observer = metrics.jobs_observer()
    result_store = ResultStore(results, writer=j.replica)
    jobs = JobService(store, result_store, registry, decode_request, classify_error, policy, observer, serving=serving)
    return jobs, where


@dataclass
class JobsDir:
    """The jobs' state directory as this generator holds it: removed at stop when it is a temporary one, its lock
    (an embedded store) released."""

    path: Path
    scratch: bool
    lock: IO[str] | None = None

    def close(self) -> None:
        if self.lock is not None:
            self.lock.close()
            self.lock = None
        if self.scratch:
            shutil.rmtree(self.path, ignore_errors=True)
