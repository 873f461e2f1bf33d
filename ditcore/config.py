"""Model configuration: the `DiTConfig` dataclass, its named presets and shape arithmetic.

Everything that depends only on shapes lives here (parameter names and shapes, counts,
page size), so `inspect --preset h3` works without materializing a single tensor.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

MODALITIES = ("video", "audio", "text")
"""Stream order inside every block's modulation vector and inside the joint sequence."""

MOD_CHUNKS = ("shift_msa", "scale_msa", "gate_msa", "shift_mlp", "scale_mlp", "gate_mlp")
"""The six modulation chunks each modality gets per block (DiT's adaLN-Zero naming)."""

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Checkpoint / compute dtypes the project supports, by their config.json spelling."""

TEXT_VOCAB = 257
"""Byte-level text vocabulary: the 256 byte values plus one pad token."""
TEXT_PAD_ID = 256


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


@dataclass(frozen=True)
class DiTConfig:
    """Shapes and limits of one DiT. Stored verbatim as `config.json` in a checkpoint."""

    hidden_size: int
    """Width of every token stream (H3: 5376)."""
    num_layers: int
    """Number of DiT blocks, each with its own `adaln_proj` (H3: 50)."""
    num_heads: int
    """Attention heads of the joint attention; must divide hidden_size."""
    time_embed_dim: int
    """Width of the timestep embedding fed to every adaln_proj (H3: 2688 = hidden/2)."""
    freq_embed_dim: int = 256
    """Sinusoidal frequency features before the timestep MLP."""
    mlp_ratio: int = 5
    """MLP expansion; 5 puts adaln_proj at ~39% of parameters like MiniMax-H3."""
    video_channels: int = 16
    """Latent channels of the video VAE."""
    audio_channels: int = 8
    """Latent channels of the audio VAE."""
    patch_size: tuple[int, int, int] = (1, 2, 2)
    """Video patch (frames, height, width) in latent units."""
    vae_temporal: int = 4
    """Pixel frames per latent frame after the first: latent frames = (frames-1)/4 + 1."""
    vae_spatial: int = 8
    """Pixels per latent cell along height and width."""
    text_len: int = 64
    """Text tokens per prompt (bytes, padded); also the maximum prompt length in bytes."""
    text_layers: int = 1
    """Layers of the byte-level text encoder."""
    max_frames: int = 33
    """Largest accepted `frames` (pixel frames)."""
    max_height: int = 256
    """Largest accepted `height` in pixels."""
    max_width: int = 256
    """Largest accepted `width` in pixels."""
    max_audio_length: int = 128
    """Largest accepted `audio_length` (audio latent frames, one token each)."""
    dtype: str = "float32"
    """Parameter and page dtype: "float32" or "bfloat16"."""
    preset: str = "custom"
    """Name of the preset this config came from (informational)."""

    # ----------------------------------------------------------------- validation
    def __post_init__(self) -> None:
        ints = {
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "time_embed_dim": self.time_embed_dim,
            "freq_embed_dim": self.freq_embed_dim,
            "mlp_ratio": self.mlp_ratio,
            "video_channels": self.video_channels,
            "audio_channels": self.audio_channels,
            "vae_temporal": self.vae_temporal,
            "vae_spatial": self.vae_spatial,
            "text_len": self.text_len,
            "text_layers": self.text_layers,
            "max_frames": self.max_frames,
            "max_height": self.max_height,
            "max_width": self.max_width,
            "max_audio_length": self.max_audio_length,
        }
        for name, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config field '{name}' must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"config field 'num_heads' ({self.num_heads}) must divide hidden_size ({self.hidden_size})"
            )
        if self.freq_embed_dim % 2:
            raise ConfigError(f"config field 'freq_embed_dim' must be even, got {self.freq_embed_dim}")
        if len(self.patch_size) != 3 or any(
            not isinstance(p, int) or isinstance(p, bool) or p < 1 for p in self.patch_size
        ):
            raise ConfigError(f"config field 'patch_size' must be 3 positive integers, got {self.patch_size!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"config field 'dtype' must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    # ----------------------------------------------------------------- derived
    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_mod_numel(self) -> int:
        """Output width of one `blocks.{i}.adaln_proj`: 6 chunks x 3 modalities x hidden."""
        return len(MOD_CHUNKS) * len(MODALITIES) * self.hidden_size

    @property
    def final_mod_numel(self) -> int:
        """Output width of `final_layer.adaln_proj`: shift and scale."""
        return 2 * self.hidden_size

    @property
    def page_numel(self) -> int:
        """Elements of one page: every block's params plus the final params, one timestep."""
        return self.num_layers * self.block_mod_numel + self.final_mod_numel

    @property
    def page_bytes(self) -> int:
        return self.page_numel * self.dtype_bytes

    @property
    def video_patch_numel(self) -> int:
        return self.video_channels * math.prod(self.patch_size)

    # ----------------------------------------------------------------- (de)serialization
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["patch_size"] = list(self.patch_size)
        return d

    @classmethod
    def from_dict(cls, data: Any) -> DiTConfig:
        """Build from parsed config.json, naming the bad or missing field on error."""
        if not isinstance(data, dict):
            raise ConfigError("config.json must hold a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"config.json has unknown field(s) {unknown}; allowed: {sorted(names)}")
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ConfigError(f"config.json is missing required field(s) {missing}")
        kwargs = dict(data)
        if "patch_size" in kwargs:
            if not isinstance(kwargs["patch_size"], list):
                raise ConfigError("config field 'patch_size' must be a list of 3 positive integers")
            kwargs["patch_size"] = tuple(kwargs["patch_size"])
        return cls(**kwargs)

    def replace(self, **changes: Any) -> DiTConfig:
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------- presets
PRESETS: dict[str, DiTConfig] = {
    # Unit tests: a full 50-step request runs in well under a second.
    "tiny": DiTConfig(
        hidden_size=32, num_layers=2, num_heads=2, time_embed_dim=16, freq_embed_dim=32,
        video_channels=4, audio_channels=4, text_len=32, text_layers=1,
        max_frames=17, max_height=64, max_width=64, max_audio_length=32, preset="tiny",
    ),
    # Demo: what `ditserve serve` generates when no checkpoint is given.
    "small": DiTConfig(
        hidden_size=128, num_layers=4, num_heads=4, time_embed_dim=64, freq_embed_dim=64,
        video_channels=16, audio_channels=8, text_len=64, text_layers=1,
        max_frames=33, max_height=256, max_width=256, max_audio_length=128, preset="small",
    ),
    # Benchmarks: adaln_proj ~39% of parameters, a 50-step t2va request in seconds on 2 CPU cores.
    "bench": DiTConfig(
        hidden_size=384, num_layers=8, num_heads=6, time_embed_dim=192, freq_embed_dim=128,
        video_channels=16, audio_channels=8, text_len=64, text_layers=1,
        max_frames=33, max_height=256, max_width=256, max_audio_length=256, preset="bench",
    ),
    # H3's widths with 8 layers: the `ditserve bench --device cuda` preset (4.2 GB of adaln_proj).
    "h3lite": DiTConfig(
        hidden_size=5376, num_layers=8, num_heads=42, time_embed_dim=2688, freq_embed_dim=256,
        video_channels=48, audio_channels=64, text_len=512, text_layers=2,
        max_frames=121, max_height=1280, max_width=1280, max_audio_length=1024,
        dtype="bfloat16", preset="h3lite",
    ),
    # MiniMax-H3's shapes: shape arithmetic and GPU runs only, never materialized on CPU tests.
    "h3": DiTConfig(
        hidden_size=5376, num_layers=50, num_heads=42, time_embed_dim=2688, freq_embed_dim=256,
        video_channels=48, audio_channels=64, text_len=512, text_layers=2,
        max_frames=121, max_height=1280, max_width=1280, max_audio_length=1024,
        dtype="bfloat16", preset="h3",
    ),
}  # fmt: skip


def get_preset(name: str) -> DiTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None


# --------------------------------------------------------------------- parameter shapes
def is_adaln_name(name: str) -> bool:
    """True for the tensors cached mode never loads (the native rebuild source)."""
    return ".adaln_proj." in name


def adaln_layer_names(config: DiTConfig) -> list[str]:
    """Module prefixes of every adaln_proj, in page order: blocks 0..L-1, then final_layer."""
    return [f"blocks.{i}.adaln_proj" for i in range(config.num_layers)] + ["final_layer.adaln_proj"]


def param_shapes(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint, by name, in a fixed order."""
    h, t, f = config.hidden_size, config.time_embed_dim, config.freq_embed_dim
    m = config.mlp_ratio * h
    shapes: dict[str, tuple[int, ...]] = {
        "time_embed.fc1.weight": (t, f),
        "time_embed.fc1.bias": (t,),
        "time_embed.fc2.weight": (t, t),
        "time_embed.fc2.bias": (t,),
        "text_embed.weight": (TEXT_VOCAB, h),
        "video_embed.weight": (h, config.video_patch_numel),
        "video_embed.bias": (h,),
        "audio_embed.weight": (h, config.audio_channels),
        "audio_embed.bias": (h,),
    }
    for j in range(config.text_layers):
        p = f"text_encoder.layers.{j}"
        shapes.update(
            {
                f"{p}.norm1.weight": (h,),
                f"{p}.norm1.bias": (h,),
                f"{p}.attn.qkv.weight": (3 * h, h),
                f"{p}.attn.qkv.bias": (3 * h,),
                f"{p}.attn.out.weight": (h, h),
                f"{p}.attn.out.bias": (h,),
                f"{p}.norm2.weight": (h,),
                f"{p}.norm2.bias": (h,),
                f"{p}.mlp.fc1.weight": (m, h),
                f"{p}.mlp.fc1.bias": (m,),
                f"{p}.mlp.fc2.weight": (h, m),
                f"{p}.mlp.fc2.bias": (h,),
            }
        )
    shapes["text_encoder.norm.weight"] = (h,)
    shapes["text_encoder.norm.bias"] = (h,)
    for i in range(config.num_layers):
        p = f"blocks.{i}"
        shapes.update(
            {
                f"{p}.adaln_proj.weight": (config.block_mod_numel, t),
                f"{p}.adaln_proj.bias": (config.block_mod_numel,),
                f"{p}.attn.qkv.weight": (3 * h, h),
                f"{p}.attn.qkv.bias": (3 * h,),
                f"{p}.attn.out.weight": (h, h),
                f"{p}.attn.out.bias": (h,),
                f"{p}.mlp.fc1.weight": (m, h),
                f"{p}.mlp.fc1.bias": (m,),
                f"{p}.mlp.fc2.weight": (h, m),
                f"{p}.mlp.fc2.bias": (h,),
            }
        )
    shapes.update(
        {
            "final_layer.adaln_proj.weight": (config.final_mod_numel, t),
            "final_layer.adaln_proj.bias": (config.final_mod_numel,),
            "final_layer.video_out.weight": (config.video_patch_numel, h),
            "final_layer.video_out.bias": (config.video_patch_numel,),
            "final_layer.audio_out.weight": (config.audio_channels, h),
            "final_layer.audio_out.bias": (config.audio_channels,),
        }
    )
    return shapes


@dataclass(frozen=True)
class ParamCounts:
    """Parameter arithmetic of one config (no tensors involved)."""

    total: int
    adaln_proj: int
    resident: int
    adaln_share: float
    adaln_bytes: int
    total_bytes: int


def param_counts(config: DiTConfig) -> ParamCounts:
    shapes = param_shapes(config)
    total = sum(math.prod(s) for s in shapes.values())
    adaln = sum(math.prod(s) for n, s in shapes.items() if is_adaln_name(n))
    return ParamCounts(
        total=total,
        adaln_proj=adaln,
        resident=total - adaln,
        adaln_share=adaln / total,
        adaln_bytes=adaln * config.dtype_bytes,
        total_bytes=total * config.dtype_bytes,
    )
