"""Rebuild source: streams `adaln_proj` from the checkpoint and projects plans into slots.

One pass per prepare that misses: `safe_open` each layer's weight and bias (one layer in
memory at a time), project every missing plan with ditcore's shared `build_pages` (GEMM
M = the plan's width), drop the layer; then `final_layer`. Before each pass the checkpoint
fingerprint is re-checked: files changed since the source was opened are refused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from ditcore.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    CheckpointReader,
    fingerprint,
    validate_checkpoint,
)
from ditcore.model import TimestepEmbedder
from ditcore.plans import PlanKey, build_pages

from .errors import CheckpointChangedError, RebuildError

log = logging.getLogger(__name__)


class RebuildSource:
    """The checkpoint plans are built from, plus the (small, resident) timestep embedder."""

    def __init__(self, checkpoint: str | Path | CheckpointInfo, device: torch.device) -> None:
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else validate_checkpoint(checkpoint)
        if not info.has_adaln:
            raise CheckpointError(f"{info.path}: no native adaln_proj tensors: it cannot feed the plan cache")
        self.info = info
        self.device = device
        self.config = info.config
        with torch.device("meta"):
            embed = TimestepEmbedder(info.config)
        with CheckpointReader(info) as reader:
            state = {n: reader.get(f"time_embed.{n}") for n in embed.state_dict()}
        embed.load_state_dict(state, assign=True)
        self.time_embed = embed.to(device).eval().requires_grad_(False)

    @property
    def fingerprint(self) -> str:
        return self.info.fingerprint

    def check_unchanged(self) -> None:
        """Refuse to rebuild from files that changed since this source was opened."""
        try:
            now = fingerprint(self.info.path)
        except (CheckpointError, OSError) as e:
            raise CheckpointChangedError(f"rebuild source {self.info.path} is no longer readable: {e}") from e
        if now != self.info.fingerprint:
            changed = self._changed_file()
            raise CheckpointChangedError(
                f"rebuild source {self.info.path} changed on disk since it was opened ({changed}); "
                "refusing to build plans from it"
            )

    def _changed_file(self) -> str:
        try:
            current = validate_checkpoint(self.info.path, require_adaln=False)
        except CheckpointError as e:
            return str(e)
        for name in sorted(set(current.weight_map.values()) | set(self.info.weight_map.values())):
            if current.weight_map.get(name) != self.info.weight_map.get(name):
                return f"{name} changed"
        return "config, index or a shard header changed"

    @torch.inference_mode()
    def build(self, keys: Sequence[PlanKey], outputs: Sequence[torch.Tensor]) -> None:
        """One pass: project every key's pages into `outputs[k]` (width_k, page_numel)."""
        self.check_unchanged()
        inputs = [self.time_embed.adaln_input(k.timesteps().to(self.device)) for k in keys]
        dev = self.device

        def load_layer(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
            w, b = reader.adaln_layer(prefix)
            return w.to(dev, non_blocking=True), b.to(dev, non_blocking=True)

        try:
            with CheckpointReader(self.info) as reader:
                build_pages(self.config, load_layer, inputs, outputs)
        except CheckpointError as e:
            raise RebuildError(f"rebuild failed: {e}") from e
        except OSError as e:
            raise RebuildError(f"rebuild failed reading {self.info.path}: {e}") from e
