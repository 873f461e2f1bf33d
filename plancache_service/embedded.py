"""Embedded use of the cache core: a ditcore `PlanProvider` backed by an in-process PlanCache.

`generate-local --adaln-mode cached` runs through this; the generator service uses the same
slot-reading rule against the sidecar's slab instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ditcore.plans import StepPlan
from ditcore.report import CacheReport
from ditcore.sampler import PlanLease

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

    def release(self) -> None:
        self._cache.release(self.lease.lease_id)


class EmbeddedPlanProvider:
    """ditcore's `PlanProvider`: each request's plans leased from the cache's current generation."""

    def __init__(self, cache: PlanCache, owner: str = "embedded") -> None:
        self.cache = cache
        self.owner = owner

    def acquire(self, steps: Sequence[StepPlan]) -> EmbeddedLease:
        lease = self.cache.prepare(self.cache.generation, [s.key for s in steps], self.owner)
        return EmbeddedLease(self.cache, lease)
