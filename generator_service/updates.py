"""Weight updates, coordinated by the generator (docs/architecture.md, "Weight generations and
UpdateWeights"); no gRPC here. Every step goes through the `Backend` interface:

    1 authorize (adapter) and validate: path inside --weights-root, checkpoint valid and
      compatible with the running model. Nothing is mutated yet.
    2 prepare: cached mode asks the sidecar (native adaln_proj present); nothing served changes.
    3 drain: pause the queue, let the running request finish, release every lease (bounded by
      drain_timeout_s, or by default by the running request's own remaining time: its steps left x
      its observed or modeled step time, x a factor, + its decode; on timeout the update fails
      ABORTED and serving resumes).
    4 stage the new weights and swap them in (the old model is kept for rollback).
    5 commit: generation + 1 (cached mode: the sidecar persists it, invalidates both tiers,
      retargets rebuilds). 6 resume the queue.

Any failure before 5 restores the old model and aborts the prepared update. If 5's outcome is
unknown (CommitOutcomeUnknownError: the sidecar died or timed out), the backend drops its
session and serves nothing until it reattaches; then it loads whatever generation the sidecar names.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ditcore import CheckpointNotFoundError
from ditruntime.errors import GenerationMismatchError
from ditruntime.faults import crash_point

from .backends.base import Backend, StagedWeights
from .backends.sidecar_port import Committed
from .errors import UpdateError
from .execution.executor import Executor
from .health import ServingState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpdateResult:
    generation: int
    previous_generation: int
    weights_path: str
    fingerprint: str
    phase_ms: dict[str, float]
    kept_partitions: tuple[str, ...] = ()
    """Partitions whose cached plans were kept (their adaln_proj unchanged; cached mode)."""


def resolve_weights_path(root: Path | None, weights_path: str) -> Path:
    """`weights_path` (relative to the root, or absolute) resolved, and proven inside the root."""
    if root is None:
        raise UpdateError("FAILED_PRECONDITION", "NO_WEIGHTS_ROOT", "weight updates need --weights-root")
    if not weights_path:
        raise UpdateError(
            "INVALID_ARGUMENT",
            "INVALID_PATH",
            "weights_path: must name a checkpoint directory inside --weights-root",
            {"field": "weights_path"},
        )
    if "\0" in weights_path:
        raise UpdateError(
            "INVALID_ARGUMENT", "INVALID_PATH", "weights_path: must not contain NUL bytes", {"field": "weights_path"}
        )
    if ".." in Path(weights_path).parts:
        raise UpdateError(
            "PERMISSION_DENIED", "PATH_OUTSIDE_ROOT", f"weights_path: '..' is not allowed (got {weights_path!r})"
        )
    root_real = Path(os.path.realpath(root))
    candidate = Path(weights_path) if os.path.isabs(weights_path) else root_real / weights_path
    real = Path(os.path.realpath(candidate))
    if real != root_real and root_real not in real.parents:
        raise UpdateError(
            "PERMISSION_DENIED",
            "PATH_OUTSIDE_ROOT",
            f"weights_path: {weights_path!r} resolves outside --weights-root {root}",
        )
    if not real.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory not found: {weights_path}")
    return real


class UpdateCoordinator:
    """One update at a time; health reads NOT_SERVING from the drain until the update ends."""

    def __init__(
        self,
        backend: Backend,
        executor: Executor,
        state: ServingState,
        drain_timeout_s: float | None = None,
        commit_timeout_s: float = 60.0,
    ) -> None:
        self.backend = backend
        self.executor = executor
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.commit_timeout_s = commit_timeout_s
        self._lock = threading.Lock()

    def update(self, path: Path, expected_generation: int | None, request_id: str) -> UpdateResult:
        with self._exclusive():
            return self._update(path, expected_generation, request_id)

    def _update(self, path: Path, expected: int | None, request_id: str) -> UpdateResult:
        phases = _Phases()
        backend = self.backend
        previous = self._check_expected(expected)
        info = backend.validate_update(path)  # step 1: raises before any mutation
        phases.mark("validate")
        log.info("update %s: %s (generation %d)", request_id, path, previous)
        backend.prepare_update(previous, path)
        phases.mark("prepare")
        self.executor.pause()
        self.state.set_updating(True)
        try:
            crash_point("update:during_drain")
            self._drain("update aborted, serving resumed")
            phases.mark("drain")
            staged = backend.stage(info)
            phases.mark("load")
            done = self._install(previous, staged, str(path))
            phases.mark("commit")
            return UpdateResult(done.generation, previous, str(path), done.fingerprint, phases.ms, done.kept_partitions)
        except BaseException:
            backend.abort_update(str(path))
            raise
        finally:
            self.state.set_updating(False)
            self.executor.resume()

    def update_tensors(self, tensors: dict[str, torch.Tensor], expected: int | None) -> UpdateResult:
        """Replace named tensors under a new generation (resident mode; cached mode refuses)."""
        with self._exclusive():
            previous = self._check_expected(expected)
            t0 = time.perf_counter()
            staged = self.backend.stage_tensors(tensors)
            path = str(staged.info.path)
            self.executor.pause()
            try:
                self._drain("update aborted")
                done = self._install(previous, staged, path)
            finally:
                self.executor.resume()
            ms = round((time.perf_counter() - t0) * 1000, 3)
            return UpdateResult(done.generation, previous, path, done.fingerprint, {"total_ms": ms})

    def _drain(self, outcome: str) -> None:
        """Wait for the running request (UpdateError ABORTED, DRAIN_TIMEOUT, when it does not finish in time)."""
        if self.executor.drain(self.drain_timeout_s):
            return
        if self.drain_timeout_s is not None:
            raise UpdateError(
                "ABORTED", "DRAIN_TIMEOUT",
                f"the running request did not finish within --drain-timeout-s {self.drain_timeout_s:g}; {outcome}",
            )  # fmt: skip
        raise UpdateError(
            "ABORTED", "DRAIN_TIMEOUT",
            "the running request did not finish within its own remaining time (steps left x its step time x "
            f"--step-time-factor, + its decode, + 30 s; --drain-timeout-s sets a fixed bound); {outcome}",
        )  # fmt: skip

    def _install(self, previous: int, staged: StagedWeights, path: str) -> Committed:
        """Swap `staged` in and commit it; on any failure the old model goes back."""
        backend = self.backend
        with backend.model_lock:
            rollback = backend.swap(staged)
            crash_point("update:after_swap")
            try:
                return backend.commit_update(previous, path, staged.fingerprint, self.commit_timeout_s)
            except BaseException:
                rollback()
                raise

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """One update at a time: a second one is refused, not queued."""
        if not self._lock.acquire(blocking=False):
            raise UpdateError(
                "ABORTED", "UPDATE_IN_PROGRESS", "another weight update is running; retry when it is done"
            )
        try:
            yield
        finally:
            self._lock.release()

    def _check_expected(self, expected: int | None) -> int:
        """The served generation, refusing (ABORTED) a stale `expected_generation`."""
        current = self.backend.generation()
        if expected is not None and expected != current:
            raise GenerationMismatchError(current, expected)
        return current


class _Phases:
    """Milliseconds per update phase, each since the previous mark."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self._t = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.ms[f"{name}_ms"] = round((now - self._t) * 1000, 3)
        self._t = now
