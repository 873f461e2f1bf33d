"""The `ditserve` command line: checkpoints, inspection and local generation.

    ditserve make-checkpoint --preset small --seed 0 --out ./ckpt
    ditserve inspect ./ckpt            # or: ditserve inspect --preset h3
    ditserve generate-local --checkpoint ./ckpt --adaln-mode cached --prompt "a cat"

User errors (bad flags, bad request fields, corrupt checkpoints) exit with code 2 and a
message naming the field or file; nothing is written.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from ditcore import CheckpointError, ConfigError, RequestError
from ditruntime.flags import add_flags
from plancache_service.config import CacheConfig
from plancache_service.errors import InvalidPlanRequestError, PlanCacheError, PlanCapacityError

from . import __version__
from .bench.runner import add_bench_flags, cmd_bench
from .commands import LOCAL_CACHE_FLAGS, UsageError, cmd_generate_local, cmd_inspect, cmd_make_checkpoint
from .launcher import add_serve_flags, serve
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
    p = argparse.ArgumentParser(prog="ditserve", description="Serve a DiT with an AdaLN plan cache.")
    p.add_argument("--version", action="version", version=f"ditserve {__version__}")
    p.add_argument("--log-level", default="WARNING", help="logging level (default %(default)s)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    mk = sub.add_parser("make-checkpoint", help="write a deterministic random-init checkpoint")
    mk.add_argument("--preset", required=True, help="tiny, small, bench or h3")
    mk.add_argument("--seed", type=int, default=0, help="init seed (default %(default)s)")
    mk.add_argument("--out", required=True, help="output directory")
    mk.add_argument("--shards", type=int, default=1, help="number of .safetensors shards (default %(default)s)")
    mk.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: the preset's")
    mk.add_argument("--force", action="store_true", help="overwrite a non-empty --out directory")
    mk.set_defaults(func=cmd_make_checkpoint)

    ins = sub.add_parser("inspect", help="config, parameter counts, adaln_proj share, page bytes, fingerprint")
    ins.add_argument("checkpoint", nargs="?", help="checkpoint directory")
    ins.add_argument("--preset", help="shape arithmetic for a preset, without a checkpoint")
    ins.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="with --preset: override dtype")
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    ins.set_defaults(func=cmd_inspect)

    gl = sub.add_parser("generate-local", help="run requests in this process (no services)")
    gl.add_argument("--checkpoint", required=True, help="checkpoint directory")
    gl.add_argument("--adaln-mode", choices=("resident", "cached"), default="resident")
    add_flags(gl, CacheConfig, only=LOCAL_CACHE_FLAGS, group="plan cache (cached mode)")
    add_request_flags(gl)
    gl.set_defaults(func=cmd_generate_local)

    gr = sub.add_parser("generate", help="run requests against a generator service (GenerateStream)")
    gr.add_argument("--target", required=True, help="generator address HOST:PORT")
    gr.add_argument("--expected-generation", type=int, default=None, help="refuse unless this weight generation serves")
    add_request_flags(gr)
    add_client_flags(gr)
    gr.set_defaults(func=cmd_generate)

    uw = sub.add_parser("update-weights", help="swap the served checkpoint (admin token required)")
    uw.add_argument("--target", required=True, help="generator address HOST:PORT")
    uw.add_argument("--path", required=True, help="checkpoint directory inside the server's --weights-root")
    uw.add_argument("--token", default=None, help="admin token (default: $DITSERVE_ADMIN_TOKEN)")
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVICE_COMMANDS:
        return SERVICE_COMMANDS[argv[0]](argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (RequestError, CheckpointError, ConfigError, UsageError, PlanCapacityError, InvalidPlanRequestError) as e:
        print(f"ditserve {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except PlanCacheError as e:
        print(f"ditserve {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
