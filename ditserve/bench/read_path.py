"""Scenario 16, the rebuild's read path and the host tier's copy path against plain reads and copies of the same
bytes, in this process (no services; a few seconds):

(b) the rebuild's read throughput (`PlanBuilder.read_bytes / read_s` of streamed passes over a first-seen schedule's
    plans: ditcore.plan_stream) over one plain sequential read of the same byte ranges of the same files
    (`measure.plain_read_seconds`), page cache warm (medians of interleaved rounds) and cold where it can be dropped
    (`measure.drop_page_cache`); beside them the per-tensor path's (safetensors, one tensor at a time: the old one);
(c) bits: every page of the streamed passes torch.equal to the per-tensor path's;
(d) the host tier's swap-in (`HostMemoryTier.fill` of the same schedule's plans into shuffled slots of a real slab,
    caches flushed before each; at the preset's page size, and with `released_pages` again at the released one:
    the same plans of 9.25 MiB pages, 0.9 GB a swap-in, where a swap-in's fixed cost per plan no longer shows) over
    one plain copy of the same bytes between the same two buffers (the host tier's pages into the slab's rows, one
    copy: what the swap-in's bookkeeping and run splitting cost); beside it one plain copy between two fresh buffers
    (`measure.memcpy_bandwidth`; on cpu the slab is a shared-memory file, the fresh buffers private memory).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch

from ditcore import PlanBuilder, validate_checkpoint
from ditcore.plan_stream import projection_reads
from ditcore.plans import PageLayout, PlanKey, distinct_keys

from .context import BenchContext
from .measure import drop_page_cache, memcpy_bandwidth, plain_read_seconds

READ_TARGET = 0.8
"""Rebuild read throughput / a plain sequential read of the same bytes."""
SWAP_TARGET = 0.8
"""Host tier swap-in bandwidth / a plain copy of the same bytes."""


def _pass(builder: PlanBuilder, keys: list[PlanKey], outs: list[torch.Tensor]) -> tuple[float, float, int]:
    """(build seconds, read seconds, bytes read) of one pass."""
    b0, s0 = builder.read_bytes, builder.read_s
    t0 = time.perf_counter()
    builder.build(keys, outs)
    if builder.device.type == "cuda":
        torch.cuda.synchronize(builder.device)
    return time.perf_counter() - t0, builder.read_s - s0, builder.read_bytes - b0


def read_path(ctx: BenchContext, rounds: int = 5, released_pages: bool = False) -> dict[str, Any]:
    torch.set_num_threads(ctx.threads)
    info = validate_checkpoint(ctx.checkpoint)
    transformer = info.path / "transformer"
    keys = distinct_keys(ctx.plan_keys("A"))[1:]  # what a first-seen schedule builds: all but t = 0
    new = PlanBuilder(transformer, ctx.device)
    old = PlanBuilder(transformer, ctx.device, streamed=False)

    def outputs() -> list[torch.Tensor]:
        return [torch.empty(k.width, new.layout.page_numel, dtype=new.projection_dtype, device=new.device)
                for k in keys]  # fmt: skip

    new_outs, old_outs = outputs(), outputs()
    spans = [(p, None) for p, _, _ in new.layout.projections()]
    ranges = [(s.path, s.offset, s.nbytes)
              for r in projection_reads(transformer, new.files, spans, new.device) for s in r.segments]  # fmt: skip
    nbytes = sum(n for _, _, n in ranges)
    files = sorted({p for p, _, _ in ranges})
    _pass(new, keys, new_outs), _pass(old, keys, old_outs), plain_read_seconds(ranges)  # warm-up, page cache warm
    bit_exact = all(torch.equal(a, b) for a, b in zip(new_outs, old_outs, strict=True))
    warm: dict[str, list[float]] = {"build": [], "read": [], "old_build": [], "old_read": [], "plain": []}
    for _ in range(rounds):  # interleaved, so the machine's drift hits all three alike
        build_s, read_s, _ = _pass(new, keys, new_outs)
        warm["build"].append(build_s)
        warm["read"].append(read_s)
        old_build, old_read, _ = _pass(old, keys, old_outs)
        warm["old_build"].append(old_build)
        warm["old_read"].append(old_read)
        warm["plain"].append(plain_read_seconds(ranges))
    bit_exact = bit_exact and all(torch.equal(a, b) for a, b in zip(new_outs, old_outs, strict=True))
    med = {k: statistics.median(v) for k, v in warm.items()}
    ratio = med["plain"] / med["read"]

    method = drop_page_cache(files)
    cold: dict[str, Any] = {"method": method}
    if method != "none":
        _, cold_read, _ = _pass(new, keys, new_outs)
        drop_page_cache(files)
        cold_plain = plain_read_seconds(ranges)
        drop_page_cache(files)
        _, cold_old, _ = _pass(old, keys, old_outs)
        cold.update(read_gbps=round(nbytes / cold_read / 1e9, 3), plain_read_gbps=round(nbytes / cold_plain / 1e9, 3),
                    per_tensor_read_gbps=round(nbytes / cold_old / 1e9, 3))  # fmt: skip
        cold_ratio = cold_plain / cold_read
        cold.update(ratio=round(cold_ratio, 3), met=bool(cold_ratio >= READ_TARGET))
    else:
        cold.update(ratio=None, met=None)
    cold["target"] = f"cold page cache ({method}): rebuild read / plain read >= {READ_TARGET}"
    return {
        "ratio": round(ratio, 3),
        "target": f"rebuild read throughput / plain sequential read of the same bytes >= {READ_TARGET} (warm page "
                  "cache); pages bitwise the per-tensor path's",
        "met": bool(ratio >= READ_TARGET and bit_exact),
        "plan_tensor_bytes": nbytes, "files": len(files), "reads": len(ranges), "plans": len(keys),
        "read_gbps": round(nbytes / med["read"] / 1e9, 3), "plain_read_gbps": round(nbytes / med["plain"] / 1e9, 3),
        "per_tensor_read_gbps": round(nbytes / med["old_read"] / 1e9, 3),
        "per_tensor_ratio": round(med["plain"] / med["old_read"], 3),
        "build_s": round(med["build"], 4), "per_tensor_build_s": round(med["old_build"], 4),
        "bit_exact": bit_exact, "cold": cold, "swap_in": swap_in(ctx, keys, new.layout.page_numel, new.projection_dtype),
        "swap_in_released_pages": (swap_in(ctx, keys, released_page_numel(), torch.bfloat16, rounds=7)
                                   if released_pages else None),
    }  # fmt: skip


def released_page_numel() -> int:
    """Elements of a page at the released shapes (9.25 MiB in bf16: ditcore.plans.PageLayout)."""
    from ditcore.presets import get_preset

    return PageLayout.from_config(get_preset("h3").transformer_kwargs()).page_numel


def swap_in(
    ctx: BenchContext, keys: list[PlanKey], page_numel: int, dtype: torch.dtype, rounds: int = 15
) -> dict[str, Any]:
    """(d): the host tier's swap-in of `keys` into shuffled slots of a real slab (shm on cpu) against one plain copy
    of the same bytes, caches flushed before each; medians."""
    import tempfile

    from plancache_service.device import Copier, SlabMemory
    from plancache_service.host_buffer import allocate_host_pages
    from plancache_service.host_tier import HostTier
    from plancache_service.tiers import HostMemoryTier, SlabPages

    width = max(k.width for k in keys)
    device = torch.device(ctx.device)
    with tempfile.TemporaryDirectory(prefix="ditserve-bench-") as shm:
        memory = SlabMemory(
            len(keys), width, page_numel, dtype, ctx.device, "/dev/shm" if device.type == "cpu" else shm
        )
        try:
            pages = sum(k.width for k in keys)
            tier = HostMemoryTier(HostTier(allocate_host_pages(pages, page_numel, dtype, pin=device.type == "cuda")))
            slab = SlabPages(memory.slab, Copier(device))
            memory.slab.fill_(1.5) if memory.slab.numel() > 2**26 else memory.slab.normal_()  # any bits: a copy's
            slots = list(range(len(keys)))
            stored = tier.store(keys, slots, slab)
            stored.copy()
            flush = torch.zeros(16 * 2**20)  # 64 MiB: more than this machine's last-level cache
            rng = random.Random(0)
            times, plain, nbytes = [], [], 0
            chunk = tier.host.buffer.chunks[0]
            rows = memory.slab.view(-1, memory.slab.shape[-1])
            n = min(pages, int(chunk.shape[0]))
            for _ in range(rounds):  # interleaved: the swap-in, then a plain copy of as many pages
                rng.shuffle(slots)
                flush.add_(1.0)
                fill = tier.fill(keys, slots, slab)
                times.append(fill.counts.swap_in_s)
                nbytes = fill.counts.swap_in_bytes
                flush.add_(1.0)
                t0 = time.perf_counter()
                slab.copier.copy(rows[:n], chunk[:n])
                slab.fence()
                plain.append((time.perf_counter() - t0) * pages / n)
        finally:
            memory.close()
    swap_bw = nbytes / statistics.median(times)
    copy_bw = nbytes / statistics.median(plain)
    fresh_bw = memcpy_bandwidth(nbytes, ctx.device)
    ratio = swap_bw / copy_bw
    return {
        "ratio": round(ratio, 3),
        "target": f"host tier swap-in / one plain copy of the same bytes from the host tier into the slab >= "
                  f"{SWAP_TARGET}",
        "met": bool(ratio >= SWAP_TARGET), "swap_in_gbps": round(swap_bw / 1e9, 3), "copy_gbps": round(copy_bw / 1e9, 3),
        "fresh_buffers_copy_gbps": round(fresh_bw / 1e9, 3), "fresh_buffers_ratio": round(swap_bw / fresh_bw, 3),
        "bytes": nbytes, "plans": len(keys),
    }  # fmt: skip
