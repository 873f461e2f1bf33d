"""Where the executor gets its model, generation and plans: resident, or cached via the sidecar.

`CachedBackend` loads the DiT without adaln_proj from whatever checkpoint the sidecar's
session names (so both sides always serve one weight version) and checks that the slab's
geometry matches the model before it accepts the attachment.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ditcore import (
    CheckpointError,
    CheckpointInfo,
    DiT,
    DiTConfig,
    GenerationRequest,
    RequestError,
    load_model,
    validate_checkpoint,
)
from ditcore.plans import distinct_keys

from .errors import PlanCapacityError, SidecarUnavailableError
from .plan_client import Attachment, RemoteLease, SidecarLink

log = logging.getLogger(__name__)


class Backend:
    """Common interface; `model_lock` is held while a request denoises."""

    cached = False
    device: torch.device

    def __init__(self) -> None:
        self.model_lock = threading.RLock()

    def model(self) -> DiT:
        raise NotImplementedError

    def model_config(self) -> DiTConfig:
        return self.model().config

    def generation(self) -> int:
        raise NotImplementedError

    def check_fits(self, request: GenerationRequest) -> None:
        """Raise if the request can never run on this server (before any work)."""

    def acquire(self, request: GenerationRequest) -> Any:
        return None

    def verify(self, lease: Any) -> None:
        pass

    def alive(self, lease: Any) -> bool:
        return True

    def status(self) -> dict[str, Any]:
        raise NotImplementedError

    # ---------------------------------------------------------------- weight updates
    def validate_update(self, path: Path) -> CheckpointInfo:
        """Step 1: the checkpoint is valid and compatible with the running model (no mutation)."""
        info = validate_checkpoint(path, require_adaln=not self.cached)
        check_compatible(self.model_config(), info)
        return info

    def stage(self, info: CheckpointInfo) -> DiT:
        return load_model(info, "cached" if self.cached else "resident").to(self.device)

    def swap(self, model: DiT, info: CheckpointInfo) -> Callable[[], None]:
        """Install `model`; returns the rollback that puts the old one back."""
        raise NotImplementedError

    def adopt(self, generation: int, weights_path: str, fingerprint: str) -> int:
        raise NotImplementedError


def check_compatible(current: DiTConfig, info: CheckpointInfo) -> None:
    new = info.config.replace(preset=current.preset)
    if new != current:
        a, b = current.to_dict(), new.to_dict()
        diff = ", ".join(f"{k}: {a[k]} -> {b[k]}" for k in a if a[k] != b[k])
        raise CheckpointError(f"{info.path}/config.json: incompatible with the running model ({diff})")


class ResidentBackend(Backend):
    def __init__(self, checkpoint: Path, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.info = validate_checkpoint(checkpoint, require_adaln=True)
        self._model = load_model(self.info, "resident").to(device)
        self._generation = 1  # local to this process: resident mode has no sidecar to persist it
        self._fingerprint = self.info.fingerprint

    def model(self) -> DiT:
        return self._model

    def generation(self) -> int:
        return self._generation

    def swap(self, model: DiT, info: CheckpointInfo) -> Callable[[], None]:
        old = (self._model, self.info)
        self._model, self.info = model, info

        def rollback() -> None:
            self._model, self.info = old

        return rollback

    def adopt(self, generation: int, weights_path: str, fingerprint: str) -> int:
        self._generation = generation
        self._fingerprint = fingerprint  # "tensors:<sha256>" after a tensor-pushed update
        return generation

    def stage_tensors(self, tensors: dict[str, torch.Tensor]) -> DiT:
        """A copy of the model with `tensors` replacing same-named parameters (checked first)."""
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
        return model

    def status(self) -> dict[str, Any]:
        return {"weights_path": str(self.info.path), "fingerprint": self._fingerprint, "serving": True}


class CachedBackend(Backend):
    cached = True

    def __init__(self, sidecar_target: str, device: torch.device, reconnect_s: float) -> None:
        super().__init__()
        self.device = device
        self._model: DiT | None = None
        self._loaded: tuple[str, str] | None = None  # (weights_path, fingerprint)
        self.link = SidecarLink(sidecar_target, device, reconnect_s, on_attach=self._on_attach)

    # ---------------------------------------------------------------- attachment
    def _on_attach(self, att: Attachment) -> None:
        """Load the sidecar's weights if ours differ; check slab geometry against the model."""
        with self.model_lock:
            if self._loaded != (att.weights_path, att.fingerprint):
                info = validate_checkpoint(att.weights_path, require_adaln=False)
                if info.fingerprint != att.fingerprint:
                    raise ValueError(
                        f"{att.weights_path}: fingerprint {info.fingerprint[:16]} differs from the sidecar's "
                        f"{att.fingerprint[:16]}; the files changed"
                    )
                log.info("loading DiT (cached mode) from %s", att.weights_path)
                self._model = load_model(info, "cached").to(self.device)
                self._loaded = (att.weights_path, att.fingerprint)
            cfg = self.model_config()
            d = att.descriptor
            if d.page_numel != cfg.page_numel or d.dtype != cfg.dtype:
                raise ValueError(
                    f"slab pages are {d.page_numel} x {d.dtype} but the model needs {cfg.page_numel} x {cfg.dtype}"
                )

    def swap(self, model: DiT, info: CheckpointInfo) -> Callable[[], None]:
        old = (self._model, self._loaded)
        self._model, self._loaded = model, (str(info.path), info.fingerprint)

        def rollback() -> None:
            self._model, self._loaded = old

        return rollback

    def adopt(self, generation: int, weights_path: str, fingerprint: str) -> int:
        self.link.adopt(generation, weights_path, fingerprint)
        return generation

    def model(self) -> DiT:
        if self._model is None:
            raise SidecarUnavailableError("no weights loaded yet: the plan-cache sidecar was never attached")
        return self._model

    def generation(self) -> int:
        att = self.link.attachment
        if att is None:
            raise SidecarUnavailableError(f"not attached to the plan-cache sidecar: {self.link.last_error}")
        return att.generation

    def start(self, on_change: Callable[[bool], None]) -> None:
        """Start the sidecar link; `on_change(attached)` follows the session."""
        self.link.set_on_change(on_change)
        self.link.start()

    def close(self) -> None:
        self.link.close()

    # ---------------------------------------------------------------- plans
    def check_fits(self, request: GenerationRequest) -> None:
        att = self.link.attachment
        if att is None:
            raise SidecarUnavailableError(f"not attached to the plan-cache sidecar: {self.link.last_error}")
        keys = request.schedule_spec().plan_keys()
        n, width = len(distinct_keys(keys)), max(k.width for k in keys)
        d = att.descriptor
        if width > d.width:
            raise PlanCapacityError(
                f"the request needs plans {width} wide but slab slots hold {d.width} (--plan-width)"
            )
        if n > d.num_slots:
            raise PlanCapacityError(
                f"the request needs {n} distinct plans but the slab has {d.num_slots} slots (--gpu-plans)"
            )

    def acquire(self, request: GenerationRequest) -> RemoteLease:
        keys = request.schedule_spec().plan_keys()
        return self.link.prepare(keys, self.generation(), request.request_id)

    def verify(self, lease: RemoteLease) -> None:
        if not self.alive(lease):
            raise SidecarUnavailableError("the plan-cache sidecar session changed before the request ran")
        lease.check_rows()

    def alive(self, lease: RemoteLease) -> bool:
        att = self.link.attachment
        return att is not None and att.epoch == lease.epoch

    def status(self) -> dict[str, Any]:
        att = self.link.attachment
        if att is None:
            return {"serving": False, "weights_path": self._loaded[0] if self._loaded else "", "fingerprint": ""}
        return {
            "serving": True,
            "weights_path": att.weights_path,
            "fingerprint": att.fingerprint,
            "slab": att.descriptor,
        }
