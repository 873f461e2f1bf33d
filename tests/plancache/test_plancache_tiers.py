"""Plan-cache scenarios across the tiers: slot hits, host-tier swap-in and admission, rebuild
passes, and the ordered tier list itself.

Every scenario drives `PlanCache.prepare/release` directly with the plan keys of real MiniMax-H3
t2va schedules and compares the whole observable state (stats, resident keys in LRU order, host
groups, live leases, slot-table rows) with docs/architecture.md, "Plans, slots, pages and groups".
Pages are compared with diffusers' own adaln_proj / norm_out.linear outputs (`ref`).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from ditcore.plans import PlanKey
from ditcore.report import CacheReport
from plancache_service.errors import (
    SlabBusyError,
)
from plancache_service.rebuild import RebuildSource
from plancache_service.tiers import NOT_KEPT, CacheCounters, SlabPages, Tier, TierFill, TierStore

from plancache_helpers import (  # isort: skip
    PAGE_BYTES,
    T2VA_A,
    T2VA_B,
    X,
    Y,
    Z,
    DiffusersPages,
    MakeCache,
    assert_host_matches_reference,
    assert_slots_match_reference,
    assert_unchanged,
    check_invariants,
    expect,
    group_of,
    keys_of,
    pages_needed,
    prepare,
    run,
    same_bits,
    sched,
    snapshot,
)


def test_schedules_used_here_have_the_shapes_the_scenarios_assume() -> None:
    a, b = set(keys_of(T2VA_A)), set(keys_of(T2VA_B))
    assert len(a) == len(b) == 20 == len(keys_of(T2VA_A))
    assert a & b == {PlanKey.from_timesteps(0.0)} == {keys_of(T2VA_A)[0]}  # t = 0 for video and audio
    assert pages_needed(a) == 1 + 19 * 2 and all(k.width == 2 for k in keys_of(T2VA_A)[1:])
    for s in (X, Y, Z):
        assert len(set(keys_of(s))) == 4 and all(k.width == 1 for k in keys_of(s))
    assert set(keys_of(X)) & set(keys_of(Y)) == set(keys_of(X)) & set(keys_of(Z)) == {keys_of(X)[0]}


# ============================================================================ 1. headline
@pytest.mark.parametrize("host_pages", [0, 100])
def test_alternating_t2va_schedules_rebuild_only_on_first_two_requests(
    make: MakeCache, ref: DiffusersPages, host_pages: int
) -> None:
    cache = make(gpu_plans=48, host_pages=host_pages)
    reports = [run(cache, spec).report for spec in (T2VA_A, T2VA_B) * 3]

    assert (reports[0].built_plans, reports[0].gpu_hit_plans, reports[0].host_hit_plans) == (20, 0, 0)
    assert (reports[1].built_plans, reports[1].gpu_hit_plans, reports[1].host_hit_plans) == (19, 1, 0)
    assert reports[0].rebuild_s > 0 and reports[1].rebuild_s > 0
    for r in reports[2:]:
        assert (r.built_plans, r.gpu_hit_plans, r.host_hit_plans) == (0, 20, 0)
        assert r.rebuild_s == 0 and r.swap_in_s == 0
    assert [r.host_stored for r in reports] == [host_pages > 0] * 6

    expect(
        cache,
        resident=set(keys_of(T2VA_A)) | set(keys_of(T2VA_B)),
        leases=0,
        host_groups=[group_of(T2VA_A), group_of(T2VA_B)] if host_pages else [],
        built_plans=39,
        rebuild_passes=2,
        slot_hit_plans=1 + 4 * 20,
        host_hit_plans=0,
        slot_evictions=0,
        prepares=6,
        failed_prepares=0,
    )
    assert_slots_match_reference(cache, ref)


# ============================================================================ 2. host tier swap-in
def test_slab_of_one_schedule_plus_host_tier_swaps_in_instead_of_rebuilding(
    make: MakeCache, ref: DiffusersPages
) -> None:
    both = set(keys_of(T2VA_A)) | set(keys_of(T2VA_B))
    cache = make(gpu_plans=20, host_pages=pages_needed(both))  # 77 pages: both groups fit
    reports = [run(cache, spec).report for spec in (T2VA_A, T2VA_B) * 3]

    assert (reports[0].built_plans, reports[0].host_hit_plans) == (20, 0)
    assert (reports[1].built_plans, reports[1].host_hit_plans, reports[1].gpu_hit_plans) == (19, 0, 1)
    for r in reports[2:]:
        assert r.built_plans == 0 and r.rebuild_s == 0
        assert (r.host_hit_plans, r.gpu_hit_plans) == (19, 1)  # t = 0 stays in its slot
        assert r.swap_in_s > 0
        assert r.host_stored
    st = cache.stats()
    assert st.swap_in_s > 0
    expect(
        cache,
        resident=set(keys_of(T2VA_B)),
        leases=0,
        host_groups=[group_of(T2VA_A), group_of(T2VA_B)],
        built_plans=39,
        rebuild_passes=2,
        host_hit_plans=4 * 19,
        swap_in_bytes=4 * 19 * 2 * PAGE_BYTES,
        slot_evictions=5 * 19,
        host_group_evictions=0,
        host_pressure_skips=0,
        host_used_bytes=pages_needed(both) * PAGE_BYTES,
    )
    # swapped-in slots and host pages are diffusers' rows, bit for bit
    assert_slots_match_reference(cache, ref)
    assert_host_matches_reference(cache, ref)


# ============================================================================ 5. host tier through the cache
def test_shared_plan_survives_eviction_of_one_group(make: MakeCache, ref: DiffusersPages) -> None:
    x, y, z = keys_of(X), keys_of(Y), keys_of(Z)
    shared = x[0]
    cache = make(gpu_plans=4, host_pages=7)  # host: X and Y (7 pages, t = 0 stored once)
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


def test_group_larger_than_host_tier_is_skipped_not_an_error(make: MakeCache, ref: DiffusersPages) -> None:
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
    w = sched(4, 5.0, 3.0)  # t = 0 (width 1, shared with X) + three width-2 plans = 6 new pages
    cache = make(gpu_plans=8, host_pages=5)
    run(cache, X)
    expect(cache, host_groups=[group_of(X)], host_used_bytes=4 * PAGE_BYTES)
    host_before = (cache.host.groups(), cache.host.plan_keys(), cache.host.used_pages, cache.host.buffer.gather())

    lease = run(cache, w)  # 6 new pages > 1 free + X's 3 evictable: skipped, X kept
    assert lease.report.host_stored is False
    assert cache.host.groups() == host_before[0]
    assert cache.host.plan_keys() == host_before[1]
    assert cache.host.used_pages == host_before[2]
    assert same_bits(cache.host.buffer.gather(), host_before[3])
    expect(cache, host_pressure_skips=1, host_group_evictions=0)


def test_swap_in_what_the_host_holds_and_rebuild_only_the_rest(make: MakeCache, ref: DiffusersPages) -> None:
    x, z = keys_of(X), keys_of(Z)
    w = sched(4, 5.0, 3.0)
    cache = make(gpu_plans=4, host_pages=5)
    run(cache, X)  # host: [X]
    r = run(cache, w).report  # evicts x1..x3 from the slab; W (6 new pages) does not fit the host
    assert (r.built_plans, r.host_stored) == (3, False)
    expect(cache, host_groups=[group_of(X)], host_hit_plans=0)

    # x1, x2 are on the host, z1 is not: x1, x2 swapped in, z1 alone rebuilt (one pass)
    q = [x[1], x[2], z[1]]
    r = run(cache, q).report
    assert (r.built_plans, r.host_hit_plans, r.gpu_hit_plans) == (1, 2, 0)
    assert r.rebuild_s > 0 and r.swap_in_s > 0
    expect(cache, host_hit_plans=2, swap_in_bytes=2 * PAGE_BYTES, rebuild_passes=3, host_groups=[group_of(X), tuple(q)])
    for k in (x[1], x[2]):  # swapped-in pages are bit-identical to the host copies
        assert torch.equal(cache.slab[cache.slot_of(k), :1], torch.stack(cache.host.page_rows(k)))

    # X's missing plans (t = 0 and x3) are all on the host -> swap-in, no rebuild
    r = run(cache, X).report
    assert (r.host_hit_plans, r.built_plans, r.gpu_hit_plans) == (2, 0, 2)
    expect(cache, host_hit_plans=4, swap_in_bytes=4 * PAGE_BYTES, rebuild_passes=3)
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
    run(cache, sched(4, 16.0))  # 3 more pages: the least recently used group, Y, goes first
    assert cache.host.groups()[0] == group_of(X) and group_of(Y) not in cache.host.groups()
    check_invariants(cache)


def test_host_tier_stays_within_cap_under_random_traffic(make: MakeCache, ref: DiffusersPages) -> None:
    import random

    rng = random.Random(1234)
    specs = [sched(4, 2.0), sched(5, 3.0), sched(6, 8.0), sched(3, 5.0, 3.0), sched(4, 7.0, 2.0), sched(5, 5.0, 1.5)]
    specs += [sched(8, 5.0, 3.0), sched(9, 7.0, 2.0)]  # 15 pages (evicts everything else), 17 (never fits)
    assert [pages_needed(keys_of(s)) for s in specs[-2:]] == [15, 17]
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
    assert_host_matches_reference(cache, ref)


# ============================================================================ 12. the tier list
class OnlyTheseTier(Tier):
    """A tier between host and rebuild (where a disk tier would go) that holds a fixed set of
    plans, builds them itself, and records what the cache asked of it."""

    name = "only-these"

    def __init__(self, source: RebuildSource, keys: Sequence[PlanKey]) -> None:
        self.source = source
        self.keys = set(keys)
        self.filled: list[list[PlanKey]] = []
        self.offered: list[tuple[PlanKey, ...]] = []
        self.clears = 0

    def holds_all(self, keys: Sequence[PlanKey]) -> bool:
        return set(keys) <= self.keys

    def fill(self, keys: Sequence[PlanKey], slots: Sequence[int], slab: SlabPages) -> TierFill:
        self.source.build(keys, [slab.plan(s, k.width) for k, s in zip(keys, slots, strict=True)])
        slab.copier.fence()
        self.filled.append(list(keys))
        return TierFill(CacheReport(built_plans=len(keys)), CacheCounters(built_plans=len(keys)))

    def store(self, group: Sequence[PlanKey], slots: Sequence[int], slab: SlabPages) -> TierStore:
        self.offered.append(tuple(group))
        return NOT_KEPT

    def clear(self, partitions: set[str] | None = None) -> None:
        self.clears += 1


def test_tiers_are_asked_in_order_and_the_rebuild_holds_the_rest(
    make: MakeCache, source: RebuildSource, ref: DiffusersPages
) -> None:
    x = keys_of(X)
    cache = make(gpu_plans=4, host_pages=7)  # the host tier holds X and Y (t = 0 once)
    middle = OnlyTheseTier(source, x)
    cache.tiers.insert(1, middle)  # the one line a new tier needs: after host, before rebuild

    r = run(cache, X).report  # the host holds nothing yet; the middle tier holds all of X
    assert (r.built_plans, r.host_hit_plans, r.host_stored) == (4, 0, True)
    assert middle.filled == [x] and middle.offered == [group_of(X)]
    expect(cache, rebuild_passes=0, built_plans=4, host_groups=[group_of(X)])

    r = run(cache, Y).report  # the middle tier lacks y[1:]: one rebuild pass for all three
    assert (r.built_plans, r.gpu_hit_plans, r.host_stored) == (3, 1, True)
    assert len(middle.filled) == 1 and middle.offered == [group_of(X), group_of(Y)]
    expect(cache, rebuild_passes=1, built_plans=7, host_groups=[group_of(X), group_of(Y)])

    r = run(cache, X).report  # both the host and the middle tier hold x[1:]: the host is asked first
    assert (r.host_hit_plans, r.built_plans, r.gpu_hit_plans) == (3, 0, 1)
    assert len(middle.filled) == 1
    expect(cache, host_hit_plans=3, swap_in_bytes=3 * PAGE_BYTES, rebuild_passes=1, built_plans=7)
    assert_slots_match_reference(cache, ref)

    cache.invalidate()  # every tier is cleared
    assert middle.clears == 1
    expect(cache, resident=[], host_groups=[], host_used_bytes=0)
