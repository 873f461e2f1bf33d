"""Host tier: plan pages kept in host memory, with LRU at group (schedule) granularity.

Bookkeeping only: `tiers.HostMemoryTier` allocates the page buffer (`host_buffer.HostBuffer`, pages
in chunks of whole pages) and does the copies through the cache's `Copier`. A group is one
request's ordered distinct plan keys: a rebuild pass streams every layer however few plans miss,
so a request missing one plan of its schedule costs almost a whole rebuild, and the unit of
retention (LRU, eviction) is the whole group. Lookups are per plan, not per group: a slab miss is
swapped in from whichever stored group holds its key (`holds`, `page_indices`). Plans shared by
groups (every schedule's t = 0 plan, of the base weights or of one adapters digest) are stored once
and refcounted.

Admission is all-or-nothing per group: if the group's new pages cannot fit even after
evicting every other group, it is skipped and counted (`pressure_skips`), never an error.
`admit` only books pages; the caller copies into them (after dropping its own lock) and calls
`forget` if that copy fails.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ditcore.plans import PlanKey

from .host_buffer import HostBuffer

Group = tuple[PlanKey, ...]


@dataclass
class _HostPlan:
    pages: list[int]  # page indices in the buffer, one per timestep of the key
    spans: tuple[tuple[int, int, int], ...]  # the pages as (chunk, row in chunk, count) runs, in order
    refs: int = 0  # number of stored groups containing this plan


def _spans(pages: list[int], buffer: HostBuffer) -> tuple[tuple[int, int, int], ...]:
    out: list[tuple[int, int, int]] = []
    for page in pages:
        c, r = buffer.locate(page)
        if out and out[-1][0] == c and out[-1][1] + out[-1][2] == r:
            out[-1] = (c, out[-1][1], out[-1][2] + 1)
        else:
            out.append((c, r, 1))
    return tuple(out)


class HostTier:
    def __init__(self, buffer: HostBuffer) -> None:
        self.buffer = buffer  # page p: buffer.page(p)
        self._free: list[int] = list(range(buffer.n_pages))[::-1]
        self._plans: dict[PlanKey, _HostPlan] = {}
        self._groups: OrderedDict[Group, None] = OrderedDict()  # LRU order: oldest first
        self.group_evictions = 0
        self.pressure_skips = 0

    # ---------------------------------------------------------------- queries
    @property
    def capacity_pages(self) -> int:
        return self.buffer.n_pages

    @property
    def used_pages(self) -> int:
        return self.capacity_pages - len(self._free)

    @property
    def page_bytes(self) -> int:
        return self.buffer.page_bytes

    def holds(self, key: PlanKey) -> bool:
        return key in self._plans

    def holds_all(self, keys: Iterable[PlanKey]) -> bool:
        return all(k in self._plans for k in keys)

    def groups(self) -> list[Group]:
        """Stored groups, least recently used first."""
        return list(self._groups)

    def plan_keys(self) -> set[PlanKey]:
        return set(self._plans)

    def page_rows(self, key: PlanKey) -> list[torch.Tensor]:
        """The held plan's pages as (page_numel,) row views, one per timestep of the key."""
        return [self.buffer.page(p) for p in self._plans[key].pages]

    def page_indices(self, key: PlanKey) -> list[int]:
        """Pages of `buffer` holding the plan's pages, one per timestep of the key."""
        return list(self._plans[key].pages)

    def page_spans(self, key: PlanKey) -> tuple[tuple[int, int, int], ...]:
        """The plan's pages as (chunk, row in chunk, pages) runs of consecutive rows, in timestep order (computed
        once, when the plan is admitted: a swap-in reads them for every plan it copies)."""
        return self._plans[key].spans

    # ---------------------------------------------------------------- updates
    def touch(self, keys: Iterable[PlanKey]) -> None:
        """Mark every group containing any of `keys` as most recently used."""
        wanted = set(keys)
        for g in [g for g in self._groups if wanted.intersection(g)]:
            self._groups.move_to_end(g)

    def admit(self, group: Sequence[PlanKey], write: Callable[[PlanKey, list[int]], None]) -> bool:
        """Store `group`; `write(key, pages)` must fill those pages of `buffer` for each plan not yet held
        (or arrange for them to be filled before the tier is next read).

        Returns False (and counts a pressure skip) when the group cannot fit even after
        evicting every other group; the tier is then left exactly as it was.
        """
        g: Group = tuple(group)
        if g in self._groups:
            self._groups.move_to_end(g)
            return True
        uniq = list(dict.fromkeys(g))
        new = [k for k in uniq if k not in self._plans]
        need = sum(k.width for k in new)
        if need > self._reclaimable_pages(g):
            self.pressure_skips += 1
            return False
        for k in uniq:
            if k in self._plans:
                self._plans[k].refs += 1  # pinned by g before evicting others
        while len(self._free) < need:
            self._evict_lru(protect=g)
        for k in new:
            pages = [self._free.pop() for _ in range(k.width)]
            self._plans[k] = _HostPlan(pages, _spans(pages, self.buffer), refs=1)
            write(k, pages)
        self._groups[g] = None
        return True

    def forget(self, keys: Iterable[PlanKey]) -> None:
        """Drop `keys` and every group holding any of them (their pages were never filled)."""
        gone = set(keys)
        for g in [g for g in self._groups if gone.intersection(g)]:
            del self._groups[g]
            for k in dict.fromkeys(g):
                if k in self._plans:
                    self._plans[k].refs -= 1
        for k in gone:
            hp = self._plans.pop(k, None)
            if hp is not None:
                self._free.extend(hp.pages)
        for k in [k for k, hp in self._plans.items() if hp.refs == 0]:
            self._free.extend(self._plans.pop(k).pages)

    def clear(self) -> None:
        self._plans.clear()
        self._groups.clear()
        self._free = list(range(self.capacity_pages))[::-1]

    # ---------------------------------------------------------------- internals
    def _reclaimable_pages(self, protect: Group) -> int:
        """Free pages plus pages that evicting every other group would free."""
        keep = set(protect)
        freed = sum(len(hp.pages) for k, hp in self._plans.items() if k not in keep)
        return len(self._free) + freed

    def _evict_lru(self, protect: Group) -> None:
        victim = next(g for g in self._groups if g != protect)
        del self._groups[victim]
        self.group_evictions += 1
        for k in dict.fromkeys(victim):
            hp = self._plans[k]
            hp.refs -= 1
            if hp.refs == 0:
                self._free.extend(hp.pages)
                del self._plans[k]
