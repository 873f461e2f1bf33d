"""The tiers below the slab: what a prepare asks, in order, for a group's missing plans.

Each missing plan goes to the first tier of the cache's list that holds it (`holds_all([key])`);
each tier then fills its share's FILLING slots in one go (`fill`, fenced before it returns): the
host tier swaps in every plan it holds, whichever group stored it, and the rebuild builds the rest
in one pass. A fill's bookkeeping (`commit`) runs once every fill succeeded. After the
slots are published, each tier may keep the group (`store`; a capacity miss is not kept, never
an error). The list ends with the rebuild tier, which holds every plan; the disk tier of built plans
(`disk_tier.DiskTier`, `--plan-dir`) sits between the host tier and the rebuild. No gRPC here.

Locking: every call comes under the cache's prepare lock, so a tier's bookkeeping never changes
under a `fill` or a copy. Bookkeeping changes only under the cache's state lock too (`store`'s
booking, `fill`'s `commit`), so stats are consistent; page copies (`fill`, `TierStore.copy`) run
without the state lock, so a release never waits on a copy.
See docs/architecture.md, "Plans, slots, pages and groups".
"""

from __future__ import annotations

import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

import torch

from ditcore.plans import PlanKey
from ditcore.report import CacheReport

from .config import CacheConfig
from .device import Copier
from .host_buffer import MemoryBudget, allocate_host_pages, host_memory_budget
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
    disk_hit_plans: int = 0
    disk_read_bytes: int = 0
    disk_read_s: float = 0.0
    rebuild_read_bytes: int = 0
    rebuild_read_s: float = 0.0
    slot_evictions: int = 0
    prepares: int = 0
    failed_prepares: int = 0

    def add(self, delta: CacheCounters) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(delta, f.name))


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class TierFill:
    """What one `fill` did: its part of the request's report, the counters it adds, and the bookkeeping the cache
    runs under its state lock (`commit`)."""

    report: CacheReport
    counts: CacheCounters
    commit: Callable[[], None] = _nothing


@dataclass(frozen=True)
class TierStore:
    """A tier's answer to `store`: whether it holds the group once `copy` has run. The booking is done (under the
    cache's state lock); the cache runs `copy` after dropping that lock, with the group's slots still pinned, and
    `undo` (under the lock again) if the copy raised. `report` is added to the request's (the disk tier's
    `disk_stored_plans`)."""

    kept: bool
    copy: Callable[[], None] = _nothing
    undo: Callable[[], None] = _nothing
    report: CacheReport = field(default_factory=CacheReport)


NOT_KEPT = TierStore(False)


@dataclass(frozen=True)
class SlabPages:
    """The slab as the tiers see it: its pages and the copy engine that writes them; for a replica, every device's
    slab (`slabs[0]` is `slab`) and copier, which a fill writes alike and a store reads the first of."""

    slab: torch.Tensor  # (S, W, P) in the checkpoint's projection dtype
    copier: Copier
    slabs: tuple[torch.Tensor, ...] = ()
    copiers: tuple[Copier, ...] = ()

    def __post_init__(self) -> None:
        if not self.slabs:
            object.__setattr__(self, "slabs", (self.slab,))
            object.__setattr__(self, "copiers", (self.copier,))

    def fence(self) -> None:
        """Every device's copies have landed."""
        for copier in self.copiers:
            copier.fence()

    def plans(self, slot: int, width: int) -> list[torch.Tensor]:
        """(width, P) views of a slot's first `width` pages on every device."""
        return [s[slot, :width] for s in self.slabs]

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
        """Whether this tier can fill every one of `keys` (the cache asks per key: a request's missing plans may
        come from several tiers)."""

    @abstractmethod
    def fill(self, keys: Sequence[PlanKey], slots: Sequence[int], slab: SlabPages) -> TierFill:
        """Write each key's pages into its slot (`slots[i]` for `keys[i]`), then fence."""

    def store(self, group: Sequence[PlanKey], slots: Sequence[int], slab: SlabPages) -> TierStore:
        """Book a copy of the published `group` (`slots[i]` holds `group[i]`); called under the cache's state
        lock, so it only books: the page copy is the returned `TierStore.copy`, run after the lock is dropped."""
        return NOT_KEPT

    @abstractmethod
    def clear(self, partitions: set[str] | None = None) -> None:
        """Forget every plan (invalidate), or only those of `partitions` (a retarget that changed them)."""


# ---------------------------------------------------------------------------- host memory
def host_tier_pages(config: CacheConfig, page_bytes: int, budget: MemoryBudget | None = None) -> tuple[int, str]:
    """Pages the host tier gets (the byte cap clipped to the memory budget minus the reserve), and why."""
    cap = config.host_cache_bytes
    if cap <= 0:
        return 0, "off (host cache 0)"
    budget = host_memory_budget() if budget is None else budget
    why = f"not clipped; budget: {budget.source}"
    if budget.bytes:
        clipped = max(0, budget.bytes - config.host_reserve_bytes)
        if clipped < cap:
            why = f"clipped to {clipped} bytes = budget minus reserve {config.host_reserve_bytes}; budget: {budget.source}"
            cap = clipped
    return cap // page_bytes, why


class HostMemoryTier(Tier):
    """Plan pages in host memory (pinned on cuda), kept per group by `HostTier`'s LRU."""

    name = "host"

    def __init__(self, host: HostTier) -> None:
        self.host = host

    @property
    def pinned(self) -> bool:
        return self.host.buffer.pinned

    @classmethod
    def allocate(cls, config: CacheConfig, page_numel: int, dtype: torch.dtype, device: torch.device) -> HostMemoryTier:
        """A tier of `page_numel`-element pages in `dtype` (the slab's), as many as the byte cap allows."""
        page_bytes = page_numel * dtype.itemsize
        pages, why = host_tier_pages(config, page_bytes)
        buf = allocate_host_pages(
            pages, page_numel, dtype, pin=device.type == "cuda", chunk_bytes=config.host_chunk_bytes
        )
        log.info(
            "host tier: %d bytes in %d pages of %d bytes, %d chunk(s) of up to %d pages; pinned %d bytes; "
            "configured %d bytes, %s",
            buf.nbytes,
            buf.n_pages,
            page_bytes,
            len(buf.chunks),
            buf.chunk_pages,
            buf.pinned_bytes,
            config.host_cache_bytes,
            why,
        )
        return cls(HostTier(buf))

    def holds_all(self, keys: Sequence[PlanKey]) -> bool:
        return self.host.holds_all(keys)

    def fill(self, keys: Sequence[PlanKey], slots: Sequence[int], slab: SlabPages) -> TierFill:
        t0 = time.perf_counter()
        runs = self._runs(keys, slots, int(slab.slab.shape[1]))
        chunks = self.host.buffer.chunks
        nbytes = 0
        for dst, copier in zip(slab.slabs, slab.copiers, strict=True):  # one host copy, every device's slab
            nbytes += copier.copy_runs(dst.view(-1, dst.shape[-1]), chunks, runs)
        slab.fence()
        dt = time.perf_counter() - t0
        touched = list(keys)
        return TierFill(
            CacheReport(host_hit_plans=len(keys), swap_in_s=round(dt, 6)),
            CacheCounters(host_hit_plans=len(keys), swap_in_bytes=nbytes, swap_in_s=dt),
            commit=lambda: self.host.touch(touched),
        )

    def _runs(self, keys: Sequence[PlanKey], slots: Sequence[int], width: int) -> list[tuple[int, int, int, int]]:
        """The swap-in as (slab row, chunk, row in chunk, pages) runs, slots in order: pages consecutive on both
        sides (a plan's, and the next slot's plan when its pages follow in the same chunk) are one run."""
        page_spans = self.host.page_spans
        runs: list[tuple[int, int, int, int]] = []
        d0 = c0 = r0 = n0 = 0  # the run being extended (n0 = 0: none yet)
        for slot, key in sorted(zip(slots, keys, strict=True), key=itemgetter(0)):
            row = slot * width
            for c, r, n in page_spans(key):
                if n0 and c == c0 and row == d0 + n0 and r == r0 + n0:
                    n0 += n
                else:
                    if n0:
                        runs.append((d0, c0, r0, n0))
                    d0, c0, r0, n0 = row, c, r, n
                row += n
        if n0:
            runs.append((d0, c0, r0, n0))
        return runs

    def store(self, group: Sequence[PlanKey], slots: Sequence[int], slab: SlabPages) -> TierStore:
        """Book the group's plans not yet held (all or nothing); the copy out of their slots is `copy`."""
        if self.host.capacity_pages == 0:
            return NOT_KEPT
        slot_of = dict(zip(group, slots, strict=True))
        pairs: list[tuple[int, int]] = []  # (slab row, host page)
        written: list[PlanKey] = []

        def write(key: PlanKey, pages: list[int]) -> None:
            written.append(key)
            pairs.extend((slab.row(slot_of[key], j), page) for j, page in enumerate(pages))

        if not self.host.admit(group, write):
            return NOT_KEPT
        if not pairs:
            return TierStore(True)
        buffer = self.host.buffer
        per_chunk = buffer.by_chunk(pairs)  # chunk -> [(slab row, row in chunk)]

        def copy() -> None:
            for c, rows in per_chunk.items():
                slab.copier.copy_rows(buffer.chunks[c], slab.rows, [(dst, src) for src, dst in rows])
            slab.copier.fence()

        return TierStore(True, copy, lambda: self.host.forget(written))

    def clear(self, partitions: set[str] | None = None) -> None:
        if partitions is None:
            self.host.clear()
        else:
            self.host.forget([k for k in self.host.plan_keys() if k.partition in partitions])


# ---------------------------------------------------------------------------- rebuild
class RebuildTier(Tier):
    """The repository: holds every plan; one streamed pass builds a whole group (`RebuildSource.build_all`), one
    GEMM per plan (and per shard, on a replica's slabs) written straight into its slot."""

    name = "rebuild"

    def __init__(self, source: RebuildSource) -> None:
        self.source = source
        self.built: set[PlanKey] | None = None
        """The keys built since a storing tier last looked (None: nobody looks; the disk tier sets and clears it)."""

    def holds_all(self, keys: Sequence[PlanKey]) -> bool:
        return True

    def fill(self, keys: Sequence[PlanKey], slots: Sequence[int], slab: SlabPages) -> TierFill:
        t0 = time.perf_counter()
        per_key = [slab.plans(s, k.width) for k, s in zip(keys, slots, strict=True)]
        reads = self.source.build_all(keys, [list(views) for views in zip(*per_key, strict=True)])  # per device, key
        slab.fence()
        dt = time.perf_counter() - t0
        built = list(keys)

        def commit() -> None:
            if self.built is not None:
                self.built.update(built)

        return TierFill(
            CacheReport(
                built_plans=len(keys),
                rebuild_s=round(dt, 6),
                rebuild_read_bytes=reads.nbytes,
                rebuild_read_s=round(reads.seconds, 6),
            ),
            CacheCounters(
                built_plans=len(keys),
                rebuild_passes=1,
                rebuild_s=dt,
                rebuild_read_bytes=reads.nbytes,
                rebuild_read_s=reads.seconds,
            ),
            commit,
        )

    def clear(self, partitions: set[str] | None = None) -> None:
        """Nothing to forget: the checkpoint is the source, not a copy (`retarget` swaps it)."""
