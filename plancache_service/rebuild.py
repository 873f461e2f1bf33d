"""Rebuild source: the MiniMax-H3 repository plans are built from, and the one place pages are computed.

A `RebuildSource` wraps ditcore's `PlanBuilder` over a validated `CheckpointInfo` (a diffusers repository whose
transformer holds its native `adaln_proj` and `norm_out.linear` tensors). One `build` is one streamed pass: every
plan tensor is read from the transformer's shards once, then projected with one GEMM per plan (M = the plan's width,
as diffusers' forward computes it), straight into the slab slots given as outputs. Pages are in the checkpoint's
projection dtype (bfloat16 in the released mixed precision, float32 in a float32 repository) and
`layout.page_numel` elements long.

Before each pass the repository's per-file digests (ditcore.checkpoint.file_digests) are compared with the ones its
generation was committed with: a repository changed in place is refused (`CheckpointChangedError`), never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ditcore.checkpoint import (
    TRANSFORMER,
    CheckpointError,
    CheckpointInfo,
    changed_files,
    combine_digests,
    file_digests,
    validate_checkpoint,
)
from ditcore.plans import PageLayout, PlanKey
from ditcore.rebuild import PlanBuilder
from ditruntime.faults import crash_point

from .errors import CheckpointChangedError, PlanCacheError, RebuildError


def open_checkpoint(path: str | Path) -> CheckpointInfo:
    """Validate a repository as a rebuild source: a MiniMax-H3 repository whose transformer holds every plan tensor.

    Raises CheckpointError naming the file (and tensor) of any fault; a repository without native `adaln_proj`
    tensors (one prepared for cached generators only) is refused with a message saying so.
    """
    info = validate_checkpoint(path, require_adaln=False)  # present plan tensors are still checked in full
    _require_adaln(info)
    return info


def _require_adaln(info: CheckpointInfo) -> None:
    if not info.has_adaln:
        raise CheckpointError(
            f"{info.path}: {TRANSFORMER}/ holds no native adaln_proj / norm_out.linear tensors (a repository "
            "stripped for cached generators); the plan cache builds every plan from them, so it cannot serve it"
        )


def concrete_device(device: torch.device | str) -> torch.device:
    """`device` with its index filled in ("cuda" -> "cuda:N", the current device), as tensors report theirs: the
    builder compares its device with the slab slots' it writes."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


class RebuildSource:
    """The repository plans are built from: its validation, committed digests and page builder.

    `committed_digests` are the per-file digests the serving generation was committed with (from the state file);
    by default, the files as they are when the source is opened.
    """

    def __init__(
        self,
        checkpoint: str | Path | CheckpointInfo,
        device: torch.device,
        committed_digests: dict[str, str] | None = None,
    ) -> None:
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else open_checkpoint(checkpoint)
        _require_adaln(info)
        self.info = info
        self.device = concrete_device(device)
        self.digests = dict(committed_digests) if committed_digests else file_digests(info.path)
        try:
            self.builder = PlanBuilder(info.path / TRANSFORMER, self.device)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{info.path}: cannot open the transformer's plan tensors: {e}") from e
        if self.builder.layout != info.layout or self.builder.projection_dtype != info.projection_dtype:
            raise CheckpointError(
                f"{info.path}: the page builder reads {self.builder.layout} in {self.builder.projection_dtype}, "
                f"validation found {info.layout} in {info.projection_dtype}"
            )

    # ---------------------------------------------------------------- geometry
    @property
    def path(self) -> Path:
        return self.info.path

    @property
    def layout(self) -> PageLayout:
        """Where each projection's rows sit in a page (from the transformer's config)."""
        return self.info.layout

    @property
    def dtype(self) -> torch.dtype:
        """The pages' dtype: the checkpoint's projection dtype."""
        return self.info.projection_dtype

    @property
    def page_numel(self) -> int:
        return self.layout.page_numel

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes(self.dtype)

    def geometry_mismatch(self, other: RebuildSource) -> str | None:
        """Why `other`'s pages would not fit a slab laid out for this source's (layout or dtype), or None."""
        if (other.layout, other.dtype) == (self.layout, self.dtype):
            return None
        return f"pages of {other.layout} in {other.dtype}, the slab holds {self.layout} in {self.dtype}"

    # ---------------------------------------------------------------- identity
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
        """Refuse to build from files that changed since their generation was committed."""
        changed = self.changed_files()
        if changed:
            raise CheckpointChangedError(
                f"rebuild source {self.info.path} changed on disk since its generation was committed "
                f"(changed: {', '.join(changed)}); refusing to build plans from it"
            )

    # ---------------------------------------------------------------- pages
    def build(self, keys: Sequence[PlanKey], outputs: Sequence[torch.Tensor]) -> None:
        """One pass: every key's pages into `outputs[k]`, (width_k, page_numel) in `dtype` on the device."""
        self.check_unchanged()
        crash_point("sidecar:during_rebuild")
        try:
            self.builder.build(keys, outputs)
        except PlanCacheError:
            raise
        except Exception as e:  # OSError, a safetensors error on a damaged shard, a shape the builder refuses
            raise RebuildError(f"rebuild from {self.info.path} failed: {type(e).__name__}: {e}") from e
