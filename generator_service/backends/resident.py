"""Resident mode: diffusers' MiniMax-H3 transformer exactly as `from_pretrained` loads it (its
`adaln_proj` and `norm_out.linear` included), no sidecar. The model computes modulation itself (no
leases) and the weight-update steps are process-local: the generation lives only in this process
and starts at 1. Pushed tensors replace same-named transformer tensors in a copy. No grpc here.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import torch

from ditcore import CheckpointInfo, GenerationRequest, H3Model, RequestError, validate_checkpoint
from ditcore.model import RunOptions

from ..errors import UpdateError
from .base import Backend, BackendStatus, MemoryReader, Rollback, ServedLease, StagedWeights, validate_compatible
from .placement import StartPlacement
from .replica_port import ReplicaPort
from .sidecar_port import Committed


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the pushed tensors: each name, dtype, shape and raw bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ResidentBackend(Backend):
    mode = "resident"

    def __init__(
        self,
        checkpoint: Path,
        device: torch.device,
        free_memory: MemoryReader | None = None,
        options: RunOptions | None = None,
        replica: ReplicaPort | None = None,
        placement: StartPlacement | None = None,
    ) -> None:
        super().__init__(device, threading.RLock(), free_memory, replica)
        self.placement = placement
        info = validate_checkpoint(checkpoint, require_adaln=True)
        self._options = options if options is not None else RunOptions()  # every model this backend loads runs so
        self._model = self.load(info, self._options)  # a replica's other ranks load it at their start too
        self._generation = 1  # local to this process: resident mode has no sidecar to persist it
        self._fingerprint = info.fingerprint

    @property
    def info(self) -> CheckpointInfo:
        return self._model.info

    def start(self) -> None:
        if self.replica is not None:  # loaded in the constructor, on every rank; what each holds, for GetStatus
            self.replica.describe(self._model)

    def close(self) -> None:
        pass

    def model(self) -> H3Model:
        return self._model

    def loaded(self) -> H3Model | None:
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

    def acquire(self, request: GenerationRequest, step_bound_s: float = 0.0) -> ServedLease | None:
        return None

    def verify(self, lease: ServedLease) -> None:
        pass

    def alive(self, lease: ServedLease) -> bool:
        return True

    # ---------------------------------------------------------------- weight updates
    def validate_update(self, path: Path) -> CheckpointInfo:
        return validate_compatible(path, self.info, require_adaln=True)

    def prepare_update(self, previous: int, path: Path) -> None:
        pass  # nothing outside this process to prepare

    def stage(self, info: CheckpointInfo) -> StagedWeights:
        return self.stage_everywhere(info, self._options)

    def stage_tensors(self, tensors: dict[str, torch.Tensor]) -> StagedWeights:
        """Check every tensor against the same-named transformer tensor (its state-dict name, e.g.
        "proj_out.bias"; shape and dtype must match), then replace them in a copy of the model."""
        if self.replica is not None:
            raise UpdateError(
                "FAILED_PRECONDITION", "TENSOR_UPDATE_REFUSED",
                f"tensor-pushed updates are refused on a replica of {self.replica.world_size} ranks (the tensors would "
                "have to reach every rank); write a checkpoint under --weights-root and pass weights_path",
            )  # fmt: skip
        if not tensors:
            raise RequestError("tensors", "no tensors given")
        state = self._model.transformer.state_dict()
        for name, t in tensors.items():
            if name not in state:
                raise RequestError(
                    "tensors", f"unknown tensor {name!r}; names are the transformer's state-dict names "
                    "(e.g. 'proj_out.bias', 'transformer_blocks.0.adaln_proj.linear.weight')"
                )  # fmt: skip
            want = state[name]
            if tuple(t.shape) != tuple(want.shape) or t.dtype != want.dtype:
                raise RequestError(
                    "tensors", f"{name}: got {t.dtype} {list(t.shape)}, expected {want.dtype} {list(want.shape)}"
                )
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise RequestError("tensors", f"{name}: holds a NaN or an infinity")
        model = self._model.with_tensors(tensors)
        return StagedWeights(model, self.info, f"tensors:{tensors_digest(tensors)}")

    def swap(self, staged: StagedWeights) -> Rollback:
        def install() -> Rollback:
            old = self._model
            self._model = staged.model

            def rollback() -> None:
                self._model = old

            return rollback

        return self.swap_everywhere(install)

    def commit_update(self, previous: int, path: str, fingerprint: str, timeout_s: float) -> Committed:
        self._generation = previous + 1
        self._fingerprint = fingerprint
        self.committed_everywhere()
        return Committed(self._generation, fingerprint)  # no plans to keep

    def abort_update(self, path: str) -> None:
        self.aborted_everywhere()
