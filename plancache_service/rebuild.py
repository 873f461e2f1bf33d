"""Rebuild source: the MiniMax-H3 repository plans are built from, and the one place pages are computed.

A repository holds one or two transformer partitions (ditcore.checkpoint_files.PARTITIONS: "base" = `transformer/`,
"ref" = `transformer_ref/`), each with its own `adaln_proj`; the source has one set of page builders per partition and
builds each key from its own partition's folder (`PlanKey.partition`). Both partitions share one page layout.

A `RebuildSource` wraps ditcore's `PlanBuilder` over a validated `CheckpointInfo` (a diffusers repository whose
transformer holds its native `adaln_proj` and `norm_out.linear` tensors). One `build` is one streamed pass: every
plan tensor is read from the transformer's shards once, then projected with one GEMM per plan (M = the plan's width,
as diffusers' forward computes it), straight into the slab slots given as outputs. Pages are in the checkpoint's
projection dtype (bfloat16 in the released mixed precision, float32 in a float32 repository) and
`layout.page_numel` elements long.

Before each pass the repository's per-file digests (ditcore.digests.file_digests) are compared with the ones its
generation was committed with: a repository changed in place is refused (`CheckpointChangedError`), never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ditcore.checkpoint import CheckpointInfo, validate_checkpoint
from ditcore.checkpoint_files import CheckpointError
from ditcore.digests import changed_files, combine_digests, file_digests, partition_fingerprint
from ditcore.plans import PageLayout, PlanKey
from ditcore.rebuild import PlanBuilder, Shard
from ditcore.rebuild import shard_mode as ditcore_shard_mode
from ditruntime.faults import crash_point

from .adapters import AdapterPlans
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
    for part in info.partitions.values():
        if not part.has_adaln:
            raise CheckpointError(
                f"{info.path}: {part.folder}/ holds no native adaln_proj / norm_out.linear tensors (a repository "
                "stripped for cached generators); the plan cache builds every plan from them, so it cannot serve it"
            )


@dataclass(frozen=True)
class PassReads:
    """What one rebuild pass read from the checkpoint: plan-tensor bytes (every device's together) and the seconds
    spent reading them (the devices read at once: the slowest device's; partitions and adapter groups one after the
    other: summed). `gbps` is the pass's read throughput."""

    nbytes: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def concrete_device(device: torch.device | str) -> torch.device:
    """`device` with its index filled in ("cuda" -> "cuda:N", the current device), as tensors report theirs: the
    builder compares its device with the slab slots' it writes."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


class RebuildSource:
    """The repository plans are built from: its validation, committed digests and page builder(s).

    `committed_digests` are the per-file digests the serving generation was committed with (from the state file);
    by default, the files as they are when the source is opened. With several `device`s (a replica's slabs) a
    rebuild is sharded: one PlanBuilder per device computes its Shard of every page (`shard_mode`: "rows",
    "projections", or "auto" = rows where ditcore.rebuild.row_split_is_exact holds on every device), reading only its
    part of the plan tensors, and `build_all` copies each device's columns into every other device's pages.
    """

    def __init__(
        self,
        checkpoint: str | Path | CheckpointInfo,
        device: torch.device | Sequence[torch.device],
        committed_digests: dict[str, str] | None = None,
        shard_mode: str = "auto",
        adapter_plans: AdapterPlans | None = None,
    ) -> None:
        self.adapter_plans = adapter_plans if adapter_plans is not None else AdapterPlans(None)
        """What keys with an adapters digest are built with (without --adapter-dir: none, such keys refused)."""
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else open_checkpoint(checkpoint)
        _require_adaln(info)
        self.info = info
        listed = [device] if isinstance(device, torch.device | str) else list(device)
        self.devices = [concrete_device(d) for d in listed]
        self.device = self.devices[0]
        self.digests = dict(committed_digests) if committed_digests else file_digests(info.path)
        count = len(self.devices)
        if shard_mode == "auto":  # measured per distinct device; one device splits nothing (no measurement)
            modes = {ditcore_shard_mode(info.layout, info.projection_dtype, count, d) for d in set(self.devices)}
            shard_mode = "rows" if modes == {"rows"} else "projections"
        self.shard_mode = shard_mode
        """How a rebuild is split across `devices` ("rows" or "projections"; one device: the whole)."""
        self.partition_builders: dict[str, list[PlanBuilder]] = {}
        """Per partition: one PlanBuilder per device, reading that partition's folder."""
        for name, part in info.partitions.items():
            try:
                builders = [
                    PlanBuilder(info.path / part.folder, d, shard=Shard(r, count, shard_mode))
                    for r, d in enumerate(self.devices)
                ]
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{info.path}: cannot open {part.folder}/'s plan tensors: {e}") from e
            if builders[0].layout != info.layout or builders[0].projection_dtype != info.projection_dtype:
                raise CheckpointError(
                    f"{info.path}: the page builder reads {builders[0].layout} in {builders[0].projection_dtype} "
                    f"from {part.folder}/, validation found {info.layout} in {info.projection_dtype}"
                )
            self.partition_builders[name] = builders
        self.builders = self.partition_builders["base"]
        self.builder = self.builders[0]
        self._columns = [b.shard.columns(info.layout) for b in self.builders]

    def like(
        self, checkpoint: str | Path | CheckpointInfo, committed_digests: dict[str, str] | None = None
    ) -> RebuildSource:
        """A source on another checkpoint, on the same devices and split the same way (a weight update's)."""
        return RebuildSource(checkpoint, self.devices, committed_digests, self.shard_mode, self.adapter_plans)

    @property
    def bytes_read(self) -> list[int]:
        """Plan-tensor bytes each device's builders (every partition's) have read from the checkpoint so far."""
        return [sum(bs[d].plan_bytes_read for bs in self.partition_builders.values()) for d in range(len(self.devices))]

    @property
    def partitions(self) -> tuple[str, ...]:
        """The partitions this source builds plans of ("base", and "ref" when the repository has transformer_ref/)."""
        return tuple(self.partition_builders)

    def partition_fingerprints(self) -> dict[str, str]:
        """Per partition, the digest of its files as committed: what its plans' pages depend on."""
        return {name: partition_fingerprint(self.digests, name) for name in self.partition_builders}

    def unchanged_partitions(self, other: RebuildSource) -> set[str]:
        """The partitions whose files are the same in `other` (their plans stay valid under it)."""
        mine, theirs = self.partition_fingerprints(), other.partition_fingerprints()
        return {name for name, fp in mine.items() if theirs.get(name) == fp}

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
    def build(self, keys: Sequence[PlanKey], outputs: Sequence[torch.Tensor]) -> PassReads:
        """One pass: every key's pages into `outputs[k]`, (width_k, page_numel) in `dtype` on the (one) device."""
        if len(self.devices) != 1:
            raise ValueError(f"this source builds for {len(self.devices)} devices: use build_all")
        return self.build_all(keys, [outputs])

    def read_totals(self) -> list[tuple[int, float]]:
        """Per device, the plan-tensor bytes its builders (every partition's) have read so far and the seconds spent."""
        return [
            (sum(bs[d].read_bytes for bs in self.partition_builders.values()),
             sum(bs[d].read_s for bs in self.partition_builders.values()))
            for d in range(len(self.devices))
        ]  # fmt: skip

    def build_all(self, keys: Sequence[PlanKey], outputs: Sequence[Sequence[torch.Tensor]]) -> PassReads:
        """One sharded pass: `outputs[d][k]` is key k's (width_k, page_numel) pages on device d, every device's
        written in full. Device d's builder computes its shard's columns into its own outputs (the devices in
        parallel), then those columns are copied into every other device's outputs. Returns what the pass read."""
        if len(outputs) != len(self.devices):
            raise ValueError(f"{len(outputs)} output lists for {len(self.devices)} devices")
        self.check_unchanged()
        before = self.read_totals()
        crash_point("sidecar:during_rebuild")
        unknown = sorted({k.partition for k in keys} - set(self.partition_builders))
        if unknown:
            raise RebuildError(f"{self.info.path} has no '{unknown[0]}' partition to build plans from")
        try:
            for name, builders in self.partition_builders.items():
                chosen = [i for i, k in enumerate(keys) if k.partition == name]
                if chosen:
                    self._build_partition(
                        builders, [keys[i] for i in chosen], [[o[i] for i in chosen] for o in outputs]
                    )
            for d, columns in enumerate(self._columns):
                for other, outs in enumerate(outputs):
                    if other != d:
                        for src, dst in zip(outputs[d], outs, strict=True):
                            for start, stop in columns:
                                dst[:, start:stop].copy_(src[:, start:stop])  # device to device; synchronous
        except PlanCacheError:
            raise
        except Exception as e:  # OSError, a safetensors error on a damaged shard, a shape the builder refuses
            raise RebuildError(f"rebuild from {self.info.path} failed: {type(e).__name__}: {e}") from e
        after = self.read_totals()
        return PassReads(
            sum(a[0] - b[0] for a, b in zip(after, before, strict=True)),
            max((a[1] - b[1] for a, b in zip(after, before, strict=True)), default=0.0),
        )

    def _build_partition(
        self, builders: list[PlanBuilder], keys: Sequence[PlanKey], outputs: Sequence[Sequence[torch.Tensor]]
    ) -> None:
        """One partition's keys: each device's builder its shard, then the columns copied across devices; keys of each
        adapters digest built with that digest's terms (AdapterPlans)."""
        partition = keys[0].partition
        for digest in sorted({k.adapters for k in keys}):
            chosen = [i for i, k in enumerate(keys) if k.adapters == digest]
            group = [keys[i] for i in chosen]
            outs = [[o[i] for i in chosen] for o in outputs]

            def build(
                b: PlanBuilder, out: list[torch.Tensor], group: list[PlanKey] = group, digest: str = digest
            ) -> None:
                b.build(group, out, self.adapter_plans.deltas(digest, partition, b))

            if len(builders) == 1:
                build(builders[0], outs[0])
                continue
            with ThreadPoolExecutor(len(builders), thread_name_prefix="rebuild") as pool:  # the devices at once
                builds = [pool.submit(build, b, o) for b, o in zip(builders, outs, strict=True)]
                for done in builds:
                    done.result()
