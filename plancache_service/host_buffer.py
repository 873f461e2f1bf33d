"""The host tier's page buffer: pages in chunks of whole pages (`HostBuffer`), on cuda each chunk page-locked by
`cudaHostRegister` of exactly its bytes (torch's pinned allocator rounds up to a power of two), and the host memory
budget the tier sizes itself by."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from ditruntime.memory import MemoryBudget as MemoryBudget  # the host tier's budget, kept importable from here
from ditruntime.memory import host_memory_budget as host_memory_budget

log = logging.getLogger("plancache_service.device")  # its lines keep the logger name they had in device.py

HOST_CHUNK_BYTES = 64 * 1024**2
"""Target size of one host-tier chunk; a chunk holds whole pages (at least one), so a page never straddles two."""

_CUDA_HOST_REGISTER_PORTABLE = 1


def chunk_pages(page_bytes: int, chunk_bytes: int = HOST_CHUNK_BYTES) -> int:
    """Pages per chunk: as many whole pages as fit in `chunk_bytes`, at least one."""
    if page_bytes <= 0 or chunk_bytes <= 0:
        raise ValueError(f"page_bytes and chunk_bytes must be positive, got {page_bytes} and {chunk_bytes}")
    return max(1, chunk_bytes // page_bytes)


def chunk_sizes(n_pages: int, per_chunk: int) -> list[int]:
    """Pages of each chunk: full chunks of `per_chunk`, then the remainder (no empty chunk)."""
    full, rest = divmod(max(0, n_pages), per_chunk)
    return [per_chunk] * full + ([rest] if rest else [])


class Pinner(Protocol):
    """Page-locks (and unlocks) exactly a tensor's bytes; `pin` raises on failure."""

    def pin(self, t: torch.Tensor) -> None: ...

    def unpin(self, t: torch.Tensor) -> None: ...


class CudaHostRegister:
    """`cudaHostRegister` of exactly a chunk's bytes. torch's pinned allocator (`pin_memory=True`) rounds every
    allocation up to a power of two (a 10 GiB tier would pin 16 GiB); registering pageable memory does not."""

    def pin(self, t: torch.Tensor) -> None:
        # On a thread of its own: a failed runtime call leaves its error as the calling thread's "last error",
        # which torch's next kernel-launch check on that thread would raise as its own.
        cudart = torch.cuda.cudart()
        with ThreadPoolExecutor(1, thread_name_prefix="host-register") as ex:
            err = int(ex.submit(cudart.cudaHostRegister, t.data_ptr(), t.nbytes, _CUDA_HOST_REGISTER_PORTABLE).result())
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {t.nbytes} bytes failed (cudaError {err})")

    def unpin(self, t: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def _unpin_all(pinner: Pinner | None, chunks: list[torch.Tensor]) -> None:
    if pinner is not None:
        for c in chunks:
            pinner.unpin(c)


class HostBuffer:
    """The host tier's pages in chunks of whole pages: page `p` is row `p % chunk_pages` of chunk
    `p // chunk_pages`, so a page never straddles two chunks. Every chunk but the last holds `chunk_pages` pages.
    `pinned`: every chunk is page-locked, exactly its own bytes (`pinned_bytes`); `close()` unlocks them."""

    def __init__(
        self,
        chunks: list[torch.Tensor],
        chunk_pages: int,
        page_numel: int,
        dtype: torch.dtype,
        pinner: Pinner | None = None,
    ) -> None:
        if chunk_pages < 1:
            raise ValueError(f"chunk_pages must be at least 1, got {chunk_pages}")
        for i, c in enumerate(chunks):
            rows = chunk_pages if i < len(chunks) - 1 else int(c.shape[0])
            if (
                c.dim() != 2
                or c.dtype != dtype
                or c.shape[1] != page_numel
                or not 1 <= rows == c.shape[0] <= chunk_pages
            ):
                raise ValueError(f"chunk {i} has shape {tuple(c.shape)} {c.dtype}; {chunk_pages} pages per chunk")
        self.chunks = chunks
        self.chunk_pages = chunk_pages
        self.page_numel = page_numel
        self.dtype = dtype
        self.pinned = pinner is not None and bool(chunks)
        self.n_pages = sum(int(c.shape[0]) for c in chunks)
        self._finalizer = weakref.finalize(self, _unpin_all, pinner, chunks)

    @classmethod
    def of(cls, pages: torch.Tensor, chunk_pages: int) -> HostBuffer:
        """Pageable pages split into chunks (views of `pages`): tests, and tiers without pinning."""
        n = int(pages.shape[0])
        chunks = [pages[i : i + chunk_pages] for i in range(0, n, chunk_pages)]
        return cls(chunks, chunk_pages, int(pages.shape[1]), pages.dtype)

    @property
    def page_bytes(self) -> int:
        return self.page_numel * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.n_pages * self.page_bytes

    @property
    def pinned_bytes(self) -> int:
        return self.nbytes if self.pinned else 0

    def locate(self, page: int) -> tuple[int, int]:
        """(chunk, row in chunk) of `page`."""
        if not 0 <= page < self.n_pages:
            raise IndexError(f"page {page} out of range (0..{self.n_pages - 1})")
        return divmod(page, self.chunk_pages)

    def page(self, page: int) -> torch.Tensor:
        """(page_numel,) view of one page."""
        c, r = self.locate(page)
        return self.chunks[c][r]

    def by_chunk(self, pairs: Iterable[tuple[int, int]]) -> dict[int, list[tuple[int, int]]]:
        """Split (other row, page) pairs per chunk as (other row, row in chunk), for `Copier.copy_rows`."""
        out: dict[int, list[tuple[int, int]]] = {}
        for other, page in pairs:
            c, r = self.locate(page)
            out.setdefault(c, []).append((other, r))
        return out

    def gather(self) -> torch.Tensor:
        """A (n_pages, page_numel) copy of every page, in page order."""
        if not self.chunks:
            return torch.empty((0, self.page_numel), dtype=self.dtype)
        return torch.cat(self.chunks)

    def close(self) -> None:
        """Unlock pinned chunks (their memory is freed when the last view is dropped)."""
        self._finalizer()


def allocate_host_pages(
    n_pages: int,
    page_numel: int,
    dtype: torch.dtype,
    pin: bool,
    chunk_bytes: int = HOST_CHUNK_BYTES,
    pinner: Pinner | None = None,
) -> HostBuffer:
    """Allocate the host tier: `n_pages` pages in chunks of `chunk_pages(page_bytes, chunk_bytes)` whole pages.

    With `pin`, each chunk is allocated pageable and page-locked by `pinner` (default `cudaHostRegister`), exactly
    its own bytes, one chunk at a time: the pinned bytes are the tier's bytes. If pinning fails, the chunks pinned
    so far are the tier (logged); with none pinned, the tier is pageable memory."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_chunk = chunk_pages(page_numel * elem, chunk_bytes)
    sizes = chunk_sizes(n_pages, per_chunk)
    if pin and sizes:
        pinner = pinner if pinner is not None else CudaHostRegister()
        chunks: list[torch.Tensor] = []
        for n in sizes:
            chunk = torch.empty((n, page_numel), dtype=dtype)
            try:
                pinner.pin(chunk)
            except (RuntimeError, OSError, AssertionError) as e:
                log.warning("host tier: pinning chunk %d of %d failed (%s)", len(chunks) + 1, len(sizes), e)
                break
            chunks.append(chunk)
        if chunks:
            buf = HostBuffer(chunks, per_chunk, page_numel, dtype, pinner)
            if buf.n_pages < n_pages:
                log.warning("host tier: pinned %d of %d pages (pinning more failed)", buf.n_pages, n_pages)
            return buf
        log.warning("host tier: pinned memory unavailable; using %d pageable pages", n_pages)
    return HostBuffer([torch.empty((n, page_numel), dtype=dtype) for n in sizes], per_chunk, page_numel, dtype)
