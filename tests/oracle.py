"""The oracle: diffusers' own MiniMax-H3 pipeline (t2va, or fl2va with keyframes), called directly on a repository,
for torch.equal comparisons.

Independent of ditcore on purpose: it builds `MiniMaxH3Blocks` itself (with its decode steps when the frames and the
waveform are wanted, without otherwise), loads every component (the Qwen3-VL processor included) at the
repository's stored precision with diffusers' loader, sets the two schedulers' shifts, and records the `timestep`
every transformer forward receives.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

MIXED: dict[str, Any] = {"transformer": torch.bfloat16, "text_encoder": torch.bfloat16, "default": torch.float32}


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
def _pipeline(repo: str, precision: str, with_decode: bool = False) -> Any:
    import diffusers

    blocks = diffusers.MiniMaxH3Blocks()
    if not with_decode:
        blocks.sub_blocks.pop("decode")
    pipe = diffusers.MiniMaxH3ModularPipeline(blocks=blocks, pretrained_model_name_or_path=repo)
    names = [n for n in pipe.pretrained_component_names if n != "transformer_ref"]  # ref2va's, not in the repo
    pipe.load_components(names=names, dtype=MIXED if precision == "mixed" else torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_outputs(
    repo: Path, prompt: str, num_inference_steps: int, seed: int, height: int, width: int, num_frames: int,
    flow_shift: float = 12.0, audio_flow_shift: float = 3.0, image: Any = None, last_image: Any = None,
    decode: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """diffusers' own outputs: "latents", "audio_latents", "timesteps" (int32 bit patterns of each forward's
    `timestep`) and, with `decode`, "videos" (output_type "pil"), "audio" and "sampling_rate". `image` /
    `last_image` (PIL) make it fl2va."""
    pipe = _pipeline(str(repo), stored_precision(repo), decode)
    pipe.scheduler.set_shift(flow_shift)
    pipe.audio_scheduler.set_shift(audio_flow_shift)
    seen: list[tuple[int, ...]] = []

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.append(tuple(kwargs["timestep"].view(torch.int32).tolist()))

    keyframes = {k: v for k, v in (("image", image), ("last_image", last_image)) if v is not None}
    wanted = ["latents", "audio_latents"] + (["videos", "audio", "sampling_rate"] if decode else [])
    handle = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = pipe(prompt=prompt, height=height, width=width, num_frames=num_frames,
                   num_inference_steps=num_inference_steps, generator=torch.Generator("cpu").manual_seed(seed),
                   output=wanted, **keyframes)  # fmt: skip
    finally:
        handle.remove()
    return {**out, "timesteps": seen}


def diffusers_latents(
    repo: Path, prompt: str, num_inference_steps: int, seed: int, height: int, width: int, num_frames: int,
    flow_shift: float = 12.0, audio_flow_shift: float = 3.0, image: Any = None, last_image: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, ...]]]:  # fmt: skip
    """(video latents, audio latents, int32 bit patterns of each forward's `timestep`) from diffusers itself."""
    out = diffusers_outputs(repo, prompt, num_inference_steps, seed, height, width, num_frames, flow_shift,
                            audio_flow_shift, image, last_image)  # fmt: skip
    return out["latents"], out["audio_latents"], out["timesteps"]


def pil_image(data: bytes) -> Any:
    """A keyframe's bytes as the RGB PIL image a diffusers user passes (Pillow's own decoding)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def diffusers_request_latents(repo: Path, request: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers_latents for a GenerationRequest or its dict (request_id, task and output_type ignored; keyframe
    bytes decoded with Pillow)."""
    fields = request if isinstance(request, dict) else vars(request)
    keys = ("prompt", "num_inference_steps", "seed", "height", "width", "num_frames", "flow_shift", "audio_flow_shift")
    kwargs = {k: fields[k] for k in keys if k in fields}
    for field, name in (("first_frame", "image"), ("last_frame", "last_image")):
        if fields.get(field):
            kwargs[name] = pil_image(fields[field])
    video, audio, _ = diffusers_latents(repo, **kwargs)
    return video, audio
