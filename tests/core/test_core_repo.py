"""Tiny MiniMax-H3 repositories written by ditcore.repo load with diffusers' and transformers' own classes,
in the released dtypes, and are deterministic for a seed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from ditcore.presets import PRESETS, PresetError, figures
from ditcore.repo import COMPONENTS, write_repository

SUBDIRS = sorted(COMPONENTS)


@pytest.fixture(scope="session")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """seed-0 tiny repositories in float32 and mixed, a second seed-0 float32 write and a seed-1 one."""
    base = tmp_path_factory.mktemp("h3repo")
    return {
        "float32": write_repository(base / "f32", "tiny", seed=0, dtype="float32"),
        "mixed": write_repository(base / "mixed", "tiny", seed=0, dtype="mixed"),
        "again": write_repository(base / "again", "tiny", seed=0, dtype="float32"),
        "seed1": write_repository(base / "seed1", "tiny", seed=1, dtype="float32"),
    }


def digests(repo: Path) -> dict[str, str]:
    """sha256 of every file, the repository's own absolute path (recorded by the modular index) masked."""
    out = {}
    for f in sorted(repo.rglob("*")):
        if f.is_file():
            data = f.read_bytes().replace(str(repo.resolve()).encode(), b"<repo>")
            out[str(f.relative_to(repo))] = hashlib.sha256(data).hexdigest()
    return out


@pytest.mark.parametrize("dtype", ["float32", "mixed"])
def test_layout(repos: dict[str, Path], dtype: str) -> None:
    repo = repos[dtype]
    index = json.loads((repo / "model_index.json").read_text())
    assert index["_class_name"] == "MiniMaxH3ModularPipeline"
    assert {k: v for k, v in index.items() if not k.startswith("_")} == {k: list(v) for k, v in COMPONENTS.items()}
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == SUBDIRS
    modular = json.loads((repo / "modular_model_index.json").read_text())
    assert modular["_blocks_class_name"] == "MiniMaxH3Blocks"
    assert all(modular[k][2]["subfolder"] == k for k in COMPONENTS)
    tr = repo / "transformer"
    shard_index = json.loads((tr / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in tr.glob("diffusion_pytorch_model-*-of-*.safetensors"))
    assert len(shards) >= 2 and sorted(set(shard_index["weight_map"].values())) == shards
    assert "transformer_blocks.0.adaln_proj.linear.weight" in shard_index["weight_map"]
    for sub, name in [("scheduler", "scheduler_config.json"), ("processor", "processor_config.json"),
                      ("text_encoder", "model.safetensors"), ("tokenizer", "tokenizer.json"),
                      ("vae", "diffusion_pytorch_model.safetensors"),
                      ("audio_vae", "diffusion_pytorch_model.safetensors")]:  # fmt: skip
        assert (repo / sub / name).is_file(), f"{sub}/{name}"


@pytest.mark.parametrize("dtype", ["float32", "mixed"])
def test_transformer_loads_in_released_dtypes(repos: dict[str, Path], dtype: str) -> None:
    from diffusers import MiniMaxH3Transformer3DModel
    from safetensors import safe_open

    tr = repos[dtype] / "transformer"
    stored = {}
    for shard in tr.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            stored.update({k: f.get_slice(k).get_dtype() for k in f.keys()})  # noqa: SIM118
    # as the released checkpoint is loaded: torch_dtype=bfloat16 keeps _keep_in_fp32_modules in float32
    load_dtype = torch.bfloat16 if dtype == "mixed" else torch.float32
    model = MiniMaxH3Transformer3DModel.from_pretrained(tr, torch_dtype=load_dtype)
    keep = model._keep_in_fp32_modules
    assert "time_embedder" in keep and "proj_out" in keep
    kept = 0
    for name, param in model.named_parameters():
        in_keep = any(k in name.split(".") for k in keep)
        kept += in_keep
        want = torch.float32 if dtype == "float32" or in_keep else torch.bfloat16
        assert param.dtype == want, name
        assert stored[name] == ("F32" if want == torch.float32 else "BF16"), name
    assert kept > 0
    assert model.transformer_blocks[0].adaln_proj.linear.weight.dtype == (
        torch.bfloat16 if dtype == "mixed" else torch.float32
    )
    assert model.config.num_layers == PRESETS["tiny"].num_layers
    assert sum(p.numel() for p in model.parameters()) == figures("tiny").params


@pytest.mark.parametrize("dtype", ["float32", "mixed"])
def test_text_encoder_and_tokenizer_load(repos: dict[str, Path], dtype: str) -> None:
    from transformers import AutoTokenizer, Qwen2TokenizerFast, Qwen3VLForConditionalGeneration

    repo = repos[dtype]
    tok = AutoTokenizer.from_pretrained(repo / "tokenizer")
    assert isinstance(tok, Qwen2TokenizerFast)
    ids = tok("a red fox runs through the snow")["input_ids"]
    assert len(ids) > 0 and tok.decode(ids) == "a red fox runs through the snow"
    for special in ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|video_pad|>"]:
        assert tok.convert_tokens_to_ids(special) != tok.unk_token_id
        assert tok(special)["input_ids"] == [tok.convert_tokens_to_ids(special)], special
    assert Qwen2TokenizerFast.from_pretrained(repo / "processor").vocab_size == tok.vocab_size
    te = Qwen3VLForConditionalGeneration.from_pretrained(repo / "text_encoder", dtype="auto")
    assert te.config.text_config.num_hidden_layers > 50  # the pipeline reads hidden_states[50]
    assert te.config.text_config.hidden_size == PRESETS["tiny"].text_dim
    assert te.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert te.model.language_model.embed_tokens.weight.dtype == (torch.bfloat16 if dtype == "mixed" else torch.float32)


def test_vaes_and_schedulers_load(repos: dict[str, Path]) -> None:
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler

    repo = repos["mixed"]
    for cls, sub in [(AutoencoderKLMiniMaxH3, "vae"), (AutoencoderKLMiniMaxH3Audio, "audio_vae")]:
        vae = cls.from_pretrained(repo / sub)
        assert {p.dtype for p in vae.parameters()} == {torch.float32}, sub  # released VAEs stay float32
    assert MiniMaxH3Scheduler.from_pretrained(repo / "scheduler").config.shift == 12.0
    assert MiniMaxH3Scheduler.from_pretrained(repo / "audio_scheduler").config.shift == 3.0


def test_same_seed_is_byte_identical_and_seeds_differ(repos: dict[str, Path]) -> None:
    first, again, other = digests(repos["float32"]), digests(repos["again"]), digests(repos["seed1"])
    assert first == again
    assert first.keys() == other.keys()
    changed = {k for k in first if first[k] != other[k]}
    assert "text_encoder/model.safetensors" in changed and "vae/diffusion_pytorch_model.safetensors" in changed
    assert any(k.startswith("transformer/diffusion_pytorch_model-") for k in changed)
    assert "tokenizer/tokenizer.json" not in changed  # the tokenizer depends on the corpus, not the seed


def test_released_shapes_are_arithmetic_only(tmp_path: Path) -> None:
    with pytest.raises(PresetError, match="arithmetic only"):
        write_repository(tmp_path / "h3", "h3")
    assert not (tmp_path / "h3").exists()
    f = figures("h3")
    assert round(f.adaln_bytes("mixed") / 2**30, 1) == 24.2
    assert round(f.page_bytes("mixed") / 2**20, 2) == 9.25


def test_bad_preset_and_dtype_name_the_choices(tmp_path: Path) -> None:
    with pytest.raises(PresetError, match="tiny"):
        write_repository(tmp_path / "x", "huge")
    with pytest.raises(ValueError, match="mixed"):
        write_repository(tmp_path / "x", "tiny", dtype="fp16")
