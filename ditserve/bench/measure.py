"""Baselines the benchmarks compare against: reading the plan tensors' bytes (through safetensors, or as a plain
sequential read of their byte ranges), dropping them from the page cache, a plain memcpy, and what a process holds in
memory (/proc)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ditcore import CheckpointInfo
from ditcore.rebuild import plan_tensor_names
from ditcore.shards import shard_map

PROC_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
"""/proc/<pid>/status lines `process_memory` reads (kB there, bytes here)."""


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def read_plan_tensors_seconds(info: CheckpointInfo, device: str = "cpu") -> float:
    """Best of 3 (after a warm-up read): every plan tensor (each block's `adaln_proj.linear` and `norm_out.linear`,
    weight and bias) read once onto `device`, each shard opened once — the least any rebuild must do. The page cache
    is warm, as for the rebuilds."""
    transformer_dir = os.fspath(Path(info.path) / "transformer")
    files = shard_map(transformer_dir)
    by_file: dict[str, list[str]] = {}
    for name in plan_tensor_names(transformer_dir):
        by_file.setdefault(files[name], []).append(name)
    dev = torch.device(device)

    def read() -> None:
        for file, names in sorted(by_file.items()):
            with safe_open(os.path.join(transformer_dir, file), "pt") as f:
                for name in names:
                    f.get_tensor(name).to(dev).sum()  # touch every byte
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    read()
    return min(timed(read) for _ in range(3))


def plain_read_seconds(ranges: list[tuple[str, int, int]], chunk_bytes: int = 64 * 1024**2) -> float:
    """One plain sequential read of the (path, offset, bytes) ranges, in file order, each file opened once, in reads
    of at most `chunk_bytes` into one reusable pre-faulted buffer (cat's way, with a bigger buffer): what reading the
    same bytes costs with nothing else done."""
    from ditcore.checkpoint_files import pread_into

    buf = memoryview(bytearray(min(chunk_bytes, max((n for _, _, n in ranges), default=1))))
    fds: dict[str, int] = {}
    t0 = time.perf_counter()
    try:
        for path, offset, nbytes in sorted(ranges):
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            for o in range(0, nbytes, len(buf)):
                n = min(len(buf), nbytes - o)
                pread_into(fd, buf[:n], offset + o, path)
        return time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)


def drop_page_cache(paths: list[str]) -> str:
    """Evict `paths` from the page cache: "fadvise" (posix_fadvise DONTNEED per file, after writing back: its clean
    pages go unless someone maps them; nothing else on the machine is touched), else "drop_caches" (root only:
    /proc/sys/vm/drop_caches, every file's), else "none"."""
    if hasattr(os, "posix_fadvise"):
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        return "none"


def memcpy_bandwidth(nbytes: int, device: str = "cpu") -> float:
    """Bytes/s of one plain copy of `nbytes` between the buffers a swap-in copies between
    (host -> slab): pre-faulted, caches flushed first (swap-in pages are not cache-hot); median of 5."""
    n = max(1, nbytes // 4)
    if device.startswith("cuda"):
        src = torch.empty(n, pin_memory=True).normal_()
        dst = torch.empty(n, device=device)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

        def copy_sync() -> None:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()

        return n * 4 / statistics.median(timed(copy_sync) for _ in range(5))
    src, dst, flush = torch.empty(n).normal_(), torch.zeros(n), torch.zeros(16 * 2**20)
    times = []
    for _ in range(5):
        flush.add_(1.0)
        times.append(timed(lambda: dst.copy_(src)))
    return n * 4 / statistics.median(times)


def process_memory(pid: int) -> dict[str, int]:
    """Bytes a live process holds, from /proc/<pid>/status: resident set (VmRSS), its peak (VmHWM), and its parts —
    private memory (RssAnon: heap, tensors), file-backed pages (RssFile: libraries, mmapped files) and shared memory
    (RssShmem: e.g. the /dev/shm slab a cached generator maps). Linux only; OSError if the process is gone."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in PROC_FIELDS:
                amount, unit = value.split()
                if unit != "kB":
                    raise ValueError(f"/proc/{pid}/status: {key} in unexpected unit {unit!r}")
                out[key] = int(amount) * 1024
    missing = [k for k in PROC_FIELDS if k not in out]
    if missing:
        raise ValueError(f"/proc/{pid}/status lacks {', '.join(missing)}")
    return out
