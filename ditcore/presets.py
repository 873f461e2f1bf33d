"""The MiniMax-H3 preset registry: the shapes of each named size (tiny/small/bench to write, h3 = the released shapes
for arithmetic only), the precisions a repository comes in, and each preset's parameter and plan-page counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DTYPES: tuple[str, ...] = ("float32", "mixed")

MODALITIES = 3  # video, text, audio rows per timestep in every adaln_proj output
CHUNKS = 6  # shift/scale/gate for attention and MLP


@dataclass(frozen=True)
class H3Preset:
    """Shapes of one MiniMax-H3 size: transformer arguments plus the text encoder that feeds it."""

    name: str
    num_attention_heads: int
    attention_head_dim: int
    hidden_size: int
    """the residual width; may differ from heads x head_dim (released: 5376 vs 56 x 128 = 7168)."""
    num_layers: int
    """transformer blocks, each with its own adaln_proj."""
    num_refiner_layers: int
    ffn_dim: int
    freq_dim: int
    """sinusoidal timestep features fed to the float32 time_embedder."""
    time_embed_hidden_dim: int
    time_embed_dim: int
    """adaln_proj's input width: each block's adaln_proj is (time_embed_dim -> 18 x hidden)."""
    rope_freq_dim: int
    text_dim: int
    """= the text encoder's hidden size (the released Qwen3-VL has 5120)."""
    text_intermediate: int = 64
    text_heads: int = 2
    text_head_dim: int = 16
    vocab_size: int = 384
    """BPE merges trained on CORPUS; Qwen's special and added tokens come on top."""
    writable: bool = True
    """False for the released shapes: 33B parameters are for arithmetic, never for this machine's memory."""
    canvas_short_edge: int = 768
    """diffusers' `canvas_short_edge` config: the canvas a video reference (and a request without a size) is put
    on. The released 768; the written presets shrink it with the model (modular_model_index.json carries it)."""
    reference_image_short_edge: int = 2048
    """diffusers' `reference_image_short_edge` config: the short edge an image reference is encoded at."""

    def pipeline_configs(self) -> dict[str, int]:
        """The ref2va geometry configs diffusers' blocks read (`ConfigSpec`s) that a written repository records in
        modular_model_index.json; the released values are the blocks' defaults."""
        return {
            "canvas_short_edge": self.canvas_short_edge,
            "canvas_max_pixels": self.canvas_short_edge * (self.canvas_short_edge * 7 // 4),
            "reference_image_short_edge": self.reference_image_short_edge,
        }

    def transformer_kwargs(self) -> dict[str, Any]:
        """Arguments of MiniMaxH3Transformer3DModel (the channel counts and patch are H3's fixed ones)."""
        return dict(
            num_attention_heads=self.num_attention_heads, attention_head_dim=self.attention_head_dim,
            hidden_size=self.hidden_size, num_layers=self.num_layers, num_refiner_layers=self.num_refiner_layers,
            ffn_dim=self.ffn_dim, in_channels=24, audio_in_channels=32, patch_size=(1, 2, 2),
            text_dim=self.text_dim, freq_dim=self.freq_dim, time_embed_hidden_dim=self.time_embed_hidden_dim,
            time_embed_dim=self.time_embed_dim, rope_freq_dim=self.rope_freq_dim,
        )  # fmt: skip


def _preset(name: str, heads: int, layers: int, ffn: int, temb: int, text_dim: int, **kw: Any) -> H3Preset:
    # head_dim 32 with rope_freq_dim 4 is the split verified on CPU; width grows with the head count
    head_dim = kw.pop("head_dim", 32)
    hidden = kw.pop("hidden", heads * head_dim)
    return H3Preset(
        name=name, num_attention_heads=heads, attention_head_dim=head_dim, hidden_size=hidden, num_layers=layers,
        num_refiner_layers=kw.pop("refiner", 1), ffn_dim=ffn, freq_dim=kw.pop("freq_dim", 32),
        time_embed_hidden_dim=kw.pop("temb_hidden", hidden), time_embed_dim=temb,
        rope_freq_dim=kw.pop("rope", 4), text_dim=text_dim, **kw,
    )  # fmt: skip


# The written presets' ref2va geometry: a video reference on a 32-pixel short edge (32 x 64 at 16:9) and an image
# reference at a 64-pixel one, so a CPU request with references takes seconds; the released repository uses
# diffusers' defaults (768 and 2048).
_SMALL_REFERENCES: dict[str, Any] = {"canvas_short_edge": 32, "reference_image_short_edge": 64}

PRESETS: dict[str, H3Preset] = {
    # the test-suite size: hidden 64, 3 blocks; a forward takes milliseconds on CPU
    "tiny": _preset("tiny", heads=2, layers=3, ffn=128, temb=48, text_dim=32, **_SMALL_REFERENCES),
    # a few more blocks and a wider model for tests that want non-trivial plans
    "small": _preset(
        "small", heads=4, layers=6, ffn=256, temb=96, text_dim=64, text_intermediate=128, **_SMALL_REFERENCES
    ),
    # benchmark size: hidden 256, 8 blocks; sized by the timing measured below the registry
    "bench": _preset(
        "bench",
        heads=8,
        layers=8,
        ffn=1024,
        temb=192,
        text_dim=64,
        freq_dim=64,
        text_intermediate=128,
        **_SMALL_REFERENCES,
    ),
    # the released MiniMax-H3 transformer (33B); shapes only, writing it raises
    "h3": _preset(
        "h3",
        heads=56,
        layers=50,
        ffn=14336,
        temb=2688,
        text_dim=5120,
        head_dim=128,
        hidden=5376,
        refiner=2,
        freq_dim=256,
        temb_hidden=5376,
        rope=16,
        writable=False,
    ),
}
# measured (diffusers' t2va blocks, float32, torch 2.13 CPU, 2 threads, 32x32 px, 124 frames = 465 rows):
# a 50-step request (49 forwards) takes ~6.6 s on bench, ~1.5 s on small, plus ~4 s to load the repository


class PresetError(ValueError):
    """An unknown preset, or one that cannot be written (the released shapes)."""


def get_preset(name: str) -> H3Preset:
    """The preset called `name`; the error lists the valid ones."""
    if name not in PRESETS:
        raise PresetError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def preset_of(transformer_config: dict[str, Any]) -> str:
    """The preset whose transformer arguments `transformer_config` has ("h3" = the released shapes), else "custom"."""
    for name, p in PRESETS.items():
        want = p.transformer_kwargs()
        if all(_same(transformer_config.get(k), v) for k, v in want.items()):
            return name
    return "custom"


def _same(a: Any, b: Any) -> bool:
    return list(a) == list(b) if isinstance(b, tuple) and isinstance(a, (list, tuple)) else bool(a == b)


@dataclass(frozen=True)
class H3Figures:
    """Sizes of a preset's transformer, counted on the meta device (nothing is allocated)."""

    params: int
    adaln_params: int
    """every block's adaln_proj.linear weight + bias: the tensors the plan cache replaces."""
    page_numel: int
    """one timestep's plan page: every block's (3 modalities x 6 chunks x hidden) + norm_out's shift/scale."""

    def adaln_bytes(self, dtype: str) -> int:
        """adaln_proj bytes in a repository of `dtype` (released mixed keeps it in bfloat16)."""
        return self.adaln_params * _dtype_size(dtype)

    def page_bytes(self, dtype: str) -> int:
        return self.page_numel * _dtype_size(dtype)


def _dtype_size(dtype: str) -> int:
    check_dtype(dtype)
    return 4 if dtype == "float32" else 2


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {list(DTYPES)}")


def figures(preset: str | H3Preset) -> H3Figures:
    """Parameter and plan-page counts of `preset`'s transformer, the released `h3` included."""
    from diffusers import MiniMaxH3Transformer3DModel

    p = get_preset(preset) if isinstance(preset, str) else preset
    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**p.transformer_kwargs())
    params = sum(t.numel() for t in model.parameters())
    adaln = sum(t.numel() for n, t in model.named_parameters() if ".adaln_proj." in n)
    page = p.num_layers * MODALITIES * CHUNKS * p.hidden_size + 2 * p.hidden_size
    return H3Figures(params=params, adaln_params=adaln, page_numel=page)
