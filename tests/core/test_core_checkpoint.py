"""ditcore.h3.checkpoint on tiny MiniMax-H3 repositories: valid ones pass with a stable fingerprint, every fault is
refused with the file (and tensor) named, stripped plan tensors pass only in cached mode, in-place edits are seen."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ditcore.checkpoint import validate_checkpoint
from ditcore.checkpoint_files import CheckpointError, CheckpointNotFoundError
from ditcore.digests import changed_since
from ditcore.plans import is_plan_tensor
from ditcore.repo import write_repository
from ditcore.shards import INDEX_FILE, SINGLE_FILE

TR = "transformer"
BLOCK_WEIGHT = "transformer_blocks.1.attn.to_q.weight"  # bf16 in mixed, outside _keep_in_fp32_modules


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tiny seed-0 repositories in float32 and mixed, and a seed-1 float32 one."""
    base = tmp_path_factory.mktemp("h3ckpt")
    return {
        "float32": write_repository(base / "f32", "tiny", seed=0, dtype="float32"),
        "mixed": write_repository(base / "mixed", "tiny", seed=0, dtype="mixed"),
        "seed1": write_repository(base / "seed1", "tiny", seed=1, dtype="float32"),
    }


@pytest.fixture(params=["float32", "mixed"])
def repo(request: pytest.FixtureRequest, repos: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy to damage."""
    return Path(shutil.copytree(repos[request.param], tmp_path / "repo"))


def weight_map(repo: Path) -> dict[str, str]:
    return dict(json.loads((repo / TR / INDEX_FILE).read_text())["weight_map"])


def shard_of(repo: Path, tensor: str) -> str:
    """Relative path of the shard holding `tensor`."""
    return f"{TR}/{weight_map(repo)[tensor]}"


def rewrite_shard(repo: Path, rel: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(repo / rel))
    edit(tensors)
    save_file(tensors, str(repo / rel), metadata={"format": "pt"})


def write_index(repo: Path, wm: dict[str, str]) -> None:
    index = json.loads((repo / TR / INDEX_FILE).read_text())
    index["weight_map"] = wm
    (repo / TR / INDEX_FILE).write_text(json.dumps(index))


def refused(repo: Path, *names: str, require_adaln: bool = True) -> str:
    """Validation fails and the message names every one of `names`."""
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(repo, require_adaln=require_adaln)
    msg = str(e.value)
    for n in names:
        assert n in msg, f"{n!r} not named in: {msg}"
    return msg


@pytest.mark.parametrize("dtype", ["float32", "mixed"])
def test_valid_repository(repos: dict[str, Path], dtype: str, tmp_path: Path) -> None:
    info = validate_checkpoint(repos[dtype])
    assert info.has_adaln
    assert info.projection_dtype == (torch.float32 if dtype == "float32" else torch.bfloat16)
    assert info.layout.num_layers == info.transformer_config["num_layers"] == 3
    assert validate_checkpoint(repos[dtype]).fingerprint == info.fingerprint
    assert changed_since(info) == []
    covered = set(info.digests)
    assert "model_index.json" in covered and f"{TR}/{INDEX_FILE}" in covered and f"{TR}/config.json" in covered
    assert {"scheduler/scheduler_config.json", "text_encoder/model.safetensors", "tokenizer/tokenizer.json",
            "vae/diffusion_pytorch_model.safetensors", "audio_vae/config.json"} <= covered  # fmt: skip
    assert "modular_model_index.json" not in covered  # it records the absolute path
    copy = Path(shutil.copytree(repos[dtype], tmp_path / "copy"))
    assert validate_checkpoint(copy).fingerprint == info.fingerprint  # the model, not where it lies


def test_fingerprint_differs(repos: dict[str, Path]) -> None:
    fps = {validate_checkpoint(repos[k]).fingerprint for k in ("float32", "mixed", "seed1")}
    assert len(fps) == 3


def test_single_file_transformer(repo: Path) -> None:
    """diffusers' unsharded layout: one diffusion_pytorch_model.safetensors, no index."""
    shards = sorted(set(weight_map(repo).values()))
    tensors: dict[str, torch.Tensor] = {}
    for fname in shards:
        tensors.update(load_file(str(repo / TR / fname)))
        (repo / TR / fname).unlink()
    (repo / TR / INDEX_FILE).unlink()
    save_file(tensors, str(repo / TR / SINGLE_FILE), metadata={"format": "pt"})
    assert validate_checkpoint(repo).has_adaln
    rewrite_shard(repo, f"{TR}/{SINGLE_FILE}", lambda t: t.pop(BLOCK_WEIGHT))
    refused(repo, f"{TR}/{SINGLE_FILE}", BLOCK_WEIGHT, "missing tensor")


def test_missing_model_index(repo: Path) -> None:
    (repo / "model_index.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"model_index\.json"):
        validate_checkpoint(repo)


@pytest.mark.parametrize("component", ["vae", "audio_vae", "tokenizer", "processor"])
def test_missing_component_dir(repo: Path, component: str) -> None:
    shutil.rmtree(repo / component)
    refused(repo, f"{component}/", "model_index.json")


def test_component_not_named(repo: Path) -> None:
    index = json.loads((repo / "model_index.json").read_text())
    del index["text_encoder"]
    (repo / "model_index.json").write_text(json.dumps(index))
    refused(repo, "model_index.json", "text_encoder")


@pytest.mark.parametrize("text", ["{not json", '{"num_layers": "three"}', "[1, 2]"])
def test_garbage_transformer_config(repo: Path, text: str) -> None:
    (repo / TR / "config.json").write_text(text)
    refused(repo, f"{TR}/config.json")


def test_garbage_other_json(repo: Path) -> None:
    (repo / "scheduler" / "scheduler_config.json").write_text("{oops")
    refused(repo, "scheduler/scheduler_config.json")


def test_shard_missing_from_index(repo: Path) -> None:
    wm = weight_map(repo)
    last = sorted(set(wm.values()))[-1]
    held = sorted(t for t, f in wm.items() if f == last)
    write_index(repo, {t: f for t, f in wm.items() if f != last})
    refused(repo, f"{TR}/{last}", held[0], "not named by")


def test_index_names_missing_shard(repo: Path) -> None:
    rel = shard_of(repo, BLOCK_WEIGHT)
    (repo / rel).unlink()
    refused(repo, f"{TR}/{INDEX_FILE}", rel, "tensor '")


def test_missing_tensor_in_shard(repo: Path) -> None:
    rel = shard_of(repo, BLOCK_WEIGHT)
    rewrite_shard(repo, rel, lambda t: t.pop(BLOCK_WEIGHT))
    refused(repo, rel, BLOCK_WEIGHT, "missing tensor")


def test_missing_tensor_everywhere(repo: Path) -> None:
    rel = shard_of(repo, BLOCK_WEIGHT)
    rewrite_shard(repo, rel, lambda t: t.pop(BLOCK_WEIGHT))
    write_index(repo, {t: f for t, f in weight_map(repo).items() if t != BLOCK_WEIGHT})
    refused(repo, f"{TR}/{INDEX_FILE}", BLOCK_WEIGHT, "missing tensor")


def test_unexpected_tensor(repo: Path) -> None:
    rel = shard_of(repo, BLOCK_WEIGHT)
    rewrite_shard(repo, rel, lambda t: t.update({"extra.weight": torch.zeros(2)}))
    write_index(repo, {**weight_map(repo), "extra.weight": rel.split("/")[1]})
    refused(repo, rel, "extra.weight", "unexpected")


def test_wrong_shape(repo: Path) -> None:
    rel = shard_of(repo, BLOCK_WEIGHT)
    rewrite_shard(repo, rel, lambda t: t.update({BLOCK_WEIGHT: t[BLOCK_WEIGHT][:-1].clone()}))
    refused(repo, rel, BLOCK_WEIGHT, "wrong shape")


def test_wrong_dtype(repo: Path) -> None:
    rel = shard_of(repo, BLOCK_WEIGHT)
    rewrite_shard(repo, rel, lambda t: t.update({BLOCK_WEIGHT: t[BLOCK_WEIGHT].to(torch.float16)}))
    refused(repo, rel, BLOCK_WEIGHT, "wrong dtype F16")


def test_keep_fp32_module_must_be_float32(repos: dict[str, Path], tmp_path: Path) -> None:
    repo = Path(shutil.copytree(repos["mixed"], tmp_path / "repo"))
    name = next(t for t in weight_map(repo) if t.startswith("time_embedder.") and t.endswith(".weight"))
    rel = shard_of(repo, name)
    rewrite_shard(repo, rel, lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    refused(repo, rel, name, "wrong dtype BF16, expected F32")


def test_garbage_header(repo: Path) -> None:
    rel = shard_of(repo, BLOCK_WEIGHT)
    with open(repo / rel, "r+b") as fh:
        fh.seek(8)
        fh.write(b"\xff" * 32)
    msg = refused(repo, rel, "corrupt header", "tensor '")
    assert msg.startswith(rel)


def test_garbage_header_length(repo: Path) -> None:
    rel = shard_of(repo, BLOCK_WEIGHT)
    with open(repo / rel, "r+b") as fh:
        fh.write(struct.pack("<Q", 1 << 40))
    refused(repo, rel, "corrupt header", "tensor '")


def test_truncated_shard(repo: Path) -> None:
    rel = shard_of(repo, BLOCK_WEIGHT)
    size = (repo / rel).stat().st_size
    with open(repo / rel, "r+b") as fh:
        fh.truncate(size - 100)
    refused(repo, rel, "truncated shard", "tensor '")


def test_truncated_vae(repo: Path) -> None:
    rel = "vae/diffusion_pytorch_model.safetensors"
    size = (repo / rel).stat().st_size
    with open(repo / rel, "r+b") as fh:
        fh.truncate(size - 100)
    refused(repo, rel, "truncated shard", "tensor '")


def test_stripped_plan_tensors_pass_only_in_cached_mode(repo: Path) -> None:
    wm = weight_map(repo)
    plan = sorted(t for t in wm if is_plan_tensor(t))
    assert any(".adaln_proj." in t for t in plan) and "norm_out.linear.weight" in plan
    for fname in sorted(set(wm.values())):
        rewrite_shard(repo, f"{TR}/{fname}", lambda t: [t.pop(n) for n in plan if n in t])
    write_index(repo, {t: f for t, f in wm.items() if not is_plan_tensor(t)})
    msg = refused(repo, f"{TR}/{INDEX_FILE}", "missing tensor")
    assert any(f"'{n}'" in msg for n in plan)
    info = validate_checkpoint(repo, require_adaln=False)
    assert not info.has_adaln
    assert info.projection_dtype == validate_checkpoint(repo, require_adaln=False).projection_dtype


def test_cached_mode_still_checks_present_plan_tensors(repo: Path) -> None:
    name = "transformer_blocks.0.adaln_proj.linear.weight"
    rel = shard_of(repo, name)
    rewrite_shard(repo, rel, lambda t: t.update({name: t[name][:, :-1].clone()}))
    refused(repo, rel, name, "wrong shape", require_adaln=False)


def test_in_place_edit_is_reported(repo: Path) -> None:
    info = validate_checkpoint(repo)
    rel = shard_of(repo, BLOCK_WEIGHT)
    path = repo / rel
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        (hlen,) = struct.unpack("<Q", fh.read(8))
        begin = json.loads(fh.read(hlen))[BLOCK_WEIGHT]["data_offsets"][0]
        fh.seek(8 + hlen + begin)
        old = fh.read(4)
        fh.seek(8 + hlen + begin)
        fh.write(bytes(b ^ 0xFF for b in old))
    assert path.stat().st_size == size
    assert changed_since(info) == [rel]
    assert validate_checkpoint(repo).fingerprint != info.fingerprint


def test_changed_files_names_other_components(repo: Path) -> None:
    info = validate_checkpoint(repo)
    cfg = repo / "audio_scheduler" / "scheduler_config.json"
    cfg.write_text(cfg.read_text().replace("3.0", "4.0"))
    (repo / "tokenizer" / "tokenizer_config.json").unlink()
    assert changed_since(info) == [
        "audio_scheduler/scheduler_config.json",
        "tokenizer/tokenizer_config.json",
    ]
