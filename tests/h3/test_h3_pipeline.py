"""Oracle tests for ditcore.h3.pipeline: its resident and cached t2va loops give torch.equal latents to diffusers' own
MiniMax-H3 pipeline called directly on the same tiny repository, in float32 and in the released mixed precision."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ditcore.h3.pipeline import (
    H3Request,
    NotCachedError,
    PlanKey,
    PlanKeyMismatchError,
    TextOnlyProcessor,
    generate_latents,
    load_pipeline,
    plan_key,
    plan_keys,
    use_cached_transformer,
)
from ditcore.h3.plans import PageLayout, build_pages, plan_inputs, safetensors_layer_loader
from ditcore.h3.repo import write_repository

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

DTYPES = ("float32", "mixed")
LOAD_DTYPES: dict[str, Any] = {
    "float32": torch.float32,
    "mixed": {"transformer": torch.bfloat16, "text_encoder": torch.bfloat16, "default": torch.float32},
}
REQUEST = H3Request("a red fox runs through the snow", num_inference_steps=4, seed=7, height=32, width=32,
                    num_frames=124)  # fmt: skip


class ReferenceProcessor:
    """The test's own reading of ProcessorMixin.create_mm_token_type_ids for Qwen3-VL (1 image pad, 2 video pad)."""

    def __init__(self, tokenizer: Any) -> None:
        self.image = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.video = tokenizer.convert_tokens_to_ids("<|video_pad|>")

    def create_mm_token_type_ids(self, input_ids: list[Any]) -> list[list[int]]:
        out = []
        for ids in input_ids:
            arr = np.array(list(ids))
            types = np.zeros_like(arr)
            types[arr == self.image] = 1
            types[arr == self.video] = 2
            out.append(types.tolist())
        return out


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("h3pipe")
    return {d: write_repository(base / d, "tiny", seed=0, dtype=d) for d in DTYPES}


def diffusers_reference(repo: Path, dtype: str) -> tuple[torch.Tensor, torch.Tensor, list[PlanKey]]:
    """diffusers' t2va pipeline called directly (the recipe of the H3 groundwork scripts): latents and the keys
    its transformer received."""
    blocks = diffusers.MiniMaxH3Blocks()
    blocks.sub_blocks.pop("decode")
    pipe = diffusers.MiniMaxH3ModularPipeline(blocks=blocks.get_workflow("t2va"), pretrained_model_name_or_path=repo)
    names = [n for n in pipe.pretrained_component_names if n != "processor"]
    pipe.load_components(names=names, dtype=LOAD_DTYPES[dtype])
    pipe.update_components(processor=ReferenceProcessor(pipe.tokenizer))
    pipe.scheduler.set_shift(REQUEST.flow_shift)
    pipe.audio_scheduler.set_shift(REQUEST.audio_flow_shift)
    seen: list[PlanKey] = []

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.append(tuple(kwargs["timestep"].view(torch.int32).tolist()))

    pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    out = pipe(prompt=REQUEST.prompt, height=REQUEST.height, width=REQUEST.width, num_frames=REQUEST.num_frames,
               num_inference_steps=REQUEST.num_inference_steps, generator=torch.Generator("cpu").manual_seed(7),
               output=["latents", "audio_latents"])  # fmt: skip
    return out["latents"], out["audio_latents"], seen


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
        timestep = torch.tensor(key, dtype=torch.int32).view(torch.float32)
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
    assert [len(k) for k in keys] == [1] + [2] * (len(keys) - 1)
    for key in keys:
        values = torch.tensor(key, dtype=torch.int32).view(torch.float32)
        assert torch.equal(values, values.sort().values) and plan_key(values) == key
    assert keys[0] == (0,)  # the first step: video and audio both at t = 1 - sigma = 0.0


def test_shift_changes_the_keys(repos: dict[str, Path]) -> None:
    pipe = load_pipeline(repos["float32"])
    shifted = H3Request(**{**REQUEST.__dict__, "flow_shift": 5.0})
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
