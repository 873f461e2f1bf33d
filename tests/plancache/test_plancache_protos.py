"""CacheStats and CacheReport to their plan-cache protos: every field by name, none dropped.

`ditruntime.convert` refuses a dataclass field with no proto counterpart; these tests pin that
for the two dataclasses the sidecar sends, and that every real field round-trips.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from ditcore.report import CacheReport
from ditruntime.convert import FieldMismatchError, from_proto, to_proto
from plancache_service.cache import CacheStats
from plancache_service.rebuild import RebuildSource
from plancache_service.server import stats_to_proto
from protos.ditserve.plancache.v1 import plancache_pb2 as pb

from plancache_helpers import CPU, X, make_cache, run  # isort: skip

ON_GET_STATE = ("generation", "leases_held")  # CacheStats fields carried by GetStateResponse itself


def distinct_values(cls: type[Any]) -> dict[str, Any]:
    """A value per field, each different from the others and from the proto default."""
    values: dict[str, Any] = {}
    for i, f in enumerate(dataclasses.fields(cls), start=1):
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        values[f.name] = {"bool": True, "float": i + 0.25}.get(kind, i)
    return values


def with_extra_field(cls: type[Any]) -> type[Any]:
    """`cls` plus a field the proto lacks (a tier added to the dataclass but not the proto)."""
    return dataclasses.make_dataclass(f"{cls.__name__}Plus", [("tape_hit_plans", int, 7)], bases=(cls,), frozen=True)


def test_every_cache_stats_field_reaches_the_proto() -> None:
    stats = CacheStats(**distinct_values(CacheStats))
    msg = stats_to_proto(stats)
    for name, value in dataclasses.asdict(stats).items():
        if name in ON_GET_STATE:
            assert name in pb.GetStateResponse.DESCRIPTOR.fields_by_name
            assert name not in pb.CacheStats.DESCRIPTOR.fields_by_name
        else:
            assert getattr(msg, name) == value, name
    # and the reverse: no proto field is left for the converter to skip
    assert set(pb.CacheStats.DESCRIPTOR.fields_by_name) <= {f.name for f in dataclasses.fields(CacheStats)}


def test_cache_report_round_trips_through_its_proto() -> None:
    report = CacheReport(**distinct_values(CacheReport))
    msg = to_proto(report, pb.CacheReport)
    assert from_proto(msg, CacheReport) == report
    assert set(pb.CacheReport.DESCRIPTOR.fields_by_name) == {f.name for f in dataclasses.fields(CacheReport)}


def test_a_field_without_a_proto_counterpart_raises() -> None:
    stats_plus = with_extra_field(CacheStats)(**distinct_values(CacheStats))
    with pytest.raises(FieldMismatchError, match="tape_hit_plans"):
        stats_to_proto(stats_plus)
    report_plus = with_extra_field(CacheReport)()
    with pytest.raises(FieldMismatchError, match="tape_hit_plans"):
        to_proto(report_plus, pb.CacheReport)
    with pytest.raises(FieldMismatchError, match="generation"):  # not declared as travelling elsewhere
        to_proto(CacheStats(**distinct_values(CacheStats)), pb.CacheStats)


def test_a_live_caches_stats_convert(tiny_ckpt: Path, tmp_path: Path) -> None:
    cache = make_cache(RebuildSource(tiny_ckpt, CPU), gpu_plans=4, host_pages=4, shm_dir=tmp_path)
    try:
        lease = run(cache, X)
        stats = cache.stats()
        msg = stats_to_proto(stats)
        assert (msg.built_plans, msg.rebuild_passes, msg.prepares, msg.host_groups) == (4, 1, 1, 1)
        assert msg.rebuild_s == stats.rebuild_s > 0
        assert from_proto(to_proto(lease.report, pb.CacheReport), CacheReport) == lease.report
    finally:
        cache.close()
