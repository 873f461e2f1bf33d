"""CUDA paths: device slab, IPC sharing across processes, pinned host tier, cached == resident
on the GPU. Marked `gpu`: skipped without CUDA (run them where a GPU is lent)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from ditcore import GenerationRequest, generate, get_preset, load_model, write_checkpoint
from ditcore.plans import ScheduleSpec
from ditruntime.slab import READY, map_slab
from plancache_service.cache import PlanCache
from plancache_service.config import CacheConfig
from plancache_service.device import SlabMemory, allocate_host_pages
from plancache_service.embedded import EmbeddedPlanProvider
from plancache_service.rebuild import RebuildSource

pytestmark = pytest.mark.gpu
TINY = get_preset("tiny")


def _consumer(desc, q) -> None:  # type: ignore[no-untyped-def]
    slab, table, _maps = map_slab(desc)
    q.put((slab.sum().item(), int(table[0, 0].item()), str(slab.device)))


def test_cuda_slab_is_shared_by_ipc_handle(tmp_path: Path) -> None:
    mem = SlabMemory(4, 2, 1024, torch.float32, "cuda", "/dev/shm")
    try:
        mem.slab.fill_(1.5)
        mem.table[0, 0] = READY
        torch.cuda.synchronize()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_consumer, args=(mem.descriptor, q))
        p.start()
        total, state, device = q.get(timeout=120)
        p.join(60)
        assert total == 1.5 * 4 * 2 * 1024 and state == READY and device.startswith("cuda")
        assert mem.descriptor.transport == "cuda_ipc" and mem.descriptor.device_uuid
    finally:
        mem.close()


def test_pinned_host_tier() -> None:
    buf = allocate_host_pages(8, 1024, torch.bfloat16, pin=True)
    assert buf.pinned and buf.pages.is_pinned() and buf.n_pages == 8


def test_cached_equals_resident_on_cuda(tmp_path: Path) -> None:
    ckpt = write_checkpoint(TINY.replace(dtype="bfloat16"), tmp_path / "ck", seed=0)
    resident = load_model(ckpt, "resident").to("cuda")
    cached = load_model(ckpt, "cached").to("cuda")
    page = TINY.replace(dtype="bfloat16").page_bytes
    cache = PlanCache(
        CacheConfig(gpu_plans=8, host_cache_bytes=64 * page, device="cuda"), RebuildSource(ckpt, torch.device("cuda"))
    )
    try:
        provider = EmbeddedPlanProvider(cache)
        for flow, audio in ((5.0, 3.0), (4.0, 2.0), (5.0, 3.0)):  # cold, cold (evicts), host swap-in
            req = GenerationRequest(task="t2va", steps=8, flow_shift=flow, audio_flow_shift=audio, height=32, width=32)
            a, b = generate(resident, req), generate(cached, req, provider)
            assert torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio), b.cache
        assert b.cache.host_hit_plans > 0 and cache.host_pinned
    finally:
        cache.close()


def test_batching_probe_runs_on_cuda() -> None:
    from ditcore.plans import BatchingProbe

    probe = BatchingProbe(get_preset("bench"), torch.device("cuda"), torch.float32)
    probe.warm((1, 2), (2, 50))  # whatever it finds, it must not raise
    keys = ScheduleSpec("t2va", 50, 5.0, 3.0).plan_keys()
    assert len(keys) == 50
