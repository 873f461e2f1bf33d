"""The oracle: diffusers' own MiniMax-H3 t2va pipeline, called directly on a repository, for torch.equal comparisons.

Independent of ditcore on purpose: it builds `MiniMaxH3Blocks` itself (decode removed: no VAE pass), loads the
components at the repository's stored precision with diffusers' loader, sets the two schedulers' shifts, and records
the `timestep` every transformer forward receives. The only stand-in is the processor (Qwen3VLProcessor needs
torchvision): `ReferenceProcessor` is this file's own reading of transformers' `create_mm_token_type_ids`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

MIXED: dict[str, Any] = {"transformer": torch.bfloat16, "text_encoder": torch.bfloat16, "default": torch.float32}


class ReferenceProcessor:
    """Qwen3-VL's token types: 1 on `<|image_pad|>`, 2 on `<|video_pad|>`, 0 elsewhere."""

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


def stored_precision(repo: Path) -> str:
    """The stored precision: "mixed" if the transformer is stored in bfloat16 (the release), else "float32"."""
    from safetensors import safe_open

    transformer = Path(repo) / "transformer"
    index = transformer / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:  # one unsharded file
        with safe_open(str(transformer / "diffusion_pytorch_model.safetensors"), "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "diffusion_pytorch_model.safetensors")
    name = next(n for n in sorted(weight_map) if ".attn" in n or ".ff" in n)
    with safe_open(str(transformer / weight_map[name]), "pt") as f:
        return "mixed" if f.get_slice(name).get_dtype() == "BF16" else "float32"


@functools.lru_cache(maxsize=4)
def _pipeline(repo: str, precision: str) -> Any:
    import diffusers

    blocks = diffusers.MiniMaxH3Blocks()
    blocks.sub_blocks.pop("decode")
    pipe = diffusers.MiniMaxH3ModularPipeline(blocks=blocks.get_workflow("t2va"), pretrained_model_name_or_path=repo)
    names = [n for n in pipe.pretrained_component_names if n != "processor"]
    pipe.load_components(names=names, dtype=MIXED if precision == "mixed" else torch.float32)
    pipe.update_components(processor=ReferenceProcessor(pipe.tokenizer))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_latents(
    repo: Path, prompt: str, num_inference_steps: int, seed: int, height: int, width: int, num_frames: int,
    flow_shift: float = 12.0, audio_flow_shift: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, ...]]]:  # fmt: skip
    """(video latents, audio latents, int32 bit patterns of each forward's `timestep`) from diffusers itself."""
    pipe = _pipeline(str(repo), stored_precision(repo))
    pipe.scheduler.set_shift(flow_shift)
    pipe.audio_scheduler.set_shift(audio_flow_shift)
    seen: list[tuple[int, ...]] = []

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.append(tuple(kwargs["timestep"].view(torch.int32).tolist()))

    handle = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = pipe(prompt=prompt, height=height, width=width, num_frames=num_frames,
                   num_inference_steps=num_inference_steps, generator=torch.Generator("cpu").manual_seed(seed),
                   output=["latents", "audio_latents"])  # fmt: skip
    finally:
        handle.remove()
    return out["latents"], out["audio_latents"], seen


def diffusers_request_latents(repo: Path, request: dict[str, Any] | Any) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers_latents for a GenerationRequest or its dict (request_id and task ignored)."""
    fields = request if isinstance(request, dict) else request.to_dict()
    keys = ("prompt", "num_inference_steps", "seed", "height", "width", "num_frames", "flow_shift", "audio_flow_shift")
    video, audio, _ = diffusers_latents(repo, **{k: fields[k] for k in keys if k in fields})
    return video, audio
