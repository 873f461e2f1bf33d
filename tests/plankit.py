"""A PlanProvider for tests that need a cached model's plans without a sidecar process: pages built here by the
sidecar's own PlanBuilder, from the checkpoint folder of each key's partition."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class BuiltPages:
    """`acquire(keys)`: a lease holding every key's pages, built now (with `deltas`, a ditcore.adapter_plans
    ModulationDeltas, when set: the plans of a request's modulation-changing adapters)."""

    def __init__(self, repo: Path, device: torch.device | None = None) -> None:
        self.repo, self.device = repo, device if device is not None else torch.device("cpu")
        self.builders: dict[str, Any] = {}
        self.deltas: Any = None

    def builder(self, partition: str) -> Any:
        from ditcore.checkpoint_files import PARTITIONS
        from ditcore.rebuild import PlanBuilder

        if partition not in self.builders:
            self.builders[partition] = PlanBuilder(self.repo / PARTITIONS[partition], self.device)
        return self.builders[partition]

    def acquire(self, keys: Any) -> Any:
        from ditcore.report import CacheReport

        pages = [self.builder(k.partition).build_one(k, self.deltas) for k in keys]

        class Lease:
            report = CacheReport(built_plans=len(keys))

            def pages(self, step: int) -> torch.Tensor:
                return pages[step]

            def release(self) -> None:
                pass

        return Lease()
