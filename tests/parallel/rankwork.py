"""What each spawned rank of the context-parallel tests computes (tests/distkit.py runs it).

`cp_latents`: on every rank, diffusers' own MiniMax-H3 loop with `enable_parallelism(ContextParallelConfig(
ulysses_degree=N))` (tests/oracle.py's pipeline; the only change is that diffusers' resolver is given a CPU device
count of one, so it puts the rank on the CPU), then ditserve's cached transformer under ditcore.parallel with pages
from the sidecar's PlanBuilder, both on the same request (ditcore.load_model on a Replica: rank 0 alone loads the text encoder); each rank saves both.
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
    transformer = pipe.transformer_ref if request.get("references") else pipe.transformer  # ref2va: its partition
    with mock.patch("torch.accelerator.device_count", return_value=1):
        transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree))
    return diffusers_request_latents(repo, request)


class BuiltPages:
    """A PlanProvider whose lease holds pages built here by the sidecar's PlanBuilder (no sidecar process), from the
    checkpoint folder of each key's partition."""

    def __init__(self, repo: Path, device: torch.device | None = None) -> None:
        self.repo, self.device = repo, device if device is not None else torch.device("cpu")
        self.builders: dict[str, Any] = {}

    def builder(self, partition: str) -> Any:
        from ditcore.checkpoint_files import PARTITIONS
        from ditcore.rebuild import PlanBuilder

        if partition not in self.builders:
            self.builders[partition] = PlanBuilder(self.repo / PARTITIONS[partition], self.device)
        return self.builders[partition]

    def acquire(self, keys: Any) -> Any:
        from ditcore.report import CacheReport

        pages = [self.builder(k.partition).build_one(k) for k in keys]

        class Lease:
            report = CacheReport(built_plans=len(keys))

            def pages(self, step: int) -> torch.Tensor:
                return pages[step]

            def release(self) -> None:
                pass

        return Lease()


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


def cp_latents(rank: int, out: Path, repo: Path, request: dict[str, Any], degree: int) -> None:
    from ditcore.parallel import init_process_group

    init_process_group(torch.device("cpu"))
    video, audio = diffusers_cp(repo, request, degree)
    mine_video, mine_audio = ditserve_cp(repo, request, degree)
    save_file({"diffusers_video": video.contiguous(), "diffusers_audio": audio.contiguous(),
               "ditserve_video": mine_video.contiguous(), "ditserve_audio": mine_audio.contiguous()},
              str(out / f"rank{rank}.safetensors"))  # fmt: skip


def split_refused(rank: int, out: Path, repo: Path, request: dict[str, Any], degree: int) -> None:
    """ditserve's cached CP run of a request whose rows do not split: the SplitError each rank raised."""
    from ditcore.parallel import SplitError

    try:
        ditserve_cp(repo, request, degree)
        outcome = {"raised": None}
    except SplitError as e:
        outcome = {"raised": str(e)}
    (out / f"rank{rank}.json").write_text(json.dumps(outcome))


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
