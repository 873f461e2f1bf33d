"""The dataclasses that cross a process boundary and their proto messages: every field by name.

The one `CacheReport` reaches the client through the generator's proto too, the slab descriptor travels in Attach,
a `GenerationRequest` is a `GenerateRequest` and `ModelMemory` reaches GetStatus; a field added on one side only
must fail here, not vanish.
"""

from __future__ import annotations

import dataclasses

import pytest

from ditcore import GenerationRequest, ModelMemory, RequestError
from ditcore.report import CacheReport
from ditcore.request import TASKS
from ditruntime.convert import FieldMismatchError, from_proto, to_proto
from ditruntime.slab import ROW_WORDS, CudaIpcHandle, SlabDescriptor, descriptor_from_proto, descriptor_to_proto
from ditserve.client_requests import request_to_proto
from generator_service.serving.convert import request_from_proto
from protos.ditserve.generator.v1 import generator_pb2 as gen_pb
from protos.ditserve.plancache.v1 import plancache_pb2 as cache_pb


def test_cache_report_matches_both_protos_field_for_field() -> None:
    report = CacheReport(
        gpu_hit_plans=3, host_hit_plans=5, built_plans=7, rebuild_s=0.25, swap_in_s=1.5, host_stored=True,
        disk_hit_plans=11, disk_read_s=0.5, disk_stored_plans=13, rebuild_read_bytes=1 << 33, rebuild_read_s=2.25,
    )  # fmt: skip
    names = {f.name for f in dataclasses.fields(CacheReport)}
    for msg_cls in (gen_pb.CacheReport, cache_pb.CacheReport):
        assert set(msg_cls.DESCRIPTOR.fields_by_name) == names, msg_cls.DESCRIPTOR.full_name
        assert from_proto(to_proto(report, msg_cls), CacheReport) == report


def test_a_report_field_missing_from_the_generator_proto_fails_loudly() -> None:
    extra = dataclasses.make_dataclass("ReportPlus", [("tape_hit_plans", int, 1)], bases=(CacheReport,), frozen=True)
    with pytest.raises(FieldMismatchError, match="tape_hit_plans"):
        to_proto(extra(), gen_pb.CacheReport)


@pytest.mark.parametrize("transport", ["shm", "cuda_ipc"])
def test_slab_descriptor_round_trips_through_attach(transport: str) -> None:
    d = SlabDescriptor(
        transport=transport, slab_path="/dev/shm/ditserve-slab-x", table_path="/dev/shm/ditserve-table-y",
        slab_bytes=4 * 2 * 16 * 4, table_bytes=4 * (ROW_WORDS + 2) * 8, dtype="float32", num_slots=4, width=2,
        page_numel=16, device="cpu", device_uuid="GPU-1234",
        cuda_ipc=CudaIpcHandle(
            mem_handle=b"\x02c" + bytes(64), storage_size_bytes=512, storage_offset_bytes=0,
            ref_counter_handle=b"/torch_1_2_3", ref_counter_offset=7, event_handle=bytes(64), event_sync_required=True,
        ) if transport == "cuda_ipc" else None,
    )  # fmt: skip
    msg = descriptor_to_proto(d)
    assert msg.table_row_words == d.table_words
    assert msg.HasField("cuda_ipc") == (transport == "cuda_ipc")
    assert descriptor_from_proto(msg) == d
    carried = set(cache_pb.SlabDescriptor.DESCRIPTOR.fields_by_name) - {"table_row_words"}
    assert carried == {f.name for f in dataclasses.fields(SlabDescriptor)}
    assert set(cache_pb.CudaIpcHandle.DESCRIPTOR.fields_by_name) == {f.name for f in dataclasses.fields(CudaIpcHandle)}
    # the retired pickled field stays reserved: no field may reuse its number or name
    assert "ipc_handle" not in cache_pb.SlabDescriptor.DESCRIPTOR.fields_by_name
    assert 12 not in cache_pb.SlabDescriptor.DESCRIPTOR.fields_by_number


def test_generate_request_carries_every_generation_request_field() -> None:
    names = {f.name for f in dataclasses.fields(GenerationRequest)}
    fields = gen_pb.GenerateRequest.DESCRIPTOR.fields_by_name
    assert set(fields) == names | {"expected_generation"}
    # explicit presence on everything with a default: an unset field is GenerationRequest's default, not zero;
    # except where the zero value is the default (UNSPECIFIED enums, empty keyframe bytes = no keyframe, no
    # references, no adapters: repeated fields; an empty quality = lossless; a false quality_audit = no audit run)
    zero_is_default = {"request_id", "task", "prompt", "output_type", "first_frame", "last_frame", "references",
                       "adapters", "quality", "quality_audit"}  # fmt: skip
    for name in names - zero_is_default:
        assert fields[name].has_presence, name
    assert fields["references"].is_repeated and fields["adapters"].is_repeated
    for name in zero_is_default - {"request_id", "prompt"}:
        assert not fields[name].has_presence, name
    assert gen_pb.AdapterUse.DESCRIPTOR.fields_by_name["scale"].has_presence  # unset: 1.0, not 0
    # every served task has an enum value, and the client maps onto it
    assert {gen_pb.Task.Name(v).removeprefix("TASK_").lower() for v in gen_pb.Task.values()} - {"unspecified"} == set(
        TASKS
    )


EVERYTHING = GenerationRequest(
    request_id="r.1", prompt="a red fox", num_inference_steps=7, flow_shift=5.5, audio_flow_shift=2.25,
    seed=2**63 - 1, height=64, width=256, num_frames=345, quality="fast", quality_audit=True,
)  # fmt: skip
KEYFRAMES = dataclasses.replace(
    EVERYTHING, task="fl2va", first_frame=b"\x89PNG first", last_frame=b"\xff\xd8 last", output_type="mp4"
)
FRAMES = dataclasses.replace(EVERYTHING, output_type="frames_and_wav")


@pytest.mark.parametrize(
    "req", [GenerationRequest(), EVERYTHING, KEYFRAMES, FRAMES], ids=["defaults", "everything", "fl2va-mp4", "zip"]
)
def test_request_round_trips_client_to_server(req: GenerationRequest) -> None:
    got, expected = request_from_proto(request_to_proto(req, expected_generation=3))
    assert (got, expected) == (req, 3)
    # a bare message (grpcurl with only a prompt) takes GenerationRequest's defaults
    bare, none = request_from_proto(gen_pb.GenerateRequest(request_id="x", prompt="p"))
    assert bare == GenerationRequest(request_id="x", prompt="p") and none is None


def test_client_refuses_a_task_the_protocol_cannot_carry() -> None:
    with pytest.raises(RequestError, match="task"):
        request_to_proto({"task": "t2v", "prompt": "a fox"})


def test_model_memory_matches_the_status_proto() -> None:
    mem = ModelMemory(transformer_bytes=1000, plan_tensor_bytes=600, held_plan_bytes=0)
    assert set(gen_pb.ModelMemory.DESCRIPTOR.fields_by_name) == set(mem.to_dict())
    msg = gen_pb.ModelMemory(**mem.to_dict())
    assert (msg.saved_bytes, msg.saved_fraction) == (600, 1.0)
