"""The `ditserve` command line: MiniMax-H3 repositories, inspection, local generation, services.

    ditserve make-checkpoint --preset tiny --seed 0 --out ./ckpt      # a diffusers repository, released precision
    ditserve inspect ./ckpt            # or: ditserve inspect --preset h3 (the released figures)
    ditserve generate-local --checkpoint ./ckpt --adaln-mode cached --prompt "a red fox"
    ditserve generate-local --checkpoint ./ckpt --prompt "a red fox" --out fox.mp4     # decoded: H.264 + AAC
    ditserve generate --target 127.0.0.1:50051 --prompt "a red fox" --first-frame fox.png --out fox.mp4  # fl2va

User errors (bad flags, bad request fields, corrupt repositories) exit with code 2 and a message naming the flag,
field or file and the rule; nothing is written.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from ditcore import CheckpointError, PresetError, RequestError
from ditcore.attention import AttentionBackendError
from ditcore.presets import DTYPES as PRECISIONS
from ditcore.text_encoder import TextEncoderError
from ditruntime.flags import add_flags
from ditruntime.paths import DirectoryFlagError
from generator_service.config import GeneratorConfig
from plancache_service.config import CacheConfig
from plancache_service.errors import InvalidPlanRequestError, PlanCacheError, PlanCapacityError

from . import __version__
from .bench.runner import add_bench_flags, cmd_bench
from .commands import (
    LOCAL_CACHE_FLAGS,
    LOCAL_MODEL_FLAGS,
    MAX_SHARDS,
    WRITABLE_PRESETS,
    cmd_generate_local,
    cmd_inspect,
    cmd_make_checkpoint,
)
from .errors import UsageError
from .jobs_cli import add_jobs_parser
from .launcher import add_serve_flags, serve
from .memory_view import add_memory_flags
from .openai.cli import add_openai_api_parser
from .remote import add_client_flags, cmd_generate, cmd_update_weights
from .requests_io import add_request_flags

EXIT_USAGE = 2


def _plancache(argv: list[str]) -> int:
    from plancache_service.cli import main as plancache_main

    return plancache_main(argv)


def _generator(argv: list[str]) -> int:
    from generator_service.cli import main as generator_main

    return generator_main(argv)


SERVICE_COMMANDS: dict[str, Callable[[list[str]], int]] = {"plancache": _plancache, "generator": _generator}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ditserve", description="Serve MiniMax-H3 with its AdaLN projections in a plan cache."
    )
    p.add_argument("--version", action="version", version=f"ditserve {__version__}")
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        default="WARNING",
        help="logging level (default %(default)s)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    mk = sub.add_parser("make-checkpoint", help="write a MiniMax-H3 diffusers repository with random weights")
    mk.add_argument("--preset", required=True, help=f"one of {', '.join(WRITABLE_PRESETS)}")
    mk.add_argument("--seed", type=int, default=0, help="init seed in [0, 2^63-1] (default %(default)s)")
    mk.add_argument("--out", required=True, help="output directory")
    mk.add_argument(
        "--dtype",
        choices=PRECISIONS,
        default="mixed",
        help="mixed: the released precision (bfloat16, float32 keep-modules); float32 throughout (default %(default)s)",
    )
    mk.add_argument(
        "--shards",
        type=int,
        default=2,
        help=f"target number of transformer safetensors shards, in [1, {MAX_SHARDS}] (default %(default)s)",
    )
    mk.add_argument(
        "--partitions",
        default="base,ref",
        help="transformer partitions to write, comma-separated: base (transformer/, t2va and fl2va) and ref "
        "(transformer_ref/, ref2va) (default %(default)s)",
    )
    mk.add_argument("--force", action="store_true", help="overwrite an existing repository at --out")
    mk.set_defaults(func=cmd_make_checkpoint)

    ins = sub.add_parser(
        "inspect", help="parameters, adaln_proj share and bytes, page size, fingerprint; memory and time at a canvas"
    )
    ins.add_argument("checkpoint", nargs="?", help="repository directory")
    ins.add_argument("--preset", help="a preset's figures without a repository (h3: the released shapes)")
    ins.add_argument("--dtype", choices=PRECISIONS, default=None, help="with --preset: precision (default mixed)")
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    add_memory_flags(ins)
    ins.set_defaults(func=cmd_inspect)

    gl = sub.add_parser("generate-local", help="run requests in this process (no services)")
    gl.add_argument("--checkpoint", required=True, help="repository directory")
    gl.add_argument(
        "--adaln-mode",
        choices=("resident", "cached"),
        default="resident",
        help="cached: plans from an embedded plan cache (default %(default)s)",
    )
    add_flags(gl, CacheConfig, only=LOCAL_CACHE_FLAGS, group="plan cache (cached mode)")
    add_flags(gl, GeneratorConfig, only=LOCAL_MODEL_FLAGS, group="model")
    add_request_flags(gl)
    gl.set_defaults(func=cmd_generate_local)

    gr = sub.add_parser("generate", help="run requests against a generator service (GenerateStream)")
    gr.add_argument("--target", required=True, help="generator address HOST:PORT")
    gr.add_argument("--expected-generation", type=int, default=None, help="refuse unless this weight generation serves")
    add_request_flags(gr)
    add_client_flags(gr)
    gr.set_defaults(func=cmd_generate)

    add_jobs_parser(sub)
    add_openai_api_parser(sub)

    uw = sub.add_parser("update-weights", help="swap the served repository (admin token required)")
    uw.add_argument("--target", required=True, help="generator address HOST:PORT")
    uw.add_argument("--path", required=True, help="repository directory inside the server's --weights-root")
    uw.add_argument("--token", default=None, help="admin token (default: $DITSERVE_ADMIN_TOKEN); visible in ps")
    uw.add_argument("--token-file", default=None, help="read the admin token from this file (not readable by others)")
    uw.add_argument(
        "--allow-plaintext-admin", action="store_true",
        help="send the token without TLS to a target that is not loopback (it then crosses the network in cleartext)",
    )  # fmt: skip
    uw.add_argument("--expected-generation", type=int, default=None, help="refuse unless this generation serves")
    uw.add_argument("--request-id", default=None)
    uw.add_argument("--timeout-s", type=float, default=600.0)
    add_client_flags(uw)
    uw.set_defaults(func=cmd_update_weights)

    bn = sub.add_parser("bench", help="run the benchmark scenarios on real services")
    add_bench_flags(bn)
    bn.set_defaults(func=cmd_bench)

    sv = sub.add_parser("serve", help="start the sidecar and the generator (one command)")
    add_serve_flags(sv)
    sv.set_defaults(func=serve)

    # the services parse their own flags: `ditserve plancache --help`, `ditserve generator --help`
    sub.add_parser("plancache", help="run the plan-cache sidecar (python -m plancache_service)", add_help=False)
    sub.add_parser("generator", help="run the generator service (python -m generator_service)", add_help=False)
    return p


USAGE_ERRORS = (
    AttentionBackendError,
    DirectoryFlagError,
    RequestError,
    CheckpointError,
    PresetError,
    UsageError,
    PlanCapacityError,
    InvalidPlanRequestError,
    TextEncoderError,
)
"""Errors in what the user gave (flags, request fields, a repository): exit code 2."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVICE_COMMANDS:
        return SERVICE_COMMANDS[argv[0]](argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except USAGE_ERRORS as e:
        print(f"ditserve {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except PlanCacheError as e:
        print(f"ditserve {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
