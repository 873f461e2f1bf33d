"""`python -m generator_service` / `ditserve generator`: run the public generator service.

ditserve generator --sidecar unix:/run/ditserve/plancache.sock --listen 0.0.0.0:50051
ditserve generator --adaln-mode resident --checkpoint ./ckpt      # reference, no sidecar
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from ditcore import CheckpointError
from ditruntime.obs import setup_logging
from ditruntime.paths import default_socket, grpc_target
from ditruntime.service_main import run_service

from .app import build_server
from .config import GeneratorConfig

log = logging.getLogger("generator_service")
TOKEN_ENV = "DITSERVE_ADMIN_TOKEN"


def build_parser() -> argparse.ArgumentParser:
    d = GeneratorConfig  # class attributes hold the field defaults
    p = argparse.ArgumentParser(prog="ditserve generator", description="Run the generator service.")
    p.add_argument("--adaln-mode", choices=("cached", "resident"), default=d.adaln_mode)
    p.add_argument("--checkpoint", default=None, help="resident mode: checkpoint dir (cached mode loads the sidecar's)")
    p.add_argument("--sidecar", default=None, help=f"sidecar socket or host:port (default {default_socket()})")
    p.add_argument("--run-dir", default=None, help="run dir holding the sidecar socket")
    p.add_argument("--listen", default=d.listen, help="public address host:port (default %(default)s)")
    p.add_argument("--port", type=int, default=None, help="shorthand for --listen 0.0.0.0:PORT")
    p.add_argument("--device", default=d.device)
    p.add_argument("--max-queue-depth", type=int, default=d.max_queue_depth)
    p.add_argument("--max-message-mb", type=int, default=d.max_message_bytes // 2**20, help="gRPC message limit (MiB)")
    p.add_argument("--no-prefetch", action="store_true", help="do not prepare the next request's plans early")
    p.add_argument(
        "--admin-token", default=None, help=f"UpdateWeights bearer token (default: ${TOKEN_ENV}); unset = updates off"
    )
    p.add_argument("--weights-root", default=None, help="UpdateWeights paths must resolve inside this directory")
    p.add_argument(
        "--drain-timeout-s", type=float, default=d.drain_timeout_s, help="update drain bound (default %(default)s)"
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="json: one object per line")
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port (default off)"
    )
    for name, what in (
        ("steps", "denoise steps"),
        ("frames", "pixel frames"),
        ("height", "pixels"),
        ("width", "pixels"),
        ("prompt-bytes", "prompt bytes"),
    ):
        p.add_argument(f"--max-{name}", type=int, default=None, help=f"limit on {what} (default: the model's)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve the public port over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, help="PEM CA: require client certificates (mutual TLS)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return p


def config_from_args(args: argparse.Namespace) -> GeneratorConfig:
    sidecar = ""
    if args.adaln_mode == "cached":
        sidecar = grpc_target(args.sidecar or str(default_socket(args.run_dir)))
    listen = f"0.0.0.0:{args.port}" if args.port is not None else args.listen
    return GeneratorConfig(
        adaln_mode=args.adaln_mode,
        checkpoint=Path(args.checkpoint) if args.checkpoint else None,
        sidecar=sidecar,
        listen=listen,
        device=args.device,
        max_queue_depth=args.max_queue_depth,
        max_message_bytes=args.max_message_mb * 2**20,
        prefetch=not args.no_prefetch,
        admin_token=args.admin_token or os.environ.get(TOKEN_ENV, ""),
        weights_root=Path(args.weights_root) if args.weights_root else None,
        drain_timeout_s=args.drain_timeout_s,
        metrics_port=args.metrics_port,
        max_steps=args.max_steps,
        max_frames=args.max_frames,
        max_height=args.max_height,
        max_width=args.max_width,
        max_prompt_bytes=args.max_prompt_bytes,
        tls_cert=Path(args.tls_cert) if args.tls_cert else None,
        tls_key=Path(args.tls_key) if args.tls_key else None,
        tls_client_ca=Path(args.tls_client_ca) if args.tls_client_ca else None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    return run_service(
        "ditserve generator",
        args.threads,
        lambda: build_server(config_from_args(args)),
        (ValueError, CheckpointError, OSError),
        lambda server: f"generator serving on port {server.port}",  # type: ignore[attr-defined]
    )
