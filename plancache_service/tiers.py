"""The tiers below the slab: what a prepare asks, in order, for a group's missing plans.

The cache asks each tier of its list `holds_all(missing)`; the first that answers yes fills
every missing plan's FILLING slot in one go (`fill`, fenced before it returns). After the
slots are published, each tier may keep the group (`store`; a capacity miss is False, never
an error). The list ends with the rebuild tier, which holds every plan. A new tier (a disk
tier of built plans) is one class here plus one entry in the cache's list. No gRPC here.
See docs/architecture.md, "Plans, slots, pages and groups".
"""

from __future__ import annotations

import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ditcore.plans import PlanKey
from ditcore.report import CacheReport

from .config import CacheConfig
from .device import Copier, allocate_host_pages, available_memory_bytes
from .host_tier import HostTier
from .rebuild import RebuildSource

log = logging.getLogger(__name__)


@dataclass
class CacheCounters:
    """What the cache has done since it started; `CacheStats` reports them."""

    slot_hit_plans: int = 0
    host_hit_plans: int = 0
    built_plans: int = 0
    rebuild_passes: int = 0
    rebuild_s: float = 0.0
    swap_in_bytes: int = 0
    swap_in_s: float = 0.0
    slot_evictions: int = 0
    prepares: int = 0
    failed_prepares: int = 0

    def add(self, delta: CacheCounters) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(delta, f.name))


@dataclass(frozen=True)
class TierFill:
    """What one `fill` did: its part of the request's report, and the counters it adds."""

    report: CacheReport
    counts: CacheCounters


@dataclass(frozen=True)
class SlabPages:
    """The slab as the tiers see it: its pages and the copy engine that writes them."""

    slab: torch.Tensor  # (S, W, P) in the checkpoint's projection dtype
    copier: Copier

    @property
    def rows(self) -> torch.Tensor:
        """The slab as (S * W, P) page rows; row `slot * W + j` is page j of `slot`."""
        return self.slab.view(-1, self.slab.shape[-1])

    def row(self, slot: int, j: int) -> int:
        return slot * int(self.slab.shape[1]) + j

    def plan(self, slot: int, width: int) -> torch.Tensor:
        """(width, P) view of a slot's first `width` pages."""
        return self.slab[slot, :width]


class Tier(ABC):
    """One place plans can come from when they are not in a slot."""

    name: str

    @abstractmethod
    def holds_all(self, keys: Sequence[PlanKey]) -> bool:
        """Whether this tier can fill every one of `keys` (one tier fills a whole group)."""

    @abstractmethod
    def fill(self, keys: Sequence[PlanKey], slots: Sequence[int], slab: SlabPages) -> TierFill:
        """Write each key's pages into its slot (`slots[i]` for `keys[i]`), then fence."""

    def store(self, group: Sequence[PlanKey], slots: Sequence[int], slab: SlabPages) -> bool:
        """Keep a copy of the published `group` (`slots[i]` holds `group[i]`); False if not kept."""
        return False

    @abstractmethod
    def clear(self) -> None:
        """Forget every plan (invalidate, retarget)."""


# ---------------------------------------------------------------------------- host memory
def host_tier_pages(config: CacheConfig, page_bytes: int) -> int:
    """Pages the host tier gets: the byte cap clipped to available memory minus the reserve."""
    cap = config.host_cache_bytes
    avail = available_memory_bytes()
    if avail:
        clipped = max(0, avail - config.host_reserve_bytes)
        if clipped < cap:
            log.warning("host tier: clipping %d bytes to %d (available memory minus reserve)", cap, clipped)
            cap = clipped
    return cap // page_bytes


class HostMemoryTier(Tier):
    """Plan pages in host memory (pinned on cuda), kept per group by `HostTier`'s LRU."""

    name = "host"

    def __init__(self, host: HostTier, pinned: bool) -> None:
        self.host = host
        self.pinned = pinned

    @classmethod
    def allocate(cls, config: CacheConfig, page_numel: int, dtype: torch.dtype, device: torch.device) -> HostMemoryTier:
        """A tier of `page_numel`-element pages in `dtype` (the slab's), as many as the byte cap allows."""
        pages = host_tier_pages(config, page_numel * dtype.itemsize)
        buf = allocate_host_pages(pages, page_numel, dtype, pin=device.type == "cuda")
        return cls(HostTier(buf.pages), buf.pinned)

    def holds_all(self, keys: Sequence[PlanKey]) -> bool:
        return self.host.holds_all(keys)

    def fill(self, keys: Sequence[PlanKey], slots: Sequence[int], slab: SlabPages) -> TierFill:
        t0 = time.perf_counter()
        pairs = [
            (slab.row(s, j), page)
            for k, s in zip(keys, slots, strict=True)
            for j, page in enumerate(self.host.page_indices(k))
        ]
        nbytes = slab.copier.copy_rows(slab.rows, self.host.buffer, pairs)
        slab.copier.fence()
        self.host.touch(keys)
        dt = time.perf_counter() - t0
        return TierFill(
            CacheReport(host_hit_plans=len(keys), swap_in_s=round(dt, 6)),
            CacheCounters(host_hit_plans=len(keys), swap_in_bytes=nbytes, swap_in_s=dt),
        )

    def store(self, group: Sequence[PlanKey], slots: Sequence[int], slab: SlabPages) -> bool:
        """Copy the group's plans not yet held out of their slots (all or nothing)."""
        if self.host.capacity_pages == 0:
            return False
        slot_of = dict(zip(group, slots, strict=True))
        pairs: list[tuple[int, int]] = []

        def write(key: PlanKey, rows: list[int]) -> None:
            pairs.extend((row, slab.row(slot_of[key], j)) for j, row in enumerate(rows))

        stored = self.host.admit(group, write)
        if pairs:
            slab.copier.copy_rows(self.host.buffer, slab.rows, pairs)
            slab.copier.fence()
        return stored

    def clear(self) -> None:
        self.host.clear()


# ---------------------------------------------------------------------------- rebuild
class RebuildTier(Tier):
    """The repository: holds every plan; one streamed pass builds a whole group (`RebuildSource.build`), one GEMM
    per plan written straight into its slot."""

    name = "rebuild"

    def __init__(self, source: RebuildSource) -> None:
        self.source = source

    def holds_all(self, keys: Sequence[PlanKey]) -> bool:
        return True

    def fill(self, keys: Sequence[PlanKey], slots: Sequence[int], slab: SlabPages) -> TierFill:
        t0 = time.perf_counter()
        self.source.build(keys, [slab.plan(s, k.width) for k, s in zip(keys, slots, strict=True)])
        slab.copier.fence()
        dt = time.perf_counter() - t0
        return TierFill(
            CacheReport(built_plans=len(keys), rebuild_s=round(dt, 6)),
            CacheCounters(built_plans=len(keys), rebuild_passes=1, rebuild_s=dt),
        )

    def clear(self) -> None:
        """Nothing to forget: the checkpoint is the source, not a copy (`retarget` swaps it)."""
