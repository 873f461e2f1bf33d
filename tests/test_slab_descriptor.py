"""The slab descriptor the generator receives in Attach is data, never code: typed fields, checked field by field
before anything is mapped or opened (docs/architecture.md, "The slab and the lease protocol").

A descriptor crafted by whoever answers as the sidecar — a pickle payload whose unpickling would create a file (in
the CUDA IPC fields, or in the old `ipc_handle` field number), handles of the wrong length or type, a storage size
that disagrees with the geometry, an unknown dtype — is refused by the generator's own Attach path
(`SidecarClient._attach`) with an error naming the field and the rule; the file is never created and the weights
are never loaded. The generator also refuses a slab on another GPU than its model's, naming both UUIDs.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ditruntime.slab import (
    CUDA_IPC_HANDLE_SIZE,
    ROW_WORDS,
    CudaIpcHandle,
    SlabDescriptor,
    SlabDescriptorError,
    SlabMapping,
    SlabMappingClosedError,
    descriptor_from_proto,
    descriptor_to_proto,
    validate_descriptor,
)
from generator_service.cached import check_slab_device
from generator_service.health import ServingState
from generator_service.sidecar_client import SidecarClient
from generator_service.sidecar_port import Attachment
from protos.ditserve.plancache.v1 import plancache_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]


class _CreatesFile:
    """Unpickling this calls open(path, "w"): the file's existence is the proof that code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str, str]]:
        return (open, (str(self.path), "w"))


def _payload(marker: Path) -> bytes:
    return pickle.dumps(_CreatesFile(marker))


def _cuda_descriptor(**ipc: Any) -> SlabDescriptor:
    """A well-formed cuda_ipc descriptor (4 slots x 2 pages x 16 bfloat16) with `ipc` fields overridden."""
    fields: dict[str, Any] = dict(
        mem_handle=b"\x02c" + bytes(range(CUDA_IPC_HANDLE_SIZE)), storage_size_bytes=4 * 2 * 16 * 2,
        storage_offset_bytes=0, ref_counter_handle=b"/torch_4242_123456789_0", ref_counter_offset=3,
        event_handle=bytes(CUDA_IPC_HANDLE_SIZE), event_sync_required=True,
    )  # fmt: skip
    fields.update(ipc)
    return SlabDescriptor(
        transport="cuda_ipc", slab_path="", table_path="/dev/shm/ditserve-table-x", slab_bytes=4 * 2 * 16 * 2,
        table_bytes=4 * (ROW_WORDS + 2) * 8, dtype="bfloat16", num_slots=4, width=2, page_numel=16, device="cuda:0",
        device_uuid="GPU-6a0e2c1b-1d7c-4f38-9a3e-4b5c6d7e8f90", cuda_ipc=CudaIpcHandle(**fields),
    )  # fmt: skip


class _Refused(Exception):
    pass


def _client() -> tuple[SidecarClient, list[Attachment]]:
    vetted: list[Attachment] = []
    client = SidecarClient("unix:/nonexistent/plancache.sock", 0.1, vetted.append, ServingState(False, lambda *_: None))
    return client, vetted


def _attach(msg: pb.SlabDescriptor | bytes) -> tuple[SidecarClient, list[Attachment]]:
    """Feed one Attach session message through the generator's own attach path."""
    slab = pb.SlabDescriptor.FromString(msg) if isinstance(msg, bytes) else msg
    client, vetted = _client()
    try:
        client._attach(pb.Session(session_id="s", slab=slab, generation=1, weights_path="/w", fingerprint="f"))
    finally:
        client.close()
    return client, vetted


def _malicious(marker: Path) -> list[tuple[str, SlabDescriptor, str]]:
    evil = _payload(marker)
    return [
        ("pickle as mem_handle", _cuda_descriptor(mem_handle=evil), "cuda_ipc.mem_handle"),
        ("pickle as ref_counter_handle", _cuda_descriptor(ref_counter_handle=evil), "cuda_ipc.ref_counter_handle"),
        ("pickle as event_handle", _cuda_descriptor(event_handle=evil), "cuda_ipc.event_handle"),
        ("short mem_handle", _cuda_descriptor(mem_handle=b"\x02c" + bytes(10)), "cuda_ipc.mem_handle"),
        ("expandable segment", _cuda_descriptor(mem_handle=b"\x02e" + bytes(64)), "expandable"),
        ("long event_handle", _cuda_descriptor(event_handle=bytes(65)), "cuda_ipc.event_handle"),
        ("counter path escape", _cuda_descriptor(ref_counter_handle=b"/../../etc/passwd"), "ref_counter_handle"),
        ("counter offset", _cuda_descriptor(ref_counter_offset=10_000), "cuda_ipc.ref_counter_offset"),
        ("storage size", _cuda_descriptor(storage_size_bytes=1 << 40), "cuda_ipc.storage_size_bytes"),
        ("storage offset", _cuda_descriptor(storage_offset_bytes=3), "cuda_ipc.storage_offset_bytes"),
        ("no export", dataclasses.replace(_cuda_descriptor(), cuda_ipc=None), "cuda_ipc: missing"),
        ("unknown dtype", dataclasses.replace(_cuda_descriptor(), dtype="object"), "dtype: 'object' is not one of"),
        ("geometry", dataclasses.replace(_cuda_descriptor(), num_slots=8), "slab_bytes"),
        ("huge geometry", dataclasses.replace(_cuda_descriptor(), num_slots=10**7), "num_slots"),
        ("device uuid", dataclasses.replace(_cuda_descriptor(), device_uuid="x" * 300), "device_uuid"),
        ("relative table", dataclasses.replace(_cuda_descriptor(), table_path="table"), "table_path"),
        ("unknown transport", dataclasses.replace(_cuda_descriptor(), transport="unknown"), "transport"),
    ]


def test_a_well_formed_cuda_descriptor_passes_validation_and_round_trips() -> None:
    d = _cuda_descriptor()
    assert validate_descriptor(d) == torch.bfloat16
    assert descriptor_from_proto(descriptor_to_proto(d)) == d


CASES = [name for name, _, _ in _malicious(Path("/unused"))]


@pytest.mark.parametrize("name", CASES)
def test_a_malicious_descriptor_is_refused_by_the_attach_path_and_nothing_runs(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "pwned"
    desc, match = next((d, m) for n, d, m in _malicious(marker) if n == name)
    if desc.transport == "unknown":  # not expressible by the dataclass's encoder: the raw enum value 0
        msg = descriptor_to_proto(dataclasses.replace(desc, transport="cuda_ipc"))
        msg.transport = pb.TRANSPORT_UNSPECIFIED
    else:
        msg = descriptor_to_proto(desc)
    with pytest.raises(SlabDescriptorError, match=re.escape(match)) as err:
        _attach(msg)
    assert str(err.value).startswith("slab descriptor: "), name
    assert not marker.exists(), f"{name}: code ran while reading the descriptor"


def test_a_pickle_in_the_retired_ipc_handle_field_is_ignored(tmp_path: Path) -> None:
    """An old sidecar's (or an attacker's) field 12 is an unknown field now: never read, never unpickled."""
    marker = tmp_path / "pwned"
    payload = _payload(marker)
    wire = descriptor_to_proto(dataclasses.replace(_cuda_descriptor(), cuda_ipc=None)).SerializeToString()
    wire += bytes([12 << 3 | 2]) + _varint(len(payload)) + payload
    with pytest.raises(SlabDescriptorError, match="cuda_ipc: missing"):
        _attach(wire)
    assert not marker.exists()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def test_a_refused_descriptor_maps_nothing_and_vets_nothing(tmp_path: Path) -> None:
    client, vetted = _client()
    try:
        with pytest.raises(SlabDescriptorError):
            client._attach(pb.Session(session_id="s", slab=descriptor_to_proto(_cuda_descriptor(event_handle=b""))))
        assert vetted == [] and client.attachment is None
    finally:
        client.close()


def test_no_pickle_on_any_path_fed_by_another_process() -> None:
    """No module of the services or their runtime deserializes with pickle (or imports it)."""
    offenders = []
    for pkg in ("ditruntime", "generator_service", "plancache_service", "ditserve", "ditcore"):
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text()
            if re.search(r"^\s*(import pickle|from pickle import)|pickle\.loads?\(", text, re.M):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_shm_descriptor_fields_are_checked_too(tmp_path: Path) -> None:
    good = SlabDescriptor(
        transport="shm", slab_path=str(tmp_path / "slab"), table_path=str(tmp_path / "table"), slab_bytes=4 * 2 * 16 * 4,
        table_bytes=4 * (ROW_WORDS + 2) * 8, dtype="float32", num_slots=4, width=2, page_numel=16, device="cpu",
    )  # fmt: skip
    assert validate_descriptor(good) == torch.float32
    with pytest.raises(SlabDescriptorError, match="cuda_ipc: the shm transport is the cpu slab"):
        validate_descriptor(dataclasses.replace(good, cuda_ipc=_cuda_descriptor().cuda_ipc))
    with pytest.raises(SlabDescriptorError, match="slab_path"):
        validate_descriptor(dataclasses.replace(good, slab_path="relative"))
    with pytest.raises(SlabDescriptorError, match="dtype: 'float64' is not one of"):
        validate_descriptor(dataclasses.replace(good, dtype="float64"))


def test_a_closed_mapping_refuses_reads_and_drops_the_slab(tmp_path: Path) -> None:
    slab_path, table_path = tmp_path / "slab", tmp_path / "table"
    slab_path.write_bytes(bytes(4 * 2 * 16 * 4))
    table_path.write_bytes(bytes(4 * (ROW_WORDS + 2) * 8))
    desc = SlabDescriptor(
        transport="shm", slab_path=str(slab_path), table_path=str(table_path), slab_bytes=4 * 2 * 16 * 4,
        table_bytes=4 * (ROW_WORDS + 2) * 8, dtype="float32", num_slots=4, width=2, page_numel=16, device="cpu",
    )  # fmt: skip
    mapping = SlabMapping.open(desc)
    assert mapping.slab.shape == (4, 2, 16) and not mapping.closed
    assert mapping.close() is True and mapping.closed
    with pytest.raises(SlabMappingClosedError):
        _ = mapping.slab
    assert mapping.close() is True  # idempotent


# ---------------------------------------------------------------------------- device check (generator side)
def test_a_slab_on_another_gpu_is_refused_naming_both_uuids() -> None:
    uuids = {0: "GPU-aaaa", 1: "GPU-bbbb"}

    def uuid_of(d: torch.device) -> str:
        return uuids[d.index or 0]

    check_slab_device("cuda_ipc", "cuda:0", "GPU-aaaa", torch.device("cuda", 0), uuid_of)  # same GPU: accepted
    with pytest.raises(ValueError, match=r"GPU UUID GPU-bbbb .*GPU UUID GPU-aaaa"):
        check_slab_device("cuda_ipc", "cuda:0", "GPU-bbbb", torch.device("cuda", 0), uuid_of)
    with pytest.raises(ValueError, match=r"UUID GPU-aaaa.* runs on cpu"):
        check_slab_device("cuda_ipc", "cuda:0", "GPU-aaaa", torch.device("cpu"), uuid_of)
    with pytest.raises(ValueError, match=r"shared memory.* runs on cuda:0"):
        check_slab_device("shm", "cpu", "", torch.device("cuda", 0), uuid_of)
    check_slab_device("shm", "cpu", "", torch.device("cpu"), uuid_of)


def test_the_marker_mechanism_really_runs_code(tmp_path: Path) -> None:
    """Control: unpickling the payload used above does create the file (so its absence above means something)."""
    marker = tmp_path / "pwned"
    pickle.loads(_payload(marker)).close()  # the control of this test, on our own bytes
    assert marker.exists()
    os.unlink(marker)


def test_the_sidecar_refuses_to_export_under_expandable_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    from plancache_service.device import export_ipc

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    with pytest.raises(ValueError, match="expandable_segments:True"):
        export_ipc(torch.empty(4))
