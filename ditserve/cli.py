"""The `ditserve` command line: MiniMax-H3 repositories, inspection, local generation, services.

    ditserve make-checkpoint --preset tiny --seed 0 --out ./ckpt      # a diffusers repository, released precision
    ditserve make-adapter --preset tiny --targets all --layout musubi --rank 4 --out lora.safetensors
    ditserve inspect ./ckpt            # or: ditserve inspect --preset h3 (the released figures)
    ditserve generate-local --checkpoint ./ckpt --adaln-mode cached --prompt "a red fox"
    ditserve generate-local --checkpoint ./ckpt --prompt "a red fox" --out fox.mp4     # decoded: H.264 + AAC
    ditserve generate --target 127.0.0.1:50051 --prompt "a red fox" --first-frame fox.png --out fox.mp4  # fl2va
    ditserve generate --target 127.0.0.1:50051 --prompt "a red fox" --adapter style=0.8   # an --adapter-dir LoRA
    ditserve adapters --target 127.0.0.1:50051          # the generator's adapters (ListAdapters)
    ditserve adapters load style --target 127.0.0.1:50051   # load it now (LoadAdapter; the admin token)
    ditserve quality-levels --target 127.0.0.1:50051    # the quality levels and their audits (ListQualityLevels)
    ditserve plans build --checkpoint ./ckpt --schedules s.jsonl --out ./plans   # plan packs ahead of serving
    ditserve audit-quality --target 127.0.0.1:50051 --level fast --requests audit.jsonl --audit-dir ./audits

User errors (bad flags, bad request fields, corrupt repositories) exit with code 2 and a message naming the flag,
field or file and the rule; nothing is written.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from . import __version__

EXIT_USAGE = 2


def _plancache(argv: list[str]) -> int:
    from plancache_service.cli import main as plancache_main

    return plancache_main(argv)


def _generator(argv: list[str]) -> int:
    from generator_service.cli import main as generator_main

    return generator_main(argv)


SERVICE_COMMANDS: dict[str, Callable[[list[str]], int]] = {"plancache": _plancache, "generator": _generator}


def _make_checkpoint_flags(mk: argparse.ArgumentParser) -> None:
    from ditcore.presets import DTYPES as PRECISIONS

    from .commands import MAX_SHARDS, WRITABLE_PRESETS, cmd_make_checkpoint

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


def _make_adapter_flags(ma: argparse.ArgumentParser) -> None:
    from ditcore.adapter_files import LAYOUTS, PARTITIONS, TARGET_CHOICES

    from .commands import cmd_make_adapter

    ma.add_argument("--preset", default=None, help="the shapes of this preset (tiny, small, bench, h3)")
    ma.add_argument("--checkpoint", default=None, help="or: the shapes of this repository's transformer")
    ma.add_argument(
        "--targets",
        choices=TARGET_CHOICES,
        required=True,
        help="LoRA factors on trunk: attention and feed-forward linears; modulation: adaln_proj and norm_out; time: "
        "time_embedder; all; none (with --deltas)",
    )
    ma.add_argument(
        "--deltas",
        choices=TARGET_CHOICES,
        default="none",
        help="full-parameter deltas (.diff / .diff_b, as FastH3 ships) on this group's modules too; layouts "
        "diffusers, ai-toolkit, kohya (default %(default)s)",
    )
    ma.add_argument("--layout", choices=LAYOUTS, required=True, help="the key layout (ditcore/adapter_files.py)")
    ma.add_argument("--rank", type=int, required=True, help="LoRA rank, >= 1")
    ma.add_argument("--alpha", type=float, default=None, help="LoRA alpha (scale alpha/rank); omitted: scale 1.0")
    ma.add_argument("--seed", type=int, default=0, help="factor seed in [0, 2^63-1] (default %(default)s)")
    ma.add_argument(
        "--partition",
        choices=PARTITIONS,
        default="base",
        help="ref: the file targets transformer_ref (diffusers layout only) (default %(default)s)",
    )
    ma.add_argument("--out", required=True, help="the adapter file (.safetensors)")
    ma.add_argument("--force", action="store_true", help="overwrite an existing file at --out")
    ma.set_defaults(func=cmd_make_adapter)


def _inspect_flags(ins: argparse.ArgumentParser) -> None:
    from ditcore.presets import DTYPES as PRECISIONS

    from .commands import cmd_inspect
    from .memory_view import add_memory_flags

    ins.add_argument("checkpoint", nargs="?", help="repository directory")
    ins.add_argument("--preset", help="a preset's figures without a repository (h3: the released shapes)")
    ins.add_argument("--dtype", choices=PRECISIONS, default=None, help="with --preset: precision (default mixed)")
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    add_memory_flags(ins)
    ins.set_defaults(func=cmd_inspect)


def _generate_local_flags(gl: argparse.ArgumentParser) -> None:
    from ditruntime.flags import add_flags
    from generator_service.config import GeneratorConfig
    from plancache_service.config import CacheConfig

    from .commands import LOCAL_CACHE_FLAGS, LOCAL_MODEL_FLAGS, cmd_generate_local
    from .requests_io import add_request_flags

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


def _generate_flags(gr: argparse.ArgumentParser) -> None:
    from .remote import add_client_flags, cmd_generate
    from .requests_io import add_request_flags

    gr.add_argument("--target", required=True, help="generator address HOST:PORT")
    gr.add_argument("--expected-generation", type=int, default=None, help="refuse unless this weight generation serves")
    add_request_flags(gr)
    add_client_flags(gr)
    gr.set_defaults(func=cmd_generate)


def _jobs_flags(jobs: argparse.ArgumentParser) -> None:
    from .jobs_cli import add_jobs_flags

    add_jobs_flags(jobs)


def _openai_api_flags(p: argparse.ArgumentParser) -> None:
    from .openai.cli import add_openai_api_flags

    add_openai_api_flags(p)


def _plans_flags(p: argparse.ArgumentParser) -> None:
    from .plans_cli import add_plans_flags

    add_plans_flags(p)


def _update_weights_flags(uw: argparse.ArgumentParser) -> None:
    from .remote import add_admin_token_flags, add_client_flags, cmd_update_weights

    uw.add_argument("--target", required=True, help="generator address HOST:PORT")
    uw.add_argument("--path", required=True, help="repository directory inside the server's --weights-root")
    add_admin_token_flags(uw)
    uw.add_argument("--expected-generation", type=int, default=None, help="refuse unless this generation serves")
    uw.add_argument("--request-id", default=None)
    uw.add_argument("--timeout-s", type=float, default=600.0)
    add_client_flags(uw)
    uw.set_defaults(func=cmd_update_weights)


def _status_flags(st: argparse.ArgumentParser) -> None:
    from .remote import add_client_flags, cmd_status

    st.add_argument("--target", required=True, help="generator address HOST:PORT")
    st.add_argument("--timeout-s", type=float, default=10.0, help="the call's deadline (default %(default)s)")
    add_client_flags(st)
    st.set_defaults(func=cmd_status)


def _adapters_flags(ad: argparse.ArgumentParser) -> None:
    from .remote import add_admin_token_flags, add_client_flags, cmd_adapters

    ad.add_argument(
        "action", nargs="?", choices=("list", "load", "unload"), default="list",
        help="list the adapters (ListAdapters, the default); load NAME into the served model now (LoadAdapter); "
        "unload NAME from it (UnloadAdapter); load and unload need the admin token",
    )  # fmt: skip
    ad.add_argument("name", nargs="?", default=None, help="the adapter to load or unload (its file's stem)")
    ad.add_argument("--target", required=True, help="generator address HOST:PORT")
    ad.add_argument("--json", action="store_true", help="list: print the ListAdapters response as one JSON object")
    ad.add_argument(
        "--identity", default=None,
        help="load: refuse unless the adapter's file reads this identity (64 hex digits, as the listing shows it)",
    )  # fmt: skip
    ad.add_argument(
        "--timeout-s", type=float, default=None,
        help="the call's deadline (default: 10 for list; 600 for load and unload, which wait for the running request)",
    )  # fmt: skip
    add_admin_token_flags(ad)
    add_client_flags(ad)
    ad.set_defaults(func=cmd_adapters)


def _quality_levels_flags(p: argparse.ArgumentParser) -> None:
    from .quality_cli import add_quality_levels_flags

    add_quality_levels_flags(p)


def _audit_quality_flags(p: argparse.ArgumentParser) -> None:
    from .quality_cli import add_audit_flags

    add_audit_flags(p)


def _bench_flags(bn: argparse.ArgumentParser) -> None:
    from .bench.runner import add_bench_flags, cmd_bench

    add_bench_flags(bn)
    bn.set_defaults(func=cmd_bench)


def _serve_flags(sv: argparse.ArgumentParser) -> None:
    from .launcher import add_serve_flags, serve

    add_serve_flags(sv)
    sv.set_defaults(func=serve)


@dataclass(frozen=True)
class Command:
    """One subcommand: its line in `ditserve --help`, and what declares its flags (and sets its `func`)."""

    help: str
    flags: Callable[[argparse.ArgumentParser], None]
    """Imports the command's module: called only for the command that runs (or for the whole parser, `_parser()`),
    so a client command never loads the model layer or torch."""


COMMANDS: dict[str, Command] = {
    "make-checkpoint": Command("write a MiniMax-H3 diffusers repository with random weights", _make_checkpoint_flags),
    "make-adapter": Command("write a random MiniMax-H3 LoRA adapter in a public key layout", _make_adapter_flags),
    "inspect": Command(
        "parameters, adaln_proj share and bytes, page size, fingerprint; memory and time at a canvas", _inspect_flags
    ),
    "generate-local": Command("run requests in this process (no services)", _generate_local_flags),
    "generate": Command("run requests against a generator service (GenerateStream)", _generate_flags),
    "jobs": Command("asynchronous jobs on a generator service (the Jobs API)", _jobs_flags),
    "openai-api": Command("serve an OpenAI-compatible /v1/videos HTTP API over a generator's jobs", _openai_api_flags),
    "status": Command(
        "a generator's GetStatus as one JSON object (serving, weights, queue, slab, placement)", _status_flags
    ),
    "adapters": Command(
        "a generator's adapters (ListAdapters): name, partition, rank, targets, loaded, contract; refused files; "
        "load NAME / unload NAME (admin token required)",
        _adapters_flags,
    ),
    "quality-levels": Command(
        "a generator's quality levels (ListQualityLevels): step cache, what each allows, thresholds, audits",
        _quality_levels_flags,
    ),
    "audit-quality": Command(
        "audit a quality level: run requests lossless and at the level, measure, write audit records",
        _audit_quality_flags,
    ),
    "update-weights": Command("swap the served repository (admin token required)", _update_weights_flags),
    "plans": Command(
        "the sidecar's plan directory offline: build packs for a list of schedules ahead of serving; ls, verify, gc",
        _plans_flags,
    ),
    "bench": Command("run the benchmark scenarios on real services", _bench_flags),
    "serve": Command("start the sidecar and the generator (one command)", _serve_flags),
}


def _parser(declared: Collection[str] = tuple(COMMANDS)) -> argparse.ArgumentParser:
    """The `ditserve` parser with the flags of the `declared` commands (by default all); the others are listed by name
    and help only."""
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
    for name, command in COMMANDS.items():
        parser = sub.add_parser(name, help=command.help)
        if name in declared:
            command.flags(parser)
    # the services parse their own flags: `ditserve plancache --help`, `ditserve generator --help`
    sub.add_parser("plancache", help="run the plan-cache sidecar (python -m plancache_service)", add_help=False)
    sub.add_parser("generator", help="run the generator service (python -m generator_service)", add_help=False)
    return p


USAGE_ERRORS = (
    "ditcore.attention:AttentionBackendError",
    "ditruntime.paths:DirectoryFlagError",
    "ditcore.request:RequestError",
    "ditcore.checkpoint_files:CheckpointError",
    "ditcore.presets:PresetError",
    "ditserve.errors:UsageError",
    "plancache_service.errors:PlanCapacityError",
    "plancache_service.errors:InvalidPlanRequestError",
    "ditcore.text_encoder:TextEncoderError",
    "ditcore.adapter_contract:AdapterNotFoundError",
    "ditcore.adapter_contract:AdapterError",
)
"""Errors in what the user gave (flags, request fields, a repository): exit code 2. Named, not imported: a class
whose module the command never loaded cannot have been raised, so a client command does not load the model layer
to catch the model's errors."""
FAILURES = ("plancache_service.errors:PlanCacheError",)
"""Errors that exit with code 1 and their message (no traceback)."""


def _loaded(names: Sequence[str]) -> tuple[type[BaseException], ...]:
    """The classes `names` ("module:Class") whose modules are loaded (and have defined them)."""
    split = (name.split(":") for name in names)
    classes = (getattr(sys.modules.get(module), cls, None) for module, cls in split)
    return tuple(c for c in classes if c is not None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVICE_COMMANDS:
        return SERVICE_COMMANDS[argv[0]](argv[1:])
    # the command is the first word naming one (a --log-level value never does): only its module is imported
    command = next((a for a in argv if a in COMMANDS), None)
    args = _parser(declared=() if command is None else (command,)).parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if isinstance(e, _loaded(USAGE_ERRORS)):
            print(f"ditserve {args.command}: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(e, _loaded(FAILURES)):
            print(f"ditserve {args.command}: error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
