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

from ditcore import (
    CheckpointError,
    CheckpointInfo,
    GenerationRequest,
    H3Model,
    PlanKey,
    PlanLease,
    load_model,
    validate_checkpoint,
)
from ditcore.model import RunOptions
from ditcore.pipeline import PartitionNotLoadedError
from ditcore.request import RequestError, RequestLimits, prompt_tokens
from ditcore.sizing import ModelShapes, RequestSizer, device_class
from ditruntime import memory
from ditruntime.memory import MemoryBudget
from ditruntime.slab import SlabDescriptor
from protos.ditserve.replica.v1 import replica_pb2 as rpb

from ..errors import PartitionNotServedError, RequestTooLargeForDeviceError
from .placement import StartPlacement
from .replica_port import ReplicaPort
from .sidecar_port import Committed, NodeState

SWAP_INSTALL, SWAP_ROLLBACK, SWAP_DROP, SWAP_RETIRE = (
    rpb.SWAP_ACTION_INSTALL, rpb.SWAP_ACTION_ROLLBACK, rpb.SWAP_ACTION_DROP, rpb.SWAP_ACTION_RETIRE,
)  # fmt: skip

MemoryReader = Callable[[], MemoryBudget]
"""What the model's device has free now (ditruntime.memory.free_memory; tests inject their own)."""


def device_free_memory(device: torch.device) -> MemoryBudget:
    """The default MemoryReader: device memory on cuda, host memory (MemAvailable, cgroups) on cpu."""
    return memory.free_memory(device)


class ServedLease(PlanLease, Protocol):
    """A plan lease as the executor holds it (ditcore.generation.PlanLease plus what serving needs)."""

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
    node_sidecars: tuple[NodeState, ...] = ()
    """Cached mode: every node's sidecar as rank 0 holds it, in node order (one on one node)."""


@dataclass(frozen=True)
class StagedWeights:
    """A loaded model ready to swap in, and the weights it is."""

    model: H3Model
    info: CheckpointInfo
    fingerprint: str  # the checkpoint's, or "tensors:<sha256>" for pushed tensors


Rollback = Callable[[], None]


class Backend(ABC):
    """Model, generation and plans for the executor; `model_lock` is held while a request denoises.

    `free_memory` reads what the model's device has free (default `device_free_memory`); the memory admission check
    compares it with the modeled activation peak of a request (`check_memory`)."""

    mode: ClassVar[str]  # "resident" or "cached" (ditcore's adaln modes)

    def __init__(
        self,
        device: torch.device,
        model_lock: threading.RLock,
        free_memory: MemoryReader | None = None,
        replica: ReplicaPort | None = None,
    ) -> None:
        self.device = device
        self.model_lock = model_lock
        self._free_memory = free_memory
        self._sizer: tuple[H3Model, RequestSizer] | None = None
        self.replica = replica
        """Rank 0's link to the other ranks of its replica (None: one device): every model it loads runs on every
        rank, and every weight change is made on every rank or none (generator_service.replica.link)."""
        self.placement: StartPlacement | None = None
        """Decides the "auto" text encoder and partitions at the first load, and keeps them (None: as the options
        say, unchecked)."""

    def load(self, info: CheckpointInfo, options: RunOptions) -> H3Model:
        """Load `info` in this backend's mode on its device (on a replica: as rank 0 of it), placed as decided at
        the first load (PlacementError there when nothing fits)."""
        if self.placement is not None:
            options = self.placement.resolve(info, options)
        return load_model(info, self.mode, self.device, options, self.replica.replica if self.replica else None)

    def stage_everywhere(self, info: CheckpointInfo, options: RunOptions) -> StagedWeights:
        """`info` loaded here beside the served weights, and on every other rank of a replica at the same time."""
        if self.replica is None:
            return StagedWeights(self.load(info, options), info, info.fingerprint)
        model = self.replica.stage(str(info.path), info.fingerprint, lambda: self.load(info, options))
        return StagedWeights(model, info, info.fingerprint)

    def swap_everywhere(self, install: Callable[[], Rollback]) -> Rollback:
        """Every other rank installs its staged weights, then `install()` does here; the rollback puts the old
        weights back on every rank."""
        if self.replica is None:
            return install()
        link = self.replica
        link.swap(SWAP_INSTALL)
        local = install()
        link.describe(self.loaded())

        def rollback() -> None:
            local()
            link.swap(SWAP_ROLLBACK)
            link.describe(self.loaded())

        return rollback

    def committed_everywhere(self) -> None:
        """The update committed: the other ranks forget the weights they kept for a rollback."""
        if self.replica is not None:
            self.replica.settle(SWAP_RETIRE)

    def aborted_everywhere(self) -> None:
        """The update will not commit: the other ranks forget what they staged."""
        if self.replica is not None:
            self.replica.settle(SWAP_DROP)

    def check_split(self, request: GenerationRequest, prompt_tokens: int | None) -> None:
        """Admission on a replica: RequestError unless the request's packed sequence splits across the ranks (any
        length does, but on a unified Ulysses x ring layout; exact for t2va from the prompt's tokens, fl2va's vision
        rows are checked by every rank before the transformer's first forward instead)."""
        if self.replica is not None:
            self.replica.check_split(request, self.sizer(), prompt_tokens)

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
        """Raise if the request's plans can never fit this server (before any work); memory: `check_memory`."""

    def check_partition(self, request: GenerationRequest) -> None:
        """PartitionNotLoadedError (FAILED_PRECONDITION, naming the folder) unless the served model runs the
        request's transformer partition (ref2va needs transformer_ref/)."""
        model = self.loaded()
        if model is not None:
            try:
                model.check_partition(request)
            except PartitionNotLoadedError as e:
                raise PartitionNotServedError(str(e)) from None

    def check_adapters(self, request: GenerationRequest) -> None:
        """Admission: the request's adapters as the served model reads them now (ditcore.adapters.ModelAdapters.resolve:
        NOT_FOUND for an unknown name, INVALID_ARGUMENT for a contract or partition the request breaks,
        FAILED_PRECONDITION for a file this model cannot serve). The run reads them again (a file may change)."""
        model = self.loaded()
        if model is not None and request.adapters:
            model.adapter_set.resolve(request)

    def check_quality(self, request: GenerationRequest) -> None:
        """Admission: the request's quality level as the served model serves it (ditcore.quality: INVALID_ARGUMENT
        for an unknown level or a rule the request breaks, naming `quality` and the rule; FAILED_PRECONDITION
        QUALITY_NOT_AUDITED when no passing audit covers it and the level refuses that). The run reads it again."""
        model = self.loaded()
        if model is not None and request.quality:
            model.quality.for_request(request, model.world_size, model.adapter_set.resolve(request))

    @abstractmethod
    def acquire(self, request: GenerationRequest, step_bound_s: float = 0.0) -> ServedLease | None:
        """The request's plans, leased; None when the model computes modulation itself. `step_bound_s` bounds one of
        its denoise steps: a sidecar keeps the lease's slots pinned at least that long after a session vanishes."""

    # ---------------------------------------------------------------- memory and time (ditcore.sizing)
    def sizer(self) -> RequestSizer | None:
        """The memory and time model of the served model on this device (None while no model is loaded)."""
        model = self.loaded()
        if model is None:
            return None
        cached = self._sizer
        if cached is None or cached[0] is not model:
            shapes = ModelShapes.of_model(model)
            cached = self._sizer = (model, RequestSizer(shapes, device_class(memory.device_name(self.device))))
        return cached[1]

    def free_memory(self) -> MemoryBudget:
        return self._free_memory() if self._free_memory is not None else device_free_memory(self.device)

    def check_memory(
        self, request: GenerationRequest, running: GenerationRequest | None = None, reserve_bytes: int = 0
    ) -> None:
        """Raise RequestTooLargeForDeviceError when the request's modeled activation peak plus `reserve_bytes`
        exceeds the device's free memory. The `running` request's own modeled peak counts as free: requests run one
        at a time, so this one starts only once that one's activations are gone. Skipped while no model is loaded,
        and when no free-memory figure could be read."""
        sizer = self.sizer()
        if sizer is None:
            return
        budget = self.free_memory()
        if budget.bytes <= 0 and budget.source == "unknown":
            return
        need = sizer.activations(request)
        reclaim = sizer.activations(running).peak if running is not None else 0
        free = budget.bytes + reclaim
        adapters = self._adapter_load_bytes(request)
        if need.peak + reserve_bytes + adapters <= free:
            return
        tokens = sizer.tokens(request).total
        canvas = f"{request.height} x {request.width} x {request.num_frames} frames ({tokens:,} tokens)"
        running_note = f", counting the running request's modeled {reclaim:,} as free" if reclaim else ""
        adapter_note = f" + {adapters:,} for its adapters not loaded yet" if adapters else ""
        raise RequestTooLargeForDeviceError(
            f"request {request.request_id}: canvas {canvas} needs a modeled {need.peak:,} bytes of activations "
            f"({need.phase}) + {reserve_bytes:,} reserve (--memory-reserve-gb){adapter_note}, but {self.device} has "
            f"{free:,} bytes free ({budget.source}{running_note}); ask for a smaller canvas or fewer frames",
            {"height": str(request.height), "width": str(request.width), "num_frames": str(request.num_frames),
             "tokens": str(tokens), "modeled_bytes": str(need.peak), "free_bytes": str(free), "phase": need.phase},
        )  # fmt: skip

    def _adapter_load_bytes(self, request: GenerationRequest) -> int:
        """What the request's adapters that are not loaded yet will hold on the device once loaded (0 when it names
        none, or when they cannot be read: check_adapters refuses those)."""
        model = self.loaded()
        if model is None or not request.adapters:
            return 0
        try:
            return int(model.adapter_set.pending_bytes(model.adapter_set.resolve(request)))
        except Exception:  # refused by check_adapters, with the reason
            return 0

    # ---------------------------------------------------------------- prompt tokens
    def prompt_tokens(self, prompt: str) -> int | None:
        """The tokens the served model's text encoder reads for `prompt` (ditcore.request.prompt_tokens: the loaded
        pipeline's tokenizer called exactly as diffusers' MiniMax-H3 text blocks call it); None while no model is
        loaded. RequestError for a prompt holding one of the tokenizer's special tokens. Safe beside a running
        request: the call only reads the tokenizer (the same call with the same settings never reconfigures it)."""
        model = self.loaded()
        if model is None:
            return None
        return prompt_tokens(model.pipe.tokenizer, prompt)

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
    def commit_update(self, previous: int, path: str, fingerprint: str, timeout_s: float) -> Committed:
        """Make the swapped weights generation `previous + 1`."""

    @abstractmethod
    def abort_update(self, path: str) -> None:
        """Undo a prepared update that will not commit (best effort)."""


def check_prompt_tokens(backend: Backend, request: GenerationRequest, limits: RequestLimits) -> int | None:
    """Admission: the request's prompt as the served model's tokenizer counts it (`Backend.prompt_tokens`), within
    `limits.max_prompt_tokens` (--max-prompt-tokens); RequestError naming the prompt. Returns the count (None while
    no model is loaded: cached mode before its first attachment, where `check_fits` refuses the request anyway)."""
    count = backend.prompt_tokens(request.prompt)
    if count is not None and count > limits.max_prompt_tokens:
        raise RequestError(
            "prompt", f"is {count} tokens; allowed at most {limits.max_prompt_tokens} (--max-prompt-tokens)"
        )
    return count


def validate_compatible(path: Path, current: CheckpointInfo, require_adaln: bool) -> CheckpointInfo:
    """A valid MiniMax-H3 repository at `path` that can replace `current` under a running server: same transformer
    config (plan layout and shapes) and the same stored precision."""
    info = validate_checkpoint(path, require_adaln=require_adaln)
    why = current.incompatibility(info)
    if why is not None:
        raise CheckpointError(f"{info.path}: {why}")
    return info
