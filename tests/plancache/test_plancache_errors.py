"""Plan-cache failures: failed and damaged rebuilds leave the cache consistent and retryable;
rejected requests (capacity, width, non-finite, generation) change nothing (docs/architecture.md,
"Errors" and "Invariants").
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ditcore.checkpoint import CheckpointReader, read_shard_header, write_checkpoint
from ditcore.plans import PlanKey
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
    TINY,
    X,
    Y,
    Z,
    MakeCache,
    Reference,
    assert_slots_match_reference,
    assert_unchanged,
    check_invariants,
    expect,
    keys_of,
    prepare,
    run,
    same_bits,
    snapshot,
    t2v,
    t2va,
)


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
    make: MakeCache, ref: Reference, tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch
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
        ("old generation", good, 2, GenerationMismatchError, ["generation 2", "served generation 3"]),
        ("new generation", good, 4, GenerationMismatchError, ["generation 4", "served generation 3"]),
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
