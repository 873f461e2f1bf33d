"""`python -m plancache_service` / `ditserve plancache`: run the plan-cache sidecar. Its flags are
declared on SidecarConfig / CacheConfig (plancache_service/config.py) and LaunchOptions.

ditserve plancache --checkpoint ./ckpt                     # unix socket in the run dir
ditserve plancache --checkpoint ./ckpt --listen 10.0.0.5:50052 \
    --tls-cert sidecar.pem --tls-key sidecar.key --tls-client-ca clients-ca.pem   # TCP: mutual TLS only
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from ditcore import CheckpointError
from ditruntime.flags import LaunchOptions, add_flags, from_args
from ditruntime.obs import setup_logging
from ditruntime.paths import default_socket, ensure_private_dir
from ditruntime.service_main import run_service

from .app import build_server
from .config import SidecarConfig
from .state import StateFileError

log = logging.getLogger("plancache_service")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ditserve plancache", description="Run the plan-cache sidecar.")
    add_flags(p, SidecarConfig)
    # where to listen: becomes SidecarConfig.address
    p.add_argument("--socket", default=None, help="unix socket path (default <run-dir>/plancache.sock)")
    p.add_argument("--listen", default=None, help="listen on TCP HOST:PORT instead of the unix socket (needs --tls-*)")
    add_flags(p, LaunchOptions)
    return p


def config_from_args(args: argparse.Namespace) -> SidecarConfig:
    if args.listen:
        address = args.listen
    else:
        sock = Path(args.socket) if args.socket else default_socket(args.run_dir)
        ensure_private_dir(sock.parent, "--socket" if args.socket else "--run-dir")
        address = f"unix:{sock}"
    return from_args(SidecarConfig, args, address=address)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    launch = from_args(LaunchOptions, args)
    setup_logging(launch.log_level, launch.log_format)
    return run_service(
        "ditserve plancache",
        launch.threads,
        lambda: build_server(config_from_args(args)),
        (ValueError, CheckpointError, OSError, StateFileError),
        lambda server: f"plancache sidecar serving on {server.address}",  # type: ignore[attr-defined]
    )
