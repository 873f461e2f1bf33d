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
    changed_files,
    combine_digests,
    file_digests,
    validate_checkpoint,
)
from ditcore.model import TimestepEmbedder
from ditcore.plans import BatchingProbe, PlanKey, build_pages

from .errors import CheckpointChangedError, RebuildError

log = logging.getLogger(__name__)


def make_probe(info: CheckpointInfo, device: torch.device) -> BatchingProbe:
    """Start-up proof of whether batched rebuild GEMMs are bit-exact here (see BatchingProbe)."""
    probe = BatchingProbe(info.config, device, info.config.torch_dtype)
    on = probe.warm(widths=(1, 2), counts=(2, 50))
    log.info(
        "rebuild GEMM batching on %s: %s", device, "bit-exact, enabled" if on else "not bit-exact, one GEMM per plan"
    )
    return probe


class RebuildSource:
    """The checkpoint plans are built from, plus the (small, resident) timestep embedder.

    `committed_digests` are the per-file digests the serving generation was committed with
    (from the state file); by default, the files as they are when the source is opened.
    """

    def __init__(
        self,
        checkpoint: str | Path | CheckpointInfo,
        device: torch.device,
        committed_digests: dict[str, str] | None = None,
        probe: BatchingProbe | None = None,
    ) -> None:
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else validate_checkpoint(checkpoint)
        if not info.has_adaln:
            raise CheckpointError(f"{info.path}: no native adaln_proj tensors: it cannot feed the plan cache")
        self.info = info
        self.device = device
        self.config = info.config
        self.digests = dict(committed_digests) if committed_digests else file_digests(info.path)
        with torch.device("meta"):
            embed = TimestepEmbedder(info.config)
        with CheckpointReader(info) as reader:
            state = {n: reader.get(f"time_embed.{n}") for n in embed.state_dict()}
        embed.load_state_dict(state, assign=True)
        self.time_embed = embed.to(device).eval().requires_grad_(False)
        self.probe = probe if probe is not None else make_probe(info, device)

    @property
    def path(self) -> Path:
        return self.info.path

    @property
    def fingerprint(self) -> str:
        """Fingerprint of the files as committed (equal to `info.fingerprint` unless they changed)."""
        return combine_digests(self.digests)

    def changed_files(self) -> list[str]:
        """Files that differ from what was committed (a read error counts as a change)."""
        try:
            return changed_files(self.digests, file_digests(self.info.path))
        except (CheckpointError, OSError) as e:
            return [f"unreadable ({e})"]

    def check_unchanged(self) -> None:
        """Refuse to rebuild from files that changed since their generation was committed."""
        changed = self.changed_files()
        if changed:
            raise CheckpointChangedError(
                f"rebuild source {self.info.path} changed on disk since its generation was committed "
                f"(changed: {', '.join(changed)}); refusing to build plans from it"
            )

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
                build_pages(self.config, load_layer, inputs, outputs, probe=self.probe)
        except CheckpointError as e:
            raise RebuildError(f"rebuild failed: {e}") from e
        except OSError as e:
            raise RebuildError(f"rebuild failed reading {self.info.path}: {e}") from e
