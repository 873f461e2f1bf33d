"""MiniMax-H3's t2va denoise loop run by diffusers' own modular blocks (decode removed), resident or cached.

Protocol for one request on one pipeline (the pipeline's schedulers are stateful: one request at a time):

    pipe = load_pipeline(repo, dtype)                       # diffusers' MiniMaxH3Blocks, t2va workflow, no decode
    keys = plan_keys(pipe, request)                         # per step: float32 bits of its sorted distinct timesteps
    video, audio = generate_latents(pipe, request)          # resident: diffusers' transformer, unmodified
    holder = use_cached_transformer(pipe, repo, dtype)      # or: transformer without adaln_proj / norm_out.linear
    video, audio = generate_latents(pipe, request, pages_for_step, keys)   # pages_for_step(i, keys[i]) -> pages
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.processing_utils import ProcessorMixin

from .plans import PlanKey, PlanLinear, PlanPages, SlotReads, load_transformer_without_adaln
from .request import GenerationRequest

PagesForStep = Callable[[int, PlanKey], torch.Tensor]
"""(step index, plan key) -> that plan's pages, (len(key), page_numel) in the projections' dtype."""

PRECISIONS = ("float32", "mixed")
# load_components dtypes: "mixed" is the released precision (transformer and Qwen3-VL in bfloat16; from_pretrained
# keeps the transformer's `_keep_in_fp32_modules` in float32); schedulers and the rest stay float32.
_LOAD_DTYPES: dict[str, Any] = {
    "float32": torch.float32,
    "mixed": {"transformer": torch.bfloat16, "text_encoder": torch.bfloat16, "default": torch.float32},
}
# the projection dtype load_transformer_without_adaln gives the cached transformer, per precision
_TRANSFORMER_DTYPES = {"float32": torch.float32, "mixed": torch.bfloat16}
_PLANNING_STOP = "denoise.set_timesteps"  # the last block plan_keys runs; the denoise loop follows it
_PLANNING_SKIP = ("denoise.prepare_latents",)  # draws the noise, which the timesteps do not depend on


class H3PipelineError(Exception):
    """Base of the errors this module raises."""


class PlanKeyMismatchError(H3PipelineError):
    """The transformer was given timesteps other than the plan precomputed for that step."""


class NotCachedError(H3PipelineError):
    """Cached generation was asked of a pipeline whose transformer still holds its own projections."""


class TextOnlyProcessor:
    """Stands in for Qwen3VLProcessor in t2va, where MiniMaxH3TextEncoderStep uses only `create_mm_token_type_ids`.

    Qwen3VLProcessor cannot be built without torchvision (its video processor). `create_mm_token_type_ids` is
    transformers' own ProcessorMixin function, run on this object; the pad-token ids it reads are resolved by
    Qwen3VLProcessor.__init__'s rule (the tokenizer's `*_token_id` attribute, else the id of `<|image_pad|>` /
    `<|video_pad|>`). Qwen3-VL has no audio token, so `audio_token_ids` is `[None]`, as ProcessorMixin gives it.
    """

    create_mm_token_type_ids = ProcessorMixin.create_mm_token_type_ids

    def __init__(self, tokenizer: Any) -> None:
        self.image_token_ids = [_pad_token_id(tokenizer, "image", "<|image_pad|>")]
        self.video_token_ids = [_pad_token_id(tokenizer, "video", "<|video_pad|>")]
        self.audio_token_ids: list[int | None] = [None]


def _pad_token_id(tokenizer: Any, modality: str, default_token: str) -> int:
    token = getattr(tokenizer, f"{modality}_token", default_token)
    token_id = getattr(tokenizer, f"{modality}_token_id", None)
    return int(token_id) if token_id else int(tokenizer.convert_tokens_to_ids(token))


def _check_dtype(dtype: str) -> None:
    if dtype not in PRECISIONS:
        raise ValueError(f"dtype must be one of {list(PRECISIONS)}, got {dtype!r}")


def load_pipeline(repo: str | os.PathLike[str], dtype: str = "float32") -> Any:
    """diffusers' MiniMaxH3ModularPipeline on `repo`: MiniMaxH3Blocks without `decode`, pruned to the t2va workflow.

    Every from_pretrained component is loaded at `dtype`'s precision except the processor, which is a
    TextOnlyProcessor (see there). The pipeline ends at `denoise.after_denoise`, with latents in its state.
    """
    from diffusers import MiniMaxH3Blocks, MiniMaxH3ModularPipeline

    _check_dtype(dtype)
    blocks = MiniMaxH3Blocks()
    blocks.sub_blocks.pop("decode")  # no VAE pass: the service returns latents
    blocks = blocks.get_workflow("t2va")  # drops the keyframe / reference branches and their components
    pipe = MiniMaxH3ModularPipeline(blocks=blocks, pretrained_model_name_or_path=os.fspath(repo))
    names = [n for n in pipe.pretrained_component_names if n != "processor"]
    pipe.load_components(names=names, dtype=_LOAD_DTYPES[dtype])
    pipe.update_components(processor=TextOnlyProcessor(pipe.tokenizer))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def use_cached_transformer(pipe: Any, repo: str | os.PathLike[str], dtype: str = "float32") -> PlanPages:
    """Swap in the repository's transformer loaded without its plan tensors; returns the holder its PlanLinears read.

    `dtype` must be the one `pipe` was loaded with, so the two transformers share the released precision.
    """
    _check_dtype(dtype)
    holder = PlanPages()
    transformer_dir = os.path.join(os.fspath(repo), "transformer")
    transformer, _, _ = load_transformer_without_adaln(transformer_dir, holder, _TRANSFORMER_DTYPES[dtype])
    pipe.update_components(transformer=transformer.to(pipe.transformer.device))
    return holder


def plan_key(timestep: torch.Tensor) -> PlanKey:
    """The key of the (T,) float32 distinct timesteps a forward receives."""
    return PlanKey.from_tensor(timestep)


def _set_shifts(pipe: Any, request: GenerationRequest) -> None:
    # Set on the pipeline's own scheduler objects, which set_timesteps then reads: state shared by every call.
    pipe.scheduler.set_shift(request.flow_shift)
    pipe.audio_scheduler.set_shift(request.audio_flow_shift)


def _planning_blocks(pipe: Any) -> Any:
    """The workflow's blocks up to and including set_timesteps, less the noise draw: no transformer, no generator."""
    from diffusers.modular_pipelines import SequentialPipelineBlocks

    chosen = {}
    for name, block in pipe.blocks.sub_blocks.items():
        if name not in _PLANNING_SKIP:
            chosen[name] = block
        if name == _PLANNING_STOP:
            return SequentialPipelineBlocks.from_blocks_dict(chosen)
    raise H3PipelineError(f"the pipeline's workflow has no {_PLANNING_STOP!r} block: {list(pipe.blocks.sub_blocks)}")


@torch.no_grad()
def plan_keys(pipe: Any, request: GenerationRequest) -> list[PlanKey]:
    """The plan key of every step, before the loop: runs diffusers' blocks up to set_timesteps on `pipe`.

    The inputs are staged into the state as ModularPipeline.__call__ does (given value, else the input's default);
    the keys come from set_timesteps' `row_timestep_plan`, exactly the `timestep` each forward will receive.
    Costs one text encoding. Sets the pipeline's scheduler shifts and timesteps to the request's.
    """
    from diffusers.modular_pipelines import PipelineState

    _set_shifts(pipe, request)
    blocks = _planning_blocks(pipe)
    inputs = request.pipeline_inputs()
    state = PipelineState()
    for param in blocks.inputs:
        if param.name is not None:
            state.set(param.name, inputs.get(param.name, param.default), param.kwargs_type)
    _, state = blocks(pipe, state)
    return [plan_key(timestep) for timestep, _ in state.get("row_timestep_plan")]


class ScheduleKeys:
    """Every step's plan key of a t2va request from the repository's two schedulers alone: no text encoding, no
    pipeline state, safe to call while another request denoises (admission, prefetch, capacity checks).

    Mirrors MiniMaxH3SetTimestepsStep for t2va (no conditioning rows): each step's rows sit at the video timestep
    (video and text rows) or the audio timestep, reduced by `torch.unique(sorted=True)`. Pinned to the block by a test
    against `plan_keys`, which runs diffusers' own block. Results are memoised per (steps, shifts).
    """

    def __init__(self, repo: str | os.PathLike[str]) -> None:
        from diffusers import MiniMaxH3Scheduler

        root = os.fspath(repo)
        self._video = MiniMaxH3Scheduler.from_pretrained(root, subfolder="scheduler")
        self._audio = MiniMaxH3Scheduler.from_pretrained(root, subfolder="audio_scheduler")
        self._lock = threading.Lock()
        self._memo: dict[tuple[int, float, float], list[PlanKey]] = {}

    def keys(self, request: GenerationRequest) -> list[PlanKey]:
        """One key per transformer forward (num_inference_steps - 1 of them)."""
        memo_key = (request.num_inference_steps, float(request.flow_shift), float(request.audio_flow_shift))
        with self._lock:
            if memo_key not in self._memo:
                self._video.set_shift(request.flow_shift)
                self._audio.set_shift(request.audio_flow_shift)
                self._video.set_timesteps(request.num_inference_steps)
                self._audio.set_timesteps(request.num_inference_steps)
                self._memo[memo_key] = [
                    PlanKey.from_timesteps(float(tv), float(ta))
                    for tv, ta in zip(self._video.timesteps, self._audio.timesteps, strict=True)
                ]
            return list(self._memo[memo_key])


def _plan_holder(transformer: Any) -> PlanPages:
    linear = transformer.norm_out.linear
    if not isinstance(linear, PlanLinear):
        raise NotCachedError(
            "pages_for_step needs a cached transformer (see use_cached_transformer); this one holds norm_out.linear"
        )
    return linear.holder


def _run(pipe: Any, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor]:
    _set_shifts(pipe, request)
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
            key = plan_key(got[offset : offset + want.width])
            offset += want.width
            if key != want:
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
    """Run the t2va loop; returns the final (video latents (1, C, F, h, w), audio latents (2, C_a, N)).

    Resident when `pages_for_step` is None. Otherwise `pipe.transformer` must be cached (use_cached_transformer) and
    a forward pre-hook sets its pages before step i's forward: `pages_for_step.read(i)` for SlotReads, else
    `pages_for_step(i, keys[i])`. The forward's timesteps are checked against `keys` (computed with plan_keys when
    not given) as StepPlans describes: shape per step, values once after the loop. Not reentrant: the schedulers and
    the holder are the pipeline's, so a pipeline serves one request at a time. The holder is cleared on return.
    """
    if pages_for_step is None:
        return _run(pipe, request)
    holder = _plan_holder(pipe.transformer)
    expected = list(keys) if keys is not None else plan_keys(pipe, request)
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

    handle = pipe.transformer.register_forward_pre_hook(set_pages, with_kwargs=True)
    try:
        latents = _run(pipe, request)
    finally:
        handle.remove()
        holder.clear()
    plans.verify()
    return latents
