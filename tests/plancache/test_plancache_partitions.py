"""Plans that know their partition: the sidecar's cache keys every plan by (partition, timestep bits), builds each
from its own partition's folder, shares the slab across partitions (or splits it with --ref-plans), refuses a
partition the repository lacks, and a weight update drops only the plans of a partition whose files changed; an
update to a repository whose partitions differ from the served ones is refused with nothing changed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ditcore.checkpoint import validate_checkpoint
from ditcore.checkpoint_files import CheckpointError
from ditcore.plans import PlanKey
from ditcore.rebuild import PlanBuilder
from ditcore.repo import write_repository
from ditruntime.slab import COL_PARTITION, READY
from plancache_service.cache import PlanCache
from plancache_service.config import CacheConfig
from plancache_service.errors import PartitionUnavailableError, PlanCapacityError
from plancache_service.rebuild import RebuildSource
from plancache_service.sidecar import Sidecar

CPU = torch.device("cpu")
KEYS = [PlanKey.from_timesteps(0.1 * i, 0.05 * i + 0.01) for i in range(1, 5)]


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """a: both partitions; b: a's ref partition with other base weights; c: other weights in both; base: no ref."""
    root = tmp_path_factory.mktemp("partitions")
    a = write_repository(root / "a", "tiny", seed=0, dtype="mixed")
    b = write_repository(root / "b", "tiny", seed=1, dtype="mixed")
    shutil.rmtree(b / "transformer_ref")
    shutil.copytree(a / "transformer_ref", b / "transformer_ref")
    c = write_repository(root / "c", "tiny", seed=2, dtype="mixed")
    base = write_repository(root / "base", "tiny", seed=0, dtype="mixed", partitions=("base",))
    return {"a": a, "b": b, "c": c, "base": base}


def cache_on(repo: Path, **config: int) -> PlanCache:
    cfg = CacheConfig(gpu_plans=config.pop("gpu_plans", 16), plan_width=4, host_cache_bytes=0, **config)
    return PlanCache(cfg, RebuildSource(repo, CPU), generation=1)


def pages(cache: PlanCache, keys: list[PlanKey]) -> list[torch.Tensor]:
    lease = cache.prepare(cache.generation, keys, "t")
    try:
        return [cache.slab[s, : k.width].clone() for s, k in zip(lease.slots, keys, strict=True)]
    finally:
        cache.release(lease.lease_id)


def test_the_same_timesteps_in_two_partitions_are_two_plans(repos: dict[str, Path]) -> None:
    cache = cache_on(repos["a"])
    ref_keys = [k.in_partition("ref") for k in KEYS]
    base_pages, ref_pages = pages(cache, KEYS), pages(cache, ref_keys)
    assert {cache.slot_of(k) for k in KEYS}.isdisjoint({cache.slot_of(k) for k in ref_keys})
    for partition, keys, got in (("transformer", KEYS, base_pages), ("transformer_ref", ref_keys, ref_pages)):
        builder = PlanBuilder(repos["a"] / partition)
        for key, page in zip(keys, got, strict=True):
            assert torch.equal(page, builder.build_one(key))  # each from its own partition's adaln_proj
    assert not any(torch.equal(b, r) for b, r in zip(base_pages, ref_pages, strict=True))
    for key in ref_keys:
        row = cache.table[cache.slot_of(key)]  # type: ignore[index]
        assert int(row[0]) == READY and int(row[COL_PARTITION]) == 1
    assert int(cache.table[cache.slot_of(KEYS[0])][COL_PARTITION]) == 0  # type: ignore[index]
    assert {p.name: p.slots_ready for p in cache.partition_states()} == {"base": 4, "ref": 4}


def test_a_repository_without_transformer_ref_refuses_ref_plans(repos: dict[str, Path]) -> None:
    cache = cache_on(repos["base"])
    with pytest.raises(PartitionUnavailableError, match="'ref' partition") as caught:
        cache.prepare(1, [KEYS[0].in_partition("ref")], "t")
    assert caught.value.grpc_code == "FAILED_PRECONDITION"
    assert cache.stats().built_plans == 0 and cache.resident_keys() == []
    with pytest.raises(Exception, match="one request runs one partition"):
        cache_on(repos["a"]).prepare(1, [KEYS[0], KEYS[1].in_partition("ref")], "t")


def test_ref_plans_split_the_slab(repos: dict[str, Path]) -> None:
    cache = cache_on(repos["a"], gpu_plans=8, ref_plans=3)
    ref_keys = [k.in_partition("ref") for k in KEYS[:3]]
    pages(cache, ref_keys)
    assert {cache.slot_of(k) for k in ref_keys} == {5, 6, 7}
    for i in range(3):  # bursts of base plans: 15 distinct ones through 5 slots, never into the ref slots
        pages(cache, [PlanKey.from_timesteps(0.3 + 0.01 * (5 * i + j), 0.9) for j in range(5)])
    assert all(cache.slot_of(k) in (5, 6, 7) for k in ref_keys)
    with pytest.raises(PlanCapacityError, match="at most 3 of the 'ref' partition"):
        cache.prepare(1, [k.in_partition("ref") for k in KEYS], "t")
    assert {p.name: p.slots_allowed for p in cache.partition_states()} == {"base": 5, "ref": 3}


def test_an_update_that_keeps_the_ref_partition_keeps_its_plans(repos: dict[str, Path], tmp_path: Path) -> None:
    sidecar = Sidecar(cache_on(repos["a"]), tmp_path / "state")
    cache = sidecar.cache
    ref_keys = [k.in_partition("ref") for k in KEYS]
    before_ref = pages(cache, ref_keys)
    pages(cache, KEYS)
    built = cache.stats().built_plans
    sidecar.prepare_update(1, str(repos["b"]))
    done = sidecar.commit_update(1, str(repos["b"]))
    assert (done.generation, done.kept_partitions) == (2, ("ref",))
    lease = cache.prepare(2, ref_keys, "t")
    assert lease.report.gpu_hit_plans == 4 and lease.report.built_plans == 0  # kept, under generation 2
    assert all(int(cache.table[s][1]) == 2 for s in lease.slots)
    assert all(
        torch.equal(cache.slab[s, : k.width], p) for s, k, p in zip(lease.slots, ref_keys, before_ref, strict=True)
    )
    cache.release(lease.lease_id)
    lease = cache.prepare(2, KEYS, "t")  # the base partition changed: rebuilt from b
    assert lease.report.built_plans == 4
    builder = PlanBuilder(repos["b"] / "transformer")
    assert all(
        torch.equal(cache.slab[s, : k.width], builder.build_one(k)) for s, k in zip(lease.slots, KEYS, strict=True)
    )
    cache.release(lease.lease_id)
    assert cache.stats().built_plans == built + 4
    sidecar.prepare_update(2, str(repos["c"]))  # both partitions change: nothing kept
    assert sidecar.commit_update(2, str(repos["c"])).kept_partitions == ()
    assert cache.resident_keys() == []


def test_an_update_with_other_partitions_is_refused_with_nothing_changed(
    repos: dict[str, Path], tmp_path: Path
) -> None:
    sidecar = Sidecar(cache_on(repos["a"]), tmp_path / "state")
    pages(sidecar.cache, [k.in_partition("ref") for k in KEYS])
    resident = sidecar.cache.resident_keys()
    with pytest.raises(
        CheckpointError, match=r"transformer partitions are \['base'\], the served ones \['base', 'ref'\]"
    ):
        sidecar.prepare_update(1, str(repos["base"]))
    st = sidecar.state()
    assert (st.generation, st.pending_weights_path, sidecar.cache.resident_keys()) == (1, "", resident)
    assert validate_checkpoint(repos["a"]).incompatibility(validate_checkpoint(repos["b"])) is None
