"""HostTier on its own: group LRU, refcounted shared plans, all-or-nothing admission, the cap.

A small float buffer stands in for the page buffer, split into chunks of 3 pages (a plan's pages
may sit in two chunks; a page never straddles two); `write` fills each page with a value derived
from (key, page) so page contents can be checked after evictions and re-admissions.
"""

from __future__ import annotations

import random

import pytest
import torch

from ditcore.plans import PlanKey
from plancache_service.host_buffer import HostBuffer
from plancache_service.host_tier import HostTier

PAGE_NUMEL = 3


def key(*ts: int) -> PlanKey:
    return PlanKey(tuple(ts))


A, B, C, D, E = key(1), key(2), key(3), key(4), key(5)
AB2 = key(6, 7)  # a width-2 plan


class Writer:
    """Records which plans were written and fills row j of key k with k.bits[j] + 0.5."""

    def __init__(self, t: HostTier) -> None:
        self.tier = t
        self.written: list[PlanKey] = []

    def __call__(self, k: PlanKey, rows: list[int]) -> None:
        assert len(rows) == k.width
        self.written.append(k)
        for j, row in enumerate(rows):
            self.tier.buffer.page(row).fill_(k.bits[j] + 0.5)


def tier(pages: int) -> HostTier:
    return HostTier(HostBuffer.of(torch.full((pages, PAGE_NUMEL), -1.0), chunk_pages=3))


def expect_tier(t: HostTier, groups: list[tuple[PlanKey, ...]], evictions: int = 0, skips: int = 0) -> None:
    """Exact groups (LRU order) and counters, plus: pages of every held plan hold its values,
    used pages equal the held plans' widths, no page is used twice, and nothing exceeds the cap."""
    assert t.groups() == groups
    assert (t.group_evictions, t.pressure_skips) == (evictions, skips)
    held = {k for g in groups for k in g}
    assert t.plan_keys() == held
    assert t.used_pages == sum(k.width for k in held) <= t.capacity_pages
    seen: list[int] = []
    for k in held:
        rows = t.page_rows(k)
        assert len(rows) == k.width
        for j, row in enumerate(rows):
            assert torch.equal(row, torch.full((PAGE_NUMEL,), k.bits[j] + 0.5))
            seen.append(row.data_ptr())
    assert len(seen) == len(set(seen)), "two plans share a page"


def test_geometry() -> None:
    t = tier(5)
    assert (t.capacity_pages, t.used_pages, t.page_bytes) == (5, 0, PAGE_NUMEL * 4)
    assert t.groups() == [] and not t.holds(A) and t.holds_all([])


def test_admit_stores_group_and_pages() -> None:
    t = tier(5)
    w = Writer(t)
    assert t.admit([A, AB2, A], w)  # duplicates inside a group are stored once
    assert w.written == [A, AB2]
    expect_tier(t, [(A, AB2, A)])
    assert t.holds(A) and t.holds_all([A, AB2]) and not t.holds_all([A, B])


def test_readmitting_a_stored_group_only_touches_it() -> None:
    t = tier(4)
    w = Writer(t)
    t.admit([A, B], w)
    t.admit([C], w)
    w.written.clear()
    assert t.admit([A, B], w)
    assert w.written == []
    expect_tier(t, [(C,), (A, B)])


def test_lru_group_is_evicted_first_and_touch_reorders() -> None:
    t = tier(4)
    w = Writer(t)
    t.admit([A, B], w)
    t.admit([C, D], w)
    t.touch([B])  # (A, B) becomes most recent
    expect_tier(t, [(C, D), (A, B)])
    assert t.admit([E], w)  # 1 page needed, 0 free: evicts (C, D), frees 2
    expect_tier(t, [(A, B), (E,)], evictions=1)
    assert t.used_pages == 3


def test_shared_plan_survives_eviction_of_one_group() -> None:
    t = tier(4)
    w = Writer(t)
    t.admit([A, B], w)
    t.admit([A, C], w)  # A stored once, referenced twice
    assert w.written == [A, B, C] and t.used_pages == 3
    t.admit([D, E], w)  # needs 2, 1 free: evict (A, B) -> frees only B
    expect_tier(t, [(A, C), (D, E)], evictions=1)
    assert t.holds(A) and not t.holds(B)
    t.admit([B], w)  # full again; evicting (A, C) now frees A too
    expect_tier(t, [(D, E), (B,)], evictions=2)
    assert not t.holds(A)


def test_group_sharing_a_plan_with_its_victim_keeps_that_plan() -> None:
    # (AB2, A) holds 3 pages of 4; (AB2, B, C) needs 2 new pages, 1 free: evicting the old group
    # must free A but keep AB2, which the new group is about to reference.
    t = tier(4)
    w = Writer(t)
    t.admit([AB2, A], w)
    assert t.admit([AB2, B, C], w)
    expect_tier(t, [(AB2, B, C)], evictions=1)
    assert w.written == [AB2, A, B, C]  # AB2 was not rewritten


def test_group_over_the_cap_is_skipped_and_tier_unchanged() -> None:
    t = tier(3)
    w = Writer(t)
    t.admit([A, B], w)
    before = t.buffer.gather()
    w.written.clear()
    assert not t.admit([C, D, E, key(9)], w)  # 4 pages > 3
    assert w.written == []
    assert torch.equal(t.buffer.gather(), before)
    expect_tier(t, [(A, B)], skips=1)


def test_admission_is_all_or_nothing_when_shared_pages_cannot_be_reclaimed() -> None:
    # (A, B, C) is stored; (A, AB2, D) needs 3 new pages; free 1 + reclaimable (B, C) 2 = 3: fits.
    t = tier(4)
    w = Writer(t)
    t.admit([A, B, C], w)
    assert t.admit([A, AB2, D], w)
    expect_tier(t, [(A, AB2, D)], evictions=1)
    # now (A, AB2, D) fills all 4 pages; (A, E, key(8, 9)) needs 3 new: only AB2 + D (3) reclaimable: fits
    assert t.admit([A, E, key(8, 9)], w)
    expect_tier(t, [(A, E, key(8, 9))], evictions=2)
    # (A, key(10, 11), key(12, 13)) needs 4 new; free 0 + reclaimable 3: skipped, nothing evicted
    before = t.buffer.gather()
    assert not t.admit([A, key(10, 11), key(12, 13)], w)
    assert torch.equal(t.buffer.gather(), before)
    expect_tier(t, [(A, E, key(8, 9))], evictions=2, skips=1)


def test_zero_capacity_tier_skips_everything() -> None:
    t = tier(0)
    w = Writer(t)
    assert not t.admit([A], w)
    expect_tier(t, [], skips=1)


def test_clear_frees_every_page() -> None:
    t = tier(4)
    w = Writer(t)
    t.admit([A, B], w)
    t.admit([AB2], w)
    t.clear()
    assert t.used_pages == 0 and t.groups() == [] and t.plan_keys() == set()
    assert t.admit([key(20, 21), key(22), key(23)], w)  # all 4 pages available again
    expect_tier(t, [(key(20, 21), key(22), key(23))])


@pytest.mark.parametrize("seed", range(3))
def test_random_admissions_never_exceed_the_cap_or_corrupt_pages(seed: int) -> None:
    rng = random.Random(seed)
    universe = [key(i) for i in range(1, 9)] + [key(100 + i, 200 + i) for i in range(6)]
    t = tier(8)
    w = Writer(t)
    stored: list[tuple[PlanKey, ...]] = []  # model of the expected LRU list
    skips = evictions = 0
    for _ in range(300):
        g = tuple(rng.sample(universe, rng.randint(1, 6)))
        if rng.random() < 0.2 and stored:
            probe = rng.choice(rng.choice(stored))
            t.touch([probe])
            stored = [s for s in stored if probe not in s] + [s for s in stored if probe in s]
            expect_tier(t, stored, evictions, skips)
            continue
        need_new = sum(k.width for k in set(g) if not any(k in s for s in stored))
        free = t.capacity_pages - t.used_pages
        reclaimable = free + sum(k.width for k in {k for s in stored for k in s} - set(g))
        ok = t.admit(g, w)
        if g in stored:
            assert ok
            stored.remove(g)
            stored.append(g)
        elif need_new > reclaimable:
            assert not ok
            skips += 1
        else:
            assert ok
            # evict LRU groups until the new pages fit (plans kept alive by g or others stay)
            while True:
                held = {k for s in stored for k in s} | set(g)
                if sum(k.width for k in held) <= t.capacity_pages:
                    break
                stored.pop(0)
                evictions += 1
            stored.append(g)
        expect_tier(t, stored, evictions, skips)
    assert skips > 0 and evictions > 0
