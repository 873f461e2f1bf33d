"""Weight updates (DESIGN §5), coordinated by the generator; no gRPC here.

    1 authorize (adapter) and validate: path inside --weights-root, checkpoint valid and
      compatible with the running model. Nothing is mutated yet.
    2 sidecar PrepareWeightUpdate: native adaln_proj present; nothing served changes.
    3 drain: pause the queue, let the running request finish, release every lease
      (bounded by drain_timeout_s; on timeout the update fails ABORTED and serving resumes).
    4 stage the new non-adaln weights and swap them in (the old model is kept for rollback).
    5 sidecar CommitWeightUpdate: generation + 1 persisted, both tiers invalidated, rebuilds
      retargeted. 6 adopt the new generation, resume the queue.

Any failure before 5 restores the old model and aborts at the sidecar. If 5's outcome is
unknown (the sidecar died or timed out), the generator drops its session and serves
nothing until it reattaches; then it loads whatever generation the sidecar names.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from ditcore import CheckpointNotFoundError
from ditruntime.faults import crash_point

from .backend import Backend, CachedBackend, ResidentBackend
from .errors import GeneratorError, SidecarUnavailableError
from .executor import Executor
from .plan_client import sidecar_error

log = logging.getLogger(__name__)

_UNKNOWN = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
}


class UpdateError(GeneratorError):
    """An update refused or failed; `grpc_code` says which."""

    def __init__(self, code: str, reason: str, message: str, metadata: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.grpc_code = code
        self.reason = reason
        self.metadata = dict(metadata or {})


@dataclass(frozen=True)
class UpdateResult:
    generation: int
    previous_generation: int
    weights_path: str
    fingerprint: str
    phase_ms: dict[str, float]


def check_token(configured: str, authorization: str | None) -> None:
    """Admin token from `authorization: Bearer <token>` metadata."""
    if not configured:
        raise UpdateError(
            "PERMISSION_DENIED",
            "UPDATES_DISABLED",
            "weight updates are disabled: start the generator with --admin-token (or DITSERVE_ADMIN_TOKEN)",
        )
    if not authorization:
        raise UpdateError(
            "UNAUTHENTICATED", "MISSING_TOKEN", "UpdateWeights needs metadata 'authorization: Bearer <admin token>'"
        )
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), configured.encode()):
        raise UpdateError("PERMISSION_DENIED", "BAD_TOKEN", "the admin token is wrong")


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
    def __init__(
        self, backend: Backend, executor: Executor, drain_timeout_s: float, commit_timeout_s: float = 60.0
    ) -> None:
        self.backend = backend
        self.executor = executor
        self.drain_timeout_s = drain_timeout_s
        self.commit_timeout_s = commit_timeout_s
        self._lock = threading.Lock()
        self.updating = False
        self.on_change: Callable[[], None] = lambda: None  # health follows `updating`

    def update(self, path: Path, expected_generation: int | None, request_id: str) -> UpdateResult:
        with self._exclusive():
            return self._update(path, expected_generation, request_id)

    def _update(self, path: Path, expected: int | None, request_id: str) -> UpdateResult:
        phases: dict[str, float] = {}
        t = time.perf_counter()

        def mark(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            phases[f"{name}_ms"] = round((now - t) * 1000, 3)
            t = now

        backend = self.backend
        previous = self._check_expected(expected)
        info = backend.validate_update(path)  # step 1: raises before any mutation
        mark("validate")
        log.info("update %s: %s (generation %d)", request_id, path, previous)
        cached = isinstance(backend, CachedBackend)
        if cached:
            backend.link.prepare_update(previous, str(path))
            crash_point("update:after_prepare")
        mark("prepare")
        self.executor.pause()
        self._set_updating(True)
        try:
            crash_point("update:during_drain")
            if not self.executor.drain(self.drain_timeout_s):
                raise UpdateError(
                    "ABORTED",
                    "DRAIN_TIMEOUT",
                    f"the running request did not finish within --drain-timeout-s {self.drain_timeout_s:g}; update aborted, serving resumed",
                )
            mark("drain")
            staged = backend.stage(info)
            mark("load")
            with backend.model_lock:
                rollback = backend.swap(staged, info)
                crash_point("update:after_swap")
                try:
                    generation, fingerprint = self._commit(previous, str(path), info.fingerprint)
                except BaseException:
                    rollback()
                    raise
            mark("commit")
            return UpdateResult(generation, previous, str(path), fingerprint, phases)
        except BaseException:
            if cached:
                backend.link.abort_update(str(path))
            raise
        finally:
            self._set_updating(False)
            self.executor.resume()

    def _set_updating(self, value: bool) -> None:
        self.updating = value
        self.on_change()

    def update_tensors(self, tensors: dict[str, torch.Tensor], expected: int | None) -> UpdateResult:
        """Resident mode only: replace named tensors under a new (process-local) generation."""
        backend = self.backend
        if not isinstance(backend, ResidentBackend):
            raise UpdateError(
                "FAILED_PRECONDITION", "TENSOR_UPDATE_REFUSED",
                "tensor-pushed updates are refused in cached mode: plans are rebuilt from checkpoint files and "
                "pushed tensors have none on disk; write a checkpoint under --weights-root and pass weights_path",
            )  # fmt: skip
        with self._exclusive():
            previous = self._check_expected(expected)
            t0 = time.perf_counter()
            staged = backend.stage_tensors(tensors)
            self.executor.pause()
            try:
                if not self.executor.drain(self.drain_timeout_s):
                    raise UpdateError(
                        "ABORTED", "DRAIN_TIMEOUT", "the running request did not finish in time; update aborted"
                    )
                digest = hashlib.sha256(
                    b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors.values())
                )
                fingerprint = f"tensors:{digest.hexdigest()}"
                with backend.model_lock:
                    backend.swap(staged, backend.info)
                    generation = backend.adopt(previous + 1, str(backend.info.path), fingerprint)
            finally:
                self.executor.resume()
            ms = round((time.perf_counter() - t0) * 1000, 3)
            return UpdateResult(generation, previous, str(backend.info.path), fingerprint, {"total_ms": ms})

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
            raise UpdateError(
                "ABORTED",
                "GENERATION_MISMATCH",
                f"expected_generation {expected} does not match the served generation {current}",
                {"current_generation": str(current)},
            )
        return current

    def _commit(self, previous: int, path: str, fingerprint: str) -> tuple[int, str]:
        backend = self.backend
        if not isinstance(backend, CachedBackend):
            return backend.adopt(previous + 1, path, fingerprint), fingerprint
        crash_point("update:before_commit")
        try:
            generation, fp = backend.link.commit_update(previous, path, self.commit_timeout_s)
        except grpc.RpcError as e:
            if e.code() in _UNKNOWN:
                # outcome unknown: serve nothing until the sidecar tells us on reattach
                backend.link.reattach()
                raise SidecarUnavailableError(
                    f"the commit's outcome is unknown ({e.code().name}); not serving until the sidecar is back"
                ) from e
            raise sidecar_error(e) from e
        crash_point("update:after_commit")
        backend.adopt(generation, path, fp)
        return generation, fp
