"""Implementations of the local `ditserve` subcommands (no services involved)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ditcore import (
    DiT,
    GenerationRequest,
    PlanProvider,
    generate,
    get_preset,
    load_model,
    param_counts,
    validate_checkpoint,
    write_checkpoint,
)
from ditcore.checkpoint import is_checkpoint_dir
from ditruntime.flags import from_args
from plancache_service.cache import PlanCache
from plancache_service.config import CacheConfig
from plancache_service.embedded import EmbeddedPlanProvider
from plancache_service.rebuild import RebuildSource

from .requests_io import requests_from_args, result_line, validate_all, write_result

GIB = 1024**3
MIB = 1024**2
LOCAL_CACHE_FLAGS = ("gpu_plans", "plan_width", "host_cache_bytes")
"""The CacheConfig flags of `generate-local` (its slab is always in host memory)."""


class UsageError(Exception):
    """A command-line value is invalid (exit code 2)."""


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    config = get_preset(args.preset)
    if args.dtype:
        config = config.replace(dtype=args.dtype)
    if args.shards < 1 or args.shards > 1000:
        raise UsageError(f"--shards must be in [1, 1000], got {args.shards}")
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed must be in [0, 2^63-1], got {args.seed}")
    if args.preset == "h3":
        raise UsageError("--preset h3 is for shape arithmetic and GPU runs; it is not materialized here")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        if not args.force:
            raise UsageError(f"--out {out} is not empty; pass --force to overwrite it")
        if not is_checkpoint_dir(out):
            raise UsageError(f"--out {out} is not a checkpoint directory; refusing to overwrite it")
        shutil.rmtree(out)
    write_checkpoint(config, out, seed=args.seed, shards=args.shards)
    info = validate_checkpoint(out)
    print(json.dumps({"checkpoint": str(out), "preset": config.preset, "fingerprint": info.fingerprint}))
    return 0


def inspect_data(args: argparse.Namespace) -> dict[str, Any]:
    if bool(args.checkpoint) == bool(args.preset):
        raise UsageError("give exactly one of a checkpoint DIR or --preset NAME")
    fp = None
    if args.preset:
        config = get_preset(args.preset)
        if args.dtype:
            config = config.replace(dtype=args.dtype)
    else:
        info = validate_checkpoint(args.checkpoint, require_adaln=False)
        config, fp = info.config, info.fingerprint
    pc = param_counts(config)
    return {
        "source": args.checkpoint or f"preset:{args.preset}",
        "preset": config.preset,
        "config": config.to_dict(),
        "dtype": config.dtype,
        "params": {"total": pc.total, "adaln_proj": pc.adaln_proj, "resident": pc.resident},
        "adaln_share": round(pc.adaln_share, 4),
        "adaln_bytes": pc.adaln_bytes,
        "adaln_gib": round(pc.adaln_bytes / GIB, 3),
        "total_bytes": pc.total_bytes,
        "page_numel": config.page_numel,
        "page_bytes": config.page_bytes,
        "page_mib": round(config.page_bytes / MIB, 3),
        "fingerprint": fp,
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    data = inspect_data(args)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    c = data["config"]
    rows = [
        ("source", data["source"]),
        ("preset", data["preset"]),
        ("dtype", data["dtype"]),
        ("layers x hidden", f"{c['num_layers']} x {c['hidden_size']} (heads {c['num_heads']})"),
        ("time_embed_dim", c["time_embed_dim"]),
        ("params total", f"{data['params']['total']:,}"),
        ("params adaln_proj", f"{data['params']['adaln_proj']:,}"),
        ("params resident", f"{data['params']['resident']:,}"),
        ("adaln_proj share", f"{100 * data['adaln_share']:.1f}%"),
        ("adaln_proj bytes", f"{data['adaln_bytes']:,} ({data['adaln_bytes'] / GIB:.2f} GiB)"),
        ("page elements", f"{data['page_numel']:,}"),
        ("page bytes", f"{data['page_bytes']:,} ({data['page_bytes'] / MIB:.2f} MiB)"),
        ("fingerprint", data["fingerprint"] or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def cmd_generate_local(args: argparse.Namespace) -> int:
    requests = requests_from_args(args)
    info = validate_checkpoint(args.checkpoint, require_adaln=True)
    validate_all(requests, info.config)
    if args.adaln_mode == "resident":
        _run_local(load_model(info, "resident"), None, requests, args)
        return 0
    cache_config = from_args(CacheConfig, args, only=LOCAL_CACHE_FLAGS)  # bounds were checked while parsing
    cache = PlanCache(cache_config, RebuildSource(info, torch.device("cpu")))
    try:
        for req in requests:  # every request must fit this slab before any runs
            cache.check_request(req.schedule_spec().plan_keys())
        _run_local(load_model(info, "cached"), EmbeddedPlanProvider(cache, owner="generate-local"), requests, args)
    finally:
        cache.close()
    return 0


def _run_local(
    model: DiT, provider: PlanProvider | None, requests: list[GenerationRequest], args: argparse.Namespace
) -> None:
    for req in requests:
        result = generate(model, req, provider)
        if args.out:
            write_result(Path(args.out), result, req)
        print(result_line(result, req, adaln_mode=args.adaln_mode), flush=True)
