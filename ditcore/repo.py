"""Writes MiniMax-H3 diffusers repositories with random weights of the real classes, offline and deterministic.

Owns the dtype policy of a written repository and its layout; the sizes it writes are presets.py's.
`write_repository` is the one entry point.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .presets import PRESETS, H3Preset, PresetError, check_dtype, get_preset

# MiniMax-H3 reads the text encoder's hidden_states[50]: the encoder needs more than 50 decoder layers.
TEXT_LAYERS = 51

# Qwen2/Qwen3 special tokens in Qwen's id order (151643..); the tiny vocab puts them right after the BPE vocab.
QWEN_SPECIAL = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
QWEN_ADDED_NONSPECIAL = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)  # fmt: skip
# BPE training text: enough to give common English words and H3's prompt markers their own merges.
CORPUS = (
    "a red fox runs through a snowy forest at dawn, cinematic lighting, birds singing",
    "A cat sits on a windowsill watching the rain; soft piano music plays in the background.",
    "The quick brown fox jumps over the lazy dog. 0123456789 !?,.;:'\"()[]{}<>-_=+*/\\|@#$%^&~`",
    "waves crash on the rocky shore while seagulls call overhead, drone shot, golden hour",
    "<Picture 1>: <Picture 2>: <Audio 1>: <Video 1>: <0.5 seconds> <1.0 seconds>",
)
VIDEO_SHIFT = 12.0  # H3's default video flow shift
AUDIO_SHIFT = 3.0  # H3's default audio flow shift


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    # modules initialize from the global generator; fork it so the caller's RNG state is left untouched
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _to_released_dtype(model: torch.nn.Module) -> None:
    """bfloat16 except parameters under a `_keep_in_fp32_modules` entry, by diffusers' loader rule
    (`module in param_name.split(".")`); buffers keep their dtype."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not any(k in name.split(".") for k in keep):
                param.data = param.data.to(torch.bfloat16)


def _build_tokenizer(p: H3Preset) -> Any:
    """Byte-level BPE trained in-process with Qwen2's pre-tokenizer, wrapped as Qwen2TokenizerFast."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=p.vocab_size, min_frequency=1, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(list(CORPUS) * 4, trainer=trainer)
    state = json.loads(tok.to_str())
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["model"]["merges"]]
    qwen = Qwen2TokenizerFast(
        vocab=state["model"]["vocab"], merges=merges, unk_token=None, bos_token=None, eos_token="<|endoftext|>",
        pad_token="<|endoftext|>", model_max_length=131072,
    )  # fmt: skip
    qwen.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL[1:])})  # <|endoftext|> is eos
    qwen.add_tokens(list(QWEN_ADDED_NONSPECIAL), special_tokens=False)
    return qwen


def _text_encoder_config(p: H3Preset, tokenizer: Any) -> Any:
    from transformers import Qwen3VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=p.text_dim, intermediate_size=p.text_intermediate,
        num_hidden_layers=TEXT_LAYERS, num_attention_heads=p.text_heads, num_key_value_heads=1,
        head_dim=p.text_head_dim, max_position_embeddings=4096, rope_parameters=rope, tie_word_embeddings=False,
    )  # fmt: skip
    # a one-layer vision tower: H3's t2va path never runs it, but the class needs one
    vision = dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, out_hidden_size=p.text_dim, num_position_embeddings=64, deepstack_visual_indexes=[0],
    )  # fmt: skip
    return Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
    )  # fmt: skip


def _build_text_encoder(p: H3Preset, tokenizer: Any, seed: int) -> Any:
    from transformers import Qwen3VLForConditionalGeneration

    config = _text_encoder_config(p, tokenizer)
    with _seeded(seed + 1):
        return Qwen3VLForConditionalGeneration(config).eval()


# processor_config.json exactly as Qwen3VLProcessor.save_pretrained writes it (transformers 5.24 with torchvision),
# so processor/ is the same directory whether or not torchvision imports here.
PROCESSOR_CONFIG: dict[str, Any] = {
    "image_processor": {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "Qwen2VLImageProcessor",
        "image_std": [0.26862954, 0.26130258, 0.27577711], "merge_size": 2, "patch_size": 16, "resample": 3,
        "rescale_factor": 0.00392156862745098, "size": {"longest_edge": 1003520, "shortest_edge": 3136},
        "temporal_patch_size": 2,
    },
    "processor_class": "Qwen3VLProcessor",
    "video_processor": {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "do_sample_frames": True, "fps": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "max_frames": 768, "max_video_tokens": 768, "merge_size": 2, "min_frames": 4, "patch_size": 16,
        "resample": 3, "rescale_factor": 0.00392156862745098, "return_metadata": False,
        "size": {"longest_edge": 786432, "shortest_edge": 131072}, "temporal_patch_size": 2,
        "video_processor_type": "Qwen3VLVideoProcessor",
    },
}  # fmt: skip


def _write_json(path: Path, obj: dict[str, Any], sort_keys: bool = False) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=sort_keys, ensure_ascii=False) + "\n")


def _write_processor(tokenizer: Any, out: Path) -> None:
    """processor/ as Qwen3VLProcessor lays it out: the tokenizer files (tagged with the processor class) plus
    processor_config.json. Written as plain files: constructing the processor needs torchvision."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["processor_class"] = "Qwen3VLProcessor"
    _write_json(cfg_path, cfg)
    _write_json(out / "processor_config.json", PROCESSOR_CONFIG, sort_keys=True)


def _build_transformer(p: H3Preset, seed: int) -> Any:
    from diffusers import MiniMaxH3Transformer3DModel

    with _seeded(seed):
        model = MiniMaxH3Transformer3DModel(**p.transformer_kwargs())
        # default init leaves some projections at zero/identity; randomize all so a wrong row or dtype shows
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.ndim >= 2:  # weights: N(0, 0.2)
                    param.normal_(0.0, 0.2)
                elif name.endswith("bias"):
                    param.normal_(0.0, 0.1)
                else:  # norm scales near 1
                    param.copy_(1.0 + 0.1 * torch.randn_like(param))
    return model.eval()


def _build_vae(seed: int) -> Any:
    """Video VAE: spatial x16, temporal x4 (17n + 5 frames), 24 latent channels; tiny widths."""
    from diffusers import AutoencoderKLMiniMaxH3

    with _seeded(seed + 2):
        return AutoencoderKLMiniMaxH3(
            block_out_channels=(8, 8, 8, 8), layers_per_block=1, spatial_downsample_factors=(2, 2, 2, 2),
            temporal_downsample_factors=(1, 2, 2, 1), norm_num_groups=4, decoder_num_layers=1,
            decoder_num_attention_heads=2, decoder_attention_head_dim=8, decoder_num_register_tokens=1,
            decoder_ffn_mult=2, clip_length=17, token_drop=3,
            latents_mean=tuple(0.01 * i for i in range(24)), latents_std=tuple(1.0 + 0.02 * i for i in range(24)),
        ).eval()  # fmt: skip


def _build_audio_vae(seed: int) -> Any:
    """Stereo audio VAE: hop 800 at 32 kHz (40 latents/s), 32 latent channels; tiny widths."""
    from diffusers import AutoencoderKLMiniMaxH3Audio

    with _seeded(seed + 3):
        return AutoencoderKLMiniMaxH3Audio(
            encoder_dim=2, encoder_rates=(2, 4, 4, 5, 5), latent_dim=64, latent_channels=32, num_attention_heads=2,
            decoder_dim=128, decoder_rates=(5, 5, 2, 2, 2, 2, 2), decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4),
            resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),), sampling_rate=32000,
            latents_mean=[0.01 * i for i in range(32)], latents_std=[1.0 + 0.01 * i for i in range(32)],
        ).eval()  # fmt: skip


# component -> (library, class) as model_index.json names it; the order is the order written
COMPONENTS: dict[str, tuple[str, str]] = {
    "tokenizer": ("transformers", "Qwen2TokenizerFast"),
    "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
    "processor": ("transformers", "Qwen3VLProcessor"),
    "transformer": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "transformer_ref": ("diffusers", "MiniMaxH3Transformer3DModel"),
    "scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "audio_scheduler": ("diffusers", "MiniMaxH3Scheduler"),
    "vae": ("diffusers", "AutoencoderKLMiniMaxH3"),
    "audio_vae": ("diffusers", "AutoencoderKLMiniMaxH3Audio"),
}


def _write_indexes(out: Path, p: H3Preset, partitions: tuple[str, ...]) -> None:
    """model_index.json, and modular_model_index.json so `ModularPipeline.from_pretrained(out)` resolves
    MiniMaxH3ModularPipeline / MiniMaxH3Blocks (it records `out`'s absolute path, as diffusers does) and reads the
    preset's ref2va geometry configs."""
    import diffusers

    written = {k: v for k, v in COMPONENTS.items() if k not in PARTITION_FOLDERS.values() or k in partitions}
    head = {"_class_name": "MiniMaxH3ModularPipeline", "_diffusers_version": diffusers.__version__}
    _write_json(out / "model_index.json", {**head, **{k: list(v) for k, v in written.items()}})
    modular: dict[str, Any] = {**head, "_blocks_class_name": "MiniMaxH3Blocks", **p.pipeline_configs()}
    for name, (lib, cls) in written.items():
        spec = {"pretrained_model_name_or_path": str(out.resolve()), "subfolder": name, "type_hint": [lib, cls],
                "revision": None, "variant": None}  # fmt: skip
        modular[name] = [lib, cls, spec]
    _write_json(out / "modular_model_index.json", modular)


def _shard_bytes(model: torch.nn.Module, shards: int) -> int:
    # diffusers packs whole tensors into shards of at most this size: `shards` files, one more when a tensor spills
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return max(1, math.ceil(total / shards))


PARTITION_FOLDERS: dict[str, str] = {"base": "transformer", "ref": "transformer_ref"}
"""The transformer partitions a repository may hold (ditcore.checkpoint_files.PARTITIONS) and their folders."""
REF_SEED_OFFSET = 5
"""transformer_ref/ is initialised from `seed + REF_SEED_OFFSET`: other weights than transformer/'s, so a plan of one
partition used for the other shows in the output."""


def check_partitions(partitions: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """`partitions` (a subset of PARTITION_FOLDERS holding "base"), in PARTITION_FOLDERS' order; ValueError else."""
    unknown = [p for p in partitions if p not in PARTITION_FOLDERS]
    if unknown or "base" not in partitions or len(set(partitions)) != len(partitions):
        raise ValueError(
            f"partitions must be distinct names among {list(PARTITION_FOLDERS)} including 'base', got {list(partitions)}"
        )
    return tuple(p for p in PARTITION_FOLDERS if p in partitions)


def write_repository(
    out: Path,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    shards: int = 2,
    partitions: tuple[str, ...] = ("base", "ref"),
) -> Path:
    """Write a MiniMax-H3 diffusers repository at `out` with random weights of the real classes.

    Deterministic for (`preset`, `seed`, `dtype`, `partitions`): files are byte-identical across writes, except that
    modular_model_index.json records `out`'s absolute path. `dtype="mixed"` is the released precision:
    bfloat16 except the transformer's `_keep_in_fp32_modules`, VAEs in float32. `shards` is the target
    number of safetensors files per transformer partition. `partitions`: "base" (`transformer/`, t2va / fl2va) and
    optionally "ref" (`transformer_ref/`, ref2va: same shapes, its own weights). Offline: nothing is downloaded.
    """
    chosen = check_partitions(partitions)
    p = get_preset(preset)
    if not p.writable:
        raise PresetError(f"preset {preset!r} is the released shapes, for arithmetic only; "
                          f"write one of {sorted(k for k, v in PRESETS.items() if v.writable)}")  # fmt: skip
    check_dtype(dtype)
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_text_side(p, out, seed, dtype)
    _write_diffusers_side(p, out, seed, dtype, shards, chosen)
    _write_indexes(out, p, tuple(PARTITION_FOLDERS[name] for name in chosen))
    return out


def _write_text_side(p: H3Preset, out: Path, seed: int, dtype: str) -> None:
    tokenizer = _build_tokenizer(p)
    tokenizer.save_pretrained(out / "tokenizer")
    encoder = _build_text_encoder(p, tokenizer, seed)
    if dtype == "mixed":
        _to_released_dtype(encoder)  # the released Qwen3-VL is bfloat16
    encoder.save_pretrained(out / "text_encoder")
    _write_processor(tokenizer, out / "processor")


def _write_diffusers_side(
    p: H3Preset, out: Path, seed: int, dtype: str, shards: int, partitions: tuple[str, ...]
) -> None:
    from diffusers import MiniMaxH3Scheduler

    for name in partitions:
        transformer = _build_transformer(p, seed if name == "base" else seed + REF_SEED_OFFSET)
        if dtype == "mixed":
            _to_released_dtype(transformer)
        folder = PARTITION_FOLDERS[name]
        transformer.save_pretrained(out / folder, max_shard_size=_shard_bytes(transformer, shards))
        del transformer
    MiniMaxH3Scheduler(shift=VIDEO_SHIFT).save_pretrained(out / "scheduler")
    MiniMaxH3Scheduler(shift=AUDIO_SHIFT).save_pretrained(out / "audio_scheduler")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # VAE constructors warn about tiny group norms; irrelevant here
        _build_vae(seed).save_pretrained(out / "vae")  # released VAEs are float32
        _build_audio_vae(seed).save_pretrained(out / "audio_vae")
