"""Checkpoint format: writer determinism, fingerprint, loading, and a validator that names names.

Every corruption is applied to a private copy (`copy_ckpt`) of the session fixture.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from clikit import copy_ckpt
from safetensors import safe_open
from safetensors.torch import save_file

from ditcore import (
    CheckpointError,
    CheckpointNotFoundError,
    GenerationRequest,
    LocalPlanProvider,
    fingerprint,
    generate,
    get_preset,
    load_model,
    validate_checkpoint,
    write_checkpoint,
)
from ditcore.checkpoint import CONFIG_FILE, INDEX_FILE, read_shard_header
from ditcore.config import is_adaln_name, param_shapes

TINY = get_preset("tiny")


# ----------------------------------------------------------------------------- helpers
def read_index(root: Path) -> dict[str, str]:
    return dict(json.loads((root / INDEX_FILE).read_text())["weight_map"])


def write_index(root: Path, weight_map: dict[str, str]) -> None:
    data = json.loads((root / INDEX_FILE).read_text())
    data["weight_map"] = weight_map
    (root / INDEX_FILE).write_text(json.dumps(data, indent=2, sort_keys=True))


def shard_files(root: Path) -> list[str]:
    return sorted(set(read_index(root).values()))


def load_shard(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118


def rewrite_shard(root: Path, fname: str, mutate: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Load every tensor of one shard, let `mutate` edit the dict in place, save it back."""
    tensors, meta = load_shard(root / fname)
    mutate(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / fname), metadata=meta)


def drop_tensor(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def mutate(t: dict[str, torch.Tensor]) -> None:
        del t[name]

    return mutate


def shard_of(root: Path, tensor: str) -> str:
    return read_index(root)[tensor]


# A tensor in the second shard, and one in the first (the fixture has 2 shards).
VICTIM = "blocks.1.attn.qkv.weight"
VICTIM_1 = "time_embed.fc2.weight"


def assert_names(err: BaseException, *names: str) -> None:
    msg = str(err)
    for n in names:
        assert n in msg, f"{n!r} not named in: {msg}"


# ----------------------------------------------------------------------------- round trip
def test_fixture_layout(tiny_ckpt: Path) -> None:
    names = sorted(p.name for p in tiny_ckpt.iterdir())
    assert names == sorted(
        [CONFIG_FILE, INDEX_FILE, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    )
    wm = read_index(tiny_ckpt)
    assert set(wm) == set(param_shapes(TINY))
    assert shard_of(tiny_ckpt, VICTIM) == "model-00002-of-00002.safetensors"
    assert shard_of(tiny_ckpt, VICTIM_1) == "model-00001-of-00002.safetensors"


def test_round_trip_resident(tiny_ckpt: Path) -> None:
    info = validate_checkpoint(tiny_ckpt)
    assert info.config == TINY
    assert info.has_adaln
    assert info.path == tiny_ckpt
    model = load_model(tiny_ckpt, "resident")
    assert model.with_adaln
    assert not model.training
    state = model.state_dict()
    assert set(state) == set(param_shapes(TINY))
    wm = read_index(tiny_ckpt)
    for name, tensor in state.items():
        with safe_open(str(tiny_ckpt / wm[name]), framework="pt") as f:
            expected = f.get_tensor(name)
        assert tensor.dtype == torch.float32
        assert tensor.shape == param_shapes(TINY)[name]
        assert torch.equal(tensor, expected), name
        assert not tensor.requires_grad


def test_load_cached_mode_has_no_adaln(tiny_ckpt: Path) -> None:
    model = load_model(tiny_ckpt, "cached")
    assert not model.with_adaln
    names = set(model.state_dict())
    assert names == {n for n in param_shapes(TINY) if not is_adaln_name(n)}
    resident = load_model(tiny_ckpt, "resident").state_dict()
    for n, t in model.state_dict().items():
        assert torch.equal(t, resident[n])


def test_load_model_rejects_unknown_mode(tiny_ckpt: Path) -> None:
    with pytest.raises(ValueError, match="adaln_mode"):
        load_model(tiny_ckpt, "sideways")


def test_bfloat16_round_trip(tmp_path: Path) -> None:
    root = write_checkpoint(TINY.replace(dtype="bfloat16"), tmp_path / "bf16", seed=0)
    info = validate_checkpoint(root)
    assert info.config.dtype == "bfloat16"
    model = load_model(info)
    assert all(t.dtype == torch.bfloat16 for t in model.state_dict().values())
    # bf16 values are the f32 init rounded: same seed, same stream
    f32 = write_checkpoint(TINY, tmp_path / "f32", seed=0)
    ref = load_model(f32).state_dict()
    for n, t in model.state_dict().items():
        assert torch.equal(t, ref[n].to(torch.bfloat16)), n


# ----------------------------------------------------------------------------- determinism
def _all_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_writer_is_deterministic(tmp_path: Path, tiny_ckpt: Path) -> None:
    again = write_checkpoint(TINY, tmp_path / "again", seed=0, shards=2)
    assert _all_bytes(again) == _all_bytes(tiny_ckpt)
    assert validate_checkpoint(again).fingerprint == validate_checkpoint(tiny_ckpt).fingerprint


def test_different_seed_different_weights_and_fingerprint(tiny_ckpt: Path, tiny_ckpt_b: Path) -> None:
    a, b = validate_checkpoint(tiny_ckpt), validate_checkpoint(tiny_ckpt_b)
    # same config, same index, same headers: only the data differs
    assert (tiny_ckpt / INDEX_FILE).read_bytes() == (tiny_ckpt_b / INDEX_FILE).read_bytes()
    assert a.fingerprint != b.fingerprint
    for f in shard_files(tiny_ckpt):
        assert (tiny_ckpt / f).read_bytes() != (tiny_ckpt_b / f).read_bytes()


def test_fingerprint_is_stable_and_matches_validate(tiny_ckpt: Path) -> None:
    fp = fingerprint(tiny_ckpt)
    assert re.fullmatch(r"[0-9a-f]{64}", fp)
    assert fp == fingerprint(tiny_ckpt)
    assert fp == validate_checkpoint(tiny_ckpt).fingerprint
    assert fp == validate_checkpoint(tiny_ckpt, require_adaln=False).fingerprint


def test_shard_count_changes_fingerprint(tmp_path: Path, tiny_ckpt: Path) -> None:
    one = write_checkpoint(TINY, tmp_path / "one", seed=0, shards=1)
    assert fingerprint(one) != fingerprint(tiny_ckpt)
    # same weights though
    a, b = load_model(one).state_dict(), load_model(tiny_ckpt).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_fingerprint_changes_when_shard_values_change(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    before = fingerprint(root)
    assert before == fingerprint(tiny_ckpt)
    fname = shard_of(root, VICTIM)
    size = (root / fname).stat().st_size
    header = read_shard_header(root / fname).header_bytes

    def bump(t: dict[str, torch.Tensor]) -> None:
        t[VICTIM] = t[VICTIM] + 1.0

    rewrite_shard(root, fname, bump)
    # Same size and header: only values changed.
    assert (root / fname).stat().st_size == size
    assert read_shard_header(root / fname).header_bytes == header
    assert fingerprint(root) != before
    assert validate_checkpoint(root).fingerprint != before


def test_fingerprint_changes_when_shard_metadata_changes(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    fname = shard_files(root)[0]
    tensors, meta = load_shard(root / fname)
    save_file(tensors, str(root / fname), metadata={**meta, "note": "retrained"})
    assert fingerprint(root) != fingerprint(tiny_ckpt)


def test_fingerprint_changes_when_config_changes(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    cfg = json.loads((root / CONFIG_FILE).read_text())
    cfg["max_frames"] = 9
    (root / CONFIG_FILE).write_text(json.dumps(cfg))
    assert fingerprint(root) != fingerprint(tiny_ckpt)


# ----------------------------------------------------------------------------- validator
def test_truncated_shard(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    fname = shard_files(root)[0]
    hdr = read_shard_header(root / fname)
    last = max(hdr.tensors, key=lambda n: hdr.tensors[n].end)  # the tensor the cut lands in
    data = (root / fname).read_bytes()
    (root / fname).write_bytes(data[:-100])
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(root)
    assert_names(ei.value, fname, f"'{last}'", "truncated")
    with pytest.raises(CheckpointError) as ei:
        load_model(root, "cached")
    assert_names(ei.value, fname, last)


def test_shard_truncated_inside_header(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    fname = shard_files(root)[1]
    (root / fname).write_bytes((root / fname).read_bytes()[:40])
    first = next(t for t, f in read_index(root).items() if f == fname)
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(root)
    assert_names(ei.value, fname, f"'{first}'")


@pytest.mark.parametrize("where", ["json", "length"])
def test_garbage_header(tmp_path: Path, tiny_ckpt: Path, where: str) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    fname = shard_files(root)[1]
    data = bytearray((root / fname).read_bytes())
    if where == "json":
        data[8:72] = b"\xff\xfe garbage \x00" * 4 + b"\x01" * 4  # keep the length, ruin the JSON
    else:
        data[0:8] = b"\xff" * 8  # an absurd header length
    (root / fname).write_bytes(bytes(data))
    tensors_here = [t for t, f in read_index(root).items() if f == fname]
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(root)
    msg = str(ei.value)
    assert fname in msg
    assert "header" in msg
    assert any(f"'{t}'" in msg for t in tensors_here), msg


def test_tensor_removed_from_shard_and_index(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    rewrite_shard(root, shard_of(root, VICTIM), drop_tensor(VICTIM))
    wm = read_index(root)
    del wm[VICTIM]
    write_index(root, wm)
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(root)
    assert_names(ei.value, INDEX_FILE, f"'{VICTIM}'", "missing")
    # cached mode needs it too (it is not an adaln tensor)
    with pytest.raises(CheckpointError, match=re.escape(VICTIM)):
        validate_checkpoint(root, require_adaln=False)


def test_index_entry_removed(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    wm = read_index(root)
    del wm[VICTIM_1]
    write_index(root, wm)
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(root)
    assert_names(ei.value, INDEX_FILE, f"'{VICTIM_1}'", "missing")


def test_tensor_removed_from_shard_only(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    fname = shard_of(root, VICTIM)
    rewrite_shard(root, fname, drop_tensor(VICTIM))
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(root)
    assert_names(ei.value, fname, f"'{VICTIM}'", "missing")


def test_wrong_shape(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    fname = shard_of(root, VICTIM)

    def reshape(t: dict[str, torch.Tensor]) -> None:
        t[VICTIM] = t[VICTIM][:-1].clone()  # one row short

    rewrite_shard(root, fname, reshape)
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(root)
    assert_names(ei.value, fname, f"'{VICTIM}'", "wrong shape", str(list(param_shapes(TINY)[VICTIM])))


def test_transposed_shape(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    name = "blocks.0.mlp.fc1.weight"
    fname = shard_of(root, name)

    def transpose(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].t().contiguous()  # same numel, wrong shape

    rewrite_shard(root, fname, transpose)
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(root)
    assert_names(ei.value, fname, f"'{name}'", "wrong shape")


@pytest.mark.parametrize(("dtype", "st_name"), [(torch.float16, "F16"), (torch.float64, "F64")])
def test_wrong_dtype(tmp_path: Path, tiny_ckpt: Path, dtype: torch.dtype, st_name: str) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    fname = shard_of(root, VICTIM_1)

    def cast(t: dict[str, torch.Tensor]) -> None:
        t[VICTIM_1] = t[VICTIM_1].to(dtype)

    rewrite_shard(root, fname, cast)
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(root)
    assert_names(ei.value, fname, f"'{VICTIM_1}'", "wrong dtype", st_name, "F32")


def test_bf16_tensor_in_f32_checkpoint(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    name = "blocks.0.adaln_proj.bias"
    fname = shard_of(root, name)

    def cast(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].to(torch.bfloat16)

    rewrite_shard(root, fname, cast)
    # a present adaln tensor must be well-formed even when cached mode would not read it
    for require in (True, False):
        with pytest.raises(CheckpointError) as ei:
            validate_checkpoint(root, require_adaln=require)
        assert_names(ei.value, fname, f"'{name}'", "BF16")


def test_index_points_to_missing_shard(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    wm = read_index(root)
    wm[VICTIM] = "model-00007-of-00009.safetensors"
    write_index(root, wm)
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(root)
    assert_names(ei.value, INDEX_FILE, f"'{VICTIM}'", "model-00007-of-00009.safetensors")


def test_shard_file_deleted(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    fname = shard_files(root)[1]
    (root / fname).unlink()
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(root)
    assert_names(ei.value, fname, "missing shard")
    assert re.search(r"tensor '[^']+'", str(ei.value))


def test_index_names_path_outside_checkpoint(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    wm = read_index(root)
    wm[VICTIM] = "../elsewhere/model-00002-of-00002.safetensors"
    write_index(root, wm)
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(root)
    assert_names(ei.value, INDEX_FILE, f"'{VICTIM}'")


def test_unexpected_tensor(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    fname = shard_files(root)[0]
    rewrite_shard(root, fname, lambda t: t.update({"blocks.9.extra.weight": torch.zeros(3)}))
    wm = read_index(root)
    wm["blocks.9.extra.weight"] = fname
    write_index(root, wm)
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(root)
    assert_names(ei.value, fname, "'blocks.9.extra.weight'", "unexpected")


def test_missing_index(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    (root / INDEX_FILE).unlink()
    with pytest.raises(CheckpointError, match=re.escape(INDEX_FILE)):
        validate_checkpoint(root)


def test_corrupt_index_json(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    (root / INDEX_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=re.escape(INDEX_FILE)):
        validate_checkpoint(root)


def test_missing_config(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    (root / CONFIG_FILE).unlink()
    with pytest.raises(CheckpointNotFoundError, match=re.escape(CONFIG_FILE)):
        validate_checkpoint(root)
    with pytest.raises(CheckpointNotFoundError):
        load_model(root)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="not found"):
        validate_checkpoint(tmp_path / "nope")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", 0),
        ("hidden_size", "32"),
        ("num_heads", 3),  # does not divide hidden_size 32
        ("dtype", "float16"),
        ("patch_size", [1, 2]),
        ("text_len", -4),
        ("mlp_ratio", True),
    ],
)
def test_bad_config_field(tmp_path: Path, tiny_ckpt: Path, field: str, value: object) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    cfg = json.loads((root / CONFIG_FILE).read_text())
    cfg[field] = value
    (root / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(root)
    assert not isinstance(ei.value, CheckpointNotFoundError)
    assert_names(ei.value, CONFIG_FILE, f"'{field}'")


@pytest.mark.parametrize("mutation", ["unknown", "missing"])
def test_config_unknown_or_missing_field(tmp_path: Path, tiny_ckpt: Path, mutation: str) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    cfg = json.loads((root / CONFIG_FILE).read_text())
    if mutation == "unknown":
        cfg["hidden_sise"] = 32
    else:
        del cfg["num_layers"]
    (root / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(root)
    assert_names(ei.value, CONFIG_FILE, "hidden_sise" if mutation == "unknown" else "num_layers")


def test_config_not_json(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    (root / CONFIG_FILE).write_text("hidden_size = 32")
    with pytest.raises(CheckpointError, match=re.escape(CONFIG_FILE)):
        validate_checkpoint(root)


def test_config_that_disagrees_with_shards(tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    cfg = json.loads((root / CONFIG_FILE).read_text())
    cfg["hidden_size"] = 64
    cfg["num_heads"] = 4
    (root / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="wrong shape"):
        validate_checkpoint(root)


# ----------------------------------------------------------------------------- cached mode
def strip_adaln(src: Path, dst_parent: Path) -> Path:
    """A copy of `src` with every `.adaln_proj.` tensor removed from the shards and index."""
    root = copy_ckpt(src, dst_parent, "stripped")
    for fname in shard_files(root):

        def drop(t: dict[str, torch.Tensor]) -> None:
            for n in [n for n in t if is_adaln_name(n)]:
                del t[n]

        rewrite_shard(root, fname, drop)
    write_index(root, {n: f for n, f in read_index(root).items() if not is_adaln_name(n)})
    return root


def test_cached_mode_never_reads_adaln_bytes(tmp_path: Path, tiny_ckpt: Path) -> None:
    stripped = strip_adaln(tiny_ckpt, tmp_path)
    for fname in shard_files(stripped):
        assert not any(is_adaln_name(n) for n in read_shard_header(stripped / fname).tensors)

    # The native check refuses it, naming a missing adaln tensor.
    with pytest.raises(CheckpointError) as ei:
        validate_checkpoint(stripped)
    assert_names(ei.value, INDEX_FILE, ".adaln_proj.")
    assert re.search(r"'(blocks\.\d+|final_layer)\.adaln_proj\.(weight|bias)'", str(ei.value))
    with pytest.raises(CheckpointError):
        load_model(stripped, "resident")

    # The cached-mode check and loader accept it.
    info = validate_checkpoint(stripped, require_adaln=False)
    assert not info.has_adaln
    with pytest.raises(ValueError, match="adaln"):
        LocalPlanProvider(info, load_model(stripped, "cached").time_embed)
    cached = load_model(stripped, "cached")
    assert not cached.with_adaln

    # Plans from the ORIGINAL checkpoint + the stripped model == the resident original.
    provider = LocalPlanProvider(validate_checkpoint(tiny_ckpt), cached.time_embed)
    resident = load_model(tiny_ckpt, "resident")
    req = GenerationRequest(
        request_id="strip",
        task="t2va",
        prompt="a red fox",
        negative_prompt="blurry",
        steps=5,
        flow_shift=5.0,
        audio_flow_shift=2.0,
        guidance_scale=4.0,
        seed=11,
        frames=5,
        height=32,
        width=32,
        audio_length=8,
    )
    got = generate(cached, req, provider)
    want = generate(resident, req)
    assert torch.equal(got.video, want.video)
    assert got.audio is not None and want.audio is not None
    assert torch.equal(got.audio, want.audio)
    assert got.sha256 == want.sha256
    assert got.cache is not None and got.cache.built_plans == 5
