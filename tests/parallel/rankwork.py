"""What each spawned rank of the context-parallel tests computes (tests/distkit.py runs it).

`cp_latents`: on every rank, diffusers' own MiniMax-H3 loop with `enable_parallelism(ContextParallelConfig(
ulysses_degree=N))` (tests/oracle.py's pipeline; the only change is that diffusers' resolver is given a CPU device
count of one, so it puts the rank on the CPU), then ditserve's cached transformer under ditcore.parallel with pages
from the sidecar's PlanBuilder, both on the same request (ditcore.load_model on a Replica: rank 0 alone loads the text encoder); each rank saves both.
With `anything`, diffusers' loop runs `ulysses_anything` for rows that do not divide by N (`gather_by_broadcast`).
`oracle_digests`: the per-request oracle of many requests in one process group (tests/parallel/test_replica_any_prompt.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from plankit import BuiltPages
from safetensors.torch import save_file


def gather_by_broadcast(tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """The uneven all-gather diffusers' `_all_gather_anything` asks of gloo (which refuses it), done without padding:
    each rank's share broadcast from that rank at its own size, concatenated in rank order."""
    import torch.distributed as dist
    from diffusers.models._modeling_parallel import gather_size_by_comm

    tensor = tensor.contiguous()
    sizes = gather_size_by_comm(tensor.shape[dim], group)
    parts = []
    for r, n in enumerate(sizes):
        part = (
            tensor
            if r == dist.get_rank(group)
            else tensor.new_empty((*tensor.shape[:dim], n, *tensor.shape[dim + 1 :]))
        )
        dist.broadcast(part, src=dist.get_global_rank(group, r), group=group)
        parts.append(part)
    return torch.cat(parts, dim=dim)


def diffusers_cp(
    repo: Path, request: dict[str, Any], degree: int, anything: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' loop on `degree` Ulysses ranks (the process group already joined). `anything`: diffusers'
    `ulysses_anything` (any packed length), its one uneven all-gather done by `gather_by_broadcast` (gloo's
    all_gather takes equal sizes only); the reference for lengths that do not divide by `degree`."""
    from diffusers import ContextParallelConfig
    from oracle import _pipeline, diffusers_request_latents, released_decode_dtype, stored_precision

    precision = stored_precision(repo)
    pipe = _pipeline(str(repo), precision, False, released_decode_dtype(precision), "native")
    transformer = pipe.transformer_ref if request.get("references") else pipe.transformer  # ref2va: its partition
    with mock.patch("torch.accelerator.device_count", return_value=1):
        transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree, ulysses_anything=anything))
    with mock.patch("diffusers.hooks.context_parallel._all_gather_anything", gather_by_broadcast):
        return diffusers_request_latents(repo, request)


def ditserve_cp(repo: Path, request: dict[str, Any], degree: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ditserve's cached model (no adaln_proj) on this rank of a replica: ditcore.load_model with a Replica (context
    parallel through diffusers, rank 0's text encoder broadcasting the prompt embedding), pages from PlanBuilder."""
    from ditcore import GenerationRequest, generate, load_model
    from ditcore.parallel import ParallelSpec, init_process_group
    from ditcore.replica import Replica

    device = torch.device("cpu")
    ranks = init_process_group(device)
    replica = Replica(ParallelSpec(ulysses_degree=degree), ranks, device)
    model = load_model(repo, "cached", device, replica=replica)
    if not replica.leader:
        assert model.pipe.text_encoder_load.placement == "rank0"  # no Qwen3-VL weights on this rank
    result = generate(model, GenerationRequest(**request), BuiltPages(repo))
    return result.video, result.audio


def cp_latents(rank: int, out: Path, repo: Path, request: dict[str, Any], degree: int, anything: bool = False) -> None:
    from ditcore.parallel import init_process_group

    init_process_group(torch.device("cpu"))
    video, audio = diffusers_cp(repo, request, degree, anything)
    mine_video, mine_audio = ditserve_cp(repo, request, degree)
    save_file({"diffusers_video": video.contiguous(), "diffusers_audio": audio.contiguous(),
               "ditserve_video": mine_video.contiguous(), "ditserve_audio": mine_audio.contiguous()},
              str(out / f"rank{rank}.safetensors"))  # fmt: skip


def diffusers_only(rank: int, out: Path, repos: list[Path], request: dict[str, Any], degree: int) -> None:
    """diffusers' own Ulysses loop on `degree` ranks for each repository; rank 0 saves the latents."""
    from ditcore.parallel import init_process_group

    init_process_group(torch.device("cpu"))
    for i, repo in enumerate(repos):
        video, audio = diffusers_cp(repo, request, degree)
        if rank == 0:
            save_file({"video": video.contiguous(), "audio": audio.contiguous()}, str(out / f"repo{i}.safetensors"))


def cuda_cached_vs_resident(rank: int, out: Path, repo: Path, request: dict[str, Any], degree: int) -> None:
    """On cuda:rank with NCCL: ditserve's cached model (pages from PlanBuilder) and its resident model, both on the
    replica; each rank saves both latents."""
    from ditcore import GenerationRequest, generate, load_model
    from ditcore.parallel import ParallelSpec, init_process_group
    from ditcore.replica import Replica

    device = torch.device("cuda", rank)
    replica = Replica(ParallelSpec(ulysses_degree=degree), init_process_group(device), device)
    req = GenerationRequest(**request)
    cached = generate(load_model(repo, "cached", device, replica=replica), req, BuiltPages(repo, device))
    resident = generate(load_model(repo, "resident", device, replica=replica), req)
    save_file({"cached_video": cached.video, "cached_audio": cached.audio, "resident_video": resident.video,
               "resident_audio": resident.audio}, str(out / f"rank{rank}.safetensors"))  # fmt: skip


def latents_digest(video: torch.Tensor, audio: torch.Tensor) -> str:
    """sha256 over the video then the audio latents' bytes: what the generator reports as a result's sha256."""
    import hashlib

    h = hashlib.sha256()
    for t in (video, audio):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def oracle_digests(rank: int, out: Path, repo: Path, requests: list[dict[str, Any]], degree: int) -> None:
    """`oracle_of` for one repository's requests; rank 0 writes oracle.json."""
    oracle_digests_of(rank, out, [(repo, requests, "oracle.json")], degree)


def oracle_digests_of(rank: int, out: Path, runs: list[tuple[Path, list[dict[str, Any]], str]], degree: int) -> None:
    """Each run's `oracle_of` in one process group; rank 0 writes each run's file."""
    from ditcore.parallel import init_process_group

    init_process_group(torch.device("cpu"))
    for repo, requests, name in runs:
        found = oracle_of(repo, requests, degree)
        if rank == 0:
            (out / name).write_text(json.dumps(found))


def oracle_of(repo: Path, requests: list[dict[str, Any]], degree: int) -> dict[str, Any]:
    """Each request's oracle on `degree` Ulysses ranks, in one process group: diffusers' own context-parallel loop
    (`ContextParallelConfig(ulysses_degree=degree)`) where the packed rows divide by `degree` (the length diffusers
    runs); otherwise the same loop with diffusers' `ulysses_anything` and `gather_by_broadcast`. Rank 0 writes
    oracle.json: request_id -> sha256, packed rows, text tokens and which oracle ran."""
    from diffusers import ContextParallelConfig
    from oracle import _pipeline, diffusers_request_latents, released_decode_dtype, stored_precision

    from ditcore.request import prompt_tokens

    precision = stored_precision(repo)
    pipe = _pipeline(str(repo), precision, False, released_decode_dtype(precision), "native")
    seen: dict[str, int] = {}

    def choose(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        # the forward's packed rows pick the path; the split hooks and the dispatcher read this config object
        rows = int(kwargs["position_ids"].shape[0])
        module._parallel_config.context_parallel_config.ulysses_anything = bool(rows % degree)
        seen["rows"] = rows

    for transformer in (pipe.transformer, pipe.transformer_ref):
        with mock.patch("torch.accelerator.device_count", return_value=1):
            transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree))
        transformer.register_forward_pre_hook(choose, with_kwargs=True)
    found: dict[str, Any] = {}
    with mock.patch("diffusers.hooks.context_parallel._all_gather_anything", gather_by_broadcast):
        for request in requests:
            video, audio = diffusers_request_latents(repo, request)
            found[request["request_id"]] = {
                "sha256": latents_digest(video, audio), "rows": seen["rows"],
                "tokens": prompt_tokens(pipe.tokenizer, request["prompt"]),
                "oracle": "diffusers-anything-broadcast" if seen["rows"] % degree else "diffusers",
            }  # fmt: skip
    return found


def diffusers_with_adapters(
    rank: int, out: Path, repo: Path, request: dict[str, Any], degree: int, sets: list[list[tuple[Path, float]]]
) -> None:
    """diffusers' own Ulysses loop on `degree` ranks once per set of adapter files, each loaded
    (`load_lora_weights`, after `enable_parallelism`, as a served model loads them), set (`set_adapters(names,
    weights)`) and unloaded after; rank 0 saves set i's latents as adapters{i}.safetensors."""
    from diffusers import ContextParallelConfig
    from oracle import _pipeline, diffusers_request_latents, released_decode_dtype, stored_precision

    from ditcore.parallel import init_process_group

    init_process_group(torch.device("cpu"))
    precision = stored_precision(repo)
    pipe = _pipeline(str(repo), precision, False, released_decode_dtype(precision), "native")
    with mock.patch("torch.accelerator.device_count", return_value=1):
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree))
    for i, adapters in enumerate(sets):
        names = [f"o{i}_{j}" for j in range(len(adapters))]
        for name, (path, _) in zip(names, adapters, strict=True):
            pipe.load_lora_weights(str(path), adapter_name=name)
        pipe.set_adapters(names, [s for _, s in adapters])
        video, audio = diffusers_request_latents(repo, request)
        pipe.unload_lora_weights()
        if rank == 0:
            save_file({"video": video.contiguous(), "audio": audio.contiguous()}, str(out / f"adapters{i}.safetensors"))


def diffusers_with_step_cache(
    rank: int, out: Path, repo: Path, request: dict[str, Any], degree: int, cache: dict[str, Any]
) -> None:
    """diffusers' own Ulysses loop on `degree` ranks with a step cache (ditcore.step_cache's definition: its H3 block
    registered, enabled through `enable_cache` after `enable_parallelism`, the loop in one cache context, as a served
    replica runs it); rank 0 saves the latents as step_cache.safetensors."""
    from diffusers import ContextParallelConfig
    from oracle import _pipeline, diffusers_request_latents, released_decode_dtype, stored_precision

    from ditcore.parallel import init_process_group
    from ditcore.step_cache import StepCache, register_h3_blocks

    init_process_group(torch.device("cpu"))
    precision = stored_precision(repo)
    pipe = _pipeline(str(repo), precision, False, released_decode_dtype(precision), "native")
    with mock.patch("torch.accelerator.device_count", return_value=1):
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree))
    register_h3_blocks()
    pipe.transformer.enable_cache(StepCache.parse(cache, "test").config())
    with pipe.transformer.cache_context("cond"):
        video, audio = diffusers_request_latents(repo, request)
    if rank == 0:
        save_file({"video": video.contiguous(), "audio": audio.contiguous()}, str(out / "step_cache.safetensors"))
