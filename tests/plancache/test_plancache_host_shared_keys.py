"""The host tier serves every plan it holds, whichever group (schedule, adapter) stored it.

A plan evicted from the slab whose pages are on the host is swapped in, never rebuilt, even when other plans of the
same request are new and must be built: the missing plans are split, those the host holds are swapped in and only the
rest go to the rebuild pass. A request whose plans were all built before (by one request or several) and evicted to
the host is served from the host with no build.

Plans of per-request modulation adapters are keys carrying an adapters digest (`PlanKey.adapters`), built by the
sidecar with real adapter files (`AdapterPlans` over an `AdapterRegistry` of two tiny-preset modulation LoRAs), so a
digest's plans differ from the base plans of the same timesteps. Every schedule of one adapter shares its first plan
(t = 0 for video and audio), which is the key the bench's adapter scenario saw rebuilt.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ditcore.adapter_files import write_adapter
from ditcore.adapter_plans import modulation_digest
from ditcore.adapters import AdapterRegistry
from ditcore.plans import PlanKey
from plancache_service.adapters import AdapterPlans
from plancache_service.cache import PlanCache
from plancache_service.errors import RebuildError
from plancache_service.rebuild import RebuildSource

from plancache_helpers import (  # isort: skip
    CPU,
    PAGE_BYTES,
    T2VA_A,
    X,
    Y,
    Z,
    DiffusersPages,
    MakeCache,
    assert_host_matches_reference,
    assert_slots_match_reference,
    cache_factory,
    expect,
    group_of,
    keys_of,
    pages_needed,
    prepare,
    run,
    sched,
    snapshot,
)

LONG = sched(49, 5.0, 3.0)  # a 50-point request: 49 forwards, 49 distinct plans (t = 0, then 48 of width 2)
LONG_B = sched(49, 7.0, 3.0)  # another 50-point schedule: shares only t = 0 with LONG
FEW = sched(4, 5.0, 3.0)  # a 5-point request: 4 distinct plans, shares only t = 0 with LONG


class Adapters:
    """Two modulation adapters' digests and a rebuild source that builds their plans."""

    def __init__(self, repo: Path, root: Path) -> None:
        for seed, name in enumerate(("ma", "mb"), start=11):
            write_adapter(root / f"{name}.safetensors", repo, "modulation", "diffusers", rank=2, alpha=None, seed=seed)
        registry = AdapterRegistry(root)
        self.plans = AdapterPlans(registry)
        self.source = RebuildSource(repo, CPU, adapter_plans=self.plans)
        self.digest: dict[str, str] = {}
        for name in ("ma", "mb"):
            info = registry.get(name)
            digest = modulation_digest([(info, 1.0)])
            self.plans.register([SimpleNamespace(name=name, identity=info.identity, scale=1.0)], [with_(digest, X)[0]])
            self.digest[name] = digest

    def keys(self, name: str, spec: object) -> list[PlanKey]:
        return with_(self.digest[name], spec)

    def built(self, keys: Sequence[PlanKey]) -> dict[PlanKey, torch.Tensor]:
        """Each key's pages from a fresh rebuild pass of its own (the reference a swapped-in page must equal)."""
        out = {k: torch.empty(k.width, self.source.page_numel, dtype=self.source.dtype) for k in dict.fromkeys(keys)}
        self.source.build(list(out), list(out.values()))
        return out


def with_(digest: str, spec: object) -> list[PlanKey]:
    return [k.with_adapters(digest) for k in keys_of(spec)]  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def adapters(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    return Adapters(tiny_ckpt, tmp_path_factory.mktemp("host-shared-adapters"))


@pytest.fixture
def amake(adapters: Adapters, tmp_path: Path) -> Iterator[MakeCache]:
    """Caches over the adapters' rebuild source."""
    with cache_factory(adapters.source, tmp_path) as factory:
        yield factory


def counts(lease_or_report: object) -> tuple[int, int, int]:
    r = getattr(lease_or_report, "report", lease_or_report)
    return r.built_plans, r.host_hit_plans, r.gpu_hit_plans  # type: ignore[attr-defined]


def assert_slots_equal_rebuilt(cache: PlanCache, adapters: Adapters, keys: Sequence[PlanKey]) -> None:
    for k, pages in adapters.built(keys).items():
        s = cache.slot_of(k)
        assert s is not None, f"{k} is not resident"
        assert torch.equal(cache.slab[s, : k.width], pages), f"slot {s} of {k} differs from a rebuild"


def test_schedules_share_only_the_first_plan(adapters: Adapters) -> None:
    long, few, long_b = keys_of(LONG), keys_of(FEW), keys_of(LONG_B)
    assert len(set(long)) == 49 and len(set(few)) == 4
    assert set(long) & set(few) == set(long) & set(long_b) == {PlanKey.from_timesteps(0.0)}
    a = adapters.keys("ma", LONG)
    assert a[0] != long[0] and a[0].bits == long[0].bits  # the adapter's t = 0 plan is its own key


# ============================================================================ the bench's report
def test_a_seen_adapters_first_plan_is_swapped_in_for_a_new_schedule(amake: MakeCache, adapters: Adapters) -> None:
    """The bench scenario: a modulation adapter seen on one schedule, its plans evicted from the slab, then a new
    schedule of the same adapter: its t = 0 plan (shared by every schedule of the adapter) comes from the host."""
    a_long, a_long_b = adapters.keys("ma", LONG), adapters.keys("ma", LONG_B)
    cache = amake(gpu_plans=49, host_pages=400)
    assert counts(run(cache, a_long)) == (49, 0, 0)
    assert counts(run(cache, LONG)) == (49, 0, 0)  # base plans evict every plan of the adapter
    assert not any(cache.slot_of(k) is not None for k in a_long) and cache.host.holds_all(a_long)

    r = run(cache, a_long_b).report
    assert counts(r) == (48, 1, 0), "the adapter's t = 0 plan is on the host: swapped in, not rebuilt"
    assert r.rebuild_s > 0 and r.swap_in_s > 0 and r.host_stored
    expect(cache, built_plans=49 + 49 + 48, host_hit_plans=1, rebuild_passes=3, swap_in_bytes=PAGE_BYTES)
    assert_slots_equal_rebuilt(cache, adapters, a_long_b)

    # and either schedule again, after the other evicted it: every plan from the host, nothing built
    assert counts(run(cache, a_long)) == (0, 48, 1)
    assert counts(run(cache, a_long_b)) == (0, 48, 1)
    assert_slots_equal_rebuilt(cache, adapters, a_long_b)
    assert counts(run(cache, LONG)) == (0, 49, 0)
    expect(cache, built_plans=146, rebuild_passes=3, host_pressure_skips=0, host_group_evictions=0)


@pytest.mark.parametrize("first", ["few", "long"])
def test_a_five_and_a_fifty_point_schedule_of_one_adapter(amake: MakeCache, adapters: Adapters, first: str) -> None:
    a_long, a_few = adapters.keys("ma", LONG), adapters.keys("ma", FEW)
    cache = amake(gpu_plans=49, host_pages=400)
    one, other = (a_few, a_long) if first == "few" else (a_long, a_few)
    assert counts(run(cache, one)) == (len(set(one)), 0, 0)
    run(cache, LONG)  # evicts every plan of the adapter (the slab holds 49)
    r = run(cache, other).report
    assert counts(r) == (len(set(other)) - 1, 1, 0)  # the shared t = 0 plan from the host
    run(cache, LONG)
    for keys in (one, other, one):  # seen sets after eviction: host hits only
        assert counts(run(cache, keys))[0] == 0
    assert_slots_equal_rebuilt(cache, adapters, one)
    expect(cache, rebuild_passes=3, built_plans=49 + 49 + 4 - 1)


# ============================================================================ alternating sets
def test_alternating_base_and_two_adapters_with_a_slab_of_one_set(
    amake: MakeCache, adapters: Adapters, ref: DiffusersPages
) -> None:
    base, a, b = keys_of(T2VA_A), adapters.keys("ma", T2VA_A), adapters.keys("mb", T2VA_A)
    assert len({k for keys in (base, a, b) for k in keys}) == 60  # no key shared across the three
    cache = amake(gpu_plans=20, host_pages=pages_needed(base) * 3)
    reports = [run(cache, keys).report for keys in (base, a, b) * 3]
    assert [counts(r) for r in reports[:3]] == [(20, 0, 0)] * 3
    assert [counts(r) for r in reports[3:]] == [(0, 20, 0)] * 6
    expect(cache, built_plans=60, rebuild_passes=3, host_hit_plans=120, host_groups=3, host_group_evictions=0)
    assert_slots_equal_rebuilt(cache, adapters, b)
    run(cache, base)
    assert_slots_match_reference(cache, ref)


def test_a_set_built_by_two_requests_is_served_whole_from_the_host(amake: MakeCache, adapters: Adapters) -> None:
    a = adapters.keys("ma", T2VA_A)
    cache = amake(gpu_plans=20, host_pages=200)
    assert counts(run(cache, a[:10])) == (10, 0, 0)
    assert counts(run(cache, a[10:])) == (10, 0, 0)
    run(cache, T2VA_A)  # evicts all 20
    assert counts(run(cache, a)) == (0, 20, 0)  # the plans of two groups: one swap-in
    assert_slots_equal_rebuilt(cache, adapters, a)


# ============================================================================ base schedules sharing t = 0
def test_a_partly_held_request_swaps_in_what_the_host_holds(make: MakeCache, ref: DiffusersPages) -> None:
    """X and Y share t = 0; Y's group alone is evicted from the host tier (its t = 0 plan stays, X holds it): a
    request for Y's plans swaps in t = 0 and rebuilds only the three that left the host."""
    x, y = keys_of(X), keys_of(Y)
    cache = make(gpu_plans=4, host_pages=7)  # host: X and Y (7 pages: t = 0 stored once)
    run(cache, X)
    run(cache, Y)
    cache.host.touch([x[1]])  # X most recently used: Z's admission evicts Y
    run(cache, Z)
    expect(cache, host_groups=[group_of(X), group_of(Z)], host_group_evictions=1)
    assert cache.host.holds(y[0]) and not any(cache.host.holds(k) for k in y[1:])
    run(cache, X)  # x1..x3 swapped in
    run(cache, Z)  # z1..z3 swapped in: the slab holds Z

    q = [y[1], x[1], y[0], y[2]]  # t = 0 is in its slot, x1 on the host, y1 and y2 nowhere
    r = run(cache, q).report
    assert counts(r) == (2, 1, 1), "x1 comes from the host, t = 0 from its slot, y1 and y2 are built"
    expect(cache, host_hit_plans=3 + 3 + 1, rebuild_passes=4)
    assert_slots_match_reference(cache, ref)
    assert_host_matches_reference(cache, ref)


def test_a_failed_build_after_a_swap_in_leaves_no_trace(
    make: MakeCache, ref: DiffusersPages, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host part of a split fill is committed (LRU touch, counters) only once the rebuild part succeeded too."""
    x, w = keys_of(X), sched(4, 5.0, 3.0)
    cache = make(gpu_plans=6, host_pages=20)
    run(cache, X)
    run(cache, sched(6, 16.0))  # 6 plans, t = 0 shared: evicts x1..x3 (host: both groups)
    assert not any(cache.slot_of(k) is not None for k in x[1:]) and cache.host.holds_all(x)
    before = snapshot(cache)
    calls: list[int] = []

    def broken(keys: Sequence[PlanKey], outputs: object) -> None:
        calls.append(len(keys))
        raise OSError(5, "injected I/O error")

    with monkeypatch.context() as m:
        m.setattr(cache.source, "build_all", broken)
        with pytest.raises(RebuildError, match="injected"):
            prepare(cache, [*x[1:], *keys_of(w)[1:]])  # x1..x3 on the host, w's three are not
    assert calls == [3]  # only w's plans went to the rebuild
    after = snapshot(cache)
    assert after["host_groups"] == before["host_groups"]
    expect(cache, host_hit_plans=0, swap_in_bytes=0, failed_prepares=1, leases=0, prepares=2)
    r = run(cache, [*x[1:], *keys_of(w)[1:]]).report  # retryable
    assert counts(r) == (3, 3, 0)
    assert_slots_match_reference(cache, ref)
