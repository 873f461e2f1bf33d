"""In-process plan provider: builds a request's plans with the shared projection, no cache.

The simplest `PlanProvider`: every acquire streams adaln_proj from the checkpoint once and
projects the request's distinct plans (one rebuild pass). The plan-cache core in
`plancache_service` is the real provider; this one is the reference it must match.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .checkpoint import CheckpointInfo, CheckpointReader
from .model import TimestepEmbedder
from .plans import PlanKey, StepPlan, build_pages, distinct_keys
from .report import CacheReport


class _Lease:
    def __init__(self, pages: dict[PlanKey, torch.Tensor], steps: Sequence[StepPlan], report: CacheReport) -> None:
        self._pages = pages
        self._steps = list(steps)
        self.report = report

    def pages(self, step: int) -> torch.Tensor:
        return self._pages[self._steps[step].key]

    def release(self) -> None:
        self._pages = {}


class LocalPlanProvider:
    """Builds plans for each request from the checkpoint (cold every time)."""

    def __init__(self, info: CheckpointInfo, time_embed: TimestepEmbedder) -> None:
        if not info.has_adaln:
            raise ValueError(f"{info.path}: checkpoint has no adaln_proj tensors to build plans from")
        self.info = info
        self.time_embed = time_embed

    @torch.inference_mode()
    def acquire(self, steps: Sequence[StepPlan]) -> _Lease:
        t0 = time.perf_counter()
        config = self.info.config
        keys = distinct_keys(s.key for s in steps)
        inputs = [self.time_embed.adaln_input(k.timesteps()) for k in keys]
        outputs = [torch.empty(k.width, config.page_numel, dtype=config.torch_dtype) for k in keys]
        with CheckpointReader(self.info) as reader:
            build_pages(config, reader.adaln_layer, inputs, outputs)
        report = CacheReport(built_plans=len(keys), rebuild_s=round(time.perf_counter() - t0, 6))
        return _Lease(dict(zip(keys, outputs, strict=True)), steps, report)
