"""The oracle: diffusers' own MiniMax-H3 pipeline (t2va, fl2va with keyframes, or ref2va with references on the
`transformer_ref` partition), called directly on a repository, for torch.equal comparisons.

Independent of ditcore on purpose: it builds `MiniMaxH3Blocks` itself (with its decode steps when the frames and the
waveform are wanted, without otherwise), loads every component (the Qwen3-VL processor included) at the
repository's stored precision with diffusers' loader, the two VAEs at the decode dtype (by default the released
recipe: a mixed repository loads as diffusers' MiniMax-H3 docs do, `pipe.load_components(dtype=torch.bfloat16)`),
sets the transformer's attention backend (the one the run under test used), sets the two schedulers' shifts, and
records the `timestep` every transformer forward receives.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

MIXED: dict[str, Any] = {
    "transformer": torch.bfloat16,
    "transformer_ref": torch.bfloat16,
    "text_encoder": torch.bfloat16,
    "default": torch.float32,
}
DECODE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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


def released_decode_dtype(precision: str) -> str:
    """The released recipe decodes a mixed repository in bfloat16 (diffusers' docs load every component at it);
    a float32 repository stays float32."""
    return "bfloat16" if precision == "mixed" else "float32"


def load_dtypes(precision: str, decode_dtype: str) -> Any:
    """load_components' `dtype`: the stored precision, the VAEs at `decode_dtype`."""
    if precision == "mixed" and decode_dtype == "bfloat16":
        return torch.bfloat16  # the released recipe, literally: pipe.load_components(dtype=torch.bfloat16)
    base = MIXED if precision == "mixed" else {"default": torch.float32}
    return {**base, "vae": DECODE_DTYPES[decode_dtype], "audio_vae": DECODE_DTYPES[decode_dtype]}


@functools.lru_cache(maxsize=8)
def _pipeline(repo: str, precision: str, with_decode: bool, decode_dtype: str, attention_backend: str) -> Any:
    import diffusers
    from diffusers.models.attention_dispatch import attention_backend as process_default

    blocks = diffusers.MiniMaxH3Blocks()
    if not with_decode:
        blocks.sub_blocks.pop("decode")
    pipe = diffusers.MiniMaxH3ModularPipeline(blocks=blocks, pretrained_model_name_or_path=repo)
    pipe.load_components(dtype=load_dtypes(precision, decode_dtype))  # transformer_ref too, when the repo has it
    pipe.set_progress_bar_config(disable=True)
    # diffusers' set_attention_backend also makes it the process default (the VAEs' attention); a served model sets
    # the transformer's alone, and so does the reference: the context puts the default back
    with process_default():
        for name in ("transformer", "transformer_ref"):
            if getattr(pipe, name, None) is not None:
                getattr(pipe, name).set_attention_backend(attention_backend)
    return pipe


def diffusers_outputs(
    repo: Path, prompt: str, num_inference_steps: int, seed: int, height: int, width: int, num_frames: int,
    flow_shift: float = 12.0, audio_flow_shift: float = 3.0, image: Any = None, last_image: Any = None,
    decode: bool = False, decode_dtype: str | None = None, attention_backend: str = "native",
    references: list[Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """diffusers' own outputs: "latents", "audio_latents", "timesteps" (int32 bit patterns of each forward's
    `timestep`) and, with `decode`, "videos" (output_type "pil"), "audio" and "sampling_rate". `image` /
    `last_image` (PIL) make it fl2va, `references` (diffusers' reference dataclasses) ref2va, whose loop runs
    `transformer_ref`. `decode_dtype` (None: the released one for the repository's precision) is the VAEs' dtype;
    `attention_backend` the transformer's (diffusers' name; "native" is what "auto" is on CPU)."""
    precision = stored_precision(repo)
    dtype = decode_dtype if decode_dtype is not None else released_decode_dtype(precision)
    pipe = _pipeline(str(repo), precision, decode, dtype, attention_backend)
    pipe.scheduler.set_shift(flow_shift)
    pipe.audio_scheduler.set_shift(audio_flow_shift)
    seen: list[tuple[int, ...]] = []

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.append(tuple(kwargs["timestep"].view(torch.int32).tolist()))

    keyframes = {k: v for k, v in (("image", image), ("last_image", last_image)) if v is not None}
    if references:
        keyframes["references"] = references
    wanted = ["latents", "audio_latents"] + (["videos", "audio", "sampling_rate"] if decode else [])
    transformer = pipe.transformer_ref if references else pipe.transformer
    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
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
    attention_backend: str = "native",
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, ...]]]:  # fmt: skip
    """(video latents, audio latents, int32 bit patterns of each forward's `timestep`) from diffusers itself, its
    transformer on `attention_backend`."""
    out = diffusers_outputs(repo, prompt, num_inference_steps, seed, height, width, num_frames, flow_shift,
                            audio_flow_shift, image, last_image, attention_backend=attention_backend)  # fmt: skip
    return out["latents"], out["audio_latents"], out["timesteps"]


def pil_image(data: bytes) -> Any:
    """A keyframe's bytes as the RGB PIL image a diffusers user passes (Pillow's own decoding)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def reference_from_bytes(data: bytes, kind: str) -> Any:
    """diffusers' own reference dataclass for a file's bytes: written to a temporary file and read with the class's
    `from_file` (diffusers' load_image for an image, PyAV for a video or audio clip)."""
    import os
    import tempfile

    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    cls = {"image": MiniMaxH3ImageReference, "video": MiniMaxH3VideoReference, "audio": MiniMaxH3AudioReference}
    suffix = {"image": ".png" if data.startswith(b"\x89PNG") else ".jpg", "video": ".mp4", "audio": ".wav"}[kind]
    handle, path = tempfile.mkstemp(suffix=suffix)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        return cls[kind].from_file(path)
    finally:
        os.unlink(path)


def diffusers_request_latents(
    repo: Path, request: Any, attention_backend: str = "native", kinds: list[str] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers_latents for a GenerationRequest or its dict (request_id, task and output_type ignored; keyframe
    bytes decoded with Pillow; references with diffusers' `from_file`, as `kinds` say, by default each reference's
    own `kind` or, unset, what its content is), the transformer on `attention_backend` (the run under test's)."""
    fields = request if isinstance(request, dict) else vars(request)
    keys = ("prompt", "num_inference_steps", "seed", "height", "width", "num_frames", "flow_shift", "audio_flow_shift")
    kwargs = {k: fields[k] for k in keys if k in fields}
    for field, name in (("first_frame", "image"), ("last_frame", "last_image")):
        if fields.get(field):
            kwargs[name] = pil_image(fields[field])
    refs = fields.get("references") or ()
    if refs:
        if kinds is None:  # each reference's kind as ditserve reads it (its own, or by content when unset)
            from ditcore.references import probe_references

            kinds = [p.kind for p in probe_references(refs)]
        kwargs["references"] = [reference_from_bytes(r.data, k) for r, k in zip(refs, kinds, strict=True)]
    out = diffusers_outputs(repo, **kwargs, attention_backend=attention_backend)
    return out["latents"], out["audio_latents"]


def adapter_latents(
    repo: Path, request: Any, uses: list[tuple[Path, float]] | tuple[tuple[Path, float], ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers_request_latents with these adapter files active, in order at their scales, everything put back after:
    each file's full-parameter deltas (diffusers-layout `transformer.` / `transformer_ref.` `MODULE.diff` /
    `.diff_b` keys, read here) added to their modules' parameters as their producers define it (parameter + scale x
    the delta in the parameter's dtype), and its LoRA factors (the rest of the file, its `alpha` metadata kept) loaded
    through diffusers' `load_lora_weights` and activated with `set_adapters(names, scales)`, unfused."""
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    precision = stored_precision(repo)
    pipe = _pipeline(str(repo), precision, False, released_decode_dtype(precision), "native")
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(parameter) -> (parameter, its data before)
    names: list[tuple[str, float]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="oracle-adapters-") as tmp:
            for i, (path, scale) in enumerate(uses):
                with safe_open(str(path), "pt") as f:
                    tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
                    metadata = dict(f.metadata() or {})
                lora = {k: v for k, v in tensors.items() if not k.endswith((".diff", ".diff_b"))}
                for key in set(tensors) - set(lora):
                    component, _, rest = key.partition(".")
                    module, _, suffix = rest.rpartition(".")
                    layer = getattr(pipe, component).get_submodule(module)
                    tensor = getattr(layer, "weight" if suffix == "diff" else "bias")
                    saved.setdefault(id(tensor), (tensor, tensor.data))
                    tensor.data = tensor.data + tensors[key].to(tensor.dtype) * scale
                if lora:
                    part = Path(tmp) / f"o{i}.safetensors"
                    save_file(lora, str(part), metadata={k: v for k, v in metadata.items() if k in ("alpha", "format")})
                    pipe.load_lora_weights(str(part), adapter_name=f"o{i}")  # routed by its keys' prefix
                    names.append((f"o{i}", scale))
        if names:
            pipe.set_adapters([n for n, _ in names], [s for _, s in names])
        return diffusers_request_latents(repo, request)
    finally:
        for tensor, data in saved.values():
            tensor.data = data
        if names:
            pipe.unload_lora_weights()
