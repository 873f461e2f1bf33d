"""Scenario 17, the disk tier across a restart, in this process (the sidecar's own PlanCache and RebuildSource, no
services; a few seconds):

(a) a known schedule after a restart: a first cache with `--plan-dir` builds schedule A's plans (one rebuild pass,
    its pack written), is closed; a second cache on the same directory (the restart: an empty slab and host tier)
    reads them from disk. Ratio: the second prepare's seconds / the first's (the rebuild), page cache warm.
(c) bits: every page the second cache read from disk torch.equal to the page the first rebuilt.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ditcore import validate_checkpoint
from ditcore.plans import distinct_keys
from plancache_service.cache import PlanCache
from plancache_service.config import CacheConfig
from plancache_service.rebuild import RebuildSource

from .context import BenchContext

RESTART_TARGET = 0.2
"""A known schedule's prepare after a restart (from disk) / the same schedule rebuilt."""


def restart_from_disk(ctx: BenchContext) -> dict[str, Any]:
    torch.set_num_threads(ctx.threads)
    info = validate_checkpoint(ctx.checkpoint)
    source = RebuildSource(info, torch.device(ctx.device))
    keys = ctx.plan_keys("A")
    group = distinct_keys(keys)
    with tempfile.TemporaryDirectory(prefix="bench-disk-", dir=ctx.workdir) as tmp:

        def cache() -> PlanCache:
            config = CacheConfig(gpu_plans=len(group), plan_width=max(k.width for k in group), host_cache_bytes=0,
                                 host_reserve_bytes=0, shm_dir=tmp, plan_dir=Path(tmp) / "plans",
                                 device=ctx.device)  # fmt: skip
            return PlanCache(config, source)

        def prepare(c: PlanCache) -> tuple[float, Any, list[torch.Tensor]]:
            t0 = time.perf_counter()
            lease = c.prepare(c.generation, keys, "bench")
            dt = time.perf_counter() - t0
            pages = [c.slab[s].clone() for s in lease.slots]
            c.release(lease.lease_id)
            return dt, lease.report, pages

        first = cache()
        try:
            built_s, built, built_pages = prepare(first)
            assert first.disk is not None
            first.disk.flush()
        finally:
            first.close()
        second = cache()
        try:
            read_s, read, read_pages = prepare(second)
        finally:
            second.close()
    identical = len(built_pages) == len(read_pages) and all(
        torch.equal(a, b) for a, b in zip(built_pages, read_pages, strict=True)
    )
    ratio = read_s / built_s
    return {
        "ratio": round(ratio, 3),
        "target": f"a known schedule after a restart, from disk / rebuilt <= {RESTART_TARGET} (page cache warm)",
        "met": ratio <= RESTART_TARGET and identical and read.disk_hit_plans == len(group) and read.built_plans == 0,
        "plans": len(group),
        "rebuild_s": round(built_s, 6),
        "disk_s": round(read_s, 6),
        "first": {"built_plans": built.built_plans, "disk_stored_plans": built.disk_stored_plans},
        "after_restart": {
            "disk_hit_plans": read.disk_hit_plans,
            "built_plans": read.built_plans,
            "disk_read_s": read.disk_read_s,
        },
        "pages_identical": identical,
    }
