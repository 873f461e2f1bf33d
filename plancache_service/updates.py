"""The sidecar's weight updates: the two-phase update (`prepare` validates a new rebuild source and changes nothing
served; `commit` persists generation + 1, then retargets the cache), its outcomes, and the state file it persists
(docs/architecture.md, "Weight generations and UpdateWeights")."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ditcore.checkpoint_files import CheckpointError
from ditruntime.errors import GenerationMismatchError
from ditruntime.faults import crash_point

from .cache import PlanCache
from .errors import UpdateConflictError
from .rebuild import RebuildSource, open_checkpoint
from .state import PersistedState, save_state

log = logging.getLogger("plancache_service.sidecar")  # the sidecar's lines, under the logger name they always had


@dataclass
class UpdateOutcomes:
    """Weight-update outcomes at the sidecar since it started (the metrics' `outcome` label)."""

    prepared: int = 0
    committed: int = 0
    aborted: int = 0
    refused: int = 0


class Committed(NamedTuple):
    """A committed weight update: the new generation, its fingerprint, and the partitions whose plans it kept."""

    generation: int
    fingerprint: str
    kept_partitions: tuple[str, ...]


class WeightUpdates:
    """One prepared update at a time (`pending`), committed by persisting the new generation first. The sidecar
    (`Sidecar.prepare_update`, `commit_update`, `abort_update`) calls these; the state file is written at start too."""

    def __init__(self, cache: PlanCache, state_dir: Path | None) -> None:
        self.cache = cache
        self.state_dir = state_dir
        self._lock = threading.Lock()
        self.pending: RebuildSource | None = None
        self.outcomes = UpdateOutcomes()
        if state_dir is not None:
            self._persist(cache.generation, cache.source)

    def prepare(self, from_generation: int, weights_path: str) -> RebuildSource:
        """Validate a new rebuild source: a MiniMax-H3 repository with native adaln_proj whose transformer config and
        precision match the served one (`CheckpointInfo.incompatibility`). Changes nothing served."""
        with self._lock:
            if from_generation != self.cache.generation:
                raise GenerationMismatchError(self.cache.generation, from_generation, field="from_generation")
            if self.pending is not None:
                raise UpdateConflictError(f"an update to {self.pending.path} is already prepared; commit or abort it")
            try:
                info = open_checkpoint(weights_path)
                reason = self.cache.source.info.incompatibility(info)
                if reason is not None:
                    raise CheckpointError(f"{weights_path}: {reason}")
                self.pending = self.cache.source.like(info)
            except CheckpointError as e:
                self.outcomes.refused += 1
                log.warning("refused weight update to %s: %s", weights_path, e)
                raise
            self.outcomes.prepared += 1
            log.info("prepared weight update to %s (fingerprint %s)", weights_path, info.fingerprint[:16])
            return self.pending

    def commit(
        self, from_generation: int, weights_path: str, reap: Callable[[], object], serve: Callable[[], None]
    ) -> Committed:
        """Persist generation + 1 with the prepared source, then retarget: the plans of every partition whose files
        changed are dropped, an unchanged partition's stay (PlanCache.retarget). `reap` releases the leases of retired
        sessions (they block the retarget); `serve` turns plans served again."""
        with self._lock:
            pending = self.pending
            if pending is None or str(pending.path) != str(Path(weights_path)):
                raise UpdateConflictError(f"no prepared update to {weights_path}; call PrepareWeightUpdate first")
            if from_generation != self.cache.generation:
                raise GenerationMismatchError(self.cache.generation, from_generation, field="from_generation")
            pending.check_unchanged()
            reap()  # a retired session's leases block the retarget until they are reaped
            new_generation = self.cache.generation + 1

            def persist() -> None:
                crash_point("sidecar:before_commit")
                self._persist(new_generation, pending)
                crash_point("sidecar:after_persist")

            kept = tuple(sorted(self.cache.retarget(pending, new_generation, before=persist)))
            self.pending = None
            serve()
            self.outcomes.committed += 1
            log.info(
                "committed generation %d: %s (plans kept for unchanged partitions: %s)",
                new_generation, pending.path, ", ".join(kept) or "none",
            )  # fmt: skip
            return Committed(new_generation, pending.fingerprint, kept)

    def abort(self, weights_path: str = "") -> bool:
        with self._lock:
            if self.pending is None or (weights_path and str(self.pending.path) != str(Path(weights_path))):
                return False
            log.info("aborted weight update to %s", self.pending.path)
            self.pending = None
            self.outcomes.aborted += 1
            return True

    def discard(self) -> None:
        """Drop the prepared update, if any, counting no outcome (its session ended)."""
        self.pending = None

    def _persist(self, generation: int, source: RebuildSource) -> None:
        if self.state_dir is not None and not save_state(
            self.state_dir, PersistedState(generation, str(source.path), source.digests)
        ):
            log.debug("state file unchanged (generation %d): not rewritten", generation)
