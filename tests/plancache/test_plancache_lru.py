"""Plan-cache slots and leases: LRU eviction order, plans pinned by live leases, repeated keys,
releases by id and by owner, and concurrent prepares (docs/architecture.md, "The slab and the
lease protocol").
"""

from __future__ import annotations

import pytest
import torch

from ditruntime.slab import (
    COL_STATE,
    READY,
    ROW_WORDS,
)
from plancache_service.errors import (
    SlabBusyError,
    UnknownLeaseError,
)

from plancache_helpers import (  # isort: skip
    X,
    Y,
    Z,
    DiffusersPages,
    MakeCache,
    assert_slots_match_reference,
    assert_unchanged,
    check_invariants,
    expect,
    keys_of,
    prepare,
    run,
    sched,
    snapshot,
)


# ============================================================================ 3. LRU
@pytest.mark.parametrize("touch_x", [True, False])
def test_lru_evicts_least_recently_used_and_pure_hits_touch(make: MakeCache, touch_x: bool) -> None:
    x, y, z = keys_of(X), keys_of(Y), keys_of(Z)
    cache = make(gpu_plans=7)  # exactly X u Y
    run(cache, X)
    run(cache, Y)
    # Y's hit on t = 0 moved it to the end before Y's new plans were published
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
def test_leased_plans_are_never_evicted_with_two_concurrent_leases(make: MakeCache, ref: DiffusersPages) -> None:
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


def test_concurrent_prepares_and_releases_keep_the_cache_consistent(make: MakeCache, ref: DiffusersPages) -> None:
    import random
    import threading

    specs = [X, Y, Z, sched(3, 5.0, 3.0), sched(4, 7.0, 2.0)]
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
