"""The one interface the executor, the update coordinator and the server use to reach the model
(a `ditcore.H3Model`: diffusers' MiniMax-H3 pipeline), its generation, its plans and the
weight-update steps. `resident.ResidentBackend` implements it in process; `cached.CachedBackend`
through the sidecar session. No grpc here.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch

from ditcore import CheckpointError, CheckpointInfo, GenerationRequest, H3Model, PlanKey, PlanLease, validate_checkpoint
from ditruntime.slab import SlabDescriptor


class ServedLease(PlanLease, Protocol):
    """A plan lease as the executor holds it (ditcore.model.PlanLease plus what serving needs)."""

    generation: int  # the weight generation its plans were built for
    keys: list[PlanKey]  # one per step, as leased

    def alive(self) -> bool:
        """False once the session that granted it has ended."""
        ...

    def check_rows(self) -> None:
        """Raise LeaseCheckError unless every leased slot still holds its plan."""
        ...


@dataclass(frozen=True)
class BackendStatus:
    """What GetStatus and the metrics report about the backend."""

    serving: bool  # resident: always; cached: while attached to the sidecar
    sidecar_connected: bool  # always False in resident mode
    sidecar_target: str
    weights_path: str
    fingerprint: str
    slab: SlabDescriptor | None = None


@dataclass(frozen=True)
class StagedWeights:
    """A loaded model ready to swap in, and the weights it is."""

    model: H3Model
    info: CheckpointInfo
    fingerprint: str  # the checkpoint's, or "tensors:<sha256>" for pushed tensors


Rollback = Callable[[], None]


class Backend(ABC):
    """Model, generation and plans for the executor; `model_lock` is held while a request denoises."""

    mode: ClassVar[str]  # "resident" or "cached" (ditcore's adaln modes)

    def __init__(self, device: torch.device, model_lock: threading.RLock) -> None:
        self.device = device
        self.model_lock = model_lock

    # ---------------------------------------------------------------- lifecycle
    @abstractmethod
    def start(self) -> None:
        """Begin serving (cached: start attaching to the sidecar)."""

    @abstractmethod
    def close(self) -> None:
        """Idempotent: release what the backend holds."""

    # ---------------------------------------------------------------- serving
    @abstractmethod
    def model(self) -> H3Model:
        """The served model (cached: SidecarUnavailableError before the first attachment)."""

    @abstractmethod
    def loaded(self) -> H3Model | None:
        """The served model, or None while none is loaded (never raises)."""

    @abstractmethod
    def generation(self) -> int:
        """The weight generation served now."""

    @abstractmethod
    def status(self) -> BackendStatus: ...

    @abstractmethod
    def check_fits(self, request: GenerationRequest) -> None:
        """Raise if the request can never run on this server (before any work)."""

    @abstractmethod
    def acquire(self, request: GenerationRequest) -> ServedLease | None:
        """The request's plans, leased; None when the model computes modulation itself."""

    @abstractmethod
    def verify(self, lease: ServedLease) -> None:
        """Raise unless the lease's session is live and every leased row holds its plan."""

    @abstractmethod
    def alive(self, lease: ServedLease) -> bool:
        """Checked after every denoise step."""

    # ---------------------------------------------------------------- weight updates
    @abstractmethod
    def validate_update(self, path: Path) -> CheckpointInfo:
        """Step 1: the checkpoint is valid and compatible with the running model (no mutation)."""

    @abstractmethod
    def prepare_update(self, previous: int, path: Path) -> None:
        """Step 2: whatever must hold before the drain (cached: the sidecar's PrepareWeightUpdate)."""

    @abstractmethod
    def stage(self, info: CheckpointInfo) -> StagedWeights:
        """Load the new weights beside the served ones."""

    @abstractmethod
    def stage_tensors(self, tensors: dict[str, torch.Tensor]) -> StagedWeights:
        """A copy of the model with same-named tensors replaced (cached mode refuses)."""

    @abstractmethod
    def swap(self, staged: StagedWeights) -> Rollback:
        """Install `staged` (under `model_lock`); returns the rollback that puts the old model back."""

    @abstractmethod
    def commit_update(self, previous: int, path: str, fingerprint: str, timeout_s: float) -> tuple[int, str]:
        """Make the swapped weights generation `previous + 1`; returns (generation, fingerprint)."""

    @abstractmethod
    def abort_update(self, path: str) -> None:
        """Undo a prepared update that will not commit (best effort)."""


def validate_compatible(path: Path, current: CheckpointInfo, require_adaln: bool) -> CheckpointInfo:
    """A valid MiniMax-H3 repository at `path` that can replace `current` under a running server: same transformer
    config (plan layout and shapes) and the same stored precision."""
    info = validate_checkpoint(path, require_adaln=require_adaln)
    why = current.incompatibility(info)
    if why is not None:
        raise CheckpointError(f"{info.path}: {why}")
    return info
