"""`python -m plancache_service` / `ditserve plancache`: run the plan-cache sidecar.

ditserve plancache --checkpoint ./ckpt                     # unix socket in the run dir
ditserve plancache --checkpoint ./ckpt --listen 127.0.0.1:50052   # TCP, opt-in
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Sequence
from pathlib import Path

from ditcore import CheckpointError
from ditruntime.obs import setup_logging
from ditruntime.paths import default_run_dir, default_socket, ensure_private_dir
from ditruntime.service_main import run_service

from .app import build_server
from .config import GB, CacheConfig, SidecarConfig
from .state import StateFileError

log = logging.getLogger("plancache_service")


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
