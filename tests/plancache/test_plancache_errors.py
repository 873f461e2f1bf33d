"""Plan-cache failures: failed and damaged rebuilds leave the cache consistent and retryable;
rejected requests (capacity, width, non-finite, generation) change nothing (docs/architecture.md,
"Errors" and "Invariants").
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ditcore.checkpoint_files import read_shard_header
from ditcore.plans import PlanKey, is_plan_tensor
from ditcore.rebuild import PlanBuilder
from ditruntime.errors import GenerationMismatchError
from ditruntime.slab import (
    COL_STATE,
    READY,
)
from plancache_service.cache import MAX_KEYS
from plancache_service.errors import (
    CheckpointChangedError,
    InvalidPlanRequestError,
    PlanCapacityError,
    RebuildError,
)
from plancache_service.rebuild import RebuildSource

from plancache_helpers import (  # isort: skip
    CPU,
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
    same_bits,
    sched,
    snapshot,
)


# ============================================================================ 7. failed rebuilds
def _fail_nth_plan_tensor_read(monkeypatch: pytest.MonkeyPatch, n: int) -> list[str]:
    """The builder's n-th read of a plan tensor (adaln_proj / norm_out.linear) raises an I/O error."""
    calls: list[str] = []
    real = PlanBuilder._read

    def flaky(self: PlanBuilder, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        if is_plan_tensor(name):
            calls.append(name)
            if len(calls) == n:
                raise OSError(5, "injected I/O error", name)
        return real(self, name, rows)

    monkeypatch.setattr(PlanBuilder, "_read", flaky)
    return calls


def test_failed_rebuild_leaves_cache_consistent_and_retry_works(
    make: MakeCache, ref: DiffusersPages, tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, y = keys_of(X), keys_of(Y)
    for k in set(x) | set(y):
        ref.pages(k)  # build the reference before reads are sabotaged
    cache = make(gpu_plans=7)  # exactly X u Y: a leaked slot would force an eviction on retry
    run(cache, X)
    x_pages = cache.slab.clone()

    with monkeypatch.context() as m:
        calls = _fail_nth_plan_tensor_read(m, 2)  # block 0's adaln_proj bias, after its weight
        with pytest.raises(RebuildError) as ei:
            prepare(cache, Y)
        assert calls == ["transformer_blocks.0.adaln_proj.linear.weight", "transformer_blocks.0.adaln_proj.linear.bias"]
    assert str(tiny_ckpt) in str(ei.value) and "injected I/O error" in str(ei.value)
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
def test_damaged_shard_fails_prepare_naming_the_file_and_recovers(
    make: MakeCache, ref: DiffusersPages, tiny_ckpt: Path, tmp_path: Path, damage: str
) -> None:
    ckpt = Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))  # a private copy to damage
    source = RebuildSource(ckpt, CPU)
    x, y = keys_of(X), keys_of(Y)
    cache = make(gpu_plans=7, source=source)
    run(cache, X)

    tensor = "norm_out.linear.weight"  # the last projection a pass reads
    shard = ckpt / "transformer" / source.builder.files[tensor]
    saved = tmp_path / "saved.safetensors"
    shutil.copy2(shard, saved)
    if damage == "truncate":
        with open(shard, "r+b") as fh:
            fh.truncate(shard.stat().st_size - 64)
    elif damage == "overwrite":  # same size and header, different weights at the tensor's start
        hdr = read_shard_header(shard)
        at = len(hdr.header_bytes) + hdr.tensors[tensor].begin
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
BadCase = tuple[str, int, type[Exception], list[str]]
# (name, generation asked, error, words its message holds); the keys come from _bad_keys(name) at run time
_BAD: list[BadCase] = [
    ("too many plans", 3, PlanCapacityError, ["9 distinct plans", "at most 8", "--gpu-plans"]),
    ("inf", 3, InvalidPlanRequestError, ["plan_keys[2]", "non-finite"]),
    ("nan", 3, InvalidPlanRequestError, ["plan_keys[0]", "non-finite"]),
    ("-inf", 3, InvalidPlanRequestError, ["plan_keys[1]"]),
    ("empty", 3, InvalidPlanRequestError, ["plan_keys", "at least one"]),
    ("repeated timestep", 3, InvalidPlanRequestError, ["distinct"]),
    ("too many keys", 3, InvalidPlanRequestError, [str(MAX_KEYS)]),
    ("old generation", 2, GenerationMismatchError, ["generation 2", "served generation 3"]),
    ("new generation", 4, GenerationMismatchError, ["generation 4", "served generation 3"]),
]


def _bad_keys(name: str) -> list[PlanKey]:
    good = keys_of(X)
    inf, nan, ninf = PlanKey((0x7F800000,)), PlanKey((0x7FC00000,)), PlanKey((0xFF800000,))
    return {
        "too many plans": keys_of(sched(9, 3.0)),
        "inf": [*good[:2], inf, good[3]],
        "nan": [nan],
        "-inf": [good[0], ninf],
        "empty": [],
        "repeated timestep": [PlanKey((good[1].bits[0], good[1].bits[0]))],
        "too many keys": [good[0]] * (MAX_KEYS + 1),
        "old generation": good,
        "new generation": good,
    }[name]


@pytest.mark.parametrize("case", _BAD, ids=lambda c: c[0])
def test_rejected_requests_leave_every_plan_in_place(make: MakeCache, case: BadCase) -> None:
    name, generation, error, words = case
    keys = _bad_keys(name)
    cache = make(gpu_plans=8, host_pages=8, generation=3)
    run(cache, X)
    held = prepare(cache, Y)
    before = snapshot(cache)
    with pytest.raises(error) as ei:
        cache.prepare(generation, keys, "bad")
    for w in words:
        assert w in str(ei.value)
    if isinstance(ei.value, GenerationMismatchError):
        assert (ei.value.current_generation, ei.value.requested_generation) == (3, generation)
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
        prepare(cache, sched(4, 5.0, 3.0))
    msg = str(ei.value)
    assert "--plan-width" in msg and "plan_keys[1]" in msg and "at most 1" in msg
    assert_unchanged(cache, before)
    # the same task with equal shifts has width-1 plans and is fine
    assert run(cache, sched(4, 5.0, 5.0)).report.built_plans == 3


def test_capacity_counts_distinct_plans_not_steps(make: MakeCache) -> None:
    cache = make(gpu_plans=4)
    keys = keys_of(X) * 3  # 12 steps, 4 distinct plans
    lease = prepare(cache, keys)
    assert lease.report.built_plans == 4 and len(lease.slots) == 12
    check_invariants(cache)
