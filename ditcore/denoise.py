"""The request's denoise loop on a loaded pipeline (generate_latents): resident as diffusers runs it, or cached, each
step's pages set before its forward and the forwards' timesteps checked against the plan keys (StepPlans)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .pipeline import H3PipelineError, plan_holder, transformer_for
from .plans import PlanKey, SlotReads
from .request import GenerationRequest
from .schedule import plan_key, plan_keys, set_shifts

PagesForStep = Callable[[int, PlanKey], torch.Tensor]
"""(step index, plan key) -> that plan's pages, (len(key), page_numel) in the projections' dtype."""


class PlanKeyMismatchError(H3PipelineError):
    """The transformer was given timesteps other than the plan precomputed for that step."""


def _run(pipe: Any, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor]:
    set_shifts(pipe, request)
    out = pipe(
        **request.pipeline_inputs(),
        generator=torch.Generator("cpu").manual_seed(request.seed),
        output=["latents", "audio_latents"],
    )
    return out["latents"], out["audio_latents"]  # (1, 24, F, h, w), (2, 32, N)


class StepPlans:
    """What the transformer's forward pre-hook does at each step of one cached request, with no host sync.

    Per step, in the loop (`before_forward`): the forward's `timestep` is checked on its metadata alone (1-D float32,
    as many values as the step's key: the page rows the forward will index), a reference to it is kept, and the step's
    pages are read (`read(i)`: one indexed read of the slab for a SlotReads lease). No tensor value is read on the host.
    After the loop (`verify`, once per request): every kept `timestep` is copied to the host in one read and compared
    bit for bit with the step's expected key; a mismatch raises PlanKeyMismatchError naming the first wrong step, so a
    result computed with pages of another plan is never returned. (A width mismatch is refused before the forward,
    so pages of the wrong shape are never indexed.)
    """

    def __init__(self, expected: Sequence[PlanKey], read: Callable[[int], torch.Tensor]) -> None:
        self.expected = list(expected)
        self._read = read
        self.seen: list[torch.Tensor] = []

    def before_forward(self, timestep: torch.Tensor) -> torch.Tensor:
        i = len(self.seen)
        if i >= len(self.expected):
            raise PlanKeyMismatchError(f"step {i}: the transformer ran a forward the plan has no step for")
        want = self.expected[i]
        if timestep.dtype != torch.float32 or timestep.ndim != 1 or timestep.shape[0] != want.width:
            raise PlanKeyMismatchError(
                f"step {i}: the transformer got timesteps {timestep.dtype} of shape {tuple(timestep.shape)}, "
                f"the plan has {want.width} ({want})"
            )
        self.seen.append(timestep)
        return self._read(i)

    def verify(self) -> None:
        """After the loop: the forwards' timesteps were exactly the plan's keys (one device-to-host read)."""
        if len(self.seen) != len(self.expected):
            raise PlanKeyMismatchError(
                f"the loop ran {len(self.seen)} forwards, the plan has {len(self.expected)} steps"
            )
        got = torch.cat([t.detach() for t in self.seen]).cpu()  # the request's one read of timestep values
        offset = 0
        for i, want in enumerate(self.expected):
            key = plan_key(got[offset : offset + want.width], want.partition)
            offset += want.width
            if (key.bits, key.partition) != (want.bits, want.partition):
                raise PlanKeyMismatchError(f"step {i}: the transformer got plan key {key}, the plan has {want}")


PlanReads = PagesForStep | SlotReads
"""How a cached request's steps get their pages: a callable (pages built or held elsewhere, e.g. in tests), or
SlotReads over a leased slab (one indexed read per step, no host sync: the served path)."""


def generate_latents(
    pipe: Any,
    request: GenerationRequest,
    pages_for_step: PlanReads | None = None,
    keys: Sequence[PlanKey] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the request's loop (t2va, fl2va or ref2va, as its inputs select); returns the final (video latents
    (1, C, F, h, w), audio latents (2, C_a, N)).

    Resident when `pages_for_step` is None. Otherwise the request's partition's transformer (transformer_for) must be
    cached (use_cached_transformer), every key of `keys` must be of that partition, and a forward pre-hook sets its
    pages before step i's forward: `pages_for_step.read(i)` for SlotReads, else
    `pages_for_step(i, keys[i])`. The forward's timesteps are checked against `keys` (computed with plan_keys when
    not given) as StepPlans describes: shape per step, values once after the loop. Not reentrant: the schedulers and
    the holder are the pipeline's, so a pipeline serves one request at a time. The holder is cleared on return.
    """
    transformer = transformer_for(pipe, request.partition)
    if pages_for_step is None:
        return _run(pipe, request)
    holder = plan_holder(transformer)
    expected = list(keys) if keys is not None else plan_keys(pipe, request)
    wrong = next((i for i, k in enumerate(expected) if k.partition != request.partition), None)
    if wrong is not None:
        raise PlanKeyMismatchError(
            f"step {wrong}: plan {expected[wrong]} is of the '{expected[wrong].partition}' partition; this "
            f"{request.task} request runs on '{request.partition}'"
        )
    source = pages_for_step
    if isinstance(source, SlotReads):
        if source.steps != len(expected):
            raise PlanKeyMismatchError(f"the lease reads {source.steps} steps, the plan has {len(expected)}")
        read: Callable[[int], torch.Tensor] = source.read
    else:
        read = lambda i: source(i, expected[i])  # noqa: E731
    plans = StepPlans(expected, read)

    def set_pages(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        holder.set(plans.before_forward(kwargs["timestep"]))

    handle = transformer.register_forward_pre_hook(set_pages, with_kwargs=True)
    try:
        latents = _run(pipe, request)
    finally:
        handle.remove()
        holder.clear()
    plans.verify()
    return latents
