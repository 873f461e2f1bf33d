"""The slab contract both services import: slot-table row layout, the slab descriptor and its
one proto conversion, and the consumer side of sharing (map the table and slab read-only, open
a CUDA IPC handle). The sidecar owns allocation (`plancache_service.device`); the generator
only maps. See docs/architecture.md, "The slab and the lease protocol".
"""

from __future__ import annotations

import mmap
import pickle
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ditcore.plans import DTYPES
from protos.ditserve.plancache.v1 import plancache_pb2 as pb

# slot-table row layout (int64 words)
COL_STATE, COL_GENERATION, COL_LENGTH, COL_SEQ = 0, 1, 2, 3
ROW_WORDS = 4
EMPTY, FILLING, READY = 0, 1, 2
STATE_NAMES = {EMPTY: "EMPTY", FILLING: "FILLING", READY: "READY"}


@dataclass(frozen=True)
class SlabDescriptor:
    """What a consumer needs to map the slab and the table (sent by Attach)."""

    transport: str  # "shm" (cpu) or "cuda_ipc"
    slab_path: str  # shm file of the slab ("" on cuda)
    table_path: str  # shm file of the slot table
    slab_bytes: int
    table_bytes: int
    dtype: str
    num_slots: int
    width: int
    page_numel: int
    device: str  # "cpu" or "cuda:N"
    device_uuid: str = ""
    ipc_handle: bytes = b""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def table_words(self) -> int:
        return ROW_WORDS + self.width


def map_slab(desc: SlabDescriptor) -> tuple[torch.Tensor, torch.Tensor, list[mmap.mmap]]:
    """Consumer side: check sizes, then map the table (and, on cpu, the slab) read-only.

    On cuda the slab comes from its IPC handle (`open_ipc`). Returns (slab, table, mmaps);
    keep the mmaps alive as long as the tensors are used.
    """
    dtype = DTYPES[desc.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    want_slab = desc.num_slots * desc.width * desc.page_numel * elem
    want_table = desc.num_slots * desc.table_words * 8
    if desc.slab_bytes != want_slab or desc.table_bytes != want_table:
        raise ValueError(
            f"slab descriptor is inconsistent: slab_bytes={desc.slab_bytes} (geometry says {want_slab}), "
            f"table_bytes={desc.table_bytes} (geometry says {want_table})"
        )
    maps: list[mmap.mmap] = []
    table = _map_readonly(desc.table_path, want_table, torch.int64, maps).view(desc.num_slots, desc.table_words)
    if desc.transport == "cuda_ipc":
        return open_ipc(desc), table, maps
    if desc.transport != "shm":
        raise ValueError(f"unknown slab transport {desc.transport!r}")
    slab = _map_readonly(desc.slab_path, want_slab, dtype, maps).view(desc.num_slots, desc.width, desc.page_numel)
    return slab, table, maps


def _map_readonly(path: str, nbytes: int, dtype: torch.dtype, maps: list[mmap.mmap]) -> torch.Tensor:
    size = Path(path).stat().st_size
    if size != nbytes:
        raise ValueError(f"{path}: file is {size} bytes, the descriptor says {nbytes}")
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), nbytes, prot=mmap.PROT_READ)
    maps.append(mm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: writes would fault
        return torch.frombuffer(mm, dtype=dtype)


_TRANSPORT_TO_PROTO = {"shm": pb.TRANSPORT_SHM, "cuda_ipc": pb.TRANSPORT_CUDA_IPC}
_TRANSPORT_FROM_PROTO = {v: k for k, v in _TRANSPORT_TO_PROTO.items()}


def descriptor_to_proto(d: SlabDescriptor) -> pb.SlabDescriptor:
    """The Attach wire form; every dataclass field has a proto counterpart (test_slab_contract)."""
    fields = d.to_dict()
    fields["transport"] = _TRANSPORT_TO_PROTO[d.transport]
    return pb.SlabDescriptor(**fields, table_row_words=d.table_words)


def descriptor_from_proto(msg: pb.SlabDescriptor) -> SlabDescriptor:
    """The consumer's view of an Attach descriptor (validated again by `map_slab`)."""
    names = [f for f in SlabDescriptor.__dataclass_fields__ if f != "transport"]
    kwargs: dict[str, Any] = {n: getattr(msg, n) for n in names}
    return SlabDescriptor(transport=_TRANSPORT_FROM_PROTO.get(msg.transport, "unknown"), **kwargs)


# ---------------------------------------------------------------------------- CUDA devices and IPC
def device_uuid(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    props = torch.cuda.get_device_properties(device)
    return str(getattr(props, "uuid", ""))


def local_device_for_uuid(uuid: str) -> torch.device:
    """This process's index of the CUDA device with `uuid` (CUDA_VISIBLE_DEVICES may differ)."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", i)) == uuid:
            return torch.device("cuda", i)
    raise ValueError(f"no visible CUDA device has uuid {uuid}")


def open_ipc(desc: SlabDescriptor) -> torch.Tensor:
    """Consumer side (cuda): open the slab from its IPC handle once per attachment."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(pickle.loads(desc.ipc_handle))
    device = local_device_for_uuid(desc.device_uuid)
    args[6] = device.index  # storage_device: our index for that UUID
    slab = rebuild_cuda_tensor(*args)
    want = (desc.num_slots, desc.width, desc.page_numel)
    if tuple(slab.shape) != want or str(slab.dtype).removeprefix("torch.") != desc.dtype:
        raise ValueError(f"IPC slab is {tuple(slab.shape)} {slab.dtype}, the descriptor says {want} {desc.dtype}")
    return slab
