"""The disk tier (`--plan-dir`, plancache_service.disk_tier) and its pack format (ditruntime.plan_packs).

Caches are driven with real MiniMax-H3 t2va schedules on the tiny repository; every page served from disk is compared
with diffusers' own projections (`ref`). docs/architecture.md, "The disk tier and plan packs": lookup order slab ->
host -> disk -> rebuild, packs addressed by everything their bits depend on, a damaged pack deleted and rebuilt (never
served), other weights or adapters never matched, an LRU size bound, a read-only shared directory, and a full disk
that never fails a request.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from ditcore.plans import distinct_keys
from ditruntime import plan_packs
from ditruntime.plan_packs import (
    MAGIC,
    PAYLOAD_ALIGN,
    PREFIX,
    PackCorruptError,
    PackError,
    PackIdentity,
    PackKey,
    PackStore,
    PackVersionError,
    gc,
    list_packs,
    read_header,
    verify_pack,
    write_pack,
)
from plancache_service.cache import PlanCache
from plancache_service.config import CacheConfig
from plancache_service.device import Copier, HostLanding
from plancache_service.rebuild import RebuildSource

from plancache_helpers import (  # isort: skip
    CPU,
    T2VA_A,
    T2VA_B,
    X,
    Y,
    Z,
    DiffusersPages,
    assert_slots_match_reference,
    check_invariants,
    group_of,
    keys_of,
    run,
    same_bits,
)

A_PLANS = 20  # T2VA_A's (and T2VA_B's) distinct plans (tests/plancache/test_plancache_tiers.py pins it)


@pytest.fixture
def caches(source: RebuildSource, tmp_path: Path) -> Iterator[Any]:
    """caches(plan_dir, gpu_plans=48, host_pages=0, source=..., **CacheConfig fields) -> a CPU cache with a disk tier;
    every one is closed at teardown (its pending writes written)."""
    made: list[PlanCache] = []

    def make(plan_dir: Path, *, gpu_plans: int = 48, host_pages: int = 0, src: RebuildSource = source,
             **config: Any) -> PlanCache:  # fmt: skip
        cfg = CacheConfig(
            gpu_plans=gpu_plans, plan_width=2, host_cache_bytes=host_pages * src.page_bytes, host_reserve_bytes=0,
            shm_dir=str(tmp_path), plan_dir=plan_dir, **config,
        )  # fmt: skip
        cache = PlanCache(cfg, src)
        made.append(cache)
        return cache

    yield make
    for c in made:
        c.close()


def stored(cache: PlanCache, spec: Any) -> Any:
    """Run `spec`, then wait for its pack (if any) to be written."""
    lease = run(cache, spec)
    assert cache.disk is not None
    cache.disk.flush()
    return lease.report


def packs(plan_dir: Path) -> list[Path]:
    return sorted(plan_dir.glob("*.pack"))


def slot_pages(cache: PlanCache, key: Any) -> Any:
    """A resident plan's pages in its slot (a copy)."""
    slot = cache.slot_of(key)
    assert slot is not None
    return cache.slab[slot, : key.width].clone()


def listing(plan_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file of the directory (dot files too) with its size and mtime in ns."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in plan_dir.iterdir()}


IDENTITY = PackIdentity("fp", "base", "", "bfloat16", 2, 4, 8, 100, builder="cpu/test")


# ============================================================================ the format
def test_a_pack_is_laid_out_as_documented_and_verifies(tmp_path: Path) -> None:
    key = PackKey(IDENTITY, ((1, 2), (3,)))
    plans = [((1, 2), b"a" * 400), ((3,), b"b" * 200)]
    header = write_pack(tmp_path, key, 200, plans)
    path = tmp_path / f"{key.address}.pack"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    raw = path.read_bytes()
    magic, version, hlen, hsha = PREFIX.unpack_from(raw)
    assert (magic, version, PREFIX.size) == (MAGIC, plan_packs.FORMAT_VERSION, 48)
    assert hashlib.sha256(raw[48 : 48 + hlen]).digest() == hsha
    assert header.payload_offset == PAYLOAD_ALIGN and not any(raw[48 + hlen : PAYLOAD_ALIGN])
    assert raw[PAYLOAD_ALIGN:] == b"a" * 400 + b"b" * 200 and len(raw) == header.file_bytes
    assert [(e.bits, e.offset, e.length) for e in header.plans] == [((1, 2), 0, 400), ((3,), 400, 200)]
    # each plan's checksum is XXH3-128 of its pages, as the header's JSON names it
    assert [e.checksum for e in header.plans] == [xxhash.xxh3_128_hexdigest(b"a" * 400),
                                                  xxhash.xxh3_128_hexdigest(b"b" * 200)]  # fmt: skip
    assert b'"xxh3_128":"' + header.plans[0].checksum.encode() + b'"' in raw[48 : 48 + hlen]
    assert verify_pack(path).key == key == read_header(path).key
    assert key.address == hashlib.sha256(plan_packs.canonical_json(key.describe())).hexdigest()


@pytest.mark.parametrize(
    "change",
    [{"weights": "fp2"}, {"partition": "ref"}, {"adapters": "ab" * 32}, {"dtype": "float32"}, {"num_layers": 3},
     {"hidden": 5}, {"time_embed_dim": 9}, {"page_numel": 101}, {"shard_count": 2, "shard_mode": "rows"},
     {"builder": "cuda/H200/sm_90/torch x"}],
)  # fmt: skip
def test_every_identity_field_changes_the_address(change: dict[str, Any]) -> None:
    key = PackKey(IDENTITY, ((1, 2),))
    other = PackKey(dataclasses.replace(IDENTITY, **change), ((1, 2),))
    assert other.address != key.address and other.identity.digest != IDENTITY.digest
    assert PackKey(IDENTITY, ((1, 3),)).address != key.address  # and the timesteps
    assert PackKey(IDENTITY, ((3,), (1, 2))).address != PackKey(IDENTITY, ((1, 2), (3,))).address  # and their order


@pytest.mark.parametrize("damage", ["payload", "header", "magic", "truncated", "trailing"])
def test_a_damaged_pack_raises_a_corrupt_error(tmp_path: Path, damage: str) -> None:
    key = PackKey(IDENTITY, ((1, 2),))
    path = write_pack(tmp_path, key, 200, [((1, 2), b"a" * 400)]).path
    raw = bytearray(path.read_bytes())
    if damage == "payload":
        raw[-7] ^= 0x10
    elif damage == "header":
        raw[60] ^= 0x01
    elif damage == "magic":
        raw[0] ^= 0x01
    elif damage == "truncated":
        raw = raw[:-1]
    else:
        raw += b"\0"
    path.write_bytes(bytes(raw))
    with pytest.raises(PackCorruptError):
        verify_pack(path)


def test_a_pack_truncated_while_it_is_read_is_a_corrupt_error(tmp_path: Path) -> None:
    """A pack that passed its size check when opened and then shrank (another process truncating it) fails the read
    of the plan it cut short as corrupt, never as a short buffer of pages."""
    key = PackKey(IDENTITY, ((1, 2),))
    header = write_pack(tmp_path, key, 200, [((1, 2), b"a" * 400)])
    fd = plan_packs.open_pack(header)
    try:
        os.truncate(header.path, header.file_bytes - 10)
        with pytest.raises(PackCorruptError, match=r"truncated inside plan \(1, 2\)"):
            plan_packs.read_plan_into(header, header.plans[0], memoryview(bytearray(400)), fd)
    finally:
        os.close(fd)


def test_another_format_version_is_skipped_and_never_deleted(tmp_path: Path) -> None:
    key = PackKey(IDENTITY, ((1, 2),))
    path = write_pack(tmp_path, key, 200, [((1, 2), b"a" * 400)]).path
    raw = bytearray(path.read_bytes())
    raw[8:12] = (plan_packs.FORMAT_VERSION + 1).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(PackVersionError):
        read_header(path)
    store = PackStore(tmp_path, 10**6)
    assert store.lookup(IDENTITY, (1, 2)) is None and path.exists()
    assert gc(tmp_path, 0).removed_corrupt == () and path.exists()


def test_a_reader_lands_plans_in_place_or_through_staging_and_never_reads_a_dropped_pack_again(
    tmp_path: Path,
) -> None:
    """One slab: the read lands in the slot's own memory; several (a replica's): in a staging buffer copied to each.
    After a plan fails its checksum, the pack's other plans are not read from it (rebuilt by the caller)."""
    pages = {(i, 9): bytes([i]) * 400 for i in range(3)}
    key = PackKey(IDENTITY, tuple(pages))
    store = PackStore(tmp_path, 10**6)
    assert store.write(key, 200, list(pages.items()))
    refs = [store.lookup(IDENTITY, bits) for bits in pages]
    assert all(r is not None for r in refs)
    one = torch.zeros(3, 2, 100, dtype=torch.bfloat16)
    two = [torch.zeros(3, 2, 100, dtype=torch.bfloat16) for _ in range(2)]
    copiers = [Copier(torch.device("cpu"))] * 2

    def held(t: torch.Tensor) -> bytes:
        return bytes(t.view(torch.uint8).reshape(-1).numpy())

    direct, staged = HostLanding(copiers[:1]), HostLanding(copiers, depth=2)
    with store.reader() as reader:
        for slot, ref in enumerate(refs):
            assert ref is not None
            reader.read_into(ref, direct.buffer([one[slot]]))
            assert held(one[slot]) == pages[ref.entry.bits]  # in place: there before `land`
            direct.land()
            reader.read_into(ref, staged.buffer([v[slot] for v in two]))
            assert all(held(v[slot]) == bytes(400) for v in two)  # staged: not yet
            staged.land()
            assert all(held(v[slot]) == pages[ref.entry.bits] for v in two)

    raw = bytearray(refs[0].header.path.read_bytes())  # type: ignore[union-attr]
    raw[refs[0].header.payload_offset + 5] ^= 1  # type: ignore[union-attr]
    refs[0].header.path.write_bytes(bytes(raw))  # type: ignore[union-attr]
    buf = memoryview(bytearray(400))
    with store.reader() as reader:
        with pytest.raises(PackCorruptError, match="checksum mismatch"):
            reader.read_into(refs[0], buf)  # type: ignore[arg-type]
        with pytest.raises(PackError, match="dropped earlier in this read"):
            reader.read_into(refs[1], buf)  # type: ignore[arg-type]
    assert store.stats().corrupt_packs == 1 and packs(tmp_path) == []


def test_the_store_evicts_the_least_recently_used_pack_to_keep_its_bound(tmp_path: Path) -> None:
    now = [1000.0]
    store = PackStore(tmp_path, 3 * (PAYLOAD_ALIGN + 400), clock=lambda: now[0])
    for i in range(3):
        now[0] += 1
        assert store.write(PackKey(IDENTITY, ((i, 9),)), 200, [((i, 9), bytes([i]) * 400)])
    now[0] += 1
    ref = store.lookup(IDENTITY, (0, 9))
    assert ref is not None
    got = bytearray(ref.entry.length)
    with store.reader() as reader:
        reader.read_into(ref, memoryview(got))
    assert got == b"\0" * 400
    store.touch([ref.header])  # pack 0 is now the most recent: pack 1 goes first
    now[0] += 1
    assert store.write(PackKey(IDENTITY, ((3, 9),)), 200, [((3, 9), b"\3" * 400)])
    st = store.stats()
    assert (st.packs, st.evictions) == (3, 1) and st.used_bytes <= st.capacity_bytes
    assert store.lookup(IDENTITY, (1, 9)) is None and store.lookup(IDENTITY, (0, 9)) is not None
    assert len(packs(tmp_path)) == 3
    # a restart keeps the order: the mtimes were touched
    again = PackStore(tmp_path, 2 * (PAYLOAD_ALIGN + 400))  # a smaller bound evicts at open
    assert again.stats().packs == 2 and again.lookup(IDENTITY, (2, 9)) is None
    # the CLI's helpers see the same
    assert [p.header.key.keys for p in list_packs(tmp_path, verify=True) if p.header] == [((0, 9),), ((3, 9),)]
    assert gc(tmp_path, PAYLOAD_ALIGN + 400).evicted == (tmp_path / f"{PackKey(IDENTITY, ((0, 9),)).address}.pack",)


def test_a_pack_larger_than_the_bound_is_not_written(tmp_path: Path) -> None:
    store = PackStore(tmp_path, 100)
    assert not store.write(PackKey(IDENTITY, ((1,),)), 200, [((1,), b"a" * 200)])
    assert packs(tmp_path) == [] and store.stats().write_errors == 1


# ============================================================================ the tier in the cache
def test_a_restarted_cache_reads_its_plans_from_disk_bit_exact(
    caches: Any, ref: DiffusersPages, tmp_path: Path
) -> None:
    plan_dir = tmp_path / "plans"
    first = caches(plan_dir)
    assert [t.name for t in first.tiers] == ["host", "disk", "rebuild"]
    r = stored(first, T2VA_A)
    assert (r.built_plans, r.disk_hit_plans, r.disk_stored_plans) == (A_PLANS, 0, A_PLANS)
    assert len(packs(plan_dir)) == 1 and first.stats().disk_stored_plans == A_PLANS
    r = stored(first, T2VA_A)  # slot hits: nothing rebuilt, nothing written
    assert (r.gpu_hit_plans, r.disk_stored_plans) == (A_PLANS, 0)
    first.close()

    second = caches(plan_dir)  # a restart: the slab and the host tier are empty
    r = stored(second, T2VA_A)
    assert (r.disk_hit_plans, r.built_plans, r.gpu_hit_plans, r.disk_stored_plans) == (A_PLANS, 0, 0, 0)
    assert r.disk_read_s > 0 and r.plans == A_PLANS
    st = second.stats()
    assert (st.disk_hit_plans, st.rebuild_passes, st.disk_packs) == (A_PLANS, 0, 1)
    assert st.disk_read_bytes == sum(k.width for k in group_of(T2VA_A)) * second.source.page_bytes
    assert_slots_match_reference(second, ref)
    check_invariants(second)

    r = stored(second, T2VA_B)  # B shares t = 0 with A: read from A's pack, the rest built, B's pack written
    assert (r.gpu_hit_plans, r.disk_hit_plans, r.built_plans, r.disk_stored_plans) == (1, 0, A_PLANS - 1, A_PLANS)
    assert len(packs(plan_dir)) == 2
    third = caches(plan_dir)
    r = stored(third, T2VA_B)
    assert (r.disk_hit_plans, r.built_plans) == (A_PLANS, 0)
    assert_slots_match_reference(third, ref)


def test_the_host_tier_is_asked_before_the_disk(caches: Any, tmp_path: Path) -> None:
    cache = caches(tmp_path / "plans", gpu_plans=20, host_pages=200)
    for spec in (T2VA_A, T2VA_B):
        stored(cache, spec)
    r = stored(cache, T2VA_A)  # A was evicted from the slab by B: the host holds it, and so does the disk
    assert (r.host_hit_plans, r.disk_hit_plans, r.built_plans) == (A_PLANS - 1, 0, 0)


@pytest.mark.parametrize("damage", ["flip-plan", "flip-header", "truncate"])
def test_a_damaged_pack_is_deleted_and_rebuilt_never_served(
    caches: Any, ref: DiffusersPages, tmp_path: Path, damage: str
) -> None:
    plan_dir = tmp_path / "plans"
    stored(caches(plan_dir), T2VA_A)
    [path] = packs(plan_dir)
    header = read_header(path)
    raw = bytearray(path.read_bytes())
    if damage == "flip-plan":  # a byte of the 6th plan's pages
        raw[header.payload_offset + header.plans[5].offset + 3] ^= 0x40
    elif damage == "flip-header":
        raw[PREFIX.size + 10] ^= 0x01
    else:
        raw = raw[: header.payload_offset + header.plans[10].offset + 5]
    path.write_bytes(bytes(raw))

    cache = caches(plan_dir)
    r = stored(cache, T2VA_A)
    if damage == "flip-plan":  # the plans before it were read and verified; from it on, rebuilt
        assert (r.disk_hit_plans, r.built_plans) == (5, A_PLANS - 5)
    else:  # found at the scan: never indexed
        assert (r.disk_hit_plans, r.built_plans) == (0, A_PLANS)
    assert cache.stats().disk_corrupt_packs == 1
    assert_slots_match_reference(cache, ref)  # the damaged bytes never reached a slot
    [again] = packs(plan_dir)  # deleted, then written again from the rebuilt group
    assert verify_pack(again).key == header.key and again.read_bytes() != bytes(raw)
    r = stored(caches(plan_dir), T2VA_A)
    assert (r.disk_hit_plans, r.built_plans) == (A_PLANS, 0)


def test_packs_of_other_weights_or_adapters_are_never_used_nor_deleted(
    caches: Any, source: RebuildSource, tiny_ckpt_b: Path, tmp_path: Path
) -> None:
    plan_dir = tmp_path / "plans"
    stored(caches(plan_dir), X)
    [pack_a] = packs(plan_dir)
    source_b = RebuildSource(tiny_ckpt_b, CPU)
    on_b = caches(plan_dir, src=source_b)
    x = keys_of(X)
    assert not on_b.disk.holds_all(x[:1])  # type: ignore[union-attr]
    r = stored(on_b, X)
    assert (r.disk_hit_plans, r.built_plans) == (0, len(x))
    assert pack_a.exists() and len(packs(plan_dir)) == 2  # B's own pack beside A's

    on_a = caches(plan_dir)
    disk = on_a.disk
    assert disk is not None and disk.holds_all(x)
    stored(on_a, X)
    assert not disk.holds_all([k.with_adapters("ab" * 32) for k in x[:1]])  # another modulation identity
    pages_a = {k: slot_pages(on_a, k) for k in x}
    on_a.retarget(source_b, on_a.generation + 1)  # a weight update: A's packs stop matching, and stay
    found = disk.packs.lookup(disk.identity(x[0]), x[0].bits)
    assert found is not None and found.header.path.name != pack_a.name and pack_a.exists()
    r = stored(on_a, X)
    assert (r.disk_hit_plans, r.built_plans) == (len(x), 0)  # B's pack, written by `on_b`: B's pages
    for k in x:
        assert same_bits(slot_pages(on_a, k), slot_pages(on_b, k)) and not same_bits(slot_pages(on_a, k), pages_a[k])
    on_a.retarget(source, on_a.generation + 1)  # and back: A's packs match again
    r = stored(on_a, X)
    assert (r.disk_hit_plans, r.built_plans) == (len(x), 0)
    assert all(same_bits(slot_pages(on_a, k), pages_a[k]) for k in x)


def test_eviction_keeps_the_plan_dir_under_its_bound(caches: Any, tmp_path: Path) -> None:
    plan_dir = tmp_path / "plans"
    cache = caches(plan_dir)
    stored(cache, X)
    [first] = packs(plan_dir)
    bound = 2 * first.stat().st_size + 100  # two 4-plan packs of equal size
    cache.close()
    cache = caches(plan_dir, plan_dir_max_bytes=bound)
    for spec in (Y, Z):
        stored(cache, spec)
        st = cache.stats()
        assert st.disk_used_bytes <= bound and sum(p.stat().st_size for p in packs(plan_dir)) <= bound
    assert (cache.stats().disk_evictions, len(packs(plan_dir))) == (1, 2)
    assert not first.exists()  # X's pack, the least recently used


def test_a_read_only_shared_dir_serves_a_second_cache_which_never_writes(
    caches: Any, ref: DiffusersPages, tmp_path: Path
) -> None:
    plan_dir = tmp_path / "plans"
    writer = caches(plan_dir)
    stored(writer, T2VA_A)
    before = listing(plan_dir)

    reader = caches(plan_dir, plan_dir_read_only=True)
    assert reader.disk is not None
    reader.disk.packs.rescan_s = 0  # rescan on every miss (default: at most every 2 s)
    r = stored(reader, T2VA_A)
    assert (r.disk_hit_plans, r.built_plans, r.disk_stored_plans) == (A_PLANS, 0, 0)
    assert_slots_match_reference(reader, ref)
    st = reader.stats()
    assert (st.disk_read_only, st.disk_stored_plans) == (True, 0)

    stored(writer, T2VA_B)  # the writer adds B's pack; the reader finds it at its next miss
    reader.invalidate()
    r = stored(reader, T2VA_B)
    assert (r.disk_hit_plans, r.built_plans) == (A_PLANS, 0)
    reader.invalidate()
    r = stored(reader, X)  # built here, never written here
    assert r.built_plans == len(distinct_keys(keys_of(X))) - 1 and r.disk_stored_plans == 0
    after = listing(plan_dir)
    assert {n: v for n, v in after.items() if n in before} == before  # nothing written, touched or deleted
    assert len(after) == len(before) + 1  # B's pack, the writer's

    [path_a] = [p for p in packs(plan_dir) if p.name in before]
    header = read_header(path_a)
    raw = bytearray(path_a.read_bytes())
    raw[header.payload_offset + header.plans[1].offset + 1] ^= 0x01  # A's second plan (t = 0 is in B's pack too)
    path_a.write_bytes(bytes(raw))
    damaged = listing(plan_dir)
    reader.invalidate()
    r = stored(reader, T2VA_A)  # the second plan fails its checksum: it and the rest rebuilt; the pack left, unused
    assert (r.disk_hit_plans, r.built_plans) == (1, A_PLANS - 1)
    assert listing(plan_dir) == damaged and reader.stats().disk_corrupt_packs == 1
    assert_slots_match_reference(reader, ref)


def test_a_full_disk_never_fails_a_request(
    caches: Any, ref: DiffusersPages, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    plan_dir = tmp_path / "plans"
    cache = caches(plan_dir)

    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(plan_packs, "_os_write", full)
    with caplog.at_level(logging.WARNING, logger="ditruntime.plan_packs"):
        for spec in (X, Y):
            r = stored(cache, spec)
            assert r.built_plans > 0
    assert_slots_match_reference(cache, ref)
    st = cache.stats()
    assert (st.disk_write_errors, st.disk_packs, st.disk_stored_plans) == (2, 0, 0)
    assert list(plan_dir.iterdir()) == []  # no partial file left
    assert len([r for r in caplog.records if "ENOSPC" in r.getMessage()]) == 1  # logged once, then counted
    monkeypatch.undo()
    stored(cache, Z)
    assert cache.stats().disk_packs == 1


def test_a_missing_read_only_dir_is_refused_naming_the_flag(caches: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--plan-dir .*no such directory"):
        caches(tmp_path / "absent", plan_dir_read_only=True)
    with pytest.raises(ValueError, match="--plan-dir-read-only needs --plan-dir"):
        CacheConfig(plan_dir_read_only=True)
    made = tmp_path / "a" / "b"
    caches(made)
    assert made.is_dir() and (made.stat().st_mode & 0o777) == 0o700
