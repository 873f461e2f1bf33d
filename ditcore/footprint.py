"""What MiniMax-H3 holds at any canvas, per component and per process: each component's weight bytes (counted on the
meta device from the real classes, under from_pretrained's dtype rule), the plan slab, the sidecar's rebuild working
set, the activation peak (ditcore.sizing) and the totals of the generator and the sidecar, cached and resident.

    components = meta_components(preset="h3")       # or meta_components(repository="/weights/minimax-h3")
    shapes = ModelShapes.of_components(components, "mixed", text_layers=TEXT_LAYERS)
    report = memory_report(components, shapes, Canvas(768, 1344, 345), Placement(), DEVICE_CLASSES["h200"])
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .placement import embedding_bytes
from .plans import PageLayout, is_plan_tensor
from .presets import get_preset
from .repo import TEXT_LAYERS
from .sizing import (
    DEVICE_CLASSES,
    GB,
    ActivationPeak,
    Canvas,
    DeviceClass,
    ModelShapes,
    Tokens,
    dtype_bytes,
)

QWEN3_VL_32B: dict[str, Any] = {
    "text_config": {
        "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
    },
    "vision_config": {
        "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 5120,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
    },
    "tie_word_embeddings": False,
}  # fmt: skip
"""The released text encoder's shapes (Qwen3-VL-32B-Instruct's config.json): 33,357,390,064 parameters = 62.13 GiB in
bf16, as the issue's 62 GiB. The `h3` preset models it; a repository's own text_encoder/config.json wins."""


@dataclass(frozen=True)
class Components:
    """A model's four weight-bearing components, built on the meta device (nothing allocated)."""

    transformer: Any
    text_encoder: Any
    vae: Any
    audio_vae: Any


def meta_components(preset: str | None = None, repository: str | Path | None = None) -> Components:
    """The real classes on meta: a preset's shapes (`h3`: the released ones, Qwen3-VL-32B's text encoder and the
    VAEs' diffusers defaults) or a repository's configs."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    if (preset is None) == (repository is None):
        raise ValueError("give exactly one of a preset and a repository")
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")  # tiny group norms, weight_norm's deprecation: not ours to show
        if repository is not None:
            root = Path(repository)
            transformer = MiniMaxH3Transformer3DModel.from_config(_json(root / "transformer" / "config.json"))
            text = Qwen3VLConfig.from_pretrained(root / "text_encoder")
            vae = AutoencoderKLMiniMaxH3.from_config(_json(root / "vae" / "config.json"))
            audio = AutoencoderKLMiniMaxH3Audio.from_config(_json(root / "audio_vae" / "config.json"))
            return Components(transformer, Qwen3VLForConditionalGeneration(text), vae, audio)
        p = get_preset(preset)  # type: ignore[arg-type]
        transformer = MiniMaxH3Transformer3DModel(**p.transformer_kwargs())
        if p.writable:
            from . import repo

            text = repo._text_encoder_config(p, repo._build_tokenizer(p))
            vae, audio = repo._build_vae(0), repo._build_audio_vae(0)
        else:
            text = Qwen3VLConfig(**QWEN3_VL_32B)
            vae, audio = AutoencoderKLMiniMaxH3(), AutoencoderKLMiniMaxH3Audio()
        return Components(transformer, Qwen3VLForConditionalGeneration(text), vae, audio)


def preset_shapes(preset: str, precision: str = "mixed", **options: Any) -> ModelShapes:
    """The activation and time model of a preset (its text encoder trimmed to TEXT_LAYERS unless options say)."""
    return ModelShapes.of_components(
        meta_components(preset=preset), precision, **{"text_layers": TEXT_LAYERS, **options}
    )


def _json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


@dataclass(frozen=True)
class ComponentWeights:
    name: str
    variant: str
    params: int
    bytes: int
    dtype: str


def _param_bytes(module: torch.nn.Module, dtype: str, keep_fp32: list[str], skip: Any = None) -> tuple[int, int]:
    """(parameters, bytes) under from_pretrained's dtype rule: float32 for a `_keep_in_fp32_modules` name."""
    params = size = 0
    for name, p in module.named_parameters():
        if skip is not None and skip(name):
            continue
        keep = any(k in name.split(".") for k in keep_fp32)
        params += p.numel()
        size += p.numel() * (4 if keep else dtype_bytes(dtype))
    return params, size


def _trimmed(layers: int) -> Any:
    def skip(name: str) -> bool:
        if name.startswith("lm_head."):
            return True
        parts = name.split(".")
        return "layers" in parts and "language_model" in parts and int(parts[parts.index("layers") + 1]) >= layers

    return skip


def component_weights(
    c: Components, precision: str = "mixed", decode_dtype: str = "bfloat16"
) -> list[ComponentWeights]:
    """Each component's weight bytes: the transformer whole (resident) and without its plan tensors (cached), the
    text encoder whole and trimmed to TEXT_LAYERS layers without lm_head, the video VAE with its decoder in
    `decode_dtype` (its `_keep_in_fp32_modules` stay float32), the audio VAE (float32, as released)."""
    dtype = "bfloat16" if precision == "mixed" else "float32"
    keep = list(getattr(c.transformer, "_keep_in_fp32_modules", None) or [])
    rows = [
        ComponentWeights("transformer", "resident", *_param_bytes(c.transformer, dtype, keep), dtype),
        ComponentWeights("transformer", "cached", *_param_bytes(c.transformer, dtype, keep, is_plan_tensor), dtype),
        ComponentWeights("text_encoder", "whole", *_param_bytes(c.text_encoder, dtype, []), dtype),
        ComponentWeights(
            "text_encoder",
            f"{TEXT_LAYERS} layers, no lm_head",
            *_param_bytes(c.text_encoder, dtype, [], _trimmed(TEXT_LAYERS)),
            dtype,
        ),
    ]
    vae_keep = list(getattr(c.vae, "_keep_in_fp32_modules", None) or [])
    vae_dtype = decode_dtype if decode_dtype == "float32" else f"{decode_dtype}, encoder and norms float32"
    rows.append(ComponentWeights("vae", decode_dtype, *_param_bytes(c.vae, decode_dtype, vae_keep), vae_dtype))
    rows.append(ComponentWeights("audio_vae", "float32", *_param_bytes(c.audio_vae, "float32", []), "float32"))
    return rows


# ---------------------------------------------------------------------------- per process
@dataclass(frozen=True)
class Placement:
    """Serving choices the totals depend on."""

    gpu_plans: int = 128
    plan_width: int = 3
    host_cache_bytes: int = 8 * GB
    text_encoder: str = "trimmed"
    """"trimmed" (TEXT_LAYERS layers, no lm_head) or "whole"."""
    text_encoder_device: str = "device"
    """"device", "cpu" (neither its weights nor its activations on the accelerator) or "offload" (its weights in
    host memory, streamed a layer at a time; its activations on the device)."""
    steps: int = 49
    """Denoise forwards of the request (num_inference_steps - 1) for the modeled request time."""
    partitions: int = 1
    """Transformer partitions loaded in the one generator (2: `transformer/` and `transformer_ref/`, same shapes),
    sharing one slab and one text encoder and VAEs."""


@dataclass(frozen=True)
class MemoryReport:
    canvas: Canvas
    tokens: Tokens
    weights: list[ComponentWeights]
    slab_bytes: int
    page_bytes: int
    rebuild_bytes: int
    """The sidecar's rebuild working set on the device: the largest plan tensor, streamed one at a time."""
    activations: ActivationPeak
    placement: Placement
    device: DeviceClass
    step_s: float
    encode_s: float
    decode_s: float
    flops: tuple[int, int]
    totals: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tokens"]["total"] = self.tokens.total
        out["activations"].update(peak=self.activations.peak, phase=self.activations.phase)
        out["device"] = {"name": self.device.name, "mfu": self.device.mfu, "memory_bytes": self.device.memory_bytes,
                         "note": self.device.note}  # fmt: skip
        out["flops"] = {"linear": self.flops[0], "attention": self.flops[1], "total": sum(self.flops)}
        out["request_s"] = self.request_s
        return out

    @property
    def request_s(self) -> float:
        """Modeled seconds of the whole request: encoding, every step, the decode."""
        return self.encode_s + self.placement.steps * self.step_s + self.decode_s


def _weight(weights: list[ComponentWeights], name: str, variant: str) -> int:
    return next(w.bytes for w in weights if w.name == name and w.variant == variant)


def memory_report(
    components: Components,
    shapes: ModelShapes,
    canvas: Canvas,
    placement: Placement = Placement(),
    device: DeviceClass = DEVICE_CLASSES["h200"],
    precision: str = "mixed",
) -> MemoryReport:
    """Each component, the slab, the activation peak and the totals per process, cached and resident, on one device:
    the generator holds the model and the activations, the sidecar the slab and its rebuild working set (its host
    tier is host memory)."""
    on_device = placement.text_encoder_device == "device"
    shapes = replace(shapes, text_on_device=placement.text_encoder_device != "cpu")
    weights = component_weights(components, precision, shapes.decode_dtype)
    projection = "bfloat16" if precision == "mixed" else "float32"
    layout = PageLayout.from_config(components.transformer.config)
    page = layout.page_bytes(getattr(torch, projection))
    slab = placement.gpu_plans * placement.plan_width * page
    rebuild = (layout.block_numel * (layout.time_embed_dim + 1)) * dtype_bytes(projection)
    act = shapes.activations(canvas)
    variant = "whole" if placement.text_encoder == "whole" else f"{TEXT_LAYERS} layers, no lm_head"
    text = _weight(weights, "text_encoder", variant) if on_device else 0
    if placement.text_encoder_device == "offload":  # its token embeddings stay on the device (ditcore.text_encoder)
        text = embedding_bytes(components, precision)
    rest = text + _weight(weights, "vae", shapes.decode_dtype) + _weight(weights, "audio_vae", "float32")
    sidecar = slab + rebuild
    totals = {}
    for mode in ("cached", "resident"):
        one = _weight(weights, "transformer", mode)
        generator = placement.partitions * one + rest + act.peak
        device_total = generator + (sidecar if mode == "cached" else 0)
        totals[mode] = {"generator": generator, "sidecar": sidecar if mode == "cached" else 0,
                        "sidecar_host": placement.host_cache_bytes if mode == "cached" else 0,
                        "device": device_total, "free": device.memory_bytes - device_total,
                        # the same partitions as that many one-partition servers, each on its own device
                        "separate": placement.partitions * (device_total - (placement.partitions - 1) * one)}  # fmt: skip
    return MemoryReport(
        canvas, shapes.tokens(canvas), weights, slab, page, rebuild, act, placement, device,
        shapes.step_time_s(canvas, device), shapes.encode_time_s(canvas, device), shapes.decode_time_s(canvas, device),
        shapes.step_flops(canvas), totals,
    )  # fmt: skip
