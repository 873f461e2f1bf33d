"""The slab descriptor the generator receives in Attach is data, never code: typed fields, checked field by field
before anything is mapped or opened (docs/architecture.md, "The slab and the lease protocol").

A descriptor crafted by whoever answers as the sidecar — a pickle payload whose unpickling would create a file (in
the CUDA IPC fields, or in the old `ipc_handle` field number), handles of the wrong length or type, a storage size
that disagrees with the geometry, an unknown dtype — is refused by the generator's own Attach path
(`SidecarClient._attach`) with an error naming the field and the rule; the file is never created and the weights
are never loaded. The generator also refuses a slab on another GPU than its model's, naming both UUIDs, before it
opens the IPC handle (which would create a CUDA context on that GPU), and maps only the sidecar's own files: regular
files named `ditserve-table-*` / `ditserve-slab-*` directly in the shm directory, opened without following a symlink.
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

import ditruntime.slab as slab_module
from ditruntime.slab import (
    CUDA_IPC_HANDLE_SIZE,
    ROW_WORDS,
    CudaIpcHandle,
    SlabDescriptor,
    SlabDescriptorError,
    SlabMapping,
    SlabMappingClosedError,
    check_device,
    descriptor_from_proto,
    descriptor_to_proto,
    map_slab,
    validate_descriptor,
)
from generator_service.backends.sidecar_client import SidecarClient
from generator_service.backends.sidecar_port import Attachment
from generator_service.health import ServingState
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


def _client(device: torch.device | None = None) -> tuple[SidecarClient, list[Attachment]]:
    vetted: list[Attachment] = []
    client = SidecarClient(
        "unix:/nonexistent/plancache.sock", 0.1, vetted.append, ServingState(False, lambda *_: None), device=device
    )
    return client, vetted


def _attach(
    msg: pb.SlabDescriptor | bytes, device: torch.device | None = None
) -> tuple[SidecarClient, list[Attachment]]:
    """Feed one Attach session message through the generator's own attach path."""
    slab = pb.SlabDescriptor.FromString(msg) if isinstance(msg, bytes) else msg
    client, vetted = _client(device)
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
        ("any file as table", dataclasses.replace(_cuda_descriptor(), table_path="/etc/passwd"), "ditserve-table-"),
        (
            "table path escape",
            dataclasses.replace(_cuda_descriptor(), table_path="/dev/shm/../etc/ditserve-table-x"),
            "normalized",
        ),
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


def _shm_descriptor(shm_dir: Path) -> SlabDescriptor:
    """A well-formed shm descriptor (4 slots x 2 pages x 16 float32) of files in `shm_dir` (not created here)."""
    return SlabDescriptor(
        transport="shm", slab_path=str(shm_dir / "ditserve-slab-abc_123"), table_path=str(shm_dir / "ditserve-table-x9"),
        slab_bytes=4 * 2 * 16 * 4, table_bytes=4 * (ROW_WORDS + 2) * 8, dtype="float32", num_slots=4, width=2,
        page_numel=16, device="cpu",
    )  # fmt: skip


def _write_files(desc: SlabDescriptor) -> None:
    Path(desc.slab_path).write_bytes(bytes(desc.slab_bytes))
    Path(desc.table_path).write_bytes(bytes(desc.table_bytes))


def test_shm_descriptor_fields_are_checked_too(tmp_path: Path) -> None:
    good = _shm_descriptor(tmp_path)
    assert validate_descriptor(good) == torch.float32
    with pytest.raises(SlabDescriptorError, match="cuda_ipc: the shm transport is the cpu slab"):
        validate_descriptor(dataclasses.replace(good, cuda_ipc=_cuda_descriptor().cuda_ipc))
    with pytest.raises(SlabDescriptorError, match="slab_path"):
        validate_descriptor(dataclasses.replace(good, slab_path="relative"))
    with pytest.raises(SlabDescriptorError, match=r"slab_path: .*the file name must be the sidecar's, ditserve-slab-"):
        validate_descriptor(dataclasses.replace(good, slab_path=str(tmp_path / "ditserve-table-x9")))
    with pytest.raises(SlabDescriptorError, match="dtype: 'float64' is not one of"):
        validate_descriptor(dataclasses.replace(good, dtype="float64"))


def test_a_closed_mapping_refuses_reads_and_drops_the_slab(tmp_path: Path) -> None:
    desc = _shm_descriptor(tmp_path)
    _write_files(desc)
    mapping = SlabMapping.open(desc, shm_dirs=[tmp_path])
    assert mapping.slab.shape == (4, 2, 16) and not mapping.closed
    assert mapping.close() is True and mapping.closed
    with pytest.raises(SlabMappingClosedError):
        _ = mapping.slab
    assert mapping.close() is True  # idempotent


# ---------------------------------------------------------------------------- the sidecar's files only
def test_only_the_sidecars_regular_files_in_the_shm_dir_are_mapped(tmp_path: Path) -> None:
    """A rogue sidecar cannot make the generator map any readable file of the right size: the name, the directory,
    the file type and the size are checked on the opened file, and a symlink is refused, not followed."""
    shm, elsewhere = tmp_path / "shm", tmp_path / "elsewhere"
    shm.mkdir()
    elsewhere.mkdir()
    good = _shm_descriptor(shm)
    _write_files(good)
    slab, table, _maps = map_slab(good, shm_dirs=[shm])  # the sidecar's own files: mapped
    assert slab.shape == (4, 2, 16) and table.shape == (4, ROW_WORDS + 2)
    secret = elsewhere / "secret"  # any readable file of the table's size
    secret.write_bytes(b"s" * good.table_bytes)
    planted = shm / "ditserve-table-planted"
    planted.symlink_to(secret)
    same_name_elsewhere = elsewhere / "ditserve-table-x9"
    same_name_elsewhere.write_bytes(bytes(good.table_bytes))
    (shm / "ditserve-table-dir").mkdir()
    os.mkfifo(shm / "ditserve-table-fifo")
    (shm / "ditserve-table-short").write_bytes(bytes(8))
    cases = [
        (str(secret), r"table_path: .*the file name must be the sidecar's, ditserve-table-"),
        (str(planted), r"table_path: .*ditserve-table-planted' is a symlink \(not followed\)"),
        (str(same_name_elsewhere), r"table_path: .*elsewhere/ditserve-table-x9' is not in the shm directory"),
        (
            str(shm / "ditserve-table-dir"),
            r"table_path: .*ditserve-table-dir' (is not a regular file|cannot be opened)",
        ),
        (str(shm / "ditserve-table-fifo"), r"table_path: .*ditserve-table-fifo' is not a regular file"),
        (str(shm / "ditserve-table-short"), rf"table_path: .* is 8 bytes, the descriptor says {good.table_bytes}"),
        (str(shm / "ditserve-table-absent"), r"table_path: .*ditserve-table-absent' cannot be opened"),
    ]
    for path, match in cases:
        with pytest.raises(SlabDescriptorError, match=match):
            map_slab(dataclasses.replace(good, table_path=path), shm_dirs=[shm])
    with pytest.raises(SlabDescriptorError, match=r"slab_path: .* is a symlink"):
        slab_link = shm / "ditserve-slab-link"
        slab_link.symlink_to(shm / "ditserve-slab-abc_123")  # even to the sidecar's own file
        map_slab(dataclasses.replace(good, slab_path=str(slab_link)), shm_dirs=[shm])


def test_by_default_only_dev_shm_and_the_temp_dir_are_shm_dirs(tmp_path: Path) -> None:
    """The generator's attach path maps from /dev/shm (the sidecar's shm dir) or the temp dir (its fallback)."""
    assert slab_module.default_shm_dirs()[0] == "/dev/shm"
    desc = _shm_descriptor(tmp_path)
    _write_files(desc)
    with pytest.raises(SlabDescriptorError, match="is not in the shm directory"):
        _attach(descriptor_to_proto(desc))


# ---------------------------------------------------------------------------- device check (generator side)
def test_a_slab_on_another_gpu_is_refused_naming_both_uuids() -> None:
    uuids = {0: "GPU-aaaa", 1: "GPU-bbbb"}

    def uuid_of(d: torch.device) -> str:
        return uuids[d.index or 0]

    def on(uuid: str) -> SlabDescriptor:
        return dataclasses.replace(_cuda_descriptor(), device_uuid=uuid)

    def visible() -> list[str]:
        return list(uuids.values())

    shm = dataclasses.replace(_cuda_descriptor(), transport="shm", device="cpu", device_uuid="", cuda_ipc=None)
    check_device(on("GPU-aaaa"), torch.device("cuda", 0), uuid_of, visible)  # same GPU: accepted
    with pytest.raises(ValueError, match=r"GPU UUID GPU-bbbb .*GPU UUID GPU-aaaa"):
        check_device(on("GPU-bbbb"), torch.device("cuda", 0), uuid_of, visible)
    with pytest.raises(ValueError, match=r"UUID GPU-aaaa.* runs on cpu"):
        check_device(on("GPU-aaaa"), torch.device("cpu"), uuid_of, visible)
    with pytest.raises(ValueError, match=r"shared memory.* runs on cuda:0"):
        check_device(shm, torch.device("cuda", 0), uuid_of, visible)
    check_device(shm, torch.device("cpu"), uuid_of, visible)


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


# ---------------------------------------------------------------------------- device check before the IPC open
class _Spy:
    """Records its calls; returns `result`, or raises AssertionError naming itself when `result` is None."""

    def __init__(self, name: str, result: Any = None) -> None:
        self.name, self.result = name, result
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(args)
        if self.result is None:
            raise AssertionError(f"{self.name} was called before the device check refused the slab")
        return self.result


MODEL_UUID, SLAB_UUID = "GPU-aaaa", _cuda_descriptor().device_uuid


@pytest.fixture
def ipc_spies(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Spy]:
    """CPU stand-ins for the CUDA runtime: cuda:0 is GPU-aaaa; the IPC open and the file mapping are spies."""
    spies = {name: _Spy(name) for name in ("open_ipc", "new_shared_cuda", "open_shm_file")}
    monkeypatch.setattr(slab_module, "device_uuid", lambda d: MODEL_UUID if d.type == "cuda" else "")
    monkeypatch.setattr(slab_module, "visible_uuids", lambda: [MODEL_UUID])
    monkeypatch.setattr(slab_module, "open_ipc", spies["open_ipc"])
    monkeypatch.setattr(slab_module, "open_shm_file", spies["open_shm_file"])
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", spies["new_shared_cuda"], raising=False)
    return spies


def _nothing_opened(spies: dict[str, _Spy]) -> bool:
    return all(not spy.calls for spy in spies.values())


def test_a_slab_on_a_gpu_this_process_cannot_see_is_refused_before_the_ipc_open(ipc_spies: dict[str, _Spy]) -> None:
    with pytest.raises(ValueError, match=(
        rf"the slab is on GPU UUID {SLAB_UUID} \(cuda:0 at the sidecar\), which no CUDA device visible to this "
        rf"process has \(CUDA_VISIBLE_DEVICES=.*\); the model runs on cuda:0, GPU UUID {MODEL_UUID}"
    )):  # fmt: skip
        _attach(descriptor_to_proto(_cuda_descriptor()), torch.device("cuda", 0))
    assert _nothing_opened(ipc_spies), "the IPC handle (or a file) was opened before the device check"


def test_a_slab_on_another_visible_gpu_is_refused_before_the_ipc_open(
    ipc_spies: dict[str, _Spy], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slab_module, "visible_uuids", lambda: [MODEL_UUID, SLAB_UUID])
    with pytest.raises(ValueError, match=rf"GPU UUID {SLAB_UUID} .*runs on cuda:0, GPU UUID {MODEL_UUID}: start both"):
        _attach(descriptor_to_proto(_cuda_descriptor()), torch.device("cuda", 0))
    with pytest.raises(ValueError, match=rf"GPU UUID {SLAB_UUID}\) but the model runs on cpu"):
        _attach(descriptor_to_proto(_cuda_descriptor()), torch.device("cpu"))
    assert _nothing_opened(ipc_spies)


def test_the_slab_on_the_models_gpu_is_opened_there_after_the_check(
    ipc_spies: dict[str, _Spy], monkeypatch: pytest.MonkeyPatch
) -> None:
    desc = dataclasses.replace(_cuda_descriptor(), device_uuid=MODEL_UUID)
    mapped: list[str] = []

    def map_table(name: str, *_: Any) -> torch.Tensor:
        mapped.append(name)
        return torch.zeros(4 * (ROW_WORDS + 2), dtype=torch.int64)

    monkeypatch.setattr(slab_module, "_map_readonly", map_table)
    ipc_spies["open_ipc"].result = torch.zeros(4, 2, 16)
    slab, table, _maps = map_slab(desc, torch.device("cuda", 0))
    assert mapped == ["table_path"] and table.shape == (4, ROW_WORDS + 2)
    assert ipc_spies["open_ipc"].calls == [(desc, torch.device("cuda", 0))] and slab.shape == (4, 2, 16)
