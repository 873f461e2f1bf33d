"""Device memory owner: the slab, the slot table, the host-tier buffer, copies and fences.

This is the one module of the cache that touches device memory and `torch.cuda`.

- Slab: `[num_slots, width, page_numel]` in the model dtype, allocated once, never moved.
  `cpu`: a file in /dev/shm (mode 0600, random name, unlinked on close) mapped shared;
  `cuda`: device memory (exported by CUDA IPC handle, see `export_ipc`).
- Slot table: int64 `[num_slots, ROW_WORDS + width]` in host shared memory (always a file),
  one row per slot: state, generation, length, publish sequence, key words.
- Host buffer: `[n_pages, page_numel]`; pinned on cuda (halving fallback, then pageable).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import tempfile
import warnings
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ditcore.config import DTYPES

log = logging.getLogger(__name__)

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


def _shm_dir(preferred: str) -> str:
    return preferred if os.path.isdir(preferred) and os.access(preferred, os.W_OK) else tempfile.gettempdir()


def _shm_file(shm_dir: str, kind: str, nbytes: int) -> str:
    fd, path = tempfile.mkstemp(prefix=f"ditserve-{kind}-", dir=_shm_dir(shm_dir))  # 0600, random name
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return path


def _unlink_all(paths: list[str]) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


class SlabMemory:
    """Owner side: allocates the slab and slot table once; `close()` frees and unlinks."""

    def __init__(self, num_slots: int, width: int, page_numel: int, dtype: torch.dtype, device: str, shm_dir: str):
        self.device = torch.device(device)
        self._paths: list[str] = []
        self._finalizer = weakref.finalize(self, _unlink_all, self._paths)
        elem = torch.empty((), dtype=dtype).element_size()
        numel = num_slots * width * page_numel
        table_numel = num_slots * (ROW_WORDS + width)
        table_path = _shm_file(shm_dir, "table", table_numel * 8)
        self._paths.append(table_path)
        self.table = torch.from_file(table_path, shared=True, size=table_numel, dtype=torch.int64)
        self.table = self.table.view(num_slots, ROW_WORDS + width)
        self.table.zero_()
        slab_path = ""
        if self.device.type == "cpu":
            slab_path = _shm_file(shm_dir, "slab", numel * elem)
            self._paths.append(slab_path)
            flat = torch.from_file(slab_path, shared=True, size=numel, dtype=dtype)
            self.slab = flat.view(num_slots, width, page_numel)
            transport = "shm"
        else:
            self.slab = torch.empty((num_slots, width, page_numel), dtype=dtype, device=self.device)
            transport = "cuda_ipc"
        ipc = export_ipc(self.slab) if transport == "cuda_ipc" else b""
        self.descriptor = SlabDescriptor(
            transport=transport,
            slab_path=slab_path,
            table_path=table_path,
            slab_bytes=numel * elem,
            table_bytes=table_numel * 8,
            dtype=_dtype_name(dtype),
            num_slots=num_slots,
            width=width,
            page_numel=page_numel,
            device=str(self.device),
            device_uuid=device_uuid(self.device),
            ipc_handle=ipc,
        )

    @property
    def paths(self) -> list[str]:
        return list(self._paths)

    def close(self) -> None:
        """Unlink the shared files (mappings already handed out stay valid until dropped)."""
        self._finalizer()


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


# ---------------------------------------------------------------------------- host buffer
@dataclass
class HostBuffer:
    pages: torch.Tensor  # (n_pages, page_numel)
    pinned: bool

    @property
    def n_pages(self) -> int:
        return int(self.pages.shape[0])


def available_memory_bytes() -> int:
    """Free host memory, bounded by the cgroup (container) limit when there is one."""
    try:
        avail = int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):  # pragma: no cover - non-Linux
        return 0
    try:  # cgroup v2: memory.max minus what the group already uses
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return avail


def allocate_host_pages(n_pages: int, page_numel: int, dtype: torch.dtype, pin: bool) -> HostBuffer:
    """Allocate the host tier. With `pin`, try pinned memory, halving on failure; then pageable."""
    if n_pages <= 0:
        return HostBuffer(torch.empty((0, page_numel), dtype=dtype), pinned=False)
    if pin:
        n = n_pages
        while n >= 1:
            try:
                buf = torch.empty((n, page_numel), dtype=dtype, pin_memory=True)
                if n < n_pages:
                    log.warning("host tier: pinned %d of %d pages (pinning more failed)", n, n_pages)
                return HostBuffer(buf, pinned=True)
            except RuntimeError as e:
                log.warning("host tier: pinning %d pages failed (%s); halving", n, e)
                n //= 2
        log.warning("host tier: pinned memory unavailable; using %d pageable pages", n_pages)
    return HostBuffer(torch.empty((n_pages, page_numel), dtype=dtype), pinned=False)


# ---------------------------------------------------------------------------- copies and fences
def device_uuid(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    props = torch.cuda.get_device_properties(device)
    return str(getattr(props, "uuid", ""))


class Copier:
    """Copies between host pages and slab slots on the cache's own stream, plus the fence."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor, pairs: list[tuple[int, int]]) -> int:
        """Copy src[s] -> dst[d] for each (d, s); runs consecutive on both sides become one copy.

        Returns the bytes copied. Pages of one plan (and plans taken in order) sit in
        consecutive rows, so a group's swap-in is a handful of large copies, not one per page.
        """
        nbytes = 0
        ordered = sorted(pairs)
        i = 0
        while i < len(ordered):
            d0, s0 = ordered[i]
            n = 1
            while i + n < len(ordered) and ordered[i + n] == (d0 + n, s0 + n):
                n += 1
            self.copy(dst[d0 : d0 + n], src[s0 : s0 + n])
            nbytes += n * dst.shape[1] * dst.element_size()
            i += n
        return nbytes

    def fence(self) -> None:
        """Wait until every copy and kernel issued for the cache has finished."""
        if self.device.type == "cuda":
            if self._stream is not None:
                self._stream.synchronize()
            torch.cuda.synchronize(self.device)


# ---------------------------------------------------------------------------- CUDA IPC
def export_ipc(slab: torch.Tensor) -> bytes:
    """Serialize the slab's CUDA IPC handle (torch's own reduction) for the Attach descriptor.

    Only ever sent over the sidecar's 0700 unix socket to the co-located generator.
    """
    import pickle

    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(slab)
    return pickle.dumps(args)


def local_device_for_uuid(uuid: str) -> torch.device:
    """This process's index of the CUDA device with `uuid` (CUDA_VISIBLE_DEVICES may differ)."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", i)) == uuid:
            return torch.device("cuda", i)
    raise ValueError(f"no visible CUDA device has uuid {uuid}")


def open_ipc(desc: SlabDescriptor) -> torch.Tensor:
    """Consumer side (cuda): open the slab from its IPC handle once per attachment."""
    import pickle

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(pickle.loads(desc.ipc_handle))
    device = local_device_for_uuid(desc.device_uuid)
    args[6] = device.index  # storage_device: our index for that UUID
    slab = rebuild_cuda_tensor(*args)
    want = (desc.num_slots, desc.width, desc.page_numel)
    if tuple(slab.shape) != want or str(slab.dtype).removeprefix("torch.") != desc.dtype:
        raise ValueError(f"IPC slab is {tuple(slab.shape)} {slab.dtype}, the descriptor says {want} {desc.dtype}")
    return slab
