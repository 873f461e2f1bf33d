"""Plan-cache core scenarios (no generation): slots, LRU, leases, errors, slot table, shm files.

Every scenario drives `PlanCache.prepare/release` directly with plan keys from `ScheduleSpec`
and compares the whole observable state (stats, resident keys in LRU order, host groups,
live leases, slot-table rows) with what DESIGN §3-§4 says it must be.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ditcore.checkpoint import CheckpointReader, read_shard_header, write_checkpoint
from ditcore.plans import PlanKey, f32_bits
from ditruntime.slab import (
    COL_GENERATION,
    COL_LENGTH,
    COL_STATE,
    EMPTY,
    READY,
    ROW_WORDS,
    map_slab,
)
from plancache_service.cache import MAX_KEYS, PlanCache
from plancache_service.errors import (
    CacheBusyError,
    CheckpointChangedError,
    GenerationMismatchError,
    InvalidPlanRequestError,
    PlanCacheError,
    PlanCapacityError,
    RebuildError,
    SlabBusyError,
    UnknownLeaseError,
)
from plancache_service.rebuild import RebuildSource

from plancache_helpers import (  # isort: skip
    CPU,
    PAGE_BYTES,
    T2VA_A,
    T2VA_B,
    TINY,
    Reference,
    assert_slots_match_reference,
    assert_unchanged,
    check_invariants,
    expect,
    group_of,
    keys_of,
    make_cache,
    pages_needed,
    prepare,
    run,
    same_bits,
    snapshot,
    t2v,
    t2va,
)

# Three 4-step t2v schedules: 4 width-1 plans each; all three share the first plan (t=1000).
X, Y, Z = t2v(4, 2.0), t2v(4, 4.0), t2v(4, 8.0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(TINY, tmp_path_factory.mktemp("pc_core") / "ckpt", seed=0, shards=2)


@pytest.fixture(scope="module")
def source(ckpt: Path) -> RebuildSource:
    return RebuildSource(ckpt, CPU)


@pytest.fixture(scope="module")
def ref(ckpt: Path, source: RebuildSource) -> Reference:
    return Reference(ckpt, source)


MakeCache = Callable[..., PlanCache]


@pytest.fixture
def make(source: RebuildSource, tmp_path: Path) -> Iterator[MakeCache]:
    """make(gpu_plans=..., plan_width=2, host_pages=0, generation=0) -> a cache closed at teardown."""
    caches: list[PlanCache] = []

    def factory(**kw: object) -> PlanCache:
        src = kw.pop("source", source)
        cache = make_cache(src, shm_dir=tmp_path, **kw)  # type: ignore[arg-type]
        caches.append(cache)
        return cache

    yield factory
    for c in caches:
        c.close()


def test_schedules_used_here_have_the_shapes_the_scenarios_assume() -> None:
    a, b = set(keys_of(T2VA_A)), set(keys_of(T2VA_B))
    assert len(a) == len(b) == 50
    assert a & b == {PlanKey((f32_bits(1000.0),))}
    assert pages_needed(a) == 1 + 49 * 2
    for s in (X, Y, Z):
        assert len(set(keys_of(s))) == 4 and all(k.width == 1 for k in keys_of(s))
    assert set(keys_of(X)) & set(keys_of(Y)) == set(keys_of(X)) & set(keys_of(Z)) == {keys_of(X)[0]}


# ============================================================================ 1. headline
@pytest.mark.parametrize("host_pages", [0, 200])
def test_alternating_t2va_schedules_rebuild_only_on_first_two_requests(
    make: MakeCache, ref: Reference, host_pages: int
) -> None:
    cache = make(gpu_plans=100, host_pages=host_pages)
    reports = [run(cache, spec).report for spec in (T2VA_A, T2VA_B) * 3]

    assert (reports[0].built_plans, reports[0].gpu_hit_plans, reports[0].host_hit_plans) == (50, 0, 0)
    assert (reports[1].built_plans, reports[1].gpu_hit_plans, reports[1].host_hit_plans) == (49, 1, 0)
    assert reports[0].rebuild_s > 0 and reports[1].rebuild_s > 0
    for r in reports[2:]:
        assert (r.built_plans, r.gpu_hit_plans, r.host_hit_plans) == (0, 50, 0)
        assert r.rebuild_s == 0 and r.swap_in_s == 0
    assert [r.host_stored for r in reports] == [host_pages > 0] * 6

    expect(
        cache,
        resident=set(keys_of(T2VA_A)) | set(keys_of(T2VA_B)),
        leases=0,
        host_groups=[group_of(T2VA_A), group_of(T2VA_B)] if host_pages else [],
        built_plans=99,
        rebuild_passes=2,
        slot_hit_plans=1 + 4 * 50,
        host_hit_plans=0,
        slot_evictions=0,
        prepares=6,
        failed_prepares=0,
    )
    assert_slots_match_reference(cache, ref)


# ============================================================================ 2. host tier swap-in
def test_slab_of_one_schedule_plus_host_tier_swaps_in_instead_of_rebuilding(make: MakeCache, ref: Reference) -> None:
    both = set(keys_of(T2VA_A)) | set(keys_of(T2VA_B))
    cache = make(gpu_plans=50, host_pages=pages_needed(both))  # 197 pages: both groups fit
    reports = [run(cache, spec).report for spec in (T2VA_A, T2VA_B) * 3]

    assert (reports[0].built_plans, reports[0].host_hit_plans) == (50, 0)
    assert (reports[1].built_plans, reports[1].host_hit_plans, reports[1].gpu_hit_plans) == (49, 0, 1)
    for r in reports[2:]:
        assert r.built_plans == 0 and r.rebuild_s == 0
        assert (r.host_hit_plans, r.gpu_hit_plans) == (49, 1)  # t=1000 stays in its slot
        assert r.swap_in_s > 0
        assert r.host_stored
    st = cache.stats()
    assert st.swap_in_s > 0
    expect(
        cache,
        resident=set(keys_of(T2VA_B)),
        leases=0,
        host_groups=[group_of(T2VA_A), group_of(T2VA_B)],
        built_plans=99,
        rebuild_passes=2,
        host_hit_plans=4 * 49,
        swap_in_bytes=4 * 49 * 2 * PAGE_BYTES,
        slot_evictions=5 * 49,
        host_group_evictions=0,
        host_pressure_skips=0,
        host_used_bytes=pages_needed(both) * PAGE_BYTES,
    )
    # swapped-in slots and host pages are the real plans, bit for bit
    assert_slots_match_reference(cache, ref)
    for k in cache.host.plan_keys():
        assert torch.equal(torch.stack(cache.host.page_rows(k)), ref.pages(k))


# ============================================================================ 3. LRU
@pytest.mark.parametrize("touch_x", [True, False])
def test_lru_evicts_least_recently_used_and_pure_hits_touch(make: MakeCache, touch_x: bool) -> None:
    x, y, z = keys_of(X), keys_of(Y), keys_of(Z)
    cache = make(gpu_plans=7)  # exactly X u Y
    run(cache, X)
    run(cache, Y)
    # Y's hit on t=1000 moved it to the end before Y's new plans were published
    expect(cache, resident=[*x[1:], x[0], *y[1:]], built_plans=7, slot_hit_plans=1)

    if touch_x:
        r = run(cache, X).report
        assert (r.gpu_hit_plans, r.built_plans, r.host_hit_plans) == (4, 0, 0)
        rk = cache.resident_keys()
        assert rk[:3] == y[1:] and set(rk[3:]) == set(x)

    r = run(cache, Z).report
    assert (r.gpu_hit_plans, r.built_plans) == (1, 3)
    victims = y[1:] if touch_x else x[1:]
    survivors = x if touch_x else [x[0], *y[1:]]
    expect(cache, resident=set(survivors) | set(z), slot_evictions=3, leases=0)
    assert not set(victims) & set(cache.resident_keys())


# ============================================================================ 4. leases
def test_leased_plans_are_never_evicted_with_two_concurrent_leases(make: MakeCache, ref: Reference) -> None:
    x, y = keys_of(X), keys_of(Y)
    cache = make(gpu_plans=8)  # X u Y = 7 plans, one slot free
    la = prepare(cache, X, owner="a")
    lb = prepare(cache, Y, owner="b")
    expect(cache, resident=set(x) | set(y), leases={la.lease_id, lb.lease_id}, slots_leased=7)

    before = snapshot(cache)
    with pytest.raises(SlabBusyError, match="retry"):
        prepare(cache, Z, owner="c")  # needs 3 new slots: 1 free, 0 evictable
    assert_unchanged(cache, before)
    check_invariants(cache)

    cache.release(lb.lease_id)
    lz = prepare(cache, Z, owner="c")
    assert (lz.report.gpu_hit_plans, lz.report.built_plans) == (1, 3)
    resident = set(cache.resident_keys())
    evicted = (set(x) | set(y)) - resident
    assert len(evicted) == 2 and evicted <= set(y[1:])  # free slot first, then Y's oldest
    assert set(x) <= resident  # lease A's plans all survive
    expect(cache, leases={la.lease_id, lz.lease_id}, slot_evictions=2, slots_leased=7)
    assert_slots_match_reference(cache, ref, x)


def test_a_plan_leased_twice_stays_pinned_until_both_release(make: MakeCache) -> None:
    cache = make(gpu_plans=4)
    l1 = prepare(cache, X)
    l2 = prepare(cache, X)
    assert l2.report.gpu_hit_plans == 4 and l1.slots == l2.slots
    cache.release(l1.lease_id)
    before = snapshot(cache)
    with pytest.raises(SlabBusyError):
        prepare(cache, Y)
    assert_unchanged(cache, before)
    expect(cache, leases={l2.lease_id}, slots_leased=4)
    cache.release(l2.lease_id)
    assert run(cache, Y).report.built_plans == 3
    expect(cache, resident=set(keys_of(Y)), slot_evictions=3, slots_leased=0)


def test_repeated_keys_in_one_request_share_a_slot(make: MakeCache) -> None:
    k = keys_of(X)
    cache = make(gpu_plans=2)
    lease = prepare(cache, [k[0], k[1], k[0], k[1], k[1]])  # 5 steps, 2 distinct plans
    assert lease.report.built_plans == 2
    assert lease.slots[0] == lease.slots[2] and lease.slots[1] == lease.slots[3] == lease.slots[4]
    expect(cache, resident={k[0], k[1]}, slots_leased=2, leases=1)


# ============================================================================ 5. host tier through the cache
def test_shared_plan_survives_eviction_of_one_group(make: MakeCache, ref: Reference) -> None:
    x, y, z = keys_of(X), keys_of(Y), keys_of(Z)
    shared = x[0]
    cache = make(gpu_plans=4, host_pages=7)  # host: X and Y (7 pages, t=1000 stored once)
    run(cache, X)
    run(cache, Y)
    expect(cache, host_groups=[group_of(X), group_of(Y)], host_used_bytes=7 * PAGE_BYTES)

    run(cache, Z)  # needs 3 new pages: the LRU group X is evicted
    expect(cache, host_groups=[group_of(Y), group_of(Z)], host_group_evictions=1, host_used_bytes=7 * PAGE_BYTES)
    assert cache.host.holds(shared)
    assert cache.host.holds_all(y) and cache.host.holds_all(z)
    assert not any(cache.host.holds(k) for k in x[1:])
    assert torch.equal(torch.stack(cache.host.page_rows(shared)), ref.pages(shared))

    r = run(cache, Y).report  # slab holds Z; Y's 3 missing plans all come from the host
    assert (r.host_hit_plans, r.built_plans, r.gpu_hit_plans) == (3, 0, 1)
    assert_slots_match_reference(cache, ref)


def test_group_larger_than_host_tier_is_skipped_not_an_error(make: MakeCache, ref: Reference) -> None:
    cache = make(gpu_plans=4, host_pages=3)  # X needs 4 pages
    for n in (1, 2):
        lease = prepare(cache, X)
        assert lease.report.host_stored is False
        cache.release(lease.lease_id)
        expect(cache, host_groups=[], host_pressure_skips=n, host_used_bytes=0, host_group_evictions=0)
    run(cache, Y)  # evicts X[1:]; X is not on the host, so X rebuilds
    r = run(cache, X).report
    assert (r.built_plans, r.host_hit_plans) == (3, 0)
    assert_slots_match_reference(cache, ref)


def test_host_admission_is_all_or_nothing(make: MakeCache) -> None:
    w = t2va(4, 5.0, 3.0)  # t=1000 (width 1, shared with X) + three width-2 plans = 6 new pages
    cache = make(gpu_plans=8, host_pages=5)
    run(cache, X)
    expect(cache, host_groups=[group_of(X)], host_used_bytes=4 * PAGE_BYTES)
    host_before = (cache.host.groups(), cache.host.plan_keys(), cache.host.used_pages, cache.host.buffer.clone())

    lease = run(cache, w)  # 6 new pages > 1 free + X's 3 evictable: skipped, X kept
    assert lease.report.host_stored is False
    assert cache.host.groups() == host_before[0]
    assert cache.host.plan_keys() == host_before[1]
    assert cache.host.used_pages == host_before[2]
    assert same_bits(cache.host.buffer, host_before[3])
    expect(cache, host_pressure_skips=1, host_group_evictions=0)


def test_swap_in_only_when_host_holds_every_missing_plan(make: MakeCache, ref: Reference) -> None:
    x, z = keys_of(X), keys_of(Z)
    w = t2va(4, 5.0, 3.0)
    cache = make(gpu_plans=4, host_pages=5)
    run(cache, X)  # host: [X]
    r = run(cache, w).report  # evicts x1..x3 from the slab; W (6 new pages) does not fit the host
    assert (r.built_plans, r.host_stored) == (3, False)
    expect(cache, host_groups=[group_of(X)], host_hit_plans=0)

    # x1, x2 are on the host, z1 is not: one rebuild pass for all three, no partial swap-in
    q = [x[1], x[2], z[1]]
    r = run(cache, q).report
    assert (r.built_plans, r.host_hit_plans, r.gpu_hit_plans) == (3, 0, 0)
    expect(cache, host_hit_plans=0, swap_in_bytes=0, rebuild_passes=3, host_groups=[group_of(X), tuple(q)])
    for k in (x[1], x[2]):  # rebuilt pages are bit-identical to the host copies
        assert torch.equal(cache.slab[cache.slot_of(k), :1], torch.stack(cache.host.page_rows(k)))

    # control: X's missing plans (t=1000 and x3) are all on the host -> swap-in, no rebuild
    r = run(cache, X).report
    assert (r.host_hit_plans, r.built_plans, r.gpu_hit_plans) == (2, 0, 2)
    expect(cache, host_hit_plans=2, swap_in_bytes=2 * PAGE_BYTES, rebuild_passes=3)
    assert_slots_match_reference(cache, ref)


def test_swap_in_refreshes_the_host_groups_it_read_from(make: MakeCache) -> None:
    x = keys_of(X)
    cache = make(gpu_plans=4, host_pages=10)
    run(cache, X)
    run(cache, Y)  # slab: Y; host: [X, Y]
    q = x[1:]  # a different group whose plans are all on the host, inside X's group
    r = run(cache, q).report
    assert (r.host_hit_plans, r.built_plans) == (3, 0)
    expect(cache, host_groups=[group_of(Y), group_of(X), tuple(q)], host_used_bytes=7 * PAGE_BYTES)
    run(cache, Z)  # 3 new pages, 3 free: nothing evicted
    run(cache, t2v(4, 16.0))  # 3 more pages: the least recently used group, Y, goes first
    assert cache.host.groups()[0] == group_of(X) and group_of(Y) not in cache.host.groups()
    check_invariants(cache)


def test_host_tier_stays_within_cap_under_random_traffic(make: MakeCache, ref: Reference) -> None:
    import random

    rng = random.Random(1234)
    specs = [t2v(4, 2.0), t2v(5, 3.0), t2v(6, 8.0), t2va(3, 5.0, 3.0), t2va(4, 7.0, 2.0), t2va(5, 5.0, 1.5)]
    specs += [t2va(8, 5.0, 3.0), t2va(9, 7.0, 2.0)]  # 15 pages (evicts everything else), 17 (never fits)
    cache = make(gpu_plans=12, host_pages=16)
    cap = cache.stats().host_capacity_bytes
    assert cap == 16 * PAGE_BYTES
    live: list[int] = []
    busy = prepares = 0
    for _ in range(200):
        if live and (len(live) >= 2 or rng.random() < 0.4):
            cache.release(live.pop(rng.randrange(len(live))))
        else:
            spec = rng.choice(specs)
            before = snapshot(cache)
            try:
                lease = prepare(cache, spec, owner=f"o{rng.randrange(3)}")
            except SlabBusyError:
                assert_unchanged(cache, before)
                busy += 1
            else:
                prepares += 1
                live.append(lease.lease_id)
                if pages_needed(group_of(spec)) > 16:
                    assert not lease.report.host_stored
        st = cache.stats()
        assert st.host_used_bytes <= cap
        check_invariants(cache)
    st = cache.stats()
    assert st.prepares == prepares and prepares > 80
    assert st.host_hit_plans > 0 and st.host_group_evictions > 0 and st.host_pressure_skips > 0
    assert st.slot_evictions > 0 and busy > 0
    for lid in live:
        cache.release(lid)
    assert_slots_match_reference(cache, ref)
    for k in cache.host.plan_keys():
        assert torch.equal(torch.stack(cache.host.page_rows(k)), ref.pages(k))


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


def test_retarget_drops_plans_and_bumps_generation(make: MakeCache, ckpt: Path, tmp_path: Path) -> None:
    cache = make(gpu_plans=8, generation=1)
    run(cache, X)
    lease = prepare(cache, Y)
    other = RebuildSource(ckpt, CPU)
    with pytest.raises(CacheBusyError):
        cache.retarget(other, 2)
    cache.release(lease.lease_id)

    bad_cfg = TINY.replace(num_layers=3)
    bad = RebuildSource(write_checkpoint(bad_cfg, tmp_path / "bad", seed=0), CPU)
    before = snapshot(cache)
    with pytest.raises(PlanCacheError, match="config differs"):
        cache.retarget(bad, 2)
    assert_unchanged(cache, before)

    cache.retarget(other, 2)
    expect(cache, resident=[], generation=2)
    with pytest.raises(GenerationMismatchError):
        cache.prepare(1, keys_of(X), "old")
    lease = cache.prepare(2, keys_of(X), "new")
    assert lease.report.built_plans == 4
    assert all(int(cache.table[s, COL_GENERATION]) == 2 for s in lease.slots)
    check_invariants(cache)


# ============================================================================ 7. failed rebuilds
def _fail_nth_adaln_read(monkeypatch: pytest.MonkeyPatch, n: int) -> list[str]:
    calls: list[str] = []
    real = CheckpointReader.adaln_layer

    def flaky(self: CheckpointReader, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(prefix)
        if len(calls) == n:
            raise OSError(5, "injected I/O error", prefix)
        return real(self, prefix)

    monkeypatch.setattr(CheckpointReader, "adaln_layer", flaky)
    return calls


def test_failed_rebuild_leaves_cache_consistent_and_retry_works(
    make: MakeCache, ref: Reference, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, y = keys_of(X), keys_of(Y)
    for k in set(x) | set(y):
        ref.pages(k)  # build the reference before reads are sabotaged
    cache = make(gpu_plans=7)  # exactly X u Y: a leaked slot would force an eviction on retry
    run(cache, X)
    x_pages = cache.slab.clone()

    with monkeypatch.context() as m:
        calls = _fail_nth_adaln_read(m, 2)
        with pytest.raises(RebuildError) as ei:
            prepare(cache, Y)
        assert len(calls) == 2
    assert str(ckpt) in str(ei.value) and "injected I/O error" in str(ei.value)
    assert isinstance(ei.value.__cause__, OSError)

    expect(cache, resident=set(x), leases=0, slots_leased=0, failed_prepares=1, prepares=1, built_plans=4)
    for k in x:
        s = cache.slot_of(k)
        assert int(cache.table[s, COL_STATE]) == READY
        assert same_bits(cache.slab[s], x_pages[s])
    assert_slots_match_reference(cache, ref, x)

    r = run(cache, Y).report  # the same request, now that reads work again
    assert (r.built_plans, r.gpu_hit_plans) == (3, 1)
    expect(cache, resident=set(x) | set(y), slot_evictions=0, failed_prepares=1, prepares=2)
    assert_slots_match_reference(cache, ref)


@pytest.mark.parametrize("damage", ["truncate", "delete", "overwrite"])
def test_damaged_shard_fails_prepare_naming_the_file_and_recovers(make: MakeCache, tmp_path: Path, damage: str) -> None:
    ckpt = write_checkpoint(TINY, tmp_path / "ckpt", seed=0, shards=2)
    source = RebuildSource(ckpt, CPU)
    ref = Reference(ckpt, source)
    x, y = keys_of(X), keys_of(Y)
    for k in set(x) | set(y):
        ref.pages(k)
    cache = make(gpu_plans=7, source=source)
    run(cache, X)

    shard = ckpt / source.info.weight_map["final_layer.adaln_proj.weight"]
    saved = tmp_path / "saved.safetensors"
    shutil.copy2(shard, saved)
    if damage == "truncate":
        with open(shard, "r+b") as fh:
            fh.truncate(shard.stat().st_size - 64)
    elif damage == "overwrite":  # same size and header, different weights at the tensor's start
        hdr = read_shard_header(shard)
        at = len(hdr.header_bytes) + hdr.tensors["final_layer.adaln_proj.weight"].begin
        with open(shard, "r+b") as fh:
            fh.seek(at)
            old = fh.read(16)
            fh.seek(at)
            fh.write(bytes(b ^ 0x55 for b in old))
        assert shard.stat().st_size == saved.stat().st_size
    else:
        shard.unlink()

    with pytest.raises(RebuildError) as ei:
        prepare(cache, Y)
    assert isinstance(ei.value, CheckpointChangedError)
    assert shard.name in str(ei.value)
    expect(cache, resident=set(x), leases=0, slots_leased=0, failed_prepares=1, built_plans=4)
    assert_slots_match_reference(cache, ref, x)

    shutil.copy2(saved, shard)
    r = run(cache, Y).report
    assert (r.built_plans, r.gpu_hit_plans) == (3, 1)
    expect(cache, resident=set(x) | set(y), slot_evictions=0, failed_prepares=1)
    assert_slots_match_reference(cache, ref)


# ============================================================================ 8. rejections
def _bad_requests() -> list[tuple[str, list[PlanKey], int, type[Exception], list[str]]]:
    good = keys_of(X)
    inf, nan, ninf = PlanKey((0x7F800000,)), PlanKey((0x7FC00000,)), PlanKey((0xFF800000,))
    return [
        (
            "too many plans",
            keys_of(t2v(9, 3.0)),
            3,
            PlanCapacityError,
            ["9 distinct plans", "at most 8", "--gpu-plans"],
        ),
        ("inf", [*good[:2], inf, good[3]], 3, InvalidPlanRequestError, ["plan_keys[2]", "non-finite"]),
        ("nan", [nan], 3, InvalidPlanRequestError, ["plan_keys[0]", "non-finite"]),
        ("-inf", [good[0], ninf], 3, InvalidPlanRequestError, ["plan_keys[1]"]),
        ("empty", [], 3, InvalidPlanRequestError, ["plan_keys", "at least one"]),
        ("repeated timestep", [PlanKey((good[1].bits[0], good[1].bits[0]))], 3, InvalidPlanRequestError, ["distinct"]),
        ("too many keys", [good[0]] * (MAX_KEYS + 1), 3, InvalidPlanRequestError, [str(MAX_KEYS)]),
        ("old generation", good, 2, GenerationMismatchError, ["serves generation 3", "sent 2"]),
        ("new generation", good, 4, GenerationMismatchError, ["serves generation 3", "sent 4"]),
    ]


@pytest.mark.parametrize("case", _bad_requests(), ids=lambda c: c[0])
def test_rejected_requests_leave_every_plan_in_place(
    make: MakeCache, case: tuple[str, list[PlanKey], int, type[Exception], list[str]]
) -> None:
    _, keys, generation, error, words = case
    cache = make(gpu_plans=8, host_pages=8, generation=3)
    run(cache, X)
    held = prepare(cache, Y)
    before = snapshot(cache)
    with pytest.raises(error) as ei:
        cache.prepare(generation, keys, "bad")
    for w in words:
        assert w in str(ei.value)
    if isinstance(ei.value, GenerationMismatchError):
        assert (ei.value.current_generation, ei.value.caller_generation) == (3, generation)
    assert_unchanged(cache, before)
    if generation == cache.generation:
        with pytest.raises(error):
            cache.check_request(keys)
        assert_unchanged(cache, before)
    cache.release(held.lease_id)
    assert run(cache, Z).report.built_plans == 3  # still fully usable


def test_plan_wider_than_slot_is_rejected_naming_plan_width(make: MakeCache) -> None:
    cache = make(gpu_plans=8, plan_width=1, host_pages=4)
    run(cache, X)
    before = snapshot(cache)
    with pytest.raises(PlanCapacityError) as ei:
        prepare(cache, t2va(4, 5.0, 3.0))
    msg = str(ei.value)
    assert "--plan-width" in msg and "plan_keys[1]" in msg and "at most 1" in msg
    assert_unchanged(cache, before)
    # the same task with equal shifts has width-1 plans and is fine
    assert run(cache, t2va(4, 5.0, 5.0)).report.built_plans == 3


def test_capacity_counts_distinct_plans_not_steps(make: MakeCache) -> None:
    cache = make(gpu_plans=4)
    keys = keys_of(X) * 3  # 12 steps, 4 distinct plans
    lease = prepare(cache, keys)
    assert lease.report.built_plans == 4 and len(lease.slots) == 12
    check_invariants(cache)


# ============================================================================ 9. slot table
def test_slot_table_rows_describe_leased_plans_and_clear_on_invalidate(make: MakeCache) -> None:
    cache = make(gpu_plans=6, generation=5)
    spec = t2va(4, 5.0, 3.0)
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
        for p in paths:
            assert p.parent == shm_dir
            assert os.stat(p).st_mode & 0o777 == 0o600
        assert os.stat(paths[0]).st_size == desc.slab_bytes == cache.slab.numel() * cache.slab.element_size()
        assert os.stat(paths[1]).st_size == desc.table_bytes
    finally:
        cache.close()
    assert not any(p.exists() for p in paths)
    cache.close()  # idempotent


def test_map_slab_gives_read_only_views_of_the_live_slab(make: MakeCache) -> None:
    cache = make(gpu_plans=6)
    desc = cache.memory.descriptor
    slab, table, maps = map_slab(desc)
    run(cache, t2va(4, 5.0, 3.0))  # written after mapping: the views are shared, not copies
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
    with pytest.raises(ValueError, match="file is"):
        map_slab(bigger)


# ============================================================================ 11. releases
def test_release_owner_and_unknown_leases(make: MakeCache) -> None:
    cache = make(gpu_plans=10)
    a1 = prepare(cache, X, owner="a")
    a2 = prepare(cache, Y, owner="a")
    b1 = prepare(cache, Z, owner="b")
    expect(cache, leases=3, slots_leased=10)
    assert cache.release_owner("a") == 2
    expect(cache, leases={b1.lease_id}, slots_leased=4, resident=10)
    assert cache.release_owner("a") == 0
    assert cache.release_owner("nobody") == 0
    for lid in (a1.lease_id, a2.lease_id, 999):
        with pytest.raises(UnknownLeaseError, match=str(lid)):
            cache.release(lid)
    assert cache.release(b1.lease_id) == b1
    with pytest.raises(UnknownLeaseError):
        cache.release(b1.lease_id)
    expect(cache, leases=0, slots_leased=0, resident=10)


def test_concurrent_prepares_and_releases_keep_the_cache_consistent(make: MakeCache, ref: Reference) -> None:
    import random
    import threading

    specs = [X, Y, Z, t2va(3, 5.0, 3.0), t2va(4, 7.0, 2.0)]
    cache = make(gpu_plans=10, host_pages=12)
    errors: list[BaseException] = []
    done = {"ok": 0, "busy": 0}
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(15):
                try:
                    lease = prepare(cache, rng.choice(specs), owner=f"w{seed}")
                except SlabBusyError:
                    with lock:
                        done["busy"] += 1
                    continue
                for k, s in zip(lease.keys, lease.slots, strict=True):  # leased slots stay put
                    assert int(cache.table[s, COL_STATE]) == READY
                    assert tuple(int(v) for v in cache.table[s, ROW_WORDS : ROW_WORDS + k.width]) == k.bits
                    assert torch.equal(cache.slab[s, : k.width], ref.pages(k))
                cache.release(lease.lease_id)
                with lock:
                    done["ok"] += 1
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    for s in specs:
        for k in keys_of(s):
            ref.pages(k)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors, errors[0]
    assert done["ok"] + done["busy"] == 45 and done["ok"] > 0
    expect(cache, leases=0, slots_leased=0, prepares=done["ok"], failed_prepares=0)
    assert_slots_match_reference(cache, ref)
