"""`python -m generator_service` / `ditserve generator`: run the public generator service. Its flags
are declared on GeneratorConfig (generator_service/config.py) and LaunchOptions.

ditserve generator --sidecar unix:/run/ditserve/plancache.sock --listen 0.0.0.0:50051
ditserve generator --adaln-mode resident --checkpoint ./ckpt      # reference, no sidecar
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import torch

from ditcore import CheckpointError
from ditcore.parallel import ParallelError, ranks_from_env
from ditruntime.flags import LaunchOptions, add_flags, from_args
from ditruntime.obs import setup_logging
from ditruntime.paths import default_socket, grpc_target
from ditruntime.service_main import run_service

from .app import build_server, run_follower
from .config import GeneratorConfig

log = logging.getLogger("generator_service")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ditserve generator", description="Run the generator service.")
    add_flags(p, GeneratorConfig)
    p.add_argument("--port", type=int, default=None, help="shorthand for --listen 0.0.0.0:PORT")
    add_flags(p, LaunchOptions)
    return p


def config_from_args(args: argparse.Namespace) -> GeneratorConfig:
    sidecar = ""  # resident mode has no sidecar
    if args.adaln_mode == "cached":
        sidecar = grpc_target(args.sidecar or str(default_socket(args.run_dir)))
    listen = f"0.0.0.0:{args.port}" if args.port is not None else args.listen
    return from_args(GeneratorConfig, args, sidecar=sidecar, listen=listen)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    launch = from_args(LaunchOptions, args)
    setup_logging(launch.log_level, launch.log_format)
    try:
        ranks = ranks_from_env()  # torchrun's environment
    except ParallelError as e:
        print(f"ditserve generator: error: {e}", file=sys.stderr)
        return 2
    if ranks.rank > 0:  # a replica rank other than 0 (torchrun): no server, it follows rank 0
        if launch.threads is not None:
            torch.set_num_threads(launch.threads)
        try:
            cfg = config_from_args(args)
        except (ValueError, CheckpointError, OSError) as e:
            print(f"ditserve generator: error: {e}", file=sys.stderr)
            return 2
        end_rank(run_follower(cfg))
    code = run_service(
        "ditserve generator",
        launch.threads,
        lambda: build_server(config_from_args(args)),
        (ValueError, CheckpointError, OSError),
        lambda server: f"generator serving on port {server.port}",  # type: ignore[attr-defined]
    )
    if ranks.world_size > 1:
        end_rank(code)
    return code


def end_rank(code: int) -> NoReturn:
    """A replica rank's exit, past the interpreter's teardown: torch's gloo threads may still be joinable when its
    static destructors run, and std::terminate (SIGABRT) would turn the rank's clean stop into a failure its elastic
    agent restarts (seen under load right after a Stop)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
