"""`python -m plancache_service` / `ditserve plancache`: run the plan-cache sidecar.

ditserve plancache --checkpoint ./ckpt                     # unix socket in the run dir
ditserve plancache --checkpoint ./ckpt --listen 127.0.0.1:50052   # TCP, opt-in
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ditcore import CheckpointError
from ditserve.obs import setup_logging
from ditserve.paths import default_run_dir, default_socket, ensure_private_dir
from ditserve.service_main import run_service

from .cache import PlanCache
from .config import GB, CacheConfig
from .rebuild import RebuildSource
from .server import SidecarServer
from .sidecar import Sidecar
from .state import STATE_FILE, StateFileError, load_state

log = logging.getLogger("plancache_service")


@dataclass(frozen=True)
class SidecarConfig:
    """Everything `ditserve plancache` is started with."""

    checkpoint: Path
    """Checkpoint plans are rebuilt from (needs native adaln_proj tensors)."""
    cache: CacheConfig
    """Slab and host-tier capacity and placement."""
    address: str
    """'unix:/path' (default: <run dir>/plancache.sock) or 'host:port' (TCP, opt-in)."""
    heartbeat_s: float = 1.0
    """Interval of Attach-stream heartbeats."""
    state_dir: Path | None = None
    """Where (generation, weights_path, digests) persist; its state file wins over `checkpoint`."""
    metrics_port: int | None = None
    """Prometheus /metrics HTTP port (off when None)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ditserve plancache", description="Run the plan-cache sidecar.")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (the rebuild source)")
    p.add_argument("--run-dir", default=None, help=f"holds the socket (default {default_run_dir()})")
    p.add_argument("--socket", default=None, help="unix socket path (default <run-dir>/plancache.sock)")
    p.add_argument("--listen", default=None, help="listen on TCP HOST:PORT instead of the unix socket")
    p.add_argument("--gpu-plans", type=int, default=CacheConfig.gpu_plans, help="slab slots (default %(default)s)")
    p.add_argument(
        "--plan-width", type=int, default=CacheConfig.plan_width, help="pages per slot (default %(default)s)"
    )
    p.add_argument("--host-cache-gb", type=float, default=CacheConfig.host_cache_bytes / GB, help="0 disables")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default %(default)s)")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="session heartbeat interval")
    p.add_argument(
        "--state-dir", default=None, help="persist the weight generation here (state file wins over --checkpoint)"
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="json: one object per line")
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port (default off)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return p


def config_from_args(args: argparse.Namespace) -> SidecarConfig:
    if not (math.isfinite(args.host_cache_gb) and args.host_cache_gb >= 0):
        raise ValueError(f"--host-cache-gb must be finite and >= 0, got {args.host_cache_gb}")
    if not (math.isfinite(args.heartbeat_s) and 0.05 <= args.heartbeat_s <= 60):
        raise ValueError(f"--heartbeat-s must be in [0.05, 60], got {args.heartbeat_s}")
    cache = CacheConfig(
        gpu_plans=args.gpu_plans,
        plan_width=args.plan_width,
        host_cache_bytes=int(args.host_cache_gb * GB),
        device=args.device,
    )
    if args.listen:
        address = args.listen
    else:
        sock = Path(args.socket) if args.socket else default_socket(args.run_dir)
        ensure_private_dir(sock.parent)
        address = f"unix:{sock}"
    state_dir = Path(args.state_dir) if args.state_dir else None
    return SidecarConfig(Path(args.checkpoint), cache, address, args.heartbeat_s, state_dir, args.metrics_port)


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
        if p.name.startswith(("ditserve-slab-", "ditserve-table-")) and p.exists():
            log.warning("removing %s left behind by a sidecar that did not stop cleanly", p)
            p.unlink()
    manifest.unlink()


def build_server(cfg: SidecarConfig) -> SidecarServer:
    device = torch.device(cfg.cache.device)
    state = load_state(cfg.state_dir) if cfg.state_dir is not None else None
    if state is None:
        source = RebuildSource(cfg.checkpoint, device)
        generation = 1  # generation 0 means "none yet"
    else:
        if Path(state.weights_path) != cfg.checkpoint:
            log.warning(
                "state file %s names %s (generation %d); it wins over --checkpoint %s",
                cfg.state_dir / STATE_FILE, state.weights_path, state.generation, cfg.checkpoint,
            )  # fmt: skip
        source = RebuildSource(state.weights_path, device, committed_digests=state.digests)
        generation = state.generation
    manifest = shm_manifest(cfg)
    if manifest is not None:
        remove_stale_shm(manifest)
    cache = PlanCache(cfg.cache, source, generation=generation)
    if manifest is not None:
        manifest.write_text("\n".join(cache.memory.paths) + "\n")
    try:
        sidecar = Sidecar(cache, cfg.state_dir)
        sidecar.check_source()
        return SidecarServer(sidecar, cfg.address, cfg.heartbeat_s, cfg.metrics_port)
    except BaseException:
        cache.close()
        raise


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    return run_service(
        "ditserve plancache",
        args.threads,
        lambda: build_server(config_from_args(args)),
        (ValueError, CheckpointError, OSError, StateFileError),
        lambda server: f"plancache sidecar serving on {server.address}",  # type: ignore[attr-defined]
    )
