"""Baselines the benchmarks compare against: reading adaln_proj bytes, and a plain memcpy."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ditcore import CheckpointInfo
from ditcore.checkpoint import CheckpointReader
from ditcore.config import adaln_layer_names


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def read_adaln_seconds(info: CheckpointInfo, device: str = "cpu") -> float:
    """Best of 3 (after a warm-up read): every adaln_proj weight and bias read once onto
    `device` — the least any rebuild must do. The page cache is warm, as for the rebuilds."""

    def read() -> None:
        with CheckpointReader(info) as reader:
            for name in adaln_layer_names(info.config):
                w, b = reader.adaln_layer(name)
                w.to(device).sum()  # touch every byte
                del w, b

    read()
    return min(timed(read) for _ in range(3))


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
