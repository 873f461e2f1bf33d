"""Cached mode: diffusers' MiniMax-H3 transformer loaded without its plan tensors (every
`adaln_proj.linear` and `norm_out.linear` reads the step's rows from a lease instead); plans are
leased from the sidecar's slab over the injected `SidecarSession`, and the weight-update steps go
through the sidecar. No grpc here.

`CachedWeights` loads whatever checkpoint the sidecar's session names (so both sides always
serve one weight version) and checks that the slab's pages (numel, dtype, device and, on cuda,
the device's UUID) are the ones the model reads before it accepts the attachment.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from ditcore import CheckpointInfo, GenerationRequest, H3Model, load_model, validate_checkpoint
from ditcore.adapter_plans import modulation_digest, modulation_uses
from ditcore.model import RunOptions
from ditcore.placement import PlacementError
from ditcore.plans import PlanKey, distinct_keys, dtype_name
from ditruntime.faults import crash_point
from ditruntime.slab import check_device, device_uuid

from ..errors import CommitOutcomeUnknownError, PlanCapacityError, SidecarUnavailableError, tensor_updates_refused
from .base import Backend, BackendStatus, MemoryReader, Rollback, ServedLease, StagedWeights, validate_compatible
from .placement import StartPlacement
from .replica_port import ReplicaPort
from .sidecar_port import NOT_ATTACHED, AdapterSpec, Attachment, Committed, SidecarSession

log = logging.getLogger(__name__)


class CachedWeights:
    """The cached-mode model and which checkpoint it came from; `on_attach` vets each session."""

    def __init__(
        self,
        device: torch.device,
        options: RunOptions | None = None,
        replica: ReplicaPort | None = None,
        placement: StartPlacement | None = None,
        on_refused: Callable[[PlacementError], None] | None = None,
    ) -> None:
        self.device = device
        self.placement = placement
        """Decides the "auto" text encoder and partitions at the first attach's load, and keeps them."""
        self.on_refused = on_refused
        """Called with the refusal when nothing fits at the first attach (the generator then exits as at a bad
        flag); None: the attach fails, and is retried."""
        self.options = options if options is not None else RunOptions()  # every model loaded here runs so
        self.replica = replica
        """Rank 0's link to a replica's other ranks: each attachment maps and loads on every rank."""
        self.lock = threading.RLock()  # the backend's model_lock
        self.model: H3Model | None = None
        self.loaded: tuple[str, str] | None = None  # (weights_path, fingerprint)

    def on_attach(self, att: Attachment) -> None:
        """Load the sidecar's weights if ours differ; check slab geometry against the model. On a replica every
        other rank maps its own slab of the session and loads the same weights meanwhile."""
        if self.replica is not None:
            self.replica.attach(att, lambda: self._attach_here(att))
            self.replica.describe(self.model)
        else:
            self._attach_here(att)

    def _attach_here(self, att: Attachment) -> None:
        with self.lock:
            if self.loaded != (att.weights_path, att.fingerprint):
                info = validate_checkpoint(att.weights_path, require_adaln=False)
                if info.fingerprint != att.fingerprint:
                    raise ValueError(
                        f"{att.weights_path}: fingerprint {info.fingerprint[:16]} differs from the sidecar's "
                        f"{att.fingerprint[:16]}; the files changed"
                    )
                log.info("loading MiniMax-H3 (cached mode) from %s", att.weights_path)
                try:
                    options = self.placement.resolve(info, self.options) if self.placement else self.options
                except PlacementError as e:
                    if self.on_refused is not None:
                        self.on_refused(e)
                    raise
                self.model = load_model(
                    info, "cached", self.device, options, self.replica.replica if self.replica else None
                )
                self.loaded = (att.weights_path, att.fingerprint)
            assert self.model is not None
            check_slab(self.model, att)


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def check_slab(model: H3Model, att: Attachment, uuid_of: Callable[[torch.device], str] = device_uuid) -> None:
    """The slab's pages are what the model's plan modules read: page_numel, projection dtype, device,
    and on cuda the very GPU (the descriptor's device UUID is the model device's UUID)."""
    d, info = att.descriptor, model.info
    numel, dtype = info.layout.page_numel, dtype_name(info.projection_dtype)
    if d.page_numel != numel or d.dtype != dtype:
        raise ValueError(f"slab pages are {d.page_numel} x {d.dtype} but {info.path} needs {numel} x {dtype}")
    check_device(d, model.device, uuid_of)  # done before the mapping was opened too; the model may have changed since
    if not _same_device(att.slab.device, model.device):
        raise ValueError(f"the slab is on {att.slab.device} but the model runs on {model.device} (--device)")


class CachedBackend(Backend):
    mode = "cached"

    def __init__(self, link: SidecarSession, weights: CachedWeights, free_memory: MemoryReader | None = None) -> None:
        super().__init__(weights.device, weights.lock, free_memory, weights.replica)
        self.placement = weights.placement  # decided at the first attach; updates keep it
        self.link = link
        self._weights = weights

    def start(self) -> None:
        self.link.start()

    def close(self) -> None:
        self.link.close()

    def _attachment(self) -> Attachment:
        att = self.link.attachment
        if att is None:
            raise SidecarUnavailableError(NOT_ATTACHED)  # why: in the log (SidecarClient notes each error once)
        return att

    def model(self) -> H3Model:
        model = self._weights.model
        if model is None:
            raise SidecarUnavailableError("no weights loaded yet: the plan-cache sidecar was never attached")
        return model

    def loaded(self) -> H3Model | None:
        return self._weights.model

    def generation(self) -> int:
        return self._attachment().generation

    def status(self) -> BackendStatus:
        att, nodes = self.link.attachment, tuple(self.link.node_states())
        if att is None:
            loaded = self._weights.loaded
            return BackendStatus(False, False, self.link.target, loaded[0] if loaded else "", "", node_sidecars=nodes)
        return BackendStatus(True, True, self.link.target, att.weights_path, att.fingerprint, att.descriptor, nodes)

    # ---------------------------------------------------------------- plans
    def _keys(self, request: GenerationRequest) -> tuple[list[PlanKey], list[AdapterSpec]]:
        """The request's plan keys (their adapters' digest included) and the modulation-changing adapters the
        sidecar builds them with."""
        model = self.model()
        mods = modulation_uses(model.adapter_set.resolve(request))
        keys = model.plan_keys(request, modulation_digest(mods))
        return keys, [AdapterSpec(info.name, info.identity, scale) for info, scale in mods]

    def check_fits(self, request: GenerationRequest) -> None:
        d = self._attachment().descriptor
        keys, _ = self._keys(request)
        n, width = len(distinct_keys(keys)), max(k.width for k in keys)
        if width > d.width:
            raise PlanCapacityError(
                f"the request needs plans {width} wide but slab slots hold {d.width} (--plan-width)"
            )
        if n > d.num_slots:
            raise PlanCapacityError(
                f"the request needs {n} distinct plans but the slab has {d.num_slots} slots (--gpu-plans)"
            )

    def acquire(self, request: GenerationRequest, step_bound_s: float = 0.0) -> ServedLease:
        keys, adapters = self._keys(request)
        return self.link.prepare(keys, self.generation(), request.request_id, step_bound_s, adapters)

    def verify(self, lease: ServedLease) -> None:
        if not self.alive(lease):
            raise SidecarUnavailableError("the plan-cache sidecar session changed before the request ran")
        lease.check_rows()

    def alive(self, lease: ServedLease) -> bool:
        return lease.alive()

    # ---------------------------------------------------------------- weight updates
    def validate_update(self, path: Path) -> CheckpointInfo:
        # the sidecar, which reads the plan tensors, refuses a repository without them (prepare_update)
        return validate_compatible(path, self.model().info, require_adaln=False)

    def prepare_update(self, previous: int, path: Path) -> None:
        self.link.prepare_update(previous, str(path))
        crash_point("update:after_prepare")

    def stage(self, info: CheckpointInfo) -> StagedWeights:
        return self.stage_everywhere(info, self._weights.options)

    def stage_tensors(self, tensors: dict[str, torch.Tensor]) -> StagedWeights:
        raise tensor_updates_refused()

    def swap(self, staged: StagedWeights) -> Rollback:
        w = self._weights

        def install() -> Rollback:
            old = (w.model, w.loaded)
            w.model, w.loaded = staged.model, (str(staged.info.path), staged.fingerprint)

            def rollback() -> None:
                w.model, w.loaded = old

            return rollback

        return self.swap_everywhere(install)

    def commit_update(self, previous: int, path: str, fingerprint: str, timeout_s: float) -> Committed:
        """The sidecar's CommitWeightUpdate; if its outcome is unknown, drop the session and serve
        nothing until the sidecar says, on reattach, which generation it holds."""
        crash_point("update:before_commit")
        try:
            done = self.link.commit_update(previous, path, timeout_s)
        except CommitOutcomeUnknownError:
            self.link.reattach()
            raise
        crash_point("update:after_commit")
        self.link.adopt(done.generation, path, done.fingerprint)
        self.committed_everywhere()
        return done

    def abort_update(self, path: str) -> None:
        self.link.abort_update(path)
        self.aborted_everywhere()
