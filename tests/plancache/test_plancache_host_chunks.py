"""Exact host-tier sizing (issue 12, item 7): chunks of whole pages, page -> chunk addressing, pinning exactly the
tier's bytes, and clipping by MemAvailable and cgroup limits.

torch's pinned allocator rounds every allocation up to a power of two (10 GiB would pin 16 GiB), so the host tier is
allocated in chunks of whole pages, each page-locked by `cudaHostRegister` of exactly its bytes. On CPU the pinning
is a recording fake (`RecordingPinner`: it checks what would be registered and can fail after N chunks to exercise
the fallback); the `gpu`-marked test at the end pins for real and measures it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from plancache_service.cache import PlanCache
from plancache_service.config import CacheConfig
from plancache_service.host_buffer import (
    HostBuffer,
    MemoryBudget,
    allocate_host_pages,
    chunk_pages,
    chunk_sizes,
    host_memory_budget,
)
from plancache_service.rebuild import RebuildSource
from plancache_service.tiers import HostMemoryTier, host_tier_pages

from plancache_helpers import (  # isort: skip
    PAGE_BYTES,
    X,
    Y,
    Z,
    DiffusersPages,
    assert_host_matches_reference,
    assert_slots_match_reference,
    expect,
    group_of,
    keys_of,
    pages_needed,
    run,
    sched,
)

GiB = 1024**3
MiB = 1024**2


class RecordingPinner:
    """Records (pointer, bytes) of every chunk it is asked to pin; raises on the chunk after `fail_after`."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.pinned: list[tuple[int, int]] = []
        self.unpinned: list[int] = []
        self.fail_after = fail_after

    def pin(self, t: torch.Tensor) -> None:
        if self.fail_after is not None and len(self.pinned) >= self.fail_after:
            raise RuntimeError("cudaHostRegister failed (cudaError 2)")
        self.pinned.append((t.data_ptr(), t.nbytes))

    def unpin(self, t: torch.Tensor) -> None:
        self.unpinned.append(t.data_ptr())


# ============================================================================ chunk arithmetic
def test_chunk_pages_are_whole_pages_at_least_one() -> None:
    page = 4_849_152 * 2  # a released MiniMax-H3 page in bfloat16: 9.25 MiB
    assert chunk_pages(page, 64 * MiB) == 6  # 55.5 MiB of 64: whole pages only
    assert chunk_pages(page, page) == 1
    assert chunk_pages(page, page - 1) == 1  # a page larger than the chunk: one page per chunk
    assert chunk_pages(1000, 64 * MiB) == 67108
    for bad in ((0, MiB), (MiB, 0), (-1, MiB)):
        with pytest.raises(ValueError):
            chunk_pages(*bad)


@pytest.mark.parametrize(
    ("n_pages", "per_chunk", "sizes"),
    [(0, 6, []), (5, 6, [5]), (6, 6, [6]), (12, 6, [6, 6]), (13, 6, [6, 6, 1]), (3, 1, [1, 1, 1])],
)
def test_chunk_sizes(n_pages: int, per_chunk: int, sizes: list[int]) -> None:
    assert chunk_sizes(n_pages, per_chunk) == sizes


def test_configured_bytes_become_whole_pages_within_one_page() -> None:
    page = 4_849_152 * 2
    for configured in (10 * GiB, 4 * GiB + MiB, 64 * MiB, page, page - 1, 0):
        config = CacheConfig(host_cache_bytes=configured, host_reserve_bytes=0)
        pages, why = host_tier_pages(config, page, MemoryBudget(1 << 50, "MemAvailable (fake)"))
        assert 0 <= configured - pages * page < page, configured
        assert ("off" in why) if configured == 0 else ("not clipped" in why), why


# ============================================================================ page -> chunk addressing
def test_pages_are_addressed_in_chunks_and_never_straddle() -> None:
    page_numel = 5
    buf = allocate_host_pages(13, page_numel, torch.float32, pin=False, chunk_bytes=6 * page_numel * 4 + 7)
    assert (buf.chunk_pages, [int(c.shape[0]) for c in buf.chunks]) == (6, [6, 6, 1])
    assert (buf.n_pages, buf.page_bytes, buf.nbytes, buf.pinned, buf.pinned_bytes) == (13, 20, 260, False, 0)
    spans = []
    for p in range(buf.n_pages):
        c, r = buf.locate(p)
        assert (c, r) == divmod(p, 6)
        view = buf.page(p)
        chunk = buf.chunks[c]
        start = view.data_ptr()
        assert view.shape == (page_numel,) and view.is_contiguous()
        assert start == chunk.data_ptr() + r * buf.page_bytes  # inside its own chunk, whole
        assert start + buf.page_bytes <= chunk.data_ptr() + chunk.nbytes
        spans.append((start, start + buf.page_bytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "two pages overlap"
    for p in range(buf.n_pages):
        buf.page(p).fill_(p)
    assert torch.equal(buf.gather(), torch.arange(13, dtype=torch.float32)[:, None].expand(13, page_numel))
    with pytest.raises(IndexError):
        buf.locate(13)
    # (slab row, page) pairs split per chunk as (slab row, row in chunk)
    assert buf.by_chunk([(0, 5), (1, 6), (2, 12), (3, 0)]) == {0: [(0, 5), (3, 0)], 1: [(1, 0)], 2: [(2, 0)]}


def test_host_buffer_of_a_tensor_and_its_checks() -> None:
    pages = torch.arange(21.0).view(7, 3)
    buf = HostBuffer.of(pages, chunk_pages=3)
    assert [int(c.shape[0]) for c in buf.chunks] == [3, 3, 1]
    assert torch.equal(buf.gather(), pages) and torch.equal(buf.page(4), pages[4])
    assert HostBuffer.of(torch.empty(0, 3), 3).gather().shape == (0, 3)
    with pytest.raises(ValueError):  # a chunk other than the last must be full
        HostBuffer([torch.empty(2, 3), torch.empty(3, 3)], 3, 3, torch.float32)
    with pytest.raises(ValueError):  # pages of another width
        HostBuffer([torch.empty(3, 4)], 3, 3, torch.float32)


# ============================================================================ pinning exactly, and its fallback
def test_pinned_bytes_are_the_tier_bytes_chunk_by_chunk() -> None:
    pinner = RecordingPinner()
    page_numel = 1000  # bfloat16: 2000-byte pages, 16 whole pages per 32 KiB chunk
    buf = allocate_host_pages(50, page_numel, torch.bfloat16, pin=True, chunk_bytes=32 * 1024, pinner=pinner)
    assert buf.pinned and buf.chunk_pages == 16 and [int(c.shape[0]) for c in buf.chunks] == [16, 16, 16, 2]
    assert pinner.pinned == [(c.data_ptr(), c.nbytes) for c in buf.chunks]  # exactly each chunk, nothing rounded
    assert sum(n for _, n in pinner.pinned) == buf.pinned_bytes == buf.nbytes == 50 * 2000
    buf.close()
    assert pinner.unpinned == [c.data_ptr() for c in buf.chunks]
    buf.close()  # once only
    assert len(pinner.unpinned) == 4


def test_a_pinning_failure_keeps_the_chunks_pinned_so_far(caplog: pytest.LogCaptureFixture) -> None:
    pinner = RecordingPinner(fail_after=2)
    with caplog.at_level(logging.WARNING, logger="plancache_service.device"):
        buf = allocate_host_pages(50, 1000, torch.bfloat16, pin=True, chunk_bytes=32 * 1024, pinner=pinner)
    assert buf.pinned and buf.n_pages == 32 and len(pinner.pinned) == 2
    assert "pinned 32 of 50 pages" in caplog.text and "cudaError 2" in caplog.text


def test_no_pinned_chunk_falls_back_to_pageable_pages() -> None:
    buf = allocate_host_pages(50, 1000, torch.bfloat16, pin=True, chunk_bytes=32 * 1024, pinner=RecordingPinner(0))
    assert not buf.pinned and buf.n_pages == 50 and buf.pinned_bytes == 0


# ============================================================================ the cache through chunks
def test_store_and_swap_in_through_small_chunks(source: RebuildSource, tmp_path: Path, ref: DiffusersPages) -> None:
    """Chunks of 3 pages: width-2 plans land across chunk boundaries; stores and swap-ins stay bit-exact."""
    w = sched(4, 5.0, 3.0)  # width-2 plans
    x, y, z = keys_of(X), keys_of(Y), keys_of(Z)
    config = CacheConfig(
        gpu_plans=4,
        host_cache_bytes=pages_needed(x + y + keys_of(w)) * PAGE_BYTES,
        host_reserve_bytes=0,
        host_chunk_bytes=3 * PAGE_BYTES,
        shm_dir=str(tmp_path),
    )
    cache = PlanCache(config, source)
    try:
        host = cache.host.buffer
        assert host.chunk_pages == 3 and len(host.chunks) > 2
        run(cache, w)
        run(cache, X)  # evicts w[1:] from the 4 slots
        r = run(cache, w).report
        assert (r.host_hit_plans, r.built_plans) == (3, 0)
        straddling = [k for k in keys_of(w) if len({host.locate(p)[0] for p in cache.host.page_indices(k)}) > 1]
        assert straddling, "no plan spans two chunks: the test lost its point"
        run(cache, Y)
        r = run(cache, X).report
        assert r.host_hit_plans == 3
        expect(cache, host_groups=[group_of(w), group_of(Y), group_of(X)])
        assert_host_matches_reference(cache, ref)
        assert_slots_match_reference(cache, ref)
        run(cache, Z)  # needs 3 host pages: evicts the LRU group (w) from the host tier
        assert_host_matches_reference(cache, ref)
        assert set(z) <= cache.host.plan_keys() and group_of(w) not in cache.host.groups()
    finally:
        cache.close()


# ============================================================================ clipping by MemAvailable and cgroups
def fake_system(
    root: Path,
    *,
    mem_available_kb: int | None = 16 * 1024 * 1024,
    cgroup_line: str | None = "0::/",
    files: dict[str, str] | None = None,
) -> tuple[Path, Path]:
    """A fake /proc and /sys/fs/cgroup under `root`; returns (proc, cgroup_root)."""
    proc, cg = root / "proc", root / "cgroup"
    (proc / "self").mkdir(parents=True)
    cg.mkdir()
    meminfo = "MemTotal:       65536000 kB\nMemFree:          512000 kB\n"
    if mem_available_kb is not None:
        meminfo += f"MemAvailable:   {mem_available_kb} kB\n"
    (proc / "meminfo").write_text(meminfo + "Cached:         40000000 kB\n")
    if cgroup_line is not None:
        (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for rel, text in (files or {}).items():
        path = cg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc, cg


def test_mem_available_counts_the_reclaimable_page_cache(tmp_path: Path) -> None:
    proc, cg = fake_system(tmp_path, mem_available_kb=40 * 1024 * 1024)  # MemFree is only 500 MiB
    b = host_memory_budget(proc, cg)
    assert b.bytes == 40 * GiB and "MemAvailable" in b.source


def test_cgroup_v2_limit_minus_working_set_clips(tmp_path: Path) -> None:
    proc, cg = fake_system(
        tmp_path,
        cgroup_line="0::/kubepods/pod1",
        files={
            "kubepods/memory.max": "max\n",
            "kubepods/memory.current": f"{30 * GiB}\n",
            "kubepods/pod1/memory.max": f"{12 * GiB}\n",
            "kubepods/pod1/memory.current": f"{5 * GiB}\n",
            "kubepods/pod1/memory.stat": f"anon {2 * GiB}\ninactive_file {3 * GiB}\nactive_file 0\n",
        },
    )
    b = host_memory_budget(proc, cg)
    assert b.bytes == 12 * GiB - (5 * GiB - 3 * GiB)  # the inactive page cache is reclaimable
    assert f"cgroup v2 {cg / 'kubepods/pod1/memory.max'}" in b.source


def test_a_tighter_ancestor_cgroup_wins(tmp_path: Path) -> None:
    proc, cg = fake_system(
        tmp_path,
        cgroup_line="0::/a/b",
        files={
            "a/memory.max": f"{6 * GiB}\n",
            "a/memory.current": f"{4 * GiB}\n",
            "a/b/memory.max": f"{10 * GiB}\n",
            "a/b/memory.current": f"{1 * GiB}\n",
        },
    )
    b = host_memory_budget(proc, cg)
    assert b.bytes == 2 * GiB and str(cg / "a/memory.max") in b.source


def test_a_container_sees_its_own_cgroup_at_the_mount(tmp_path: Path) -> None:
    # cgroup namespace: "0::/" and the limit at the mount; or a host path not visible inside: falls back to the mount
    for line in ("0::/", "0::/system.slice/docker-abc.scope"):
        root = tmp_path / str(len(line))
        proc, cg = fake_system(
            root, cgroup_line=line, files={"memory.max": f"{8 * GiB}\n", "memory.current": f"{3 * GiB}\n"}
        )
        b = host_memory_budget(proc, cg)
        assert b.bytes == 5 * GiB and str(cg / "memory.max") in b.source


def test_cgroup_v1_limit_and_unlimited(tmp_path: Path) -> None:
    proc, cg = fake_system(
        tmp_path / "limited",
        cgroup_line="12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc",
        files={
            "memory/docker/abc/memory.limit_in_bytes": f"{4 * GiB}\n",
            "memory/docker/abc/memory.usage_in_bytes": f"{3 * GiB}\n",
            "memory/docker/abc/memory.stat": f"cache {2 * GiB}\ntotal_inactive_file {1 * GiB}\n",
        },
    )
    b = host_memory_budget(proc, cg)
    assert b.bytes == 2 * GiB and "cgroup v1" in b.source
    proc, cg = fake_system(
        tmp_path / "unlimited",
        cgroup_line="12:memory:/",
        files={"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "1\n"},
    )
    assert "MemAvailable" in host_memory_budget(proc, cg).source


def test_no_readable_bound_means_no_clipping(tmp_path: Path) -> None:
    proc, cg = fake_system(tmp_path, mem_available_kb=None, cgroup_line=None)
    b = host_memory_budget(proc, cg)
    assert b == MemoryBudget(0, "unknown")
    pages, why = host_tier_pages(CacheConfig(host_cache_bytes=10 * GiB), GiB, b)
    assert pages == 10 and "not clipped" in why


def test_clipping_keeps_the_reserve_and_says_why(tmp_path: Path) -> None:
    proc, cg = fake_system(tmp_path, files={"memory.max": f"{8 * GiB}\n", "memory.current": f"{2 * GiB}\n"})
    budget = host_memory_budget(proc, cg)
    config = CacheConfig(host_cache_bytes=10 * GiB, host_reserve_bytes=2 * GiB)
    pages, why = host_tier_pages(config, MiB, budget)
    assert pages == 4 * 1024  # (8 - 2) GiB budget - 2 GiB reserve
    assert why.startswith(f"clipped to {4 * GiB} bytes") and "cgroup v2" in why and "memory.max" in why


def test_the_tier_logs_its_pinned_bytes_and_why(caplog: pytest.LogCaptureFixture) -> None:
    config = CacheConfig(host_cache_bytes=10 * PAGE_BYTES + 1, host_reserve_bytes=0, host_chunk_bytes=4 * PAGE_BYTES)
    with caplog.at_level(logging.INFO, logger="plancache_service.tiers"):
        tier = HostMemoryTier.allocate(config, PAGE_BYTES // 2, torch.bfloat16, torch.device("cpu"))
    assert tier.host.capacity_pages == 10 and not tier.pinned
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("host tier:"))
    assert f"host tier: {10 * PAGE_BYTES} bytes in 10 pages of {PAGE_BYTES} bytes, 3 chunk(s) of up to 4 pages" in line
    assert f"pinned 0 bytes; configured {10 * PAGE_BYTES + 1} bytes" in line and "budget" in line


# ============================================================================ on a GPU
def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.gpu
def test_just_over_4_gib_pins_less_than_4_5_gib(record_property: Callable[[str, object], None]) -> None:
    """torch's pinned allocator would pin 8 GiB for this tier (the next power of two); chunks pin what is asked.
    The byte counts are printed and recorded as test properties (scripts/gpu_check.py prints them)."""
    page_numel = 4_849_152  # a released MiniMax-H3 page: 9.25 MiB in bfloat16
    configured = 4 * GiB + 64 * MiB
    config = CacheConfig(host_cache_bytes=configured, host_reserve_bytes=0, device="cuda")
    torch.cuda.init()

    def torch_pinned() -> int:  # bytes held by torch's own (power-of-two) pinned allocator
        stats: dict[str, int] = getattr(torch.cuda, "host_memory_stats", dict)()
        return int(stats.get("allocated_bytes.current", 0))

    host_before = torch_pinned()
    rss_before = _rss_bytes()
    tier = HostMemoryTier.allocate(config, page_numel, torch.bfloat16, torch.device("cuda"))
    buf = tier.host.buffer
    try:
        rss_grown = _rss_bytes() - rss_before
        counts = {"configured_bytes": configured, "tier_bytes": buf.nbytes, "pinned_bytes": buf.pinned_bytes,
                  "rss_growth_bytes": rss_grown, "torch_pinned_allocator_growth_bytes": torch_pinned() - host_before}  # fmt: skip
        for name, value in counts.items():
            record_property(name, value)
        print(f"host tier: {counts}")
        assert buf.pinned and all(c.is_pinned() for c in buf.chunks)
        assert buf.pinned_bytes == buf.nbytes and 0 <= configured - buf.nbytes < buf.page_bytes
        assert buf.pinned_bytes < 4.5 * GiB
        assert rss_grown < 4.5 * GiB, f"resident set grew by {rss_grown} bytes"  # page-locked pages are resident
        # nothing went through torch's power-of-two pinned allocator
        assert torch_pinned() == host_before
        # the chunks work as pinned sources and destinations of the cache's copies
        dev = torch.randn(3, page_numel, device="cuda").to(torch.bfloat16)
        last = buf.n_pages - 1
        for i, p in enumerate((0, buf.chunk_pages, last)):
            buf.page(p).copy_(dev[i], non_blocking=True)
        torch.cuda.synchronize()
        for i, p in enumerate((0, buf.chunk_pages, last)):
            assert torch.equal(buf.page(p).cuda(), dev[i])
    finally:
        buf.close()
