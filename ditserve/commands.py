"""Implementations of the local `ditserve` subcommands (no services involved): make-checkpoint, inspect,
generate-local (whose results go where `outputs.py` says, with a progress bar from `progress.py`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ditcore import (
    CheckpointInfo,
    GenerationRequest,
    H3Model,
    PlanProvider,
    figures,
    generate,
    get_preset,
    load_model,
    validate_checkpoint,
    write_repository,
)
from ditcore.adapters import AdapterRegistry
from ditcore.checkpoint_files import is_repository_dir
from ditcore.media import encode
from ditcore.model import RunOptions
from ditcore.plans import dtype_name
from ditcore.presets import PRESETS
from ditcore.quality import QualityLevels, QualityLevelsError
from ditcore.repo import check_partitions
from ditcore.text_encoder import TextEncoderPlacement
from ditruntime.flags import from_args
from ditruntime.paths import check_dir, prepare_dir
from plancache_service.cache import PlanCache
from plancache_service.config import CacheConfig
from plancache_service.embedded import EmbeddedPlanProvider
from plancache_service.errors import PlanCapacityError
from plancache_service.rebuild import RebuildSource

from .errors import UsageError
from .memory_view import memory_data, print_memory, wants_memory
from .outputs import OutputTarget, write_output
from .progress import Progress, progress_enabled
from .requests_io import prepare_run, result_line, validate_all

GIB = 1024**3
MIB = 1024**2
MAX_SHARDS = 1000
MAX_SEED = 2**63 - 1
LOCAL_CACHE_FLAGS = ("gpu_plans", "plan_width", "host_cache_bytes")
"""The CacheConfig flags of `generate-local` (its slab is always in host memory)."""
LOCAL_MODEL_FLAGS = ("attention_backend", "decode_dtype", "text_encoder_device", "text_encoder_offload", "adapter_dir",
                     "max_loaded_adapters", "quality_levels", "quality_audit_dir")  # fmt: skip
"""The GeneratorConfig flags of `generate-local`: how its model runs (ditcore.model.RunOptions)."""
WRITABLE_PRESETS = tuple(name for name, p in PRESETS.items() if p.writable)
_BYTES = {"mixed": 2, "float32": 4}  # bytes per element of the projections (mixed keeps them in bfloat16)


def quiet_model_libraries() -> None:
    """Turn off diffusers' and transformers' progress bars (shard writing and loading): the commands print one JSON
    line per result on stdout and errors on stderr, nothing else."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    # diffusers' audio VAE still builds with torch.nn.utils.weight_norm; torch's deprecation notice is not ours to show
    warnings.filterwarnings("ignore", message=r".*weight_norm.* is deprecated", category=FutureWarning)


# ---------------------------------------------------------------------------- make-checkpoint
def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    """Write a MiniMax-H3 diffusers repository; print one JSON line (checkpoint, preset, precision, fingerprint)."""
    if args.preset not in WRITABLE_PRESETS:
        if args.preset in PRESETS:
            raise UsageError(
                f"--preset {args.preset} is the released shapes, for arithmetic only (`ditserve inspect --preset "
                f"{args.preset}`); write one of {', '.join(WRITABLE_PRESETS)}"
            )
        raise UsageError(f"--preset must be one of {', '.join(WRITABLE_PRESETS)}, got {args.preset!r}")
    if not 1 <= args.shards <= MAX_SHARDS:
        raise UsageError(f"--shards must be in [1, {MAX_SHARDS}], got {args.shards}")
    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed must be in [0, 2^63-1], got {args.seed}")
    try:
        partitions = check_partitions([p.strip() for p in args.partitions.split(",") if p.strip()])
    except ValueError as e:
        raise UsageError(f"--partitions: {e}") from None
    out = check_dir(args.out, "--out")  # a file, or a parent that is one, is refused before anything is written
    if out.exists() and any(out.iterdir()):
        if not args.force:
            raise UsageError(f"--out {out} is not empty; pass --force to overwrite it")
        if not is_repository_dir(out):
            raise UsageError(
                f"--out {out} is not a checkpoint directory (no model_index.json); refusing to overwrite it"
            )
        shutil.rmtree(out)
    prepare_dir(out, "--out")  # created 0700 (parents too), like every directory flag
    quiet_model_libraries()
    write_repository(
        out, preset=args.preset, seed=args.seed, dtype=args.dtype, shards=args.shards, partitions=partitions
    )
    info = validate_checkpoint(out)
    line = {
        "checkpoint": str(out),
        "preset": info.preset,
        "precision": info.precision,
        "seed": args.seed,
        "fingerprint": info.fingerprint,
        "partitions": {name: part.fingerprint for name, part in info.partitions.items()},
    }
    print(json.dumps(line))
    return 0


# ---------------------------------------------------------------------------- make-adapter
def cmd_make_adapter(args: argparse.Namespace) -> int:
    """Write a random MiniMax-H3 LoRA adapter (ditcore.adapter_files) in one of the layouts diffusers' H3 loader
    converts; print one JSON line (adapter, layout, targets, rank, alpha, seed, partition, tensors)."""
    import math

    from ditcore.adapter_files import AdapterError, check_adapter, transformer_config, write_adapter
    from ditcore.presets import preset_of
    from ditruntime.paths import write_atomically

    if args.rank < 1:
        raise UsageError(f"--rank must be >= 1, got {args.rank}")
    if args.alpha is not None and not (math.isfinite(args.alpha) and args.alpha > 0):
        raise UsageError(f"--alpha must be a finite number > 0 (omit it for scale 1.0), got {args.alpha}")
    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed must be in [0, 2^63-1], got {args.seed}")
    if args.checkpoint is None and args.preset is None:
        raise UsageError("give --preset NAME or --checkpoint DIR (the transformer the adapter is shaped for)")
    if args.preset is not None and args.preset not in PRESETS:
        raise UsageError(f"--preset must be one of {', '.join(PRESETS)}, got {args.preset!r}")
    shapes: Any = args.preset
    if args.checkpoint is not None:
        try:
            shapes = transformer_config(Path(args.checkpoint).expanduser())
        except AdapterError as e:
            raise UsageError(f"--checkpoint: {e}") from None
        if args.preset is not None and preset_of(shapes) != args.preset:
            raise UsageError(
                f"--checkpoint {args.checkpoint} has the shapes of preset {preset_of(shapes)!r}, not --preset "
                f"{args.preset}; drop --preset to shape the adapter for the repository"
            )
    values = dict(layout=args.layout, targets=args.targets, rank=args.rank, alpha=args.alpha, partition=args.partition,
                  deltas=args.deltas)  # fmt: skip
    try:  # what the layout cannot carry is refused before anything is written
        check_adapter(transformer_config(shapes), args.targets, args.layout, args.rank, args.alpha, args.partition,
                      args.deltas)  # fmt: skip
    except AdapterError as e:
        flags = " ".join(f"--{p} {values[p]}" for p in e.params if p in values)
        raise UsageError(f"{flags}: {e}" if flags else str(e)) from None
    out = Path(args.out).expanduser()
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give the adapter's file name (e.g. adapter.safetensors)")
    if out.exists() and not args.force:
        raise UsageError(f"--out {out} exists; pass --force to overwrite it")
    prepare_dir(out.parent, "--out")
    quiet_model_libraries()
    write_atomically(
        out,
        lambda tmp: write_adapter(
            tmp,
            shapes,
            args.targets,
            args.layout,
            args.rank,
            args.alpha,
            args.seed,
            partition=args.partition,
            deltas=args.deltas,
        ),
    )
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:
        tensors = len(list(f.keys()))
    print(json.dumps({"adapter": str(out), **values, "seed": args.seed, "tensors": tensors}))
    return 0


# ---------------------------------------------------------------------------- inspect
def _transformer_params(config: dict[str, Any]) -> tuple[int, int]:
    """(all parameters, adaln_proj parameters) of the transformer `config` describes, counted on meta."""
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel.from_config(config)
    params = sum(t.numel() for t in model.parameters())
    adaln = sum(t.numel() for n, t in model.named_parameters() if ".adaln_proj." in n)
    return params, adaln


def _figures_row(params: int, adaln: int, page_numel: int, precision: str) -> dict[str, Any]:
    size = _BYTES[precision]
    return {
        "params": {"total": params, "adaln_proj": adaln, "other": params - adaln},
        "adaln_share": round(adaln / params, 4),
        "adaln_bytes": adaln * size,
        "adaln_gib": round(adaln * size / GIB, 4),
        "page_numel": page_numel,
        "page_bytes": page_numel * size,
        "page_mib": round(page_numel * size / MIB, 4),
    }


def _shape(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("num_layers", "hidden_size", "num_attention_heads", "attention_head_dim", "time_embed_dim", "ffn_dim")
    return {k: config.get(k) for k in keys}


def inspect_data(args: argparse.Namespace) -> dict[str, Any]:
    """What `inspect` prints: a preset's figures (no repository), or a repository's with its fingerprint; with a
    canvas flag also the modeled memory and time at that canvas ("memory", ditserve.memory_view)."""
    data = _figures_data(args)
    if wants_memory(args):
        data["memory"] = memory_data(args, data["precision"])
    return data


def _figures_data(args: argparse.Namespace) -> dict[str, Any]:
    if bool(args.checkpoint) == bool(args.preset):
        raise UsageError("give exactly one of a checkpoint DIR or --preset NAME")
    if args.preset:
        if args.preset not in PRESETS:
            raise UsageError(f"--preset must be one of {', '.join(PRESETS)}, got {args.preset!r}")
        precision = args.dtype or "mixed"
        preset = get_preset(args.preset)
        f = figures(preset)
        config = preset.transformer_kwargs()
        return {
            "source": f"preset:{args.preset}",
            "preset": args.preset,
            "precision": precision,
            "projection_dtype": "bfloat16" if precision == "mixed" else "float32",
            "transformer": _shape(config),
            **_figures_row(f.params, f.adaln_params, f.page_numel, precision),
            "has_adaln": None,
            "fingerprint": None,
            "partitions": {name: None for name in ("base", "ref")},  # the released repository holds both
        }
    if args.dtype:
        raise UsageError("--dtype goes with --preset; a repository's precision is what its files store")
    info: CheckpointInfo = validate_checkpoint(args.checkpoint, require_adaln=False)
    params, adaln = _transformer_params(info.transformer_config)
    return {
        "source": str(args.checkpoint),
        "preset": info.preset,
        "precision": info.precision,
        "projection_dtype": dtype_name(info.projection_dtype),
        "transformer": _shape(info.transformer_config),
        **_figures_row(params, adaln, info.layout.page_numel, info.precision),
        "has_adaln": info.has_adaln,
        "fingerprint": info.fingerprint,
        "partitions": {name: part.fingerprint for name, part in info.partitions.items()},
    }


def human_bytes(n: int) -> str:
    """`n` bytes in the largest binary unit that keeps the number >= 1 (24.23 GiB, 9.25 MiB, 7.00 KiB)."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def cmd_inspect(args: argparse.Namespace) -> int:
    data = inspect_data(args)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    t, p = data["transformer"], data["params"]
    rows = [
        ("source", data["source"]),
        ("preset", data["preset"]),
        ("precision", f"{data['precision']} (adaln_proj and pages in {data['projection_dtype']})"),
        ("layers x hidden", f"{t['num_layers']} x {t['hidden_size']} (heads {t['num_attention_heads']})"),
        ("time_embed_dim", t["time_embed_dim"]),
        ("params total", f"{p['total']:,}"),
        ("params adaln_proj", f"{p['adaln_proj']:,}"),
        ("params other", f"{p['other']:,}"),
        ("adaln_proj share", f"{100 * data['adaln_share']:.1f}%"),
        ("adaln_proj bytes", f"{data['adaln_bytes']:,} ({human_bytes(data['adaln_bytes'])})"),
        ("page elements", f"{data['page_numel']:,}"),
        ("page bytes", f"{data['page_bytes']:,} ({human_bytes(data['page_bytes'])})"),
    ]
    if data["has_adaln"] is not None:
        rows.append(("native adaln_proj", "yes" if data["has_adaln"] else "no (cached serving only)"))
    rows.append(("fingerprint", data["fingerprint"] or "-"))
    folders = {"base": "transformer/: t2va, fl2va", "ref": "transformer_ref/: ref2va"}
    rows.append(("partitions", ", ".join(f"{n} ({folders[n]}{', ' + fp[:16] if fp else ''})"
                                        for n, fp in data["partitions"].items())))  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if "memory" in data:
        print_memory(data["memory"])
    return 0


# ---------------------------------------------------------------------------- generate-local
def cmd_generate_local(args: argparse.Namespace) -> int:
    requests, target, unset = prepare_run(args)
    registry = _adapter_registry(args, requests)
    requests = [_with_contract_defaults(r, u, registry) for r, u in zip(requests, unset, strict=True)]
    validate_all(requests)
    quiet_model_libraries()
    info = validate_checkpoint(args.checkpoint, require_adaln=True)
    text_encoder = TextEncoderPlacement(args.text_encoder_device, args.text_encoder_offload)
    text_encoder.check(torch.device("cpu"))  # generate-local runs on the CPU: refused before anything loads
    options = RunOptions(attention_backend=args.attention_backend, decode_dtype=args.decode_dtype,
                         text_encoder=text_encoder, adapters=registry,
                         max_loaded_adapters=args.max_loaded_adapters, quality=_quality_levels(args))  # fmt: skip
    if args.adaln_mode == "resident":
        model = load_model(info, "resident", options=options)
        _check_adapters(model, requests)
        _run_local(model, None, requests, target, args)
        return 0
    cache_config = from_args(CacheConfig, args, only=LOCAL_CACHE_FLAGS)  # bounds were checked while parsing
    cache = PlanCache(cache_config, RebuildSource(info, torch.device("cpu")))
    try:
        model = load_model(info, "cached", options=options)
        _check_adapters(model, requests)
        for req in requests:  # every request must fit this slab before any runs
            try:
                cache.check_request(model.plan_keys(req))
            except PlanCapacityError as e:
                raise UsageError(f"request {req.request_id!r}: {e}") from e
        _run_local(model, EmbeddedPlanProvider(cache, owner="generate-local"), requests, target, args)
    finally:
        cache.close()
    return 0


def _adapter_registry(args: argparse.Namespace, requests: list[GenerationRequest]) -> AdapterRegistry | None:
    """--adapter-dir's registry (None without it); UsageError for a directory that is not one, or for a request that
    names an adapter without it."""
    if args.adapter_dir is None:
        named = next((r for r in requests if r.adapters), None)
        if named is not None:
            raise UsageError(
                f"request {named.request_id!r} names the adapter {named.adapters[0].name}: give --adapter-dir DIR "
                "(the directory of NAME.safetensors files)"
            )
        return None
    path = Path(args.adapter_dir).expanduser()
    if not path.is_dir():
        raise UsageError(f"--adapter-dir {path}: not a directory")
    return AdapterRegistry(path)


def _quality_levels(args: argparse.Namespace) -> QualityLevels:
    """--quality-levels as read (lossless only without it): UsageError naming the file, level and key."""
    try:
        return QualityLevels.load(args.quality_levels, args.quality_audit_dir)
    except QualityLevelsError as e:
        raise UsageError(f"--quality-levels: {e}") from None


def _with_contract_defaults(
    request: GenerationRequest, unset: frozenset[str], registry: AdapterRegistry | None
) -> GenerationRequest:
    """`request` with the fields it left unset given by its adapters' contract defaults, as the server gives them
    (ditcore.adapter_contract.contract_defaults); an adapter that cannot be read gives none (it is refused later,
    naming why)."""
    if registry is None or not request.adapters or not unset:
        return request
    from ditcore.adapter_contract import contract_defaults

    contracts = registry.contracts(use.name for use in request.adapters)
    return dataclasses.replace(request, **contract_defaults(contracts, unset))


def _check_adapters(model: H3Model, requests: list[GenerationRequest]) -> None:
    """Every request's adapters as the model reads them (found, within their contracts, servable in this mode) before
    any runs: AdapterNotFoundError / AdapterError / RequestError naming the adapter (exit 2)."""
    for req in requests:
        model.adapter_set.resolve(req)


def _run_local(
    model: H3Model,
    provider: PlanProvider | None,
    requests: list[GenerationRequest],
    target: OutputTarget,
    args: argparse.Namespace,
) -> None:
    show = progress_enabled(args.progress)
    for req in requests:
        media = None
        with Progress(req.request_id, show, decodes=req.decodes) as bar:
            result = generate(model, req, provider, on_step=bar.step)
            if result.media is not None:
                bar.stage("mux")
                t0 = time.perf_counter()
                media = encode(result.media, req.output_type)
                result.media = None  # the decoded frames are not held while the file is written
                mux_ms = round((time.perf_counter() - t0) * 1000.0, 3)
                result.timings_ms["mux"] = mux_ms
                result.timings_ms["total"] = round(result.timings_ms["total"] + mux_ms, 3)
            try:
                files = write_output(target.path_for(req), req, media, result)
            finally:
                if media is not None:
                    media.close()  # its spooled file (memory or a temporary file) goes now
        shapes = None if req.decodes else (result.video.shape, result.audio.shape)
        timings: dict[str, Any] = {**result.timings_ms, "attention_backend": result.attention_backend}  # as remote
        line = result_line(req, result.sha256, timings, result.cache, shapes, adaln_mode=args.adaln_mode, **files)
        print(line, flush=True)
