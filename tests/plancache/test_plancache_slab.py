"""Plan-cache slab lifecycle: invalidate and retarget, slot-table rows, the shared-memory files
and their read-only mappings (docs/architecture.md, "The slab and the lease protocol").
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
import torch

from ditruntime.errors import GenerationMismatchError
from ditruntime.slab import (
    COL_GENERATION,
    COL_LENGTH,
    COL_STATE,
    EMPTY,
    READY,
    ROW_WORDS,
    map_slab,
)
from plancache_service.errors import (
    CacheBusyError,
    PlanCacheError,
)
from plancache_service.rebuild import RebuildSource

from plancache_helpers import (  # isort: skip
    CPU,
    X,
    Y,
    DiffusersPages,
    MakeCache,
    assert_slots_match_reference,
    assert_unchanged,
    check_invariants,
    expect,
    group_of,
    keys_of,
    make_cache,
    prepare,
    run,
    sched,
    snapshot,
)


@pytest.fixture(scope="module")
def ref_b(tiny_ckpt_b: Path) -> DiffusersPages:
    return DiffusersPages(tiny_ckpt_b)


# ============================================================================ 6. invalidate
def test_invalidate_clears_both_tiers_and_refuses_while_leased(make: MakeCache) -> None:
    cache = make(gpu_plans=8, host_pages=16)
    run(cache, X)
    lease = prepare(cache, Y)
    before = snapshot(cache)
    with pytest.raises(CacheBusyError, match="1 lease"):
        cache.invalidate()
    assert_unchanged(cache, before)

    cache.release(lease.lease_id)
    cache.invalidate()
    expect(cache, resident=[], host_groups=[], leases=0, host_used_bytes=0, slots_ready=0)
    assert not cache.table[:, COL_STATE].any()
    r = run(cache, X).report  # both tiers empty: a full rebuild, no host swap-in
    assert (r.built_plans, r.host_hit_plans, r.gpu_hit_plans) == (4, 0, 0)
    expect(cache, resident=set(keys_of(X)), host_groups=[group_of(X)], built_plans=4 + 3 + 4)


def test_retarget_drops_plans_and_bumps_generation(
    make: MakeCache, tiny_ckpt_b: Path, tiny_ckpt_f32: Path, ref_b: DiffusersPages
) -> None:
    cache = make(gpu_plans=8, generation=1)
    run(cache, X)
    lease = prepare(cache, Y)
    other = RebuildSource(tiny_ckpt_b, CPU)  # same transformer config and precision, other weights
    with pytest.raises(CacheBusyError):
        cache.retarget(other, 2)
    cache.release(lease.lease_id)

    f32 = RebuildSource(tiny_ckpt_f32, CPU)  # float32 pages do not fit a bfloat16 slab
    before = snapshot(cache)
    with pytest.raises(PlanCacheError, match="does not fit the slab") as ei:
        cache.retarget(f32, 2)
    assert "torch.float32" in str(ei.value) and "torch.bfloat16" in str(ei.value)
    assert_unchanged(cache, before)

    cache.retarget(other, 2)
    assert cache.source is other
    expect(cache, resident=[], generation=2)
    with pytest.raises(GenerationMismatchError):
        cache.prepare(1, keys_of(X), "old")
    lease = cache.prepare(2, keys_of(X), "new")
    assert lease.report.built_plans == 4
    assert all(int(cache.table[s, COL_GENERATION]) == 2 for s in lease.slots)
    check_invariants(cache)
    assert_slots_match_reference(cache, ref_b)  # the new weights' pages, not the old ones


# ============================================================================ 9. slot table
def test_slot_table_rows_describe_leased_plans_and_clear_on_invalidate(make: MakeCache) -> None:
    cache = make(gpu_plans=6, generation=5)
    spec = sched(4, 5.0, 3.0)
    lease = prepare(cache, spec)
    assert {k.width for k in lease.keys} == {1, 2}
    for k, s in zip(lease.keys, lease.slots, strict=True):
        row = cache.table[s]
        assert int(row[COL_STATE]) == READY
        assert int(row[COL_GENERATION]) == cache.generation == 5
        assert int(row[COL_LENGTH]) == k.width
        assert tuple(int(v) for v in row[ROW_WORDS : ROW_WORDS + k.width]) == k.bits
        assert not row[ROW_WORDS + k.width :].any()
    unused = set(range(6)) - set(lease.slots)
    assert unused and all(int(cache.table[s, COL_STATE]) == EMPTY for s in unused)
    check_invariants(cache)
    cache.release(lease.lease_id)
    cache.invalidate()
    assert all(int(cache.table[s, COL_STATE]) == EMPTY for s in range(6))
    assert not cache.table[:, COL_LENGTH].any()


# ============================================================================ 10. shared memory files
@pytest.mark.parametrize("where", ["tmp", "dev_shm"])
def test_shm_files_are_private_and_removed_on_close(source: RebuildSource, tmp_path: Path, where: str) -> None:
    shm_dir = tmp_path if where == "tmp" else Path("/dev/shm")
    if where == "dev_shm" and not (shm_dir.is_dir() and os.access(shm_dir, os.W_OK)):
        pytest.skip("/dev/shm is not a writable directory here")
    cache = make_cache(source, gpu_plans=4, shm_dir=shm_dir)
    try:
        desc = cache.memory.descriptor
        paths = [Path(desc.slab_path), Path(desc.table_path)]
        assert desc.transport == "shm"
        assert sorted(map(str, paths)) == sorted(cache.memory.paths)
        for p, prefix in zip(paths, ("ditserve-slab-", "ditserve-table-"), strict=True):
            assert p.parent == shm_dir and p.name.startswith(prefix)  # the names the generator accepts
            assert os.stat(p).st_mode & 0o777 == 0o600
        assert os.stat(paths[0]).st_size == desc.slab_bytes == cache.slab.numel() * cache.slab.element_size()
        assert os.stat(paths[1]).st_size == desc.table_bytes
    finally:
        cache.close()
    assert not any(p.exists() for p in paths)
    cache.close()  # idempotent


def test_shm_without_room_for_the_slab_is_refused_at_start_naming_the_directory(
    source: RebuildSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slab's pages are reserved when it is made (posix_fallocate), so a full /dev/shm is an error then (naming
    the directory and the way out), never a SIGBUS at a page's first write mid-request; no file is left behind.
    Here a tmpfs that is full is stood in by posix_fallocate failing as it does there (ENOSPC)."""
    import errno

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=rf"cannot reserve \d+ bytes of shared memory in {tmp_path} .*--gpu-plans") as e:
        make_cache(source, gpu_plans=4, shm_dir=tmp_path)
    assert e.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_map_slab_gives_read_only_views_of_the_live_slab(make: MakeCache, tmp_path: Path) -> None:
    cache = make(gpu_plans=6)  # its files in tmp_path
    desc = cache.memory.descriptor
    slab, table, maps = map_slab(desc, shm_dirs=[tmp_path])
    run(cache, sched(4, 5.0, 3.0))  # written after mapping: the views are shared, not copies
    assert slab.shape == cache.slab.shape and table.shape == cache.table.shape
    assert torch.equal(slab, cache.slab) and torch.equal(table, cache.table)
    assert int(table[:, COL_STATE].eq(READY).sum()) == 4
    for mm in maps:
        with pytest.raises(TypeError):
            mm[0:1] = b"\x01"
    del slab, table

    with pytest.raises(ValueError, match="slab_bytes"):
        map_slab(dataclasses.replace(desc, slab_bytes=desc.slab_bytes + 4))
    with pytest.raises(ValueError, match="table_bytes"):
        map_slab(dataclasses.replace(desc, table_bytes=desc.table_bytes - 8))
    bigger = dataclasses.replace(
        desc,
        num_slots=desc.num_slots + 1,
        slab_bytes=desc.slab_bytes // desc.num_slots * (desc.num_slots + 1),
        table_bytes=desc.table_bytes // desc.num_slots * (desc.num_slots + 1),
    )
    with pytest.raises(
        ValueError, match=re.escape(f"table_path: '{desc.table_path}' is {desc.table_bytes} bytes, the descriptor says")
    ):
        map_slab(bigger, shm_dirs=[tmp_path])
    with pytest.raises(ValueError, match="is not in the shm directory"):  # the default: /dev/shm and the temp dir
        map_slab(desc)
