"""Resident mode: the DiT with its adaln_proj loaded, no sidecar. The model computes modulation
itself (no leases) and the weight-update steps are process-local: the generation lives only
in this process and starts at 1. No grpc here.
"""

from __future__ import annotations

import copy
import hashlib
import threading
from pathlib import Path

import torch

from ditcore import CheckpointInfo, DiT, GenerationRequest, RequestError, load_model, validate_checkpoint

from .backend import Backend, BackendStatus, Rollback, ServedLease, StagedWeights, validate_compatible


class ResidentBackend(Backend):
    mode = "resident"

    def __init__(self, checkpoint: Path, device: torch.device) -> None:
        super().__init__(device, threading.RLock())
        self.info = validate_checkpoint(checkpoint, require_adaln=True)
        self._model = load_model(self.info, self.mode).to(device)
        self._generation = 1  # local to this process: resident mode has no sidecar to persist it
        self._fingerprint = self.info.fingerprint

    def start(self) -> None:
        pass  # loaded in the constructor; nothing runs in the background

    def close(self) -> None:
        pass

    def model(self) -> DiT:
        return self._model

    def generation(self) -> int:
        return self._generation

    def status(self) -> BackendStatus:
        return BackendStatus(
            serving=True,
            sidecar_connected=False,
            sidecar_target="",
            weights_path=str(self.info.path),
            fingerprint=self._fingerprint,
        )

    # ---------------------------------------------------------------- plans: none to lease
    def check_fits(self, request: GenerationRequest) -> None:
        pass

    def acquire(self, request: GenerationRequest) -> ServedLease | None:
        return None

    def verify(self, lease: ServedLease) -> None:
        pass

    def alive(self, lease: ServedLease) -> bool:
        return True

    # ---------------------------------------------------------------- weight updates
    def validate_update(self, path: Path) -> CheckpointInfo:
        return validate_compatible(path, self.model_config(), require_adaln=True)

    def prepare_update(self, previous: int, path: Path) -> None:
        pass  # nothing outside this process to prepare

    def stage(self, info: CheckpointInfo) -> StagedWeights:
        return StagedWeights(load_model(info, self.mode).to(self.device), info, info.fingerprint)

    def stage_tensors(self, tensors: dict[str, torch.Tensor]) -> StagedWeights:
        """Check every tensor against the same-named parameter, then load them into a copy."""
        state = self._model.state_dict()
        for name, t in tensors.items():
            if name not in state:
                raise RequestError("tensors", f"unknown tensor {name!r}; names are the checkpoint's")
            want = state[name]
            if tuple(t.shape) != tuple(want.shape) or t.dtype != want.dtype:
                raise RequestError(
                    "tensors", f"{name}: got {t.dtype} {list(t.shape)}, expected {want.dtype} {list(want.shape)}"
                )
        model = copy.deepcopy(self._model)
        model.load_state_dict({**model.state_dict(), **{k: v.to(self.device) for k, v in tensors.items()}})
        digest = hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors.values()))
        return StagedWeights(model, self.info, f"tensors:{digest.hexdigest()}")

    def swap(self, staged: StagedWeights) -> Rollback:
        old = (self._model, self.info)
        self._model, self.info = staged.model, staged.info

        def rollback() -> None:
            self._model, self.info = old

        return rollback

    def commit_update(self, previous: int, path: str, fingerprint: str, timeout_s: float) -> tuple[int, str]:
        self._generation = previous + 1
        self._fingerprint = fingerprint
        return self._generation, fingerprint

    def abort_update(self, path: str) -> None:
        pass
