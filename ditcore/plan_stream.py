"""A rebuild pass's reads: every projection's plan-tensor bytes in large sequential reads, read ahead on a thread of
their own while the builder projects the previous projection (ditcore.rebuild.PlanBuilder.build).

Each projection (one `adaln_proj` or `norm_out.linear`, or a shard's rows of it) is a few byte ranges of one
safetensors shard, found from the shard's header (`projection_reads`): the weight's rows and the bias's rows, in file
order; ranges that touch in the file (a whole projection's bias and weight: safetensors stores them side by side) are
one read. A `PlanStream` reads them, in the builder's order, into a fixed pool of projection buffers on the builder's
device, and hands each filled buffer over as tensor views (dtype and shape from the header, little-endian as
safetensors stores them) while it reads the next:

- cpu: `os.preadv` straight into the projection buffer (no staging copy), in reads of at most `staging_bytes`;
- cuda: into `depth` pinned staging buffers of `staging_bytes` each, every one copied to the device buffer with a
  non-blocking copy on a side stream as soon as it is read (an event per staging buffer says when it may be read into
  again), so reading, host-to-device copies and the builder's GEMMs all overlap; the consumer's stream waits on an
  event recorded after a projection's last copy, and the reader waits on one recorded after its GEMMs before it
  overwrites that buffer.

Memory is bounded: `buffers` projection buffers (2 by default: one projected, one read into) of the largest
projection's bytes, plus on cuda `depth` x `staging_bytes` pinned; never the whole plan tensors (24 GiB at the
released size, where one projection is 1.04 GB). `read_bytes` / `read_s` are the bytes read and the seconds at least
one read was in flight (the reader's own time, not the time it waited for a free buffer): the pass's read throughput.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .checkpoint_files import pread_into, read_shard_header

STAGING_BYTES = 64 * 1024**2
"""The largest single read, and on cuda the size of each pinned staging buffer."""
STAGING_DEPTH = 3
"""Pinned staging buffers on cuda: one being read into while the others' copies to the device run (triple buffering)."""
PROJECTION_BUFFERS = 2
"""Projection buffers on the builder's device: one the builder projects while the next is read (double buffering)."""
KEEP_BUFFER_BYTES = 512 * 1024**2
"""On cuda, a builder keeps its projection buffers between passes while they hold at most this many bytes in all (the
bench preset's are 2 x 1.8 MB; the released size's 2 x 1.04 GB go back to the caching allocator, which reuses them
without the slab's budget counting them)."""
KEEP_BUFFER_BYTES_CPU = 3 * 1024**3
"""On the CPU, the bound for keeping them: the released size's 2 x 1.04 GB are kept (allocating and page-faulting them
afresh every pass cut a warm pass's read to a third of a plain read's speed)."""
ALIGN = 512
"""On cuda, byte alignment of each read's largest tensor in a projection buffer, as the reference path's tensor copied
to the device (a fresh allocation: 512 bytes) is aligned."""
PAGE = 4096
"""On cpu, tensors (and their row slices) land at an address congruent to their file offset modulo a page, as
safetensors' mmap (and diffusers' from_pretrained) places them: a GEMM's bits can depend on its operands' alignment
(the float32 GEMV on this CPU does), so the pages are bitwise those of a model loaded the usual way."""

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


@dataclass(frozen=True)
class ReadConfig:
    """How a pass reads: `staging_bytes` per read (and per pinned staging buffer on cuda), `depth` staging buffers,
    `buffers` projection buffers, `threads` reads in flight at once (more than one helps a fast NVMe or a cold page
    cache; one is a plain sequential read)."""

    staging_bytes: int = STAGING_BYTES
    depth: int = STAGING_DEPTH
    buffers: int = PROJECTION_BUFFERS
    threads: int = 1

    def __post_init__(self) -> None:
        if self.staging_bytes < 4096 or self.depth < 1 or self.buffers < 1 or self.threads < 1:
            raise ValueError(f"invalid read config {self}: staging_bytes >= 4096, depth, buffers, threads >= 1")

    @classmethod
    def for_device(cls, device: torch.device | str) -> ReadConfig:
        """The defaults: on cuda 4 reads in flight (one thread's copy out of the page cache is slower than the link)."""
        return cls(threads=4) if torch.device(device).type == "cuda" else cls()


@dataclass(frozen=True)
class Segment:
    """One read: `nbytes` at absolute `offset` of `path`, into the projection buffer at `at`."""

    path: str
    offset: int
    nbytes: int
    at: int


@dataclass(frozen=True)
class TensorSlice:
    """Where a tensor's (rows') bytes land in a projection buffer, and what they are."""

    at: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ProjectionRead:
    """One projection's reads and the tensors they fill (name -> slice), `nbytes` of buffer in all."""

    prefix: str
    segments: tuple[Segment, ...]
    tensors: Mapping[str, TensorSlice]
    nbytes: int

    @property
    def read_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


def _align(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def projection_reads(
    transformer_dir: str | os.PathLike[str],
    files: Mapping[str, str],
    spans: Sequence[tuple[str, tuple[int, int] | None]],
    device: torch.device | str = "cpu",
) -> list[ProjectionRead]:
    """For each (projection prefix, rows or None for all) the byte ranges of its weight's and bias's rows, from the
    shard headers (each header read once), placed in a buffer on `device` as the tensors a plain read would give
    are aligned (PAGE, ALIGN). CheckpointError names a shard whose header is damaged; ValueError a tensor that is not
    a float type or holds fewer rows than asked."""
    on_cpu = torch.device(device).type == "cpu"
    headers: dict[str, Any] = {}
    out = []
    for prefix, rows in spans:
        ranges: list[tuple[str, int, int, str, TensorSlice]] = []  # (path, offset, nbytes, name, slice)
        for part in ("weight", "bias"):
            name = f"{prefix}.{part}"
            if name not in files:
                raise ValueError(f"{name} is not in {os.fspath(transformer_dir)}'s checkpoint")
            path = os.path.join(os.fspath(transformer_dir), files[name])
            if path not in headers:
                headers[path] = read_shard_header(Path(path))
            header = headers[path]
            entry = header.tensors.get(name)
            if entry is None:
                raise ValueError(f"{name} is not in {files[name]}")
            if entry.dtype not in _DTYPES or not entry.shape:
                raise ValueError(f"{name} in {files[name]} is {entry.dtype}{list(entry.shape)}: not a float tensor")
            dtype = _DTYPES[entry.dtype]
            row_bytes = (entry.end - entry.begin) // max(1, entry.shape[0])
            first, end = (0, entry.shape[0]) if rows is None else rows
            if not 0 <= first <= end <= entry.shape[0]:
                raise ValueError(f"{name} in {files[name]} has {entry.shape[0]} rows; rows {first}:{end} asked")
            offset = len(header.header_bytes) + entry.begin + first * row_bytes
            shape = (end - first, *entry.shape[1:])
            ranges.append((path, offset, (end - first) * row_bytes, name, TensorSlice(0, dtype, shape)))
        ranges.sort(key=lambda r: (r[0], r[1]))
        # coalesce ranges that touch in the file; place each run so its largest tensor lands ALIGN-aligned
        runs: list[list[tuple[str, int, int, str, TensorSlice]]] = []
        for r in ranges:
            last = runs[-1][-1] if runs else None
            if last is not None and last[0] == r[0] and last[1] + last[2] == r[1]:
                runs[-1].append(r)
            else:
                runs.append([r])
        segments, tensors, cursor = [], {}, 0
        for run in runs:
            before, big = 0, 0
            for i, r in enumerate(run):  # bytes in front of the run's largest tensor
                if r[2] > run[big][2]:
                    big = i
            before = sum(r[2] for r in run[:big])
            # cpu: as mmapped, congruent to the file offset; cuda: as freshly allocated
            at = cursor + (run[0][1] - cursor) % PAGE if on_cpu else _align(cursor + before) - before
            segments.append(Segment(run[0][0], run[0][1], sum(r[2] for r in run), at))
            for r in run:
                tensors[r[3]] = TensorSlice(at, r[4].dtype, r[4].shape)
                at += r[2]
            cursor = at
        out.append(ProjectionRead(prefix, tuple(segments), tensors, _align(cursor)))
    return out


@dataclass
class _Busy:
    """Bytes read and seconds at least one read was in flight (reads may overlap on several threads)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    active: int = 0
    since: float = 0.0
    seconds: float = 0.0
    nbytes: int = 0

    def begin(self) -> None:
        with self.lock:
            if self.active == 0:
                self.since = time.perf_counter()
            self.active += 1

    def end(self, nbytes: int) -> None:
        with self.lock:
            self.active -= 1
            self.nbytes += nbytes
            if self.active == 0:
                self.seconds += time.perf_counter() - self.since


def _page_aligned(nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` uint8 on `device` starting at a PAGE-aligned address (cuda: as the allocator aligns, ALIGN)."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes]


_END = object()


class PlanStream:
    """Reads `reads` in order into a pool of projection buffers on `device` on a reader thread; iterating yields each
    projection's tensors (name -> view on `device`). The view of one step stays valid until the next step is asked
    for (that step's GEMMs issued: on cuda the reader waits for them on the device, not on the host). Use as a context
    manager: leaving it stops the reader (an exception in the builder leaves no thread behind). Errors of the reader
    (a short read, an unreadable file) are raised by the iteration."""

    def __init__(
        self,
        reads: Sequence[ProjectionRead],
        device: torch.device | str,
        config: ReadConfig,
        buffers: Sequence[torch.Tensor] = (),
    ) -> None:
        self.reads = list(reads)
        self.device = torch.device(device)
        self.config = config
        self.cuda = self.device.type == "cuda"
        self._busy = _Busy()
        self._free: queue.Queue[int | None] = queue.Queue()
        self._out: queue.Queue[Any] = queue.Queue()
        self._stop = False
        self._current: int | None = None
        self._fds: dict[str, int] = {}
        biggest = max((r.nbytes for r in self.reads), default=0)
        n_buffers = max(1, min(config.buffers, len(self.reads)))
        kept = [b for b in buffers if b.numel() >= biggest and b.device == self.device and b.dtype == torch.uint8]
        self._buffers = kept[:n_buffers] + [_page_aligned(biggest, self.device) for _ in range(n_buffers - len(kept))]
        self._views = [b.numpy().data if not self.cuda else None for b in self._buffers]
        for b in range(n_buffers):
            self._free.put(b)
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="plan-read") if config.threads > 1 else None
        if self.cuda:
            chunk = min(config.staging_bytes, max((s.nbytes for r in self.reads for s in r.segments), default=1))
            self._staging = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(config.depth)]
            self._staging_views = [s.numpy().data for s in self._staging]
            self._staged = [torch.cuda.Event() for _ in self._staging]  # its last copy to the device has finished
            self._side = torch.cuda.Stream(self.device)
            self._ready = [torch.cuda.Event() for _ in self._buffers]  # a buffer's copies have landed
            self._done = [torch.cuda.Event() for _ in self._buffers]  # the GEMMs reading a buffer have run
        self._thread = threading.Thread(target=self._produce, name="plan-stream", daemon=True)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The projection buffers (a later stream may take them over: `buffers=`, so no pass faults in fresh ones)."""
        return list(self._buffers)

    # ---------------------------------------------------------------- statistics
    @property
    def read_bytes(self) -> int:
        return self._busy.nbytes

    @property
    def read_s(self) -> float:
        return self._busy.seconds

    # ---------------------------------------------------------------- consumer side
    def __enter__(self) -> PlanStream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the reader (after its read in flight), wait for it, free the files (idempotent)."""
        self._stop = True
        self._release()
        for _ in self._buffers:
            self._free.put(None)
        if self._thread.is_alive():
            self._thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.cuda:
            self._side.synchronize()  # no copy into a buffer outlives it
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        self._release()
        item = self._out.get()
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        b, read = item
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._ready[b])
        self._current = b
        buf = self._buffers[b]
        return {name: buf[s.at : s.at + s.nbytes].view(s.dtype).view(s.shape) for name, s in read.tensors.items()}

    def _release(self) -> None:
        """Hand the current buffer back to the reader (on cuda once the GEMMs issued on it have run)."""
        b, self._current = self._current, None
        if b is not None:
            if self.cuda:
                self._done[b].record(torch.cuda.current_stream(self.device))
            self._free.put(b)

    # ---------------------------------------------------------------- reader side
    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd

    def _read(self, fd: int, view: memoryview, offset: int, path: str) -> None:
        self._busy.begin()
        n = 0
        try:
            n = pread_into(fd, view, offset, path)
        finally:
            self._busy.end(n)

    def _chunks(self, read: ProjectionRead) -> Iterator[tuple[str, int, int, int]]:
        """(path, file offset, bytes, buffer offset) of every read of at most `staging_bytes`."""
        step = self.config.staging_bytes
        for s in read.segments:
            for o in range(0, s.nbytes, step):
                yield s.path, s.offset + o, min(step, s.nbytes - o), s.at + o

    def _produce(self) -> None:
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)
            for read in self.reads:
                b = self._free.get()
                if b is None or self._stop:
                    return
                if self.cuda:
                    self._fill_cuda(read, b)
                else:
                    self._fill_host(read, b)
                self._out.put((b, read))
            self._out.put(_END)
        except BaseException as e:  # handed to the consumer, raised there
            self._out.put(e)

    def _fill_host(self, read: ProjectionRead, b: int) -> None:
        view = self._views[b]
        assert view is not None
        jobs = [(self._fd(p), view[at : at + n], off, p) for p, off, n, at in self._chunks(read)]
        if self._pool is None:
            for job in jobs:
                self._read(*job)
        else:
            for f in [self._pool.submit(self._read, *job) for job in jobs]:
                f.result()

    def _fill_cuda(self, read: ProjectionRead, b: int) -> None:
        buf = self._buffers[b]
        self._side.wait_event(self._done[b])  # the GEMMs on its previous projection have run
        inflight: deque[tuple[Future[None] | None, int, int, int]] = deque()

        def land() -> None:  # the oldest read: wait for it, then copy it to the device on the side stream
            fut, s, at, n = inflight.popleft()
            if fut is not None:
                fut.result()
            with torch.cuda.stream(self._side):
                buf[at : at + n].copy_(self._staging[s][:n], non_blocking=True)
                self._staged[s].record(self._side)

        for k, (path, off, n, at) in enumerate(self._chunks(read)):
            if len(inflight) == len(self._staging):
                land()
            s = k % len(self._staging)
            self._staged[s].synchronize()  # its previous copy has left it
            job = (self._fd(path), self._staging_views[s][:n], off, path)
            if self._pool is None:  # read it, then its copy runs while the next is read
                self._read(*job)
                inflight.append((None, s, at, n))
                land()
            else:
                inflight.append((self._pool.submit(self._read, *job), s, at, n))
        while inflight:
            land()
        self._ready[b].record(self._side)
