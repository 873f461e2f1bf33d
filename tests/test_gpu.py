"""CUDA paths: device slab, IPC sharing across processes, pinned host tier, cached == resident on the GPU (in
process through the embedded cache, for t2va and for ref2va on the transformer_ref partition, and through a
sidecar + generator process pair sharing the slab by CUDA IPC). `cached_equals_resident` runs on any device (dry-run
it on the CPU). Marked `gpu`: skipped without CUDA (run them where a GPU is lent)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest
import torch
from refmedia import image_bytes, video_bytes, wav_bytes
from servicekit import FOX_REQUEST, RAIN_REQUEST, ProcessGroup, distinct_plans

from ditcore import GenerationRequest, generate, load_model, validate_checkpoint, write_repository
from ditcore.references import Reference
from ditruntime.slab import READY, SlabMapping, check_device, device_uuid, map_slab
from ditserve.client import GeneratorClient
from plancache_service.cache import PlanCache
from plancache_service.config import CacheConfig
from plancache_service.device import SlabMemory
from plancache_service.embedded import EmbeddedPlanProvider
from plancache_service.host_buffer import allocate_host_pages
from plancache_service.rebuild import RebuildSource

pytestmark = pytest.mark.gpu


def _consumer(desc, q) -> None:  # type: ignore[no-untyped-def]
    slab, table, _maps = map_slab(desc)
    q.put((slab.sum().item(), int(table[0, 0].item()), str(slab.device)))


def _session_consumer(descs, q) -> None:  # type: ignore[no-untyped-def]
    """One generator across a sidecar restart: map, read, close, then map the next session's export."""
    out: list[Any] = []
    for desc in descs:
        mapping = SlabMapping.open(desc)
        out.append((mapping.slab.sum().item(), str(mapping.slab.device)))
        out.append(mapping.close())
    q.put(out)


def test_cuda_slab_is_shared_by_ipc_handle(tmp_path: Path) -> None:
    mem = SlabMemory(4, 2, 1024, torch.float32, "cuda", "/dev/shm")
    try:
        mem.slab.fill_(1.5)
        mem.table[0, 0] = READY
        torch.cuda.synchronize()
        export = mem.export()
        desc = export.descriptor
        assert desc.transport == "cuda_ipc" and desc.device_uuid and desc.cuda_ipc is not None
        assert desc.cuda_ipc.storage_size_bytes == desc.slab_bytes
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_consumer, args=(desc, q))
        p.start()
        total, state, device = q.get(timeout=120)
        p.join(60)
        assert total == 1.5 * 4 * 2 * 1024 and state == READY and device.startswith("cuda")
        export.close()
        assert mem.live_exports == 0  # the sidecar's books; torch's registration stays until the slab is freed
    finally:
        mem.close()


def test_an_export_costs_no_device_memory_and_closing_it_is_bookkeeping() -> None:
    """Every export wraps the storage in one more torch CudaIPCSentData (a counter slot, an event) that stays until
    the slab is freed: a small per-Attach cost in host memory, none in device memory."""
    mem = SlabMemory(4, 2, 1024, torch.bfloat16, "cuda", "/dev/shm")
    try:
        torch.cuda.synchronize()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        handles = set()
        for _ in range(50):
            export = mem.export()
            assert export.descriptor.cuda_ipc is not None
            handles.add((export.descriptor.cuda_ipc.ref_counter_handle, export.descriptor.cuda_ipc.ref_counter_offset))
            export.close()
        assert len(handles) == 50 and mem.live_exports == 0
        assert (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) == (allocated, reserved)
    finally:
        mem.close()


def test_each_attach_gets_its_own_ipc_export_and_the_consumer_closes_each_mapping() -> None:
    mem = SlabMemory(4, 2, 1024, torch.bfloat16, "cuda", "/dev/shm")
    try:
        mem.slab.fill_(2.0)
        torch.cuda.synchronize()
        first, second = mem.export(), mem.export()
        a, b = first.descriptor.cuda_ipc, second.descriptor.cuda_ipc
        assert a is not None and b is not None
        # one reference counter per export: a consumer's release never counts for another session's
        assert (a.ref_counter_handle, a.ref_counter_offset) != (b.ref_counter_handle, b.ref_counter_offset)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_session_consumer, args=([first.descriptor, second.descriptor], q))
        p.start()
        out = q.get(timeout=120)
        p.join(60)
        assert out == [(2.0 * 8 * 1024, "cuda:0"), True, (2.0 * 8 * 1024, "cuda:0"), True]
        first.close()
        second.close()
        assert mem.live_exports == 0  # bookkeeping (see test_an_export_costs_no_device_memory_...)
    finally:
        mem.close()


def test_slab_device_uuid_check_on_the_real_gpu() -> None:
    dev = torch.device("cuda", 0)
    uuid = device_uuid(dev)
    assert uuid
    # the generator's check (before the IPC open, and again in check_slab): a UUID no visible device has is named
    mem = SlabMemory(4, 2, 1024, torch.bfloat16, "cuda", "/dev/shm")
    try:
        desc = mem.export().descriptor
        assert desc.device_uuid == uuid
        check_device(desc, dev)
        with pytest.raises(ValueError, match=rf"GPU-not-this-one .*which no CUDA device visible .*GPU UUID {uuid}"):
            check_device(dataclasses.replace(desc, device_uuid="GPU-not-this-one"), dev)
        with pytest.raises(ValueError, match=r"but the model runs on cpu"):
            check_device(desc, torch.device("cpu"))
    finally:
        mem.close()


def test_pinned_host_tier() -> None:
    buf = allocate_host_pages(8, 1024, torch.bfloat16, pin=True)
    assert buf.pinned and all(c.is_pinned() for c in buf.chunks) and buf.n_pages == 8


def _request(req: dict[str, Any], **overrides: Any) -> GenerationRequest:
    return GenerationRequest.from_dict({**req, "num_inference_steps": 5, "num_frames": 124, **overrides})


def cached_equals_resident(
    ckpt: Path, first: GenerationRequest, other: GenerationRequest, device: str
) -> GenerationRequest | None:
    """`first`, `first`, `other`, `first` (cold, slot hit, cold evicting it, host swap-in) through the embedded
    cache with slots for one request: cached latents torch.equal to resident ones on `device` every time."""
    info = validate_checkpoint(ckpt)
    resident = load_model(info, "resident", device)
    cached = load_model(info, "cached", device)
    slots = len(set(cached.plan_keys(first)))
    assert len(set(cached.plan_keys(other))) == slots
    page = info.layout.page_bytes(info.projection_dtype)
    config = CacheConfig(gpu_plans=slots, host_cache_bytes=64 * page, device=device)
    cache = PlanCache(config, RebuildSource(info, torch.device(device)))
    try:
        provider = EmbeddedPlanProvider(cache)
        b = None
        for req in (first, first, other, first):
            a, b = generate(resident, req), generate(cached, req, provider)
            assert torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio), b.cache
        assert b is not None and b.cache is not None and b.cache.host_hit_plans > 0
        assert cache.host_pinned == (device == "cuda")
        assert cached.memory().held_plan_bytes == 0 and cached.memory().saved_fraction == 1.0
    finally:
        cache.close()


@pytest.mark.parametrize("precision", ["mixed", "float32"])
def test_cached_equals_resident_on_cuda(tmp_path: Path, precision: str) -> None:
    ckpt = write_repository(tmp_path / "ck", "tiny", seed=0, dtype=precision, shards=2)
    cached_equals_resident(ckpt, _request(FOX_REQUEST), _request(RAIN_REQUEST), "cuda")


REF2VA_REFERENCES = (  # an image, a clip with its soundtrack, a WAV: the 4-wide plans
    Reference(image_bytes(80, 48, seed=1)), Reference(video_bytes(frames=30, fps=30, audio_rate=32000, seed=3)),
    Reference(wav_bytes(1.5, 32000, seed=5)),
)  # fmt: skip


@pytest.mark.parametrize("precision", ["mixed", "float32"])
def test_cached_ref2va_equals_resident_on_cuda(tmp_path: Path, precision: str) -> None:
    """Both partitions on the GPU: ref2va through the transformer_ref partition's plans (4 wide)."""
    ckpt = write_repository(tmp_path / "ck", "tiny", seed=0, dtype=precision, shards=2)
    fox = _request(FOX_REQUEST, task="ref2va", references=REF2VA_REFERENCES)
    rain = _request(RAIN_REQUEST, task="ref2va", references=REF2VA_REFERENCES)
    cached_equals_resident(ckpt, fox, rain, "cuda")


def test_service_pair_on_cuda_equals_resident(procs: ProcessGroup, svc_ckpt: Path) -> None:
    """Sidecar and generator processes on the GPU: the slab is shared by CUDA IPC handle; Generate's latents equal
    the resident model's on the same device, cold and on slot hits."""
    slots = distinct_plans(svc_ckpt, FOX_REQUEST)
    pair = procs.pair(svc_ckpt, gpu_plans=4 * slots, sidecar_device="cuda", device="cuda").start()
    resident = load_model(svc_ckpt, "resident", "cuda")
    with GeneratorClient(pair.target) as client:
        st = client.status()
        assert (st.slab.transport, st.slab.dtype) == ("cuda_ipc", "bfloat16") and st.slab.device.startswith("cuda")
        assert st.memory.held_plan_bytes == 0 and st.precision == "mixed"
        for req in (FOX_REQUEST, RAIN_REQUEST, FOX_REQUEST):
            res = client.generate(req, timeout=120)
            want = generate(resident, GenerationRequest.from_dict(req))
            assert res.video is not None and res.audio is not None  # latents output (the default)
            assert torch.equal(res.video, want.video) and torch.equal(res.audio, want.audio), res.cache
        assert res.cache.gpu_hit_plans == res.cache.plans
