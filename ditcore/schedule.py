"""Every step's plan key before the loop: from diffusers' own blocks up to set_timesteps on a pipeline (plan_keys), or
from the repository's two schedulers alone (ScheduleKeys, safe while another request denoises)."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from .pipeline import H3PipelineError
from .plans import PlanKey
from .request import GenerationRequest

_PLANNING_STOP = "denoise.set_timesteps"  # the last block plan_keys runs; the denoise loop follows it
# What the timesteps do not depend on: every noise draw (and the packing of its rows), and in fl2va the keyframes'
# VAE encoding (ref2va's layout is built from the encoded references' shapes, so its encoder runs)
_NOISE_BLOCKS = (
    "denoise.prepare_condition_latents",
    "denoise.prepare_latents",
    "denoise.prepare_latents_fl2va",
    "denoise.prepare_latents_ref2va",
)
_PLANNING_SKIP = {"t2va": _NOISE_BLOCKS, "fl2va": ("vae_encoder", *_NOISE_BLOCKS), "ref2va": _NOISE_BLOCKS}
KEYFRAME_NOISE_AUG = 0.999
"""The timestep an fl2va keyframe's (and a ref2va image or video reference's) rows are held at (diffusers'
`MiniMaxH3ModularPipeline.keyframe_noise_aug`; pinned to it by a test): max(video t, 0.999)."""
REFERENCE_AUDIO_T = 1.0
"""The timestep ref2va's audio reference rows are held at (diffusers' set_timesteps: `condition_audio_timestep`)."""


def plan_key(timestep: torch.Tensor, partition: str = "base") -> PlanKey:
    """The key of the (T,) float32 distinct timesteps a forward of `partition`'s transformer receives."""
    return PlanKey.from_tensor(timestep, partition)


def set_shifts(pipe: Any, request: GenerationRequest) -> None:
    """The request's video and audio flow shifts, on `pipe`'s two schedulers."""
    # Set on the pipeline's own scheduler objects, which set_timesteps then reads: state shared by every call.
    pipe.scheduler.set_shift(request.flow_shift)
    pipe.audio_scheduler.set_shift(request.audio_flow_shift)


def _planning_blocks(task: str) -> Any:
    """The task's workflow up to and including set_timesteps, less the noise draws and fl2va's keyframe encoding:
    no transformer, no generator (ref2va's reference encoder runs: the layout is built from its latents' shapes)."""
    from diffusers import MiniMaxH3Blocks
    from diffusers.modular_pipelines import SequentialPipelineBlocks

    chosen = {}
    for name, block in MiniMaxH3Blocks().get_workflow(task).sub_blocks.items():
        if name not in _PLANNING_SKIP[task]:
            chosen[name] = block
        if name == _PLANNING_STOP:
            return SequentialPipelineBlocks.from_blocks_dict(chosen)
    raise H3PipelineError(f"diffusers' {task} workflow has no {_PLANNING_STOP!r} block")


@torch.no_grad()
def plan_keys(pipe: Any, request: GenerationRequest) -> list[PlanKey]:
    """The plan key of every step, before the loop: runs diffusers' blocks up to set_timesteps on `pipe`.

    The inputs are staged into the state as ModularPipeline.__call__ does (given value, else the input's default);
    the keys come from set_timesteps' `row_timestep_plan`, exactly the `timestep` each forward will receive.
    Costs one text encoding (with the keyframes' vision blocks in fl2va, the references' in ref2va, plus ref2va's
    reference encoding). Sets the pipeline's scheduler shifts and timesteps to the request's. The keys are of the
    request's partition.
    """
    from diffusers.modular_pipelines import PipelineState

    set_shifts(pipe, request)
    blocks = _planning_blocks(request.task)
    inputs = request.pipeline_inputs()
    state = PipelineState()
    for param in blocks.inputs:
        if param.name is not None:
            state.set(param.name, inputs.get(param.name, param.default), param.kwargs_type)
    _, state = blocks(pipe, state)
    return [plan_key(timestep, request.partition) for timestep, _ in state.get("row_timestep_plan")]


class ScheduleKeys:
    """Every step's plan key of a request from the repository's two schedulers alone: no text encoding, no
    pipeline state, safe to call while another request denoises (admission, prefetch, capacity checks).

    Mirrors MiniMaxH3SetTimestepsStep: each step's rows sit at the video timestep (generated video and text rows),
    the audio timestep, in fl2va the keyframe rows and in ref2va the image and video reference rows at max(video t,
    KEYFRAME_NOISE_AUG), and in ref2va the audio reference rows (an audio clip's, a video's soundtrack's) at
    REFERENCE_AUDIO_T; reduced by `torch.unique(sorted=True)`, so an fl2va step is up to 3 wide, a ref2va step up
    to 4. ref2va keys are of the "ref" partition. Pinned to the block by tests against `plan_keys`, which runs
    diffusers' own blocks. Memoised per (steps, shifts, task, reference audio).
    """

    def __init__(self, repo: str | os.PathLike[str]) -> None:
        from diffusers import MiniMaxH3Scheduler

        root = os.fspath(repo)
        self._video = MiniMaxH3Scheduler.from_pretrained(root, subfolder="scheduler")
        self._audio = MiniMaxH3Scheduler.from_pretrained(root, subfolder="audio_scheduler")
        self._lock = threading.Lock()
        self._memo: dict[tuple[int, float, float, str, bool], list[PlanKey]] = {}

    def keys(self, request: GenerationRequest) -> list[PlanKey]:
        """One key per transformer forward (num_inference_steps - 1 of them)."""
        audio_rows = request.task == "ref2va" and request.has_reference_audio()
        return self.schedule_keys(
            request.task, request.num_inference_steps, request.flow_shift, request.audio_flow_shift, audio_rows
        )

    def schedule_keys(
        self, task: str, steps: int, flow_shift: float, audio_flow_shift: float, audio_rows: bool = False
    ) -> list[PlanKey]:
        """`keys` of a request known by its schedule alone: its task, grid points, the two shifts and (ref2va)
        whether a reference brings audio rows; what `ditserve plans build` computes a schedule line's keys with."""
        audio_rows = task == "ref2va" and audio_rows
        partition = "ref" if task == "ref2va" else "base"  # GenerationRequest.partition
        memo_key = (steps, float(flow_shift), float(audio_flow_shift), task, audio_rows)
        with self._lock:
            if memo_key not in self._memo:
                self._video.set_shift(flow_shift)
                self._audio.set_shift(audio_flow_shift)
                self._video.set_timesteps(steps)
                self._audio.set_timesteps(steps)
                self._memo[memo_key] = [
                    PlanKey.from_timesteps(
                        float(tv), float(ta), *_condition_timesteps(task, float(tv), audio_rows), partition=partition
                    )
                    for tv, ta in zip(self._video.timesteps, self._audio.timesteps, strict=True)
                ]
            return list(self._memo[memo_key])


def _condition_timesteps(task: str, video_t: float, audio_rows: bool = False) -> tuple[float, ...]:
    """The timesteps of a step's conditioning rows: fl2va's keyframe rows; ref2va's image / video reference rows
    (a ref2va request always has one) and, with `audio_rows`, its audio reference rows; none in t2va."""
    if task == "t2va":
        return ()
    video = (max(video_t, KEYFRAME_NOISE_AUG),)
    return (*video, REFERENCE_AUDIO_T) if task == "ref2va" and audio_rows else video
