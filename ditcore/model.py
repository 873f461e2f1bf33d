"""A loaded MiniMax-H3 checkpoint, ready to serve requests, and `generate()`, the one way a request runs.

`H3Model` is diffusers' own modular pipeline on a checkpoint (pipeline.py): in **resident** mode with the transformer
exactly as `from_pretrained` loads it; in **cached** mode with the transformer loaded without its plan tensors (never
read, never allocated) and every `adaln_proj.linear` / `norm_out.linear` replaced by a module that reads the current
step's rows from a plan lease. `generate(model, request, plans, on_step)` runs diffusers' t2va or fl2va denoise loop
and returns the final latents exactly as diffusers computes them, decoded by diffusers' own decode steps when the
request asks for media.
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from .checkpoint import CheckpointInfo, validate_checkpoint
from .media import DecodedMedia
from .pipeline import (
    ScheduleKeys,
    decode,
    generate_latents,
    load_decoder,
    load_pipeline,
    use_cached_transformer,
)
from .plans import PlanKey, SlotReads, is_plan_tensor
from .report import CacheReport
from .request import H3_LIMITS, GenerationRequest, RequestLimits

ADALN_MODES = ("resident", "cached")


class PlanLease(Protocol):
    """Pages for every step of one request, valid until `release()`."""

    @property
    def report(self) -> CacheReport:
        """Where the request's plans came from (read-only)."""
        ...

    def pages(self, step: int) -> torch.Tensor:
        """(width, page_numel) pages of step `step`, in the projections' dtype, on the model's device."""
        ...

    def release(self) -> None: ...


@runtime_checkable
class SlabPlanLease(PlanLease, Protocol):
    """A lease whose pages are rows of a slab: the served path reads them with SlotReads (one indexed read per step,
    no host sync) instead of calling `pages(step)`."""

    def slab_slots(self) -> tuple[torch.Tensor, Sequence[int]]:
        """The (S, W, P) slab on the model's device and the slot of every step."""
        ...


def reads_finished(device: torch.device) -> None:
    """Return once every kernel queued so far on `device`'s current stream has finished: an event recorded after the
    last kernel that reads a leased slot, then waited on. A lease may be released (its slots reused) only after this.
    CPU: kernels run synchronously, nothing is outstanding (a no-op, kept so the ordering is explicit)."""
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()


class PlanProvider(Protocol):
    def acquire(self, keys: Sequence[PlanKey]) -> PlanLease:
        """A lease on the pages of `keys` (one key per step)."""
        ...


StepCallback = Callable[[int, int], None]
"""Called as (steps_done, total) after every transformer forward; raising aborts the request."""


@dataclass
class GenerationResult:
    request_id: str
    video: torch.Tensor
    """Final video latents as diffusers returns them: (1, 24, F_latent, H/16, W/16) float32."""
    audio: torch.Tensor
    """Final audio latents as diffusers returns them: (2, 32, N) float32 (stereo channels first)."""
    sha256: str
    timings_ms: dict[str, float]
    cache: CacheReport | None = None
    media: DecodedMedia | None = None
    """The decoded frames and waveform (requests whose output_type is not "latents")."""
    extra: dict[str, Any] = field(default_factory=dict)


def latents_sha256(video: torch.Tensor, audio: torch.Tensor | None) -> str:
    """SHA-256 of the raw little-endian bytes of the video latents, then the audio latents (contiguous)."""
    h = hashlib.sha256()
    for t in (video, audio):
        if t is not None:
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class ModelMemory:
    """What the served transformer holds, against the plan tensors of its checkpoint."""

    transformer_bytes: int
    """Parameter and buffer bytes of the transformer as loaded."""
    plan_tensor_bytes: int
    """Bytes of every `adaln_proj` and `norm_out.linear` tensor in the checkpoint (as stored)."""
    held_plan_bytes: int
    """Of those, the bytes this model holds (all in resident mode, none in cached mode)."""

    @property
    def saved_bytes(self) -> int:
        return self.plan_tensor_bytes - self.held_plan_bytes

    @property
    def saved_fraction(self) -> float:
        return self.saved_bytes / self.plan_tensor_bytes if self.plan_tensor_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "transformer_bytes": self.transformer_bytes,
            "plan_tensor_bytes": self.plan_tensor_bytes,
            "held_plan_bytes": self.held_plan_bytes,
            "saved_bytes": self.saved_bytes,
            "saved_fraction": round(self.saved_fraction, 6),
        }


def _module_bytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


class H3Model:
    """diffusers' MiniMax-H3 pipeline on one checkpoint, resident or cached; one request at a time (see generate)."""

    def __init__(self, info: CheckpointInfo, mode: str, device: torch.device | str = "cpu") -> None:
        if mode not in ADALN_MODES:
            raise ValueError(f"adaln mode must be one of {list(ADALN_MODES)}, got {mode!r}")
        if mode == "resident" and not info.has_adaln:
            raise ValueError(f"{info.path}: resident mode needs the transformer's native adaln_proj tensors")
        self.info = info
        self.mode = mode
        self.device = torch.device(device)
        self.precision = info.precision
        self.pipe: Any = load_pipeline(info.path, self.precision)
        self.bytes_read = self.bytes_skipped = 0
        if mode == "cached":
            self.holder = use_cached_transformer(self.pipe, info.path, self.precision)
        if self.device.type != "cpu":
            for name in ("transformer", "text_encoder", "vae", "audio_vae"):
                self.pipe.update_components(**{name: getattr(self.pipe, name).to(self.device)})
        self.decoder: Any = load_decoder(self.pipe, info.path)
        self.schedule = ScheduleKeys(info.path)

    @property
    def path(self) -> Path:
        return self.info.path

    @property
    def transformer(self) -> Any:
        """diffusers' MiniMaxH3Transformer3DModel this model runs."""
        return self.pipe.transformer

    def plan_keys(self, request: GenerationRequest) -> list[PlanKey]:
        """Every step's plan key (cheap: the schedulers alone; safe while another request runs)."""
        return self.schedule.keys(request)

    def memory(self) -> ModelMemory:
        plan_bytes = self.info.layout.plan_tensor_bytes(self.info.projection_dtype)
        held = sum(t.numel() * t.element_size() for n, t in self.transformer.state_dict().items() if is_plan_tensor(n))
        return ModelMemory(_module_bytes(self.transformer), plan_bytes, held)

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> H3Model:
        """A resident copy whose transformer has the named tensors replaced (checked by the caller); the text
        encoder and the rest are shared."""
        if self.mode != "resident":
            raise ValueError("only a resident model takes pushed tensors")
        from diffusers import MiniMaxH3ModularPipeline

        transformer = copy.deepcopy(self.transformer)
        state = transformer.state_dict()
        for name, t in tensors.items():
            state[name].copy_(t.to(state[name].device))
        # self.pipe.blocks is a copy of its quiet blocks: no progress bars either
        pipe = MiniMaxH3ModularPipeline(blocks=self.pipe.blocks, pretrained_model_name_or_path=str(self.info.path))
        pipe.update_components(**{**self.pipe.components, "transformer": transformer})
        other = copy.copy(self)
        other.pipe = pipe
        return other


def load_model(checkpoint: CheckpointInfo | str | Path, mode: str, device: torch.device | str = "cpu") -> H3Model:
    """Validate (unless given a CheckpointInfo) and load a checkpoint for serving in `mode`."""
    info = (
        checkpoint
        if isinstance(checkpoint, CheckpointInfo)
        else validate_checkpoint(checkpoint, require_adaln=mode == "resident")
    )
    return H3Model(info, mode, device)


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000.0, 3)


def generate(
    model: H3Model,
    request: GenerationRequest,
    plans: PlanProvider | None = None,
    on_step: StepCallback | None = None,
    limits: RequestLimits = H3_LIMITS,
) -> GenerationResult:
    """Run one request through diffusers' t2va or fl2va loop. Cached models need `plans`; resident models take none.

    The lease (if any) is acquired after validation and released in every outcome (before decoding, which reads no
    plan). Timings: `plans` (acquire), `encode` (start of the loop to the first transformer forward: text and keyframe
    encoding, layout), `denoise` (the rest of the loop), `decode` (diffusers' decode steps, on the model's device;
    only for requests that ask for media).
    """
    request.validate(limits)
    if (plans is None) != (model.mode == "resident"):
        raise ValueError(f"a {model.mode} model {'takes no' if plans is not None else 'needs a'} plan provider")
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    keys = model.plan_keys(request)
    t0 = time.perf_counter()
    lease = plans.acquire(keys) if plans is not None else None
    timings["plans"] = _ms(t0)
    marks: list[float] = []

    def forward_started(module: Any, args: Any) -> None:
        marks.append(time.perf_counter())

    def forward_done(module: Any, args: Any, output: Any) -> None:
        if on_step is not None:
            on_step(len(marks), len(keys))

    transformer = model.transformer
    handles = [
        transformer.register_forward_pre_hook(forward_started),
        transformer.register_forward_hook(forward_done),
    ]
    reads = None
    try:
        t0 = time.perf_counter()
        reads = _plan_reads(lease, keys)
        video, audio = generate_latents(model.pipe, request, reads, keys)
        end = time.perf_counter()
        first = marks[0] if marks else end
        timings["encode"] = round((first - t0) * 1000.0, 3)
        timings["denoise"] = round((end - first) * 1000.0, 3)
    finally:
        for h in handles:
            h.remove()
        report = lease.report if lease is not None else None
        if lease is not None:
            # In every outcome (a step callback may abort with kernels still queued): no slot of the lease is
            # released before the last kernel that reads one has finished (docs/architecture.md, "The slab and the
            # lease protocol").
            reads_finished(model.device)
            reads = None  # no slab view outlives the request (an exception's traceback keeps this frame)
            lease.release()
    media = None
    if request.decodes:
        t0 = time.perf_counter()
        media = decode(model.decoder, video, audio)
        timings["decode"] = _ms(t0)
    timings["total"] = _ms(t_start)
    v_out = video.detach().cpu().contiguous()
    a_out = audio.detach().cpu().contiguous()
    return GenerationResult(
        request.request_id, v_out, a_out, latents_sha256(v_out, a_out), timings, report, media=media
    )


def _plan_reads(lease: PlanLease | None, keys: Sequence[PlanKey]) -> Any:
    """How the loop reads the lease: SlotReads over its slab (prepared here, once per request), else `pages(i)`."""
    if lease is None:
        return None
    if isinstance(lease, SlabPlanLease):
        slab, slots = lease.slab_slots()
        return SlotReads(slab, slots, [k.width for k in keys])
    return lambda i, key: lease.pages(i)
