"""Shared helpers for the plan-cache tests: schedules, cache construction, expected-state checks.

Imported by tests/test_plancache_*.py (pytest puts tests/ on sys.path). Kept separate from
conftest.py on purpose: these are plain functions, fixtures live in the test modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ditcore.checkpoint import validate_checkpoint
from ditcore.config import get_preset
from ditcore.local_plans import LocalPlanProvider
from ditcore.plans import PlanKey, ScheduleSpec, StepPlan, distinct_keys
from ditruntime.slab import COL_GENERATION, COL_LENGTH, COL_STATE, EMPTY, READY, ROW_WORDS
from plancache_service.cache import Lease, PlanCache
from plancache_service.config import CacheConfig
from plancache_service.rebuild import RebuildSource

TINY = get_preset("tiny")
PAGE_BYTES = TINY.page_bytes
CPU = torch.device("cpu")

# The seed's headline pair: two 50-step t2va schedules with different video shifts.
# Each has 50 distinct plans (the first, t=1000, is width 1 and shared; the other 49 are width 2).
T2VA_A = ScheduleSpec("t2va", 50, 5.0, 3.0)
T2VA_B = ScheduleSpec("t2va", 50, 7.0, 3.0)


def t2v(steps: int, shift: float) -> ScheduleSpec:
    return ScheduleSpec("t2v", steps, shift, shift)


def t2va(steps: int, shift: float, audio_shift: float) -> ScheduleSpec:
    return ScheduleSpec("t2va", steps, shift, audio_shift)


# Three 4-step t2v schedules: 4 width-1 plans each; all three share the first plan (t=1000).
X, Y, Z = t2v(4, 2.0), t2v(4, 4.0), t2v(4, 8.0)


def keys_of(spec: ScheduleSpec) -> list[PlanKey]:
    return spec.plan_keys()


def group_of(spec_or_keys: ScheduleSpec | Sequence[PlanKey]) -> tuple[PlanKey, ...]:
    keys = spec_or_keys.plan_keys() if isinstance(spec_or_keys, ScheduleSpec) else spec_or_keys
    return tuple(distinct_keys(keys))


def pages_needed(keys: Iterable[PlanKey]) -> int:
    return sum(k.width for k in set(keys))


def make_cache(
    ckpt: Path | str | RebuildSource,
    *,
    gpu_plans: int,
    plan_width: int = 2,
    host_pages: int = 0,
    shm_dir: Path | str,
    generation: int = 0,
) -> PlanCache:
    """A CPU PlanCache over the tiny checkpoint; the host tier holds `host_pages` pages."""
    source = ckpt if isinstance(ckpt, RebuildSource) else RebuildSource(ckpt, CPU)
    config = CacheConfig(
        gpu_plans=gpu_plans,
        plan_width=plan_width,
        host_cache_bytes=host_pages * source.config.page_bytes,
        host_reserve_bytes=0,
        shm_dir=str(shm_dir),
    )
    return PlanCache(config, source, generation=generation)


MakeCache = Callable[..., PlanCache]


@contextlib.contextmanager
def cache_factory(source: RebuildSource, shm_dir: Path) -> Iterator[MakeCache]:
    """make(gpu_plans=..., plan_width=2, host_pages=0, generation=0, source=...) -> a cache;
    every cache made is closed on exit (the `make` fixture of the test_plancache_* modules)."""
    caches: list[PlanCache] = []

    def make(*, source: RebuildSource = source, **sizes: int) -> PlanCache:
        cache = make_cache(source, shm_dir=shm_dir, **sizes)
        caches.append(cache)
        return cache

    try:
        yield make
    finally:
        for c in caches:
            c.close()


def prepare(cache: PlanCache, spec_or_keys: ScheduleSpec | Sequence[PlanKey], owner: str = "test") -> Lease:
    keys = spec_or_keys.plan_keys() if isinstance(spec_or_keys, ScheduleSpec) else list(spec_or_keys)
    return cache.prepare(cache.generation, keys, owner)


def run(cache: PlanCache, spec_or_keys: ScheduleSpec | Sequence[PlanKey], owner: str = "test") -> Lease:
    """prepare + release; returns the lease (its report is what the request saw)."""
    lease = prepare(cache, spec_or_keys, owner)
    cache.release(lease.lease_id)
    return lease


# ---------------------------------------------------------------------------- expected state
def expect(
    cache: PlanCache,
    *,
    resident: int | set[PlanKey] | list[PlanKey] | None = None,
    host_groups: int | list[tuple[PlanKey, ...]] | None = None,
    leases: int | set[int] | None = None,
    **stats: Any,
) -> None:
    """Compare the cache with an expected state; every given field must match exactly.

    resident: a count, a set of keys (any order) or a list (exact LRU order, oldest first).
    host_groups: a count or the exact list of groups (LRU order, oldest first).
    leases: a count or the set of live lease ids.
    **stats: CacheStats fields (built_plans=..., host_hit_plans=..., slot_evictions=...).
    """
    got = cache.stats()
    rk = cache.resident_keys()
    if resident is not None:
        if isinstance(resident, int):
            assert len(rk) == resident, f"resident count {len(rk)} != {resident}"
        elif isinstance(resident, set):
            assert set(rk) == resident, (
                f"resident keys differ: missing {len(resident - set(rk))}, extra {len(set(rk) - resident)}"
            )
            assert len(rk) == len(resident)
        else:
            assert rk == list(resident), "resident keys / LRU order differ"
    if host_groups is not None:
        groups = cache.host.groups()
        if isinstance(host_groups, int):
            assert len(groups) == host_groups, f"host groups {len(groups)} != {host_groups}"
        else:
            assert groups == list(host_groups), "host groups / order differ"
    if leases is not None:
        live = cache.leases()
        if isinstance(leases, int):
            assert len(live) == leases, f"live leases {len(live)} != {leases}"
        else:
            assert {lease.lease_id for lease in live} == leases
    d = got.to_dict()
    for name, want in stats.items():
        assert name in d, f"unknown stat {name}"
        assert d[name] == want, f"stat {name} = {d[name]!r}, expected {want!r}"
    check_invariants(cache)


def check_invariants(cache: PlanCache) -> None:
    """Structural invariants that must hold between any two operations."""
    st = cache.stats()
    rk = cache.resident_keys()
    assert len(rk) == len(set(rk)) == st.slots_ready
    slots = {}
    for k in rk:
        s = cache.slot_of(k)
        assert s is not None
        slots[s] = k
    assert len(slots) == len(rk), "two resident keys share a slot"
    # slot table rows: READY rows are exactly the resident slots, with their keys; others EMPTY
    table = cache.table
    for s in range(cache.config.gpu_plans):
        row = table[s]
        if s in slots:
            k = slots[s]
            assert int(row[COL_STATE]) == READY
            assert int(row[COL_GENERATION]) == cache.generation
            assert int(row[COL_LENGTH]) == k.width
            assert tuple(int(x) for x in row[ROW_WORDS : ROW_WORDS + k.width]) == k.bits
            assert not row[ROW_WORDS + k.width :].any()
        else:
            assert int(row[COL_STATE]) == EMPTY, f"slot {s} is not resident but its row is not EMPTY"
    # leases point at READY slots holding their keys
    leased: set[int] = set()
    for lease in cache.leases():
        assert lease.generation == cache.generation
        for k, s in zip(lease.keys, lease.slots, strict=True):
            assert slots.get(s) == k, "a lease's slot does not hold its key"
            leased.add(s)
    assert st.slots_leased == len(leased)
    assert st.leases_held == len(cache.leases())
    # host tier bookkeeping
    host = cache.host
    assert st.host_used_bytes <= st.host_capacity_bytes
    assert host.used_pages == sum(k.width for k in host.plan_keys())
    held_by_groups: set[PlanKey] = set()
    for g in host.groups():
        assert host.holds_all(g)
        held_by_groups.update(g)
    assert held_by_groups == host.plan_keys(), "a host plan is held by no group (leak) or vice versa"
    assert st.host_groups == len(host.groups())


def snapshot(cache: PlanCache) -> dict[str, Any]:
    """Everything a rejected request must leave untouched."""
    return {
        "stats": cache.stats(),
        "resident": cache.resident_keys(),
        "table": cache.table.clone(),
        "slab": cache.slab.clone(),
        "leases": [(lease.lease_id, lease.slots) for lease in cache.leases()],
        "host_groups": cache.host.groups(),
        "host_plans": cache.host.plan_keys(),
        "host_buffer": cache.host.buffer.clone(),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal is False for NaN == NaN, and host pages start uninitialized)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_unchanged(cache: PlanCache, before: dict[str, Any]) -> None:
    after = snapshot(cache)
    assert after["stats"] == before["stats"]
    assert after["resident"] == before["resident"]
    assert torch.equal(after["table"], before["table"])
    assert same_bits(after["slab"], before["slab"])
    assert after["leases"] == before["leases"]
    assert after["host_groups"] == before["host_groups"]
    assert after["host_plans"] == before["host_plans"]
    assert same_bits(after["host_buffer"], before["host_buffer"])


# ---------------------------------------------------------------------------- reference pages
class Reference:
    """Plan pages built by ditcore's own LocalPlanProvider (no cache involved)."""

    def __init__(self, ckpt: Path | str, source: RebuildSource) -> None:
        self._provider = LocalPlanProvider(validate_checkpoint(ckpt), source.time_embed)
        self._pages: dict[PlanKey, torch.Tensor] = {}

    def pages(self, key: PlanKey) -> torch.Tensor:
        if key not in self._pages:
            lease = self._provider.acquire([StepPlan(key, 0, key.width - 1)])
            self._pages[key] = lease.pages(0).clone()
        return self._pages[key]


def assert_slots_match_reference(cache: PlanCache, ref: Reference, keys: Iterable[PlanKey] | None = None) -> None:
    """Every (given or resident) plan's slot pages equal the reference bit for bit."""
    for k in cache.resident_keys() if keys is None else keys:
        s = cache.slot_of(k)
        assert s is not None, f"{k} is not resident"
        assert torch.equal(cache.slab[s, : k.width], ref.pages(k)), f"slot {s} of {k} differs from the reference"
