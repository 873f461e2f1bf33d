"""`generate()`, the one way a request runs on a loaded H3Model: diffusers' t2va, fl2va or ref2va loop on the pages
of a plan lease (cached) or none (resident), the final latents exactly as diffusers computes them, decoded when the
request asks for media; the lease it holds meanwhile, and each stage's clock."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from .adapter_plans import modulation_digest
from .adapters import AdapterInfo
from .decode import decode
from .denoise import generate_latents
from .media import DecodedMedia
from .model import H3Model
from .plans import PlanKey, SlotReads
from .quality import LOSSLESS
from .report import CacheReport
from .request import H3_LIMITS, GenerationRequest, RequestLimits, check_prompt_tokens
from .step_cache import StepCache, applied


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


def _stream_synchronize(device: torch.device) -> None:
    """Return once every kernel queued so far on `device`'s current stream has finished: an event recorded after the
    last one, then waited on. CPU: kernels run synchronously, nothing is outstanding (a no-op)."""
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()


def reads_finished(device: torch.device) -> None:
    """Return once the last kernel that reads a leased slot has finished (_stream_synchronize). A lease may be
    released (its slots reused) only after this; on CPU a no-op, kept so the ordering is explicit."""
    _stream_synchronize(device)


def stage_synchronize(device: torch.device) -> None:
    """Return once the stage's kernels have finished (_stream_synchronize), so that a stage clock read next counts
    them and not only their launch (the host runs ahead of a CUDA stream). Kept apart from reads_finished because it
    serves the clocks, not the lease. `generate` calls it at each stage boundary: a few times per request, inside the
    loop only at the first forward."""
    _stream_synchronize(device)


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
    attention_backend: str = ""
    """The diffusers attention backend the request's transformer forwards ran with ("native", "_native_cudnn", ...)."""
    blocks_skipped: list[float] = field(default_factory=list)
    """Per step, the transformer block forwards its step cache skipped (ditcore.step_cache; empty: lossless)."""
    quality: str = "lossless"
    """The quality level it ran (ditcore.quality)."""
    quality_warning: str = ""
    """Why its level served it unaudited (the level's policy "warn"); empty otherwise."""


def latents_sha256(video: torch.Tensor, audio: torch.Tensor | None) -> str:
    """SHA-256 of the raw little-endian bytes of the video latents, then the audio latents (contiguous)."""
    h = hashlib.sha256()
    for t in (video, audio):
        if t is not None:
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().data)  # the buffer itself, no copy
    return h.hexdigest()


def _clock(device: torch.device) -> float:
    """A stage clock: perf_counter once `device` has finished the work queued so far (stage_synchronize)."""
    stage_synchronize(device)
    return time.perf_counter()


def _ms(t0: float, device: torch.device) -> float:
    return round((_clock(device) - t0) * 1000.0, 3)


def generate(
    model: H3Model,
    request: GenerationRequest,
    plans: PlanProvider | None = None,
    on_step: StepCallback | None = None,
    limits: RequestLimits = H3_LIMITS,
    check: Callable[[], None] | None = None,
    adapters: Sequence[tuple[AdapterInfo, float]] = (),
    step_cache: StepCache | None = None,
) -> GenerationResult:
    """Run one request through diffusers' t2va or fl2va loop. Cached models need `plans`; resident models take none.
    `check` (optional) is called between the decode's chunks; it raises to stop the request there (cancel, deadline).
    `adapters` (AdapterInfo, scale) are active on the request's transformer for its loop, in that order
    (ditcore.adapters.ModelAdapters); default: the request's own `adapters` as the model's registry reads them now.
    Every adapter the model holds is disabled for a request without any. `step_cache` (the request's quality level's,
    ditcore.step_cache): diffusers' cache hooks on the transformer for this loop only; the result's `blocks_skipped`
    says how many block forwards each step skipped.

    The lease (if any) is acquired after validation and released in every outcome (before decoding, which reads no
    plan). Timings: `plans` (acquire), `encode` (start of the loop to the first transformer forward: text and keyframe
    encoding, layout), `denoise` (the rest of the loop), `decode` (diffusers' decode steps, on the model's device;
    only for requests that ask for media). Each stage clock is read once the device has finished the stage's work
    (stage_synchronize; on CUDA a stream sync at each boundary, the first forward's included), in both modes.
    """
    request.validate(limits)
    model.check_partition(request)
    uses = list(adapters) if adapters else model.adapter_set.resolve(request)
    level, quality_warning = None, ""
    if step_cache is None:  # the request's level as this model serves it (a replica's other ranks are handed it)
        level, quality_warning = model.quality.for_request(request, model.world_size, uses)
        step_cache = level.cache if level is not None else None
    check_prompt_tokens(model.pipe.tokenizer, request.prompt, limits)  # the served tokenizer, as diffusers calls it
    if (plans is None) != (model.mode == "resident"):
        raise ValueError(f"a {model.mode} model {'takes no' if plans is not None else 'needs a'} plan provider")
    device = model.device
    t_start = _clock(device)
    timings: dict[str, float] = {}
    backend = model.attention_backend
    keys = model.plan_keys(request, modulation_digest(uses) if model.mode == "cached" else "")
    t0 = _clock(device)
    lease = plans.acquire(keys) if plans is not None else None
    timings["plans"] = _ms(t0, device)
    first_forward: list[float] = []  # the end of "encode": text and keyframe encoding done on the device
    forwards = 0

    def forward_started(module: Any, args: Any) -> None:
        if not first_forward:
            first_forward.append(_clock(device))

    def forward_done(module: Any, args: Any, output: Any) -> None:
        nonlocal forwards
        forwards += 1
        if on_step is not None:
            on_step(forwards, len(keys))

    transformer = model.transformer_of(request.partition)
    handles = [
        transformer.register_forward_pre_hook(forward_started),
        transformer.register_forward_hook(forward_done),
    ]
    reads = None
    try:
        t0 = _clock(device)
        reads = _plan_reads(lease, keys)
        with model.adapter_set.active(request.partition, uses), applied(transformer, step_cache) as counts:
            video, audio = generate_latents(model.pipe, request, reads, keys)
        end = _clock(device)  # resident mode too: the last step's kernels have run
        first = first_forward[0] if first_forward else end
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
            if isinstance(reads, SlotReads):  # no slab view outlives the request: a failed request's traceback
                reads.close()  # keeps this frame and generate_latents', which hold the reads
            reads = None
            lease.release()
    media = None
    if request.decodes:
        t0 = _clock(device)
        media = decode(model.decoder, video, audio, check=check)
        timings["decode"] = _ms(t0, device)
    timings["total"] = _ms(t_start, device)
    v_out = video.detach().cpu().contiguous()
    a_out = audio.detach().cpu().contiguous()
    return GenerationResult(
        request.request_id, v_out, a_out, latents_sha256(v_out, a_out), timings, report, media=media,
        attention_backend=backend, blocks_skipped=counts.skipped if step_cache is not None else [],
        quality=level.name if level is not None else request.quality or LOSSLESS, quality_warning=quality_warning,
    )  # fmt: skip


def _plan_reads(lease: PlanLease | None, keys: Sequence[PlanKey]) -> Any:
    """How the loop reads the lease: SlotReads over its slab (prepared here, once per request), else `pages(i)`."""
    if lease is None:
        return None
    if isinstance(lease, SlabPlanLease):
        slab, slots = lease.slab_slots()
        return SlotReads(slab, slots, [k.width for k in keys])
    return lambda i, key: lease.pages(i)
