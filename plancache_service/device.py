"""Device memory owner: the slab, the slot table, CUDA IPC exports, copies and fences (the host tier's buffer is
`host_buffer`'s).

This is the one module of the cache that touches device memory, and with `host_buffer` (which page-locks the host
tier's chunks) the only ones that touch `torch.cuda`.

- Slab: `[num_slots, width, page_numel]` in the checkpoint's projection dtype, allocated once, never moved; one per
  device of a replica (`--devices`), all with the same layout and sharing the one slot table.
  `cpu`: a file in /dev/shm (mode 0600, random name `ditserve-slab-*`, unlinked on close) mapped shared;
  `cuda`: device memory, exported once per Attach session (`SlabMemory.export`, `export_ipc`: typed
  fields, no pickle). Closing a session's export is bookkeeping (`live_exports`): torch keeps what each
  export registered on the slab's storage until the slab is freed (see `SlabMemory.export`).
  `check_ipc_allocator` refuses an allocator configuration whose memory cannot be shared by CUDA IPC.
- Slot table: int64 `[num_slots, ROW_WORDS + width]` in host shared memory (always a file, `ditserve-table-*`),
  one row per slot: state, generation, length, publish sequence, key words.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from ditcore.plans import dtype_name
from ditruntime.slab import (
    ROW_WORDS,
    SLAB_PREFIX,
    TABLE_PREFIX,
    CudaIpcHandle,
    SlabDescriptor,
    device_uuid,
    validate_descriptor,
)


def _shm_dir(preferred: str) -> str:
    return preferred if os.path.isdir(preferred) and os.access(preferred, os.W_OK) else tempfile.gettempdir()


def _shm_file(shm_dir: str, prefix: str, nbytes: int) -> str:
    """A new shared-memory file of `nbytes`, its pages reserved now (`posix_fallocate`): a /dev/shm too small for it
    is an OSError naming the directory at start, never a SIGBUS when a page is first written mid-request."""
    # 0600, random name; the generator maps only files named so (ditruntime.slab.open_shm_file)
    directory = _shm_dir(shm_dir)
    fd, path = tempfile.mkstemp(prefix=prefix, dir=directory)
    try:
        os.ftruncate(fd, nbytes)
        if nbytes and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        _unlink_all([path])
        raise OSError(e.errno, f"cannot reserve {nbytes} bytes of shared memory in {directory} ({e.strerror}): "
                      "free space there or lower --gpu-plans", path) from e  # fmt: skip
    os.close(fd)
    return path


def _unlink_all(paths: list[str]) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


class SlabMemory:
    """Owner side: allocates one slab per device (all with the same layout) and the one slot table once; `close()`
    frees and unlinks. A replica of N generator ranks gets N slabs, slab r on rank r's device, and every rank reads
    the same slot index under one lease; `slab` / `descriptor` are the first's (the single-device case)."""

    def __init__(
        self, num_slots: int, width: int, page_numel: int, dtype: torch.dtype, device: str | Sequence[str], shm_dir: str
    ):
        devices = [device] if isinstance(device, str) else list(device)
        if not devices:
            raise ValueError("a slab needs at least one device")
        self.devices = [torch.device(d) for d in devices]
        self.device = self.devices[0]
        self._paths: list[str] = []
        self._finalizer = weakref.finalize(self, _unlink_all, self._paths)
        elem = torch.empty((), dtype=dtype).element_size()
        numel = num_slots * width * page_numel
        table_numel = num_slots * (ROW_WORDS + width)
        table_path = _shm_file(shm_dir, TABLE_PREFIX, table_numel * 8)
        self._paths.append(table_path)
        self.table = torch.from_file(table_path, shared=True, size=table_numel, dtype=torch.int64)
        self.table = self.table.view(num_slots, ROW_WORDS + width)
        self.table.zero_()
        self.slabs: list[torch.Tensor] = []
        self.descriptors: list[SlabDescriptor] = []
        for target in self.devices:
            slab_path = ""
            if target.type == "cpu":
                slab_path = _shm_file(shm_dir, SLAB_PREFIX, numel * elem)
                self._paths.append(slab_path)
                flat = torch.from_file(slab_path, shared=True, size=numel, dtype=dtype)
                flat.view(torch.uint8).zero_()  # map every page now: a fill's first write costs no page fault
                slab = flat.view(num_slots, width, page_numel)
                transport = "shm"
            else:
                slab = torch.empty((num_slots, width, page_numel), dtype=dtype, device=target)
                transport = "cuda_ipc"
            self.slabs.append(slab)
            self.descriptors.append(
                SlabDescriptor(
                    transport=transport,
                    slab_path=slab_path,
                    table_path=table_path,
                    slab_bytes=numel * elem,
                    table_bytes=table_numel * 8,
                    dtype=dtype_name(dtype),
                    num_slots=num_slots,
                    width=width,
                    page_numel=page_numel,
                    device=str(target),
                    device_uuid=device_uuid(target),
                )
            )
        self.slab = self.slabs[0]
        self.descriptor = self.descriptors[0]
        self._exports: set[SlabExport] = set()

    @property
    def paths(self) -> list[str]:
        return list(self._paths)

    def export(self) -> SlabExport:
        """One Attach session's descriptor. On cuda it carries an IPC export of its own: torch gives
        every export its own reference counter, which one consumer releases once, so an export is
        never handed to a second session. Close it when the session ends.

        Closing is bookkeeping only (`live_exports`, at most one per live session); it cannot revoke
        anything. Each `_share_cuda_()` wraps the slab's storage in one more torch `CudaIPCSentData`: an
        8-byte slot in torch's reference-counter file (/dev/shm/torch_*, 80 KB per 10 000 slots) and an
        interprocess CUDA event (torch keeps at most 1000 at once, then synchronizes the stream instead).
        They stay on the storage until the slab itself is freed (sidecar exit); `torch.cuda.ipc_collect()`
        frees only blocks their owner already freed. So each Attach (a generator start or reconnect) costs a
        small, bounded amount, released when the sidecar exits: a few hundred bytes of host memory, one
        counter slot and at most one event; never device memory.
        """
        descriptors = []
        for desc, slab in zip(self.descriptors, self.slabs, strict=True):
            if desc.transport == "cuda_ipc":
                desc = replace(desc, cuda_ipc=export_ipc(slab))
            validate_descriptor(desc)  # what the generator will check, checked here first
            descriptors.append(desc)
        export = SlabExport(self, descriptors)
        self._exports.add(export)
        return export

    @property
    def live_exports(self) -> int:
        """Exports handed out and not closed yet (at most one per live session)."""
        return len(self._exports)

    def _closed(self, export: SlabExport) -> None:
        # bookkeeping only: torch's per-export counter slot and event stay on the slab until it is freed
        self._exports.discard(export)

    def close(self) -> None:
        """Close every export and unlink the shared files (mappings already handed out stay valid until dropped)."""
        for export in list(self._exports):
            export.close()
        self._finalizer()


class SlabExport:
    """The slab as one Attach session sees it; `close()` (idempotent) ends that session's export in the
    sidecar's bookkeeping (`SlabMemory.live_exports`); torch's registration of it stays until the slab is freed."""

    def __init__(self, memory: SlabMemory, descriptors: Sequence[SlabDescriptor]) -> None:
        self._memory: SlabMemory | None = memory
        self.descriptors = list(descriptors)
        """One per slab, in device (rank) order; on cuda each carries this session's own IPC export of it."""

    @property
    def descriptor(self) -> SlabDescriptor:
        """The first slab's (the single-device case)."""
        return self.descriptors[0]

    @property
    def closed(self) -> bool:
        return self._memory is None

    def close(self) -> None:
        memory, self._memory = self._memory, None
        if memory is not None:
            memory._closed(self)


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

    def copy_runs(
        self, dst: torch.Tensor, srcs: Sequence[torch.Tensor], runs: Sequence[tuple[int, int, int, int]]
    ) -> int:
        """Copy rows srcs[c][s : s + n] -> dst[d : d + n] for each run (d, c, s, n); returns the bytes copied.

        The host tier's swap-in: `srcs` are its chunks, `dst` the slab as page rows. Between host tensors of one
        dtype, contiguous, each run is one `memmove` straight from the chunk into the slab (no tensor views, no
        dispatch: a plan's pages are one run of ~0.15 MB on the bench preset, where torch's per-copy cost would be a
        fifth of the copy); on cuda each run is one non-blocking copy on the cache's stream, as `copy`. Bounds are
        checked before any byte moves (IndexError)."""
        rows = int(dst.shape[0])
        for d, c, s, n in runs:
            if n < 1 or d < 0 or s < 0 or d + n > rows or not 0 <= c < len(srcs) or s + n > srcs[c].shape[0]:
                raise IndexError(f"copy run {(d, c, s, n)} out of range (dst rows {rows}, {len(srcs)} chunks)")
        row_bytes = (dst.shape[1] if dst.dim() > 1 else 1) * dst.element_size()
        direct = (
            self._stream is None
            and dst.device.type == "cpu"
            and dst.is_contiguous()
            and all(x.device.type == "cpu" and x.dtype == dst.dtype and x.is_contiguous() for x in srcs)
            and all(x.shape[1:] == dst.shape[1:] for x in srcs)
        )
        if direct:
            base, ptrs = dst.data_ptr(), [x.data_ptr() for x in srcs]
            for d, c, s, n in runs:
                ctypes.memmove(base + d * row_bytes, ptrs[c] + s * row_bytes, n * row_bytes)
        else:
            for d, c, s, n in runs:
                self.copy(dst[d : d + n], srcs[c][s : s + n])
        return sum(n for _, _, _, n in runs) * row_bytes

    def record(self) -> torch.cuda.Event | None:
        """An event recorded on the cache's stream after the copies issued so far (None on a cpu device, whose copies
        have run by the time they return)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def fence(self) -> None:
        """Wait until every copy and kernel issued for the cache has finished."""
        if self.device.type == "cuda":
            if self._stream is not None:
                self._stream.synchronize()
            torch.cuda.synchronize(self.device)


class HostLanding:
    """Where a plan's bytes read from a file land before they are in the slab (the disk tier's reads).

    `buffer(views)` hands out writable bytes for one plan whose destination is `views` (its (width, P) view on every
    device): on a single cpu slab that is the slot's own memory (the read lands in place, no copy); otherwise a staging
    buffer (pinned when a view is on cuda; `depth` of them in turn), which `land()` copies into every view with that
    device's copier (non-blocking on cuda) once the bytes are checked. A staging buffer is handed out again only after
    its copies have run (an event per copier), so reading the next plan overlaps the last one's copies. The caller
    fences the copiers before the pages are used."""

    def __init__(self, copiers: Sequence[Copier], depth: int = 2) -> None:
        self.copiers = list(copiers)
        self.depth = max(1, depth)
        self._staging: list[torch.Tensor | None] = [None] * self.depth
        self._copied: list[list[torch.cuda.Event | None]] = [[] for _ in range(self.depth)]
        self._turn = 0
        self._pending: tuple[int, torch.Tensor, list[torch.Tensor]] | None = None  # (staging index, bytes, views)

    def buffer(self, views: Sequence[torch.Tensor]) -> memoryview:
        first = views[0]
        nbytes = first.numel() * first.element_size()
        if len(views) == 1 and first.device.type == "cpu" and first.is_contiguous():
            self._pending = None
            return first.view(torch.uint8).view(-1).numpy().data
        i, self._turn = self._turn, (self._turn + 1) % self.depth
        for event in self._copied[i]:
            if event is not None:
                event.synchronize()
        staging = self._staging[i]
        if staging is None or staging.numel() < nbytes:
            pin = any(v.device.type == "cuda" for v in views)
            staging = self._staging[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        src = staging[:nbytes]
        self._pending = (i, src, list(views))
        self._copied[i] = []
        return src.numpy().data

    def land(self) -> None:
        """Copy the last `buffer`'s bytes (when it was staging) into every view."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        i, src, views = pending
        pages = src.view(views[0].dtype).view(views[0].shape)
        for view, copier in zip(views, self.copiers, strict=True):
            copier.copy(view, pages)
        self._copied[i] = [c.record() for c in self.copiers]


# ---------------------------------------------------------------------------- CUDA IPC
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""The environment variables torch reads its caching allocator's configuration from (the second is the older name)."""


def check_ipc_allocator(environ: Mapping[str, str] | None = None) -> None:
    """Refuse (ValueError) an allocator configuration that turns on expandable segments, in either variable:
    memory from expandable segments cannot be shared by a CUDA IPC memory handle, so the generator could not map
    the slab. Called when a cuda sidecar starts (before the checkpoint is read) and before every export."""
    env = os.environ if environ is None else environ
    for var in ALLOC_CONF_VARS:
        for option in env.get(var, "").split(","):
            key, _, value = option.partition(":")
            if key.strip().lower() == "expandable_segments" and value.strip().lower() == "true":
                raise ValueError(
                    f"{var}={env[var]}: expandable_segments:True makes the cuda slab impossible to share by CUDA "
                    f"IPC; unset it (or set expandable_segments:False) for the plan-cache sidecar"
                )


def export_ipc(slab: torch.Tensor) -> CudaIpcHandle:
    """A new CUDA IPC export of the slab's storage (torch's `UntypedStorage._share_cuda_()`, what
    `reduce_tensor` calls), as typed fields for the Attach descriptor: nothing is pickled.

    Each call registers a new reference counter with torch, so the slab outlives every consumer
    that opened this export (and the registration outlives the session: `SlabMemory.export`).
    Expandable segments cannot be shared this way and are refused (`check_ipc_allocator`).
    """
    check_ipc_allocator()
    if not slab.is_contiguous() or slab.storage_offset() != 0:
        raise ValueError("the slab must be a contiguous tensor at storage offset 0 to be exported")
    storage = slab.untyped_storage()
    (_device, handle, size, offset, ref_counter, ref_offset, event, event_sync) = storage._share_cuda_()  # type: ignore[no-untyped-call]
    return CudaIpcHandle(
        mem_handle=bytes(handle),
        storage_size_bytes=int(size),
        storage_offset_bytes=int(offset),
        ref_counter_handle=bytes(ref_counter),
        ref_counter_offset=int(ref_offset),
        event_handle=bytes(event),
        event_sync_required=bool(event_sync),
    )
