"""What each spawned rank of the context-parallel tests computes (tests/distkit.py runs it).

`cp_latents`: on every rank, diffusers' own MiniMax-H3 loop with `enable_parallelism(ContextParallelConfig(
ulysses_degree=N))` (tests/oracle.py's pipeline; the only change is that diffusers' resolver is given a CPU device
count of one, so it puts the rank on the CPU), then ditserve's cached transformer under ditcore.parallel with pages
from the sidecar's PlanBuilder, both on the same request; each rank saves both pairs of latents.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from safetensors.torch import save_file


def diffusers_cp(repo: Path, request: dict[str, Any], degree: int) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' loop on `degree` Ulysses ranks (the process group already joined)."""
    from diffusers import ContextParallelConfig
    from oracle import _pipeline, diffusers_request_latents, released_decode_dtype, stored_precision

    precision = stored_precision(repo)
    pipe = _pipeline(str(repo), precision, False, released_decode_dtype(precision), "native")
    with mock.patch("torch.accelerator.device_count", return_value=1):
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree))
    return diffusers_request_latents(repo, request)


def ditserve_cp(repo: Path, request: dict[str, Any], degree: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ditserve's cached transformer (no adaln_proj) under ditcore.parallel, pages from PlanBuilder."""
    from oracle import stored_precision

    from ditcore.parallel import ParallelSpec, enable_context_parallel, split_guard
    from ditcore.pipeline import generate_latents, load_pipeline, plan_keys
    from ditcore.rebuild import PlanBuilder
    from ditcore.request import GenerationRequest

    precision = stored_precision(repo)
    req = GenerationRequest(**request)
    pipe = load_pipeline(repo, precision, cached=True)
    spec = ParallelSpec(ulysses_degree=degree)
    enable_context_parallel(pipe.transformer, spec, torch.device("cpu"))
    split_guard(pipe.transformer, spec)
    keys = plan_keys(pipe, req)
    builder = PlanBuilder(repo / "transformer")
    pages = [builder.build_one(k) for k in keys]
    return generate_latents(pipe, req, lambda i, _key: pages[i], keys)


def cp_latents(rank: int, out: Path, repo: Path, request: dict[str, Any], degree: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("cpu:gloo")
    video, audio = diffusers_cp(repo, request, degree)
    mine_video, mine_audio = ditserve_cp(repo, request, degree)
    save_file({"diffusers_video": video.contiguous(), "diffusers_audio": audio.contiguous(),
               "ditserve_video": mine_video.contiguous(), "ditserve_audio": mine_audio.contiguous()},
              str(out / f"rank{rank}.safetensors"))  # fmt: skip


def split_refused(rank: int, out: Path, repo: Path, request: dict[str, Any], degree: int) -> None:
    """ditserve's cached CP run of a request whose rows do not split: the SplitError each rank raised."""
    from ditcore.parallel import SplitError, init_process_group

    init_process_group(torch.device("cpu"))
    try:
        ditserve_cp(repo, request, degree)
        outcome = {"raised": None}
    except SplitError as e:
        outcome = {"raised": str(e)}
    (out / f"rank{rank}.json").write_text(json.dumps(outcome))
