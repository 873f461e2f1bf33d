"""Oracle tests for ditcore.pipeline: its resident and cached t2va loops give torch.equal latents to diffusers' own
MiniMax-H3 pipeline called directly on the same tiny repository, in float32 and in the released mixed precision."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from oracle import ReferenceProcessor, diffusers_latents

from ditcore.pipeline import (
    NotCachedError,
    PlanKeyMismatchError,
    ScheduleKeys,
    TextOnlyProcessor,
    generate_latents,
    load_pipeline,
    plan_key,
    plan_keys,
    use_cached_transformer,
)
from ditcore.plans import PageLayout, PlanKey, build_pages, plan_inputs, safetensors_layer_loader
from ditcore.repo import write_repository
from ditcore.request import GenerationRequest

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

DTYPES = ("float32", "mixed")
REQUEST = GenerationRequest(prompt="a red fox runs through the snow", num_inference_steps=4, seed=7, height=32,
                            width=32, num_frames=124)  # fmt: skip


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("h3pipe")
    return {d: write_repository(base / d, "tiny", seed=0, dtype=d) for d in DTYPES}


def diffusers_reference(repo: Path, dtype: str) -> tuple[torch.Tensor, torch.Tensor, list[PlanKey]]:
    """diffusers' t2va pipeline called directly (tests/oracle.py): latents and the keys its transformer received."""
    r = REQUEST
    video, audio, seen = diffusers_latents(repo, r.prompt, r.num_inference_steps, r.seed, r.height, r.width,
                                           r.num_frames, r.flow_shift, r.audio_flow_shift)  # fmt: skip
    return video, audio, [PlanKey(k) for k in seen]


@pytest.fixture(scope="module")
def reference(repos: dict[str, Path]) -> dict[str, tuple[torch.Tensor, torch.Tensor, list[PlanKey]]]:
    return {d: diffusers_reference(repos[d], d) for d in DTYPES}


def sidecar(repo: Path, pipe: Any) -> tuple[Any, list[int]]:
    """pages_for_step built from the key alone: temb by the transformer's modules, rows streamed from the shards."""
    transformer_dir = os.path.join(repo, "transformer")
    layout = PageLayout.from_config(pipe.transformer.config)
    load = safetensors_layer_loader(transformer_dir)  # as stored: float32, or bfloat16 in the mixed repository
    built: list[int] = []

    def pages_for_step(i: int, key: PlanKey) -> torch.Tensor:
        built.append(i)
        timestep = key.timesteps()
        temb = plan_inputs(pipe.transformer.time_proj, pipe.transformer.time_embedder, timestep)
        return build_pages(layout, temb, load)

    return pages_for_step, built


@pytest.mark.parametrize("dtype", DTYPES)
def test_resident_equals_diffusers(repos: dict[str, Path], reference: dict[str, Any], dtype: str) -> None:
    video, audio = generate_latents(load_pipeline(repos[dtype], dtype), REQUEST)
    ref_video, ref_audio, _ = reference[dtype]
    assert video.shape == (1, 24, 37, 2, 2) and audio.shape == (2, 32, 207)
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cached_equals_diffusers(repos: dict[str, Path], reference: dict[str, Any], dtype: str) -> None:
    pipe = load_pipeline(repos[dtype], dtype)
    use_cached_transformer(pipe, repos[dtype], dtype)
    assert not any(".adaln_proj.linear." in n for n, _ in pipe.transformer.named_parameters())
    pages_for_step, built = sidecar(repos[dtype], pipe)
    video, audio = generate_latents(pipe, REQUEST, pages_for_step)
    ref_video, ref_audio, ref_keys = reference[dtype]
    assert built == list(range(len(ref_keys)))
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)


def test_plan_keys_are_what_the_transformer_receives(repos: dict[str, Path], reference: dict[str, Any]) -> None:
    keys = plan_keys(load_pipeline(repos["float32"]), REQUEST)
    assert keys == reference["float32"][2]
    assert [k.width for k in keys] == [1] + [2] * (len(keys) - 1)
    for key in keys:
        values = key.timesteps()
        assert torch.equal(values, values.sort().values) and plan_key(values) == key
    assert keys[0] == PlanKey((0,))  # the first step: video and audio both at t = 1 - sigma = 0.0


def test_shift_changes_the_keys(repos: dict[str, Path]) -> None:
    pipe = load_pipeline(repos["float32"])
    shifted = dataclasses.replace(REQUEST, flow_shift=5.0)
    assert plan_keys(pipe, shifted)[1] != plan_keys(pipe, REQUEST)[1]


def test_wrong_key_and_resident_transformer_are_refused(repos: dict[str, Path]) -> None:
    pipe = load_pipeline(repos["float32"])
    with pytest.raises(NotCachedError):
        generate_latents(pipe, REQUEST, lambda i, k: torch.empty(0))
    use_cached_transformer(pipe, repos["float32"])
    keys = plan_keys(pipe, REQUEST)
    wrong = [keys[0], keys[2], keys[1]]
    pages_for_step, _ = sidecar(repos["float32"], pipe)
    with pytest.raises(PlanKeyMismatchError, match="step 1"):
        generate_latents(pipe, REQUEST, pages_for_step, wrong)
    with pytest.raises(PlanKeyMismatchError, match="plan has 4 steps"):
        generate_latents(pipe, REQUEST, pages_for_step, [*keys, keys[-1]])


def test_text_only_processor_runs_transformers_own_logic(repos: dict[str, Path]) -> None:
    from transformers import AutoTokenizer
    from transformers.processing_utils import ProcessorMixin

    assert TextOnlyProcessor.create_mm_token_type_ids is ProcessorMixin.create_mm_token_type_ids
    tokenizer = AutoTokenizer.from_pretrained(repos["float32"] / "tokenizer")
    prompt = "a fox <|image_pad|> in <|video_pad|><|vision_start|> snow"
    ids = [tokenizer(prompt)["input_ids"], torch.tensor(tokenizer("plain text")["input_ids"])]
    got = TextOnlyProcessor(tokenizer).create_mm_token_type_ids(ids)
    assert got == ReferenceProcessor(tokenizer).create_mm_token_type_ids(ids)
    assert sorted(set(got[0])) == [0, 1, 2] and set(got[1]) == {0}


@pytest.mark.parametrize(
    ("steps", "shift", "audio_shift"), [(4, 12.0, 3.0), (50, 12.0, 3.0), (7, 5.0, 5.0), (2, 1.0, 0.5), (13, 30.0, 1.0)]
)
def test_schedule_keys_mirror_the_set_timesteps_block(repos: dict[str, Path], steps: int, shift: float,
                                                      audio_shift: float) -> None:  # fmt: skip
    """ScheduleKeys (the schedulers alone, no text encoding) gives exactly the keys diffusers' own
    MiniMaxH3SetTimestepsStep stages, for the release shifts and others (equal shifts collapse to width 1)."""
    request = dataclasses.replace(REQUEST, num_inference_steps=steps, flow_shift=shift, audio_flow_shift=audio_shift)
    pipe = load_pipeline(repos["float32"])
    mirror = ScheduleKeys(repos["float32"])
    assert mirror.keys(request) == plan_keys(pipe, request)
    assert len(mirror.keys(request)) == steps - 1
    if shift == audio_shift:
        assert {k.width for k in mirror.keys(request)} == {1}
