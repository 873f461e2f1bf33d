"""A PlanProvider for tests that need a cached model's plans without a sidecar process (`BuiltPages`: pages built
here by the sidecar's own PlanBuilder, from the checkpoint folder of each key's partition), and the pages a resident
model's own modules compute (`resident_pages`), which built pages must equal."""

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


def resident_pages(model: Any, key: Any, uses: list[tuple[Any, float]]) -> torch.Tensor:
    """A key's pages as the resident model computes them with `uses` active through PEFT: its own time embedder,
    adaln_proj and norm_out modules (PEFT-wrapped), called on the key's timesteps."""
    import torch.nn.functional as F

    from ditcore.plans import PageLayout, plan_inputs

    transformer = model.transformer_of("base")
    layout = PageLayout.from_config(transformer.config)
    with torch.no_grad(), model.adapter_set.active("base", uses):
        modules = dict(transformer.named_modules())  # PEFT's wrappers, once the adapters are loaded
        temb = plan_inputs(transformer.time_proj, transformer.time_embedder, key.timesteps())
        pages = None
        for prefix, offset, numel in layout.projections():
            module = modules[prefix]
            act = F.silu(temb).to(module.weight.dtype)
            rows = module(act)
            if pages is None:
                pages = torch.empty(temb.shape[0], layout.page_numel, dtype=rows.dtype)
            pages[:, offset : offset + numel] = rows
    assert pages is not None
    return pages
