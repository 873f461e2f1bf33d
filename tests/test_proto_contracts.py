"""The dataclasses that cross a process boundary and their proto messages: every field by name.

The one `CacheReport` reaches the client through the generator's proto too, and the slab
descriptor travels in Attach; a field added on one side only must fail here, not vanish.
"""

from __future__ import annotations

import dataclasses

import pytest

from ditcore.report import CacheReport
from ditruntime.convert import FieldMismatchError, from_proto, to_proto
from ditruntime.slab import ROW_WORDS, SlabDescriptor, descriptor_from_proto, descriptor_to_proto
from protos.ditserve.generator.v1 import generator_pb2 as gen_pb
from protos.ditserve.plancache.v1 import plancache_pb2 as cache_pb


def test_cache_report_matches_both_protos_field_for_field() -> None:
    report = CacheReport(
        gpu_hit_plans=3, host_hit_plans=5, built_plans=7, rebuild_s=0.25, swap_in_s=1.5, host_stored=True
    )
    names = {f.name for f in dataclasses.fields(CacheReport)}
    for msg_cls in (gen_pb.CacheReport, cache_pb.CacheReport):
        assert set(msg_cls.DESCRIPTOR.fields_by_name) == names, msg_cls.DESCRIPTOR.full_name
        assert from_proto(to_proto(report, msg_cls), CacheReport) == report


def test_a_report_field_missing_from_the_generator_proto_fails_loudly() -> None:
    extra = dataclasses.make_dataclass("ReportPlus", [("disk_hit_plans", int, 1)], bases=(CacheReport,), frozen=True)
    with pytest.raises(FieldMismatchError, match="disk_hit_plans"):
        to_proto(extra(), gen_pb.CacheReport)


@pytest.mark.parametrize("transport", ["shm", "cuda_ipc"])
def test_slab_descriptor_round_trips_through_attach(transport: str) -> None:
    d = SlabDescriptor(
        transport=transport, slab_path="/dev/shm/ditserve-slab-x", table_path="/dev/shm/ditserve-table-y",
        slab_bytes=4 * 2 * 16 * 4, table_bytes=4 * (ROW_WORDS + 2) * 8, dtype="float32", num_slots=4, width=2,
        page_numel=16, device="cpu", device_uuid="GPU-1234", ipc_handle=b"\x01\x02",
    )  # fmt: skip
    msg = descriptor_to_proto(d)
    assert msg.table_row_words == d.table_words
    assert descriptor_from_proto(msg) == d
    carried = set(cache_pb.SlabDescriptor.DESCRIPTOR.fields_by_name) - {"table_row_words"}
    assert carried == {f.name for f in dataclasses.fields(SlabDescriptor)}
