"""Embedded use of the cache core: a ditcore `PlanProvider` backed by an in-process PlanCache.

`ditcore.generation.generate(model, request, EmbeddedPlanProvider(cache))` runs a cached H3Model on the cache's pages:
the slab must live on the model's device, in the checkpoint's projection dtype (the cache's rebuild source decides).

`generate-local --adaln-mode cached` runs through this; the generator service uses the same
slot-reading rule against the sidecar's slab instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ditcore.generation import PlanLease
from ditcore.plans import PlanKey
from ditcore.report import CacheReport

from .cache import Lease, PlanCache


class EmbeddedLease(PlanLease):
    """ditcore's `PlanLease` over one cache `Lease`: step i reads its slot in the local slab."""

    def __init__(self, cache: PlanCache, lease: Lease) -> None:
        self._cache = cache
        self.lease = lease

    @property
    def report(self) -> CacheReport:
        return self.lease.report

    def pages(self, step: int) -> torch.Tensor:
        return self._cache.slab[self.lease.slots[step], : self.lease.keys[step].width]

    def slab_slots(self) -> tuple[torch.Tensor, list[int]]:
        """The local slab and every step's slot (ditcore.generation.SlabPlanLease: one indexed read per step)."""
        return self._cache.slab, list(self.lease.slots)

    def release(self) -> None:
        self._cache.release(self.lease.lease_id)


class EmbeddedPlanProvider:
    """ditcore's `PlanProvider`: each request's plans leased from the cache's current generation."""

    def __init__(self, cache: PlanCache, owner: str = "embedded") -> None:
        self.cache = cache
        self.owner = owner

    def acquire(self, keys: Sequence[PlanKey]) -> EmbeddedLease:
        """Lease the pages of `keys` (one per step); `pages(i)` is step i's slot, (width, page_numel)."""
        lease = self.cache.prepare(self.cache.generation, list(keys), self.owner)
        return EmbeddedLease(self.cache, lease)
