"""Assembly of the plan-cache sidecar: one `build_server(config)` that constructs every part in
order (rebuild source -> cache -> health -> sidecar core -> gRPC server), passing each its
collaborators; nothing is wired after construction."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import torch

from ditcore.adapters import AdapterRegistry
from ditcore.checkpoint_files import CheckpointError
from ditruntime.paths import prepare_dir
from ditruntime.slab import SLAB_PREFIX, TABLE_PREFIX
from ditruntime.tls import mutual_tls_server_credentials

from .adapters import AdapterPlans
from .cache import PlanCache
from .config import SidecarConfig
from .device import check_ipc_allocator
from .metrics import sidecar_registry
from .rebuild import RebuildSource
from .server import SidecarHealth, SidecarServer
from .sidecar import Sidecar
from .state import STATE_FILE, load_state

log = logging.getLogger("plancache_service")


def shm_manifest(cfg: SidecarConfig) -> Path | None:
    """Where this sidecar lists its /dev/shm files, so the next start can remove them if it
    was killed (SIGKILL leaves them behind): beside the socket, else in the state dir."""
    if cfg.address.startswith("unix:"):
        return Path(cfg.address[len("unix:") :] + ".shm-files")
    return cfg.state_dir / "plancache.shm-files" if cfg.state_dir is not None else None


def remove_stale_shm(manifest: Path) -> None:
    if not manifest.exists():
        return
    for line in manifest.read_text().splitlines():
        p = Path(line.strip())
        if p.name.startswith((SLAB_PREFIX, TABLE_PREFIX)) and p.exists():
            log.warning("removing %s left behind by a sidecar that did not stop cleanly", p)
            p.unlink()
    manifest.unlink()


def open_source(cfg: SidecarConfig) -> tuple[RebuildSource, int]:
    """The rebuild source and generation to serve: the state file's if there is one, else
    `--checkpoint` as generation 1 (generation 0 means "none yet"); plans with adapters from --adapter-dir."""
    devices = [torch.device(d) for d in cfg.cache.slab_devices]
    shard = cfg.cache.rebuild_shard
    adapters = AdapterPlans(AdapterRegistry(cfg.adapter_dir) if cfg.adapter_dir is not None else None)
    state_dir = cfg.state_dir
    state = load_state(state_dir) if state_dir is not None else None
    if state_dir is None or state is None:
        return RebuildSource(cfg.checkpoint, devices, shard_mode=shard, adapter_plans=adapters), 1
    if Path(state.weights_path) != cfg.checkpoint:
        log.warning(
            "state file %s names %s (generation %d); it wins over --checkpoint %s",
            state_dir / STATE_FILE, state.weights_path, state.generation, cfg.checkpoint,
        )  # fmt: skip
    try:
        return (
            RebuildSource(state.weights_path, devices, state.digests, shard, adapters),
            state.generation,
        )
    except CheckpointError as e:
        raise CheckpointError(
            f"{e} (the state file {state_dir / STATE_FILE} names {state.weights_path} as generation "
            f"{state.generation}, and the state file wins over --checkpoint; to serve --checkpoint {cfg.checkpoint} "
            f'instead, edit that state file: set "weights_path" to it and leave out "digests" and "fingerprint" (the '
            f"sidecar digests the files at start), keeping generation at least {state.generation}: never remove it, "
            "the generation would restart at 1)"
        ) from e


def server_tls(cfg: SidecarConfig) -> grpc.ServerCredentials | None:
    """Mutual TLS for a TCP sidecar (SidecarConfig insists on all three files); None on the unix socket."""
    if not cfg.tcp:
        return None
    assert cfg.tls_cert is not None and cfg.tls_key is not None and cfg.tls_client_ca is not None
    return mutual_tls_server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)


def build_server(cfg: SidecarConfig) -> SidecarServer:
    if cfg.cache.primary_device.startswith("cuda"):  # fail fast: no generator could map a slab it cannot export
        check_ipc_allocator()
    tls = server_tls(cfg)  # unreadable or non-PEM files are refused before anything is built
    if cfg.state_dir is not None:  # created 0700, or refused naming the flag, before anything reads it
        prepare_dir(cfg.state_dir, "--state-dir")
    source, generation = open_source(cfg)
    manifest = shm_manifest(cfg)
    if manifest is not None:
        remove_stale_shm(manifest)
    cache = PlanCache(cfg.cache, source, generation=generation)
    if manifest is not None:
        manifest.write_text("\n".join(cache.memory.paths) + "\n")
    try:
        health = SidecarHealth()
        sidecar = Sidecar(
            cache, cfg.state_dir, on_serving_change=health.plans_serving,
            grace_s=cfg.session_grace_s, grace_steps=cfg.session_grace_steps,
        )  # fmt: skip
        sidecar.check_source()
        registry = sidecar_registry(sidecar)
        return SidecarServer(
            sidecar, health, registry, cfg.address, cfg.heartbeat_s, cfg.metrics_port,
            tls=tls, admin_token=cfg.admin_secret, metrics_host=cfg.metrics_bind_host, reflection=cfg.reflection,
        )  # fmt: skip
    except BaseException:
        cache.close()
        raise
