"""Device memory owner: the slab, the slot table, the host-tier buffer, copies and fences.

This is the one module of the cache that touches device memory and `torch.cuda`.

- Slab: `[num_slots, width, page_numel]` in the checkpoint's projection dtype, allocated once, never moved.
  `cpu`: a file in /dev/shm (mode 0600, random name, unlinked on close) mapped shared;
  `cuda`: device memory (exported by CUDA IPC handle, see `export_ipc`).
- Slot table: int64 `[num_slots, ROW_WORDS + width]` in host shared memory (always a file),
  one row per slot: state, generation, length, publish sequence, key words.
- Host buffer: `[n_pages, page_numel]`; pinned on cuda (halving fallback, then pageable).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from ditcore.plans import dtype_name
from ditruntime.slab import ROW_WORDS, SlabDescriptor, device_uuid

log = logging.getLogger(__name__)


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
            dtype=dtype_name(dtype),
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
