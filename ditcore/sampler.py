"""The denoise loop: rectified-flow Euler with classifier-free guidance, seeded.

`generate()` runs one request on a DiT in either mode. In cached mode a `PlanProvider`
hands out the request's plan pages (in-process here, the sidecar's slab in the services).
Latents stay float32 between steps; the model runs in its own dtype.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .model import DiT, Modulation, PageModulation
from .plans import StepPlan
from .report import CacheReport
from .request import GenerationRequest, tokenize
from .schedule import flow_schedule


class PlanLease(Protocol):
    """Pages for every step of one request, valid until `release()`."""

    @property
    def report(self) -> CacheReport:
        """Where the request's plans came from (read-only)."""
        ...

    def pages(self, step: int) -> torch.Tensor:
        """(W, page_numel) pages of step `step`, in model dtype."""
        ...

    def release(self) -> None: ...


class PlanProvider(Protocol):
    def acquire(self, steps: Sequence[StepPlan]) -> PlanLease: ...


StepCallback = Callable[[int, int], None]
"""Called as (step_index_done, total) after every step; raising aborts the request."""


@dataclass
class GenerationResult:
    request_id: str
    video: torch.Tensor  # (Cv, F, H, W) float32
    audio: torch.Tensor | None  # (Ca, La) float32
    sha256: str
    timings_ms: dict[str, float]
    cache: CacheReport | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def latents_sha256(video: torch.Tensor, audio: torch.Tensor | None) -> str:
    """SHA-256 of the raw little-endian bytes of video then audio latents (contiguous)."""
    h = hashlib.sha256()
    for t in (video, audio):
        if t is not None:
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000.0, 3)


@torch.inference_mode()
def generate(
    model: DiT,
    request: GenerationRequest,
    plans: PlanProvider | None = None,
    on_step: StepCallback | None = None,
) -> GenerationResult:
    """Run one validated request. `plans=None` requires a resident model."""
    config = model.config
    request.validate(config)
    if plans is None and not model.with_adaln:
        raise ValueError("a cached-mode model needs a plan provider")
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    device = model.video_embed.weight.device
    t0 = time.perf_counter()
    prompts = [request.prompt] + ([request.negative_prompt] if request.use_guidance else [])
    ctx = model.encode_text(torch.stack([tokenize(p, config) for p in prompts]).to(device))  # (B, Lt, h)
    timings["encode"] = _ms(t0)

    # noise is drawn on the CPU so every device starts from the same latents
    gen = torch.Generator().manual_seed(request.seed)
    video = torch.randn((1, *request.video_latent_shape(config)), generator=gen).to(device)
    ashape = request.audio_latent_shape(config)
    audio = torch.randn((1, *ashape), generator=gen).to(device) if ashape else None
    vsched = flow_schedule(request.steps, request.flow_shift)
    asched = flow_schedule(request.steps, request.effective_audio_flow_shift)
    step_plans = request.schedule_spec().step_plans()

    t0 = time.perf_counter()
    lease = plans.acquire(step_plans) if plans is not None else None
    timings["plans"] = _ms(t0)
    try:
        t0 = time.perf_counter()
        for i, sp in enumerate(step_plans):
            mod: Modulation = (
                PageModulation(config, lease.pages(i))
                if lease is not None
                else model.resident_modulation(sp.key.timesteps().to(device))
            )
            v_vel, a_vel = _velocity(model, video, audio, ctx, mod, sp, request)
            video = video + (vsched.sigmas[i + 1] - vsched.sigmas[i]) * v_vel
            if audio is not None and a_vel is not None:
                audio = audio + (asched.sigmas[i + 1] - asched.sigmas[i]) * a_vel
            if on_step is not None:
                on_step(i + 1, len(step_plans))
        timings["denoise"] = _ms(t0)
    finally:
        report = lease.report if lease is not None else None
        if lease is not None:
            lease.release()
    timings["total"] = _ms(t_start)
    v_out = video[0].cpu().contiguous()
    a_out = audio[0].cpu().contiguous() if audio is not None else None
    return GenerationResult(request.request_id, v_out, a_out, latents_sha256(v_out, a_out), timings, report)


def _velocity(
    model: DiT,
    video: torch.Tensor,
    audio: torch.Tensor | None,
    ctx: torch.Tensor,
    mod: Modulation,
    sp: StepPlan,
    request: GenerationRequest,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Model velocity (float32), guided when the request asks for it."""
    dtype = model.video_embed.weight.dtype
    b = ctx.shape[0]
    xv = video.to(dtype).expand(b, *video.shape[1:])
    xa = audio.to(dtype).expand(b, *audio.shape[1:]) if audio is not None else None
    vv, va = model(xv, xa, ctx, mod, sp.video_row, sp.audio_row)
    vv, va = vv.float(), (va.float() if va is not None else None)
    if b == 1:
        return vv, va
    g = request.guidance_scale
    vv = vv[1:] + g * (vv[:1] - vv[1:])
    if va is not None:
        va = va[1:] + g * (va[:1] - va[1:])
    return vv, va
