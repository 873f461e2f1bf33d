"""The sidecar core (no gRPC) on MiniMax-H3 repositories: what it accepts as a rebuild source, weight updates
between compatible repositories (CheckpointInfo.incompatibility), the state file, and in-place edits.

A repository whose transformer lacks its native adaln_proj (one stripped for cached generators) is refused with a
message that says so; an incompatible one (float32 against a mixed-precision slab) is refused naming
transformer/config.json; a refused update changes nothing; a committed one serves the new weights' pages (equal to
diffusers' rows of the new repository) under generation + 1, persisted with its per-file digests; a repository edited
in place stops plans from being served, with the changed file named.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ditcore.checkpoint import validate_checkpoint
from ditcore.checkpoint_files import CheckpointError, CheckpointNotFoundError
from ditcore.digests import file_digests
from ditcore.plans import is_plan_tensor
from ditcore.shards import INDEX_FILE
from plancache_service.app import open_source
from plancache_service.cache import PlanCache
from plancache_service.config import CacheConfig, SidecarConfig
from plancache_service.errors import CheckpointChangedError
from plancache_service.rebuild import RebuildSource, open_checkpoint
from plancache_service.sidecar import Sidecar
from plancache_service.state import STATE_FILE, load_state

from plancache_helpers import CPU, X, DiffusersPages, assert_slots_match_reference, keys_of  # isort: skip

BLOCK_WEIGHT = "transformer_blocks.1.attn.to_q.weight"  # a tensor outside the plan


def weight_map(repo: Path) -> dict[str, str]:
    return dict(json.loads((repo / "transformer" / INDEX_FILE).read_text())["weight_map"])


def strip_plan_tensors(repo: Path) -> list[str]:
    """Remove every adaln_proj / norm_out.linear tensor from the transformer's shards and index (as a repository
    prepared for cached generators only); returns their names."""
    wm = weight_map(repo)
    plan = sorted(t for t in wm if is_plan_tensor(t))
    for fname in sorted(set(wm.values())):
        path = repo / "transformer" / fname
        tensors = {n: t for n, t in load_file(str(path)).items() if not is_plan_tensor(n)}
        save_file(tensors, str(path), metadata={"format": "pt"})
    index = json.loads((repo / "transformer" / INDEX_FILE).read_text())
    index["weight_map"] = {t: f for t, f in wm.items() if not is_plan_tensor(t)}
    (repo / "transformer" / INDEX_FILE).write_text(json.dumps(index))
    return plan


@pytest.fixture(scope="module")
def stripped(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = Path(shutil.copytree(tiny_ckpt, tmp_path_factory.mktemp("stripped") / "ckpt"))
    assert strip_plan_tensors(repo)
    return repo


@pytest.fixture
def served(tiny_ckpt: Path, tmp_path: Path) -> Iterator[Sidecar]:
    """A sidecar core on tiny_ckpt (generation 1) persisting to tmp_path/state."""
    cache = PlanCache(
        CacheConfig(gpu_plans=8, host_cache_bytes=0, shm_dir=str(tmp_path)), RebuildSource(tiny_ckpt, CPU), 1
    )
    try:
        yield Sidecar(cache, tmp_path / "state")
    finally:
        cache.close()


def test_a_repository_without_native_adaln_proj_is_refused_as_a_source(stripped: Path) -> None:
    info = validate_checkpoint(stripped, require_adaln=False)  # fine for a cached generator
    assert not info.has_adaln
    for attempt in (lambda: open_checkpoint(stripped), lambda: RebuildSource(stripped, CPU)):
        with pytest.raises(CheckpointError) as ei:
            attempt()
        msg = str(ei.value)
        assert str(stripped) in msg and "adaln_proj" in msg and "no native" in msg
    with pytest.raises(CheckpointError, match="adaln_proj"):
        RebuildSource(info, CPU)  # a CheckpointInfo is checked too


def test_source_geometry_comes_from_the_checkpoint(tiny_ckpt: Path, tiny_ckpt_f32: Path) -> None:
    for repo, dtype in ((tiny_ckpt, torch.bfloat16), (tiny_ckpt_f32, torch.float32)):
        source = RebuildSource(repo, CPU)
        info = validate_checkpoint(repo)
        assert source.dtype == info.projection_dtype == dtype
        assert source.layout == info.layout and source.page_numel == info.layout.page_numel
        assert source.page_bytes == info.layout.page_numel * dtype.itemsize
        assert source.fingerprint == info.fingerprint
        assert source.changed_files() == []


@pytest.mark.parametrize("which", ["float32", "stripped", "missing"])
def test_refused_update_changes_nothing(
    served: Sidecar, tiny_ckpt_f32: Path, stripped: Path, tmp_path: Path, which: str
) -> None:
    path, error, words = {
        "float32": (tiny_ckpt_f32, CheckpointError, ["transformer/config.json", "incompatible", "stored dtype"]),
        "stripped": (stripped, CheckpointError, ["adaln_proj"]),
        "missing": (tmp_path / "nowhere", CheckpointNotFoundError, ["nowhere"]),
    }[which]
    before = served.state()
    with pytest.raises(error) as ei:
        served.prepare_update(1, str(path))
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))
    assert served.update_outcomes.refused == 1 and served.update_outcomes.prepared == 0
    assert served.state() == before
    state = load_state(tmp_path / "state")
    assert state is not None and state.generation == 1


def test_committed_update_serves_the_new_weights(
    served: Sidecar, tiny_ckpt: Path, tiny_ckpt_b: Path, tmp_path: Path
) -> None:
    cache = served.cache
    lease = cache.prepare(1, keys_of(X), "gen")
    cache.release(lease.lease_id)
    pending = served.prepare_update(1, str(tiny_ckpt_b))
    assert pending.fingerprint == validate_checkpoint(tiny_ckpt_b).fingerprint != cache.source.fingerprint
    assert served.state().pending_weights_path == str(tiny_ckpt_b) and cache.generation == 1

    generation, fingerprint, _ = served.commit_update(1, str(tiny_ckpt_b))
    assert (generation, fingerprint) == (2, pending.fingerprint)
    st = served.state()
    assert (st.generation, st.weights_path, st.fingerprint, st.serving) == (2, str(tiny_ckpt_b), fingerprint, True)
    state = load_state(tmp_path / "state")
    assert state is not None and (state.generation, state.weights_path) == (2, str(tiny_ckpt_b))
    assert state.digests == file_digests(tiny_ckpt_b) and state.fingerprint == fingerprint

    lease = cache.prepare(2, keys_of(X), "gen")  # every plan rebuilt from B
    assert lease.report.built_plans == 4
    cache.release(lease.lease_id)
    assert_slots_match_reference(cache, DiffusersPages(tiny_ckpt_b))


def test_in_place_edit_stops_serving_and_names_the_file(tiny_ckpt: Path, tmp_path: Path) -> None:
    repo = Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))
    state_dir = tmp_path / "state"
    cache = PlanCache(CacheConfig(gpu_plans=8, host_cache_bytes=0, shm_dir=str(tmp_path)), RebuildSource(repo, CPU), 1)
    try:
        sidecar = Sidecar(cache, state_dir)
        sidecar.check_source()
        assert sidecar.serving
        shard = f"transformer/{weight_map(repo)[BLOCK_WEIGHT]}"
        tensors = load_file(str(repo / shard))
        tensors[BLOCK_WEIGHT] = tensors[BLOCK_WEIGHT] + 1
        save_file(tensors, str(repo / shard), metadata={"format": "pt"})

        sidecar.check_source()
        assert not sidecar.serving and shard in sidecar.state().not_serving_reason
        session = sidecar.attach("gen")
        with pytest.raises(CheckpointChangedError, match="not serving plans"):
            sidecar.prepare(session.session_id, 1, keys_of(X))
    finally:
        cache.close()

    # a restart reads the state file: the committed digests still disagree with the files
    config = SidecarConfig(
        checkpoint=repo, cache=CacheConfig(host_cache_bytes=0), address="unix:unused", state_dir=state_dir
    )
    assert (state_dir / STATE_FILE).exists()
    source, generation = open_source(config)
    assert generation == 1 and shard in source.changed_files()


def test_a_state_file_naming_an_unusable_repository_says_how_to_recover(tiny_ckpt: Path, tmp_path: Path) -> None:
    """A run dir left by an older version names a directory that is no MiniMax-H3 repository: the refusal names
    the state file and how to start from --checkpoint instead, and nothing is served."""
    from plancache_service.app import open_source
    from plancache_service.config import CacheConfig, SidecarConfig
    from plancache_service.state import STATE_FILE, PersistedState, save_state

    old = tmp_path / "demo-checkpoint-small"
    old.mkdir()
    state_dir = tmp_path / "state"
    save_state(state_dir, PersistedState(3, str(old), {"config.json": "0" * 64}))
    cfg = SidecarConfig(tiny_ckpt, CacheConfig(), f"unix:{tmp_path / 'pc.sock'}", state_dir=state_dir)
    with pytest.raises(CheckpointError) as info:
        open_source(cfg)
    msg = str(info.value)
    assert "model_index.json" in msg and str(state_dir / STATE_FILE) in msg
    assert 'edit that state file: set "weights_path" to it' in msg and str(tiny_ckpt) in msg
    assert "keeping generation at least 3" in msg and "never remove it" in msg
