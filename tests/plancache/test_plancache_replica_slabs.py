"""One sidecar, one slab per device of a replica (`--devices cpu,cpu` here: two shm slabs): one slot table and one
lease for every rank; a rebuild sharded across the devices (each reads half the plan tensors' bytes) fills every
slab with diffusers' own pages, a host swap-in writes every slab, and Attach hands out one descriptor per device."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from plancache_helpers import CPU, DiffusersPages, prepare, running_sidecar, sched

from plancache_service.cache import PlanCache
from plancache_service.config import CacheConfig
from plancache_service.errors import PlanCacheError
from plancache_service.rebuild import RebuildSource
from protos.ditserve.plancache.v1 import plancache_pb2 as pb
from protos.ditserve.plancache.v1 import plancache_pb2_grpc as pb_grpc

FIRST, SECOND = sched(4, 12.0), sched(5, 7.0, 2.0)


def replica_cache(repo: Path, tmp_path: Path, shard_mode: str, host_pages: int) -> PlanCache:
    source = RebuildSource(repo, [CPU, CPU], shard_mode=shard_mode)
    config = CacheConfig(gpu_plans=5, plan_width=2, host_cache_bytes=host_pages * source.page_bytes,
                         host_reserve_bytes=0, shm_dir=str(tmp_path), devices="cpu,cpu")  # fmt: skip
    return PlanCache(config, source)


@pytest.mark.parametrize("shard_mode", ["rows", "projections"])
def test_sharded_rebuild_fills_every_slab_with_diffusers_pages(
    tiny_ckpt: Path, ref: DiffusersPages, tmp_path: Path, shard_mode: str
) -> None:
    cache = replica_cache(tiny_ckpt, tmp_path, shard_mode, host_pages=0)
    try:
        assert len(cache.memory.slabs) == 2 and cache.memory.slabs[0].data_ptr() != cache.memory.slabs[1].data_ptr()
        lease = prepare(cache, FIRST)
        for slab in cache.memory.slabs:  # the one lease's slots, on every device
            for key, slot in zip(lease.keys, lease.slots, strict=True):
                assert torch.equal(slab[slot, : key.width], ref.pages(key)), f"slot {slot} of {key}"
        whole = cache.source.info.layout.plan_tensor_bytes(cache.source.dtype)
        reads = cache.source.bytes_read
        assert sum(reads) == whole  # the node read each plan byte once
        if shard_mode == "rows":
            assert reads == [whole // 2, whole // 2]  # and each device half of them
    finally:
        cache.close()


def test_host_swap_in_writes_every_slab(tiny_ckpt: Path, ref: DiffusersPages, tmp_path: Path) -> None:
    # 5 slots: FIRST's 4 plans, then SECOND's 5 (sharing FIRST's first) evict FIRST's other 3, whose slots then hold
    # SECOND's pages on both slabs; FIRST again swaps them in from the host tier, which must write both slabs
    cache = replica_cache(tiny_ckpt, tmp_path, "rows", host_pages=32)
    try:
        cache.release(prepare(cache, FIRST).lease_id)
        cache.release(prepare(cache, SECOND).lease_id)
        lease = prepare(cache, FIRST)
        assert lease.report.host_hit_plans == 3 and lease.report.built_plans == 0
        for r, slab in enumerate(cache.memory.slabs):
            for key, slot in zip(lease.keys, lease.slots, strict=True):
                assert torch.equal(slab[slot, : key.width], ref.pages(key)), f"slab {r}: slot {slot} of {key}"
    finally:
        cache.close()


def test_a_source_on_other_devices_is_refused(tiny_ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(PlanCacheError, match=r"the slab has 2 device\(s\)"):
        PlanCache(CacheConfig(gpu_plans=2, host_cache_bytes=0, shm_dir=str(tmp_path), devices="cpu,cpu"),
                  RebuildSource(tiny_ckpt, CPU))  # fmt: skip


def test_devices_flag_is_checked() -> None:
    with pytest.raises(ValueError, match="--devices must list 'cpu' or 'cuda"):
        CacheConfig(devices="cpu,tpu")
    with pytest.raises(ValueError, match="all cpu or all cuda"):
        CacheConfig(devices="cpu,cuda:0")
    assert CacheConfig(devices=" cuda:0, cuda:1 ").slab_devices == ("cuda:0", "cuda:1")
    assert CacheConfig().slab_devices == ("cpu",)


def test_attach_hands_out_one_descriptor_per_device(tiny_ckpt: Path) -> None:
    with (
        running_sidecar(tiny_ckpt, "dsrs", host_pages=0, gpu_plans=4, devices="cpu,cpu") as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        stream = pb_grpc.PlanCacheStub(channel).Attach(pb.AttachRequest(client_name="test"))
        session = next(stream).session
        stream.cancel()
    assert len(session.slabs) == 2 and session.slab == session.slabs[0]
    assert session.slabs[0].table_path == session.slabs[1].table_path  # one slot table
    assert session.slabs[0].slab_path != session.slabs[1].slab_path
