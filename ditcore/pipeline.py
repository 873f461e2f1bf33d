"""MiniMax-H3's t2va and fl2va denoise loops run by diffusers' own modular blocks, resident or cached, and diffusers'
own decode steps after them.

Protocol for one request on one pipeline (the pipeline's schedulers are stateful: one request at a time):

    pipe = load_pipeline(repo, dtype, device=d)             # diffusers' MiniMaxH3Blocks less decode (t2va / fl2va)
    keys = plan_keys(pipe, request)                         # per step: float32 bits of its sorted distinct timesteps
    video, audio = generate_latents(pipe, request)          # resident: diffusers' transformer, unmodified
    pipe = load_pipeline(repo, dtype, cached=True, device=d)  # or: transformer without adaln_proj / norm_out.linear
    holder = plan_holder(pipe.transformer)                  # (use_cached_transformer swaps one into a loaded pipe)
    video, audio = generate_latents(pipe, request, pages_for_step, keys)   # pages_for_step(i, keys[i]) -> pages
    decoder = load_decoder(pipe, repo, "bfloat16")          # diffusers' MiniMaxH3DecodeStep; the VAEs at that dtype
    media = decode(decoder, video, audio, check)            # uint8 frames (chunked), stereo waveform, sampling rate

The task follows the inputs as in diffusers: a request with references runs every conditional block's ref2va
branch (its denoise loop calls `transformer_ref`), one with keyframes (`image` / `last_image`) the fl2va branch,
one with neither t2va (both on `transformer`). One pipeline holds both partitions' transformers when the repository
has both (`partitions`): resident, each as diffusers loads it; cached, each without its plan tensors and with its
own PlanPages holder (`plan_holder(transformer_for(pipe, partition))`), whose pages are that partition's plans.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .checkpoint import PARTITIONS
from .media import DecodedMedia
from .parallel import Replica, share_prompt_embeddings
from .plans import PlanKey, PlanLinear, PlanPages, SlotReads, load_transformer_without_adaln
from .request import GenerationRequest
from .text_encoder import TextEncoderPlacement, load_text_encoder, receive_text_encoder

PagesForStep = Callable[[int, PlanKey], torch.Tensor]
"""(step index, plan key) -> that plan's pages, (len(key), page_numel) in the projections' dtype."""

PRECISIONS = ("float32", "mixed")
# load_components dtypes: "mixed" is the released precision (transformer and Qwen3-VL in bfloat16; from_pretrained
# keeps the transformer's `_keep_in_fp32_modules` in float32); schedulers and the rest stay float32.
_LOAD_DTYPES: dict[str, Any] = {
    "float32": torch.float32,
    "mixed": {
        "transformer": torch.bfloat16,
        "transformer_ref": torch.bfloat16,
        "text_encoder": torch.bfloat16,
        "default": torch.float32,
    },
}
# the projection dtype load_transformer_without_adaln gives the cached transformer, per precision
_TRANSFORMER_DTYPES = {"float32": torch.float32, "mixed": torch.bfloat16}
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
DECODE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""The dtypes the VAEs may decode in (load_decoder)."""
DECODE_CHUNK_BYTES = 64 * 1024 * 1024
"""decode turns this much float32 video (whole frames, at least one) into uint8 frames at a time: about 5 frames at
768 x 1344, so the host holds the uint8 frames plus a few chunks' temporaries, never a float copy of the video."""
_VAES = ("vae", "audio_vae")
_TRANSFORMERS = tuple(PARTITIONS.values())  # loaded last, per the `partitions` asked for
KEYFRAME_NOISE_AUG = 0.999
"""The timestep an fl2va keyframe's (and a ref2va image or video reference's) rows are held at (diffusers'
`MiniMaxH3ModularPipeline.keyframe_noise_aug`; pinned to it by a test): max(video t, 0.999)."""
REFERENCE_AUDIO_T = 1.0
"""The timestep ref2va's audio reference rows are held at (diffusers' set_timesteps: `condition_audio_timestep`)."""


class H3PipelineError(Exception):
    """Base of the errors this module raises."""


class PlanKeyMismatchError(H3PipelineError):
    """The transformer was given timesteps other than the plan precomputed for that step."""


class NotCachedError(H3PipelineError):
    """Cached generation was asked of a pipeline whose transformer still holds its own projections."""


class PartitionNotLoadedError(H3PipelineError):
    """A request's task runs on a transformer partition the pipeline did not load (or the repository lacks)."""


def repository_partitions(repo: str | os.PathLike[str]) -> tuple[str, ...]:
    """The transformer partitions `repo`'s model_index.json names (in PARTITIONS order)."""
    with open(os.path.join(os.fspath(repo), "model_index.json")) as f:
        names = set(json.load(f))
    return tuple(name for name, folder in PARTITIONS.items() if folder in names)


def loaded_partitions(pipe: Any) -> tuple[str, ...]:
    """The partitions whose transformer `pipe` holds."""
    return tuple(name for name, folder in PARTITIONS.items() if getattr(pipe, folder, None) is not None)


def transformer_for(pipe: Any, partition: str) -> Any:
    """`pipe`'s transformer of `partition` ("base": `transformer`, "ref": `transformer_ref`);
    PartitionNotLoadedError naming the component when it holds none."""
    folder = PARTITIONS[partition]
    transformer = getattr(pipe, folder, None)
    if transformer is None:
        raise PartitionNotLoadedError(
            f"{folder}: the '{partition}' transformer partition is not loaded (this pipeline holds "
            f"{list(loaded_partitions(pipe))}; a repository serves ref2va when its model_index.json names "
            f"'{PARTITIONS['ref']}')"
        )
    return transformer


def _check_dtype(dtype: str) -> None:
    if dtype not in PRECISIONS:
        raise ValueError(f"dtype must be one of {list(PRECISIONS)}, got {dtype!r}")


def load_pipeline(
    repo: str | os.PathLike[str],
    dtype: str = "float32",
    *,
    cached: bool = False,
    device: torch.device | str = "cpu",
    text_encoder: TextEncoderPlacement | None = None,
    vae_dtype: str | None = None,
    replica: Replica | None = None,
    partitions: Sequence[str] | None = None,
) -> Any:
    """diffusers' MiniMaxH3ModularPipeline on `repo`: MiniMaxH3Blocks without `decode` (see load_decoder), every
    from_pretrained component at `dtype`'s precision, each moved to `device` as soon as it is loaded, so the host
    holds about one component at a time. `partitions` (None: every one the repository has) are the transformers
    loaded: "base" (`transformer`), "ref" (`transformer_ref`); PartitionNotLoadedError for one it lacks.

    In order: the text encoder (trimmed to the layers diffusers reads, placed as `text_encoder` says:
    ditcore.text_encoder); the tokenizer, the Qwen3-VL processor (fl2va's text encoder runs the keyframes through its
    image processor), the schedulers and the VAEs; the transformer last: diffusers' from_pretrained (resident), or
    with `cached` built without its plan tensors (use_cached_transformer), so that no full transformer is ever built
    and no adaln_proj / norm_out.linear byte is read (each partition's holder: plan_holder). The execution device is `device` wherever the text encoder
    runs. `vae_dtype` (DECODE_DTYPES; None: `dtype`'s) loads the two VAEs at the dtype they will decode in, as
    load_decoder would load them again (so they are read once). On a `replica` of several ranks, rank 0 loads the
    text encoder and broadcasts each prompt embedding; the other ranks load none and receive it. The pipeline ends at `denoise.after_denoise`, with the
    final latents in its state.
    """
    from diffusers import MiniMaxH3Blocks

    _check_dtype(dtype)
    if vae_dtype is not None and vae_dtype not in DECODE_DTYPES:
        raise ValueError(f"decode dtype must be one of {list(DECODE_DTYPES)}, got {vae_dtype!r}")
    target = torch.device(device)
    blocks = MiniMaxH3Blocks()
    blocks.sub_blocks.pop("decode")  # run apart (load_decoder): the latents and their sha256 come first
    pipe = pipeline_class()(blocks=quiet(blocks), pretrained_model_name_or_path=os.fspath(repo))
    pipe.execution_device = target
    placement = text_encoder if text_encoder is not None else TextEncoderPlacement()
    text_dtype = _component_dtype(dtype, "text_encoder")
    if replica is not None and not replica.leader:  # rank 0 encodes; this rank receives the embedding
        pipe.text_encoder_load = receive_text_encoder(pipe, text_dtype, replica)
    else:
        pipe.text_encoder_load = load_text_encoder(pipe, text_dtype, placement, target)
        if replica is not None and replica.world_size > 1:
            share_prompt_embeddings(pipe.text_encoder, int(pipe.text_encoder_layer), replica)
    available = repository_partitions(repo)
    chosen = available if partitions is None else tuple(partitions)
    missing = [p for p in chosen if p not in available]
    if missing or "base" not in chosen:
        raise PartitionNotLoadedError(
            f"{PARTITIONS[missing[0]] if missing else PARTITIONS['base']}: partitions {list(chosen)} asked for; the "
            f"repository has {list(available)} (and 'base' is always served)"
        )
    for name in pipe.pretrained_component_names:
        if name not in (*_TRANSFORMERS, "text_encoder"):
            at = DECODE_DTYPES[vae_dtype] if vae_dtype is not None and name in _VAES else _LOAD_DTYPES[dtype]
            pipe.load_components(names=[name], dtype=at)
            _move(getattr(pipe, name), target)
    for partition in chosen:
        if cached:
            use_cached_transformer(pipe, repo, dtype, target, partition)
        else:
            folder = PARTITIONS[partition]
            pipe.load_components(names=[folder], dtype=_LOAD_DTYPES[dtype])
            _move(getattr(pipe, folder), target)
    return pipe


def _component_dtype(precision: str, name: str) -> torch.dtype:
    dtypes = _LOAD_DTYPES[precision]
    if not isinstance(dtypes, dict):
        return dtypes  # type: ignore[no-any-return]
    chosen: torch.dtype = dtypes[name] if name in dtypes else dtypes["default"]
    return chosen


def _move(component: Any, device: torch.device) -> None:
    if isinstance(component, torch.nn.Module) and device.type != "cpu":
        component.to(device)  # in place: the pipeline keeps the same module


@functools.cache
def pipeline_class() -> type:
    """diffusers' MiniMaxH3ModularPipeline with its execution device set at load (`execution_device`) instead of
    inferred from its first module (diffusers looks at the text encoder, which may run elsewhere: text_encoder.py),
    and what load_text_encoder kept (`text_encoder_load`)."""
    from diffusers import MiniMaxH3ModularPipeline

    class H3Pipeline(MiniMaxH3ModularPipeline):  # type: ignore[misc, valid-type]
        execution_device: torch.device | None = None
        text_encoder_load: Any = None

        @property
        def _execution_device(self) -> torch.device:
            if self.execution_device is not None:
                return self.execution_device
            return super()._execution_device  # type: ignore[no-any-return]

    return H3Pipeline


def pipeline_with(pipe: Any, repo: str | os.PathLike[str], **components: Any) -> Any:
    """A new pipeline on `pipe`'s blocks and execution device sharing its components, those given replaced."""
    other = type(pipe)(blocks=pipe.blocks, pretrained_model_name_or_path=os.fspath(repo))
    other.execution_device = getattr(pipe, "execution_device", None)
    other.text_encoder_load = getattr(pipe, "text_encoder_load", None)
    other.update_components(**{**pipe.components, **components})
    return other


def quiet(blocks: Any) -> Any:
    """`blocks` with the progress bar of every block turned off, however deep (returned for chaining).
    ModularPipeline.set_progress_bar_config reaches only the top-level blocks, and the denoise loops sit inside the
    conditional ones; a pipeline's `blocks` property is a copy, so this is done before the pipeline is built."""
    if hasattr(blocks, "set_progress_bar_config"):
        blocks.set_progress_bar_config(disable=True)
    for sub in getattr(blocks, "sub_blocks", {}).values():
        quiet(sub)
    return blocks


def released_decode_dtype(precision: str) -> str:
    """The dtype the VAEs decode in by default: the released bfloat16 for a mixed checkpoint (diffusers' MiniMax-H3
    recipe, `pipe.load_components(dtype=torch.bfloat16)`), float32 for a float32 one."""
    _check_dtype(precision)
    return "bfloat16" if precision == "mixed" else "float32"


def decode_dtype_for(choice: str, precision: str) -> str:
    """The dtype a `--decode-dtype` choice decodes a checkpoint of `precision` in: a DECODE_DTYPES name as given,
    "auto" the released one (released_decode_dtype)."""
    if choice == "auto":
        return released_decode_dtype(precision)
    if choice not in DECODE_DTYPES:
        raise ValueError(f"decode dtype must be one of {['auto', *DECODE_DTYPES]}, got {choice!r}")
    return choice


def vae_dtype(pipe: Any) -> str:
    """The dtype `pipe`'s video VAE was loaded at (its decoder's: diffusers keeps the encoder in float32)."""
    return str(pipe.vae.dtype).removeprefix("torch.")


def load_decoder(pipe: Any, repo: str | os.PathLike[str], dtype: str | None = None) -> Any:
    """diffusers' MiniMaxH3DecodeStep (video, then audio) as a pipeline sharing `pipe`'s two VAEs.

    `dtype` (DECODE_DTYPES; None: as `pipe` loaded them): unless `pipe`'s VAEs are at it already, both are loaded
    again with diffusers' loader at `dtype`, as `load_components(dtype=...)` does (so each class's
    `_keep_in_fp32_modules` stay float32: the video VAE's encoder, quant_conv and norms, the whole audio VAE), moved
    to `pipe`'s VAE device and installed in both pipelines. fl2va's keyframe encoder (the `vae_encoder` block) thus
    reads the same video VAE, whose encoder path is float32 at every dtype: keyframe latents do not depend on it.
    """
    from diffusers import MiniMaxH3Blocks, MiniMaxH3ModularPipeline

    decoder = MiniMaxH3ModularPipeline(
        blocks=quiet(MiniMaxH3Blocks().sub_blocks["decode"]), pretrained_model_name_or_path=os.fspath(repo)
    )
    if dtype is None or dtype == vae_dtype(pipe):
        decoder.update_components(vae=pipe.vae, audio_vae=pipe.audio_vae)
        return decoder
    if dtype not in DECODE_DTYPES:
        raise ValueError(f"decode dtype must be one of {list(DECODE_DTYPES)}, got {dtype!r}")
    decoder.load_components(names=list(_VAES), dtype=DECODE_DTYPES[dtype])
    device = pipe.vae.device
    vaes = {name: getattr(decoder, name).to(device) for name in _VAES}  # a move, no cast
    decoder.update_components(**vaes)
    pipe.update_components(**vaes)
    return decoder


@torch.no_grad()
def decode(
    decoder: Any,
    video: torch.Tensor,
    audio: torch.Tensor,
    check: Callable[[], None] | None = None,
    *,
    chunk_bytes: int = DECODE_CHUNK_BYTES,
) -> DecodedMedia:
    """Decode final latents exactly as diffusers' MiniMax-H3 decode steps do, with their default `output_type="pil"`:
    the frames as diffusers hands them to a user (uint8 RGB), the stereo waveform and the audio VAE's rate.

    The steps run with `output_type="pt"`, which leaves the float video on the VAE's device, and the uint8 frames are
    made from it `chunk_bytes` of float32 frames at a time (to_uint8_frames: diffusers' own pil conversion, so the
    same bits), so the host never holds a float copy of the video. `check` (optional) is called before the decode,
    before each forward of the two VAE decoders (the video decoder runs once per spatial tile of each temporal clip)
    and before each chunk; what it raises stops the decode there and propagates.
    """
    hooks = []
    if check is not None:
        check()
        call = lambda *_: check()  # noqa: E731  (a forward pre-hook's module and args are not needed)
        hooks = [getattr(decoder, name).decoder.register_forward_pre_hook(call) for name in _VAES]
    try:
        out = decoder(latents=video, audio_latents=audio, output_type="pt", output=["videos", "audio", "sampling_rate"])
    finally:
        for hook in hooks:
            hook.remove()
    pixels = out.pop("videos")[0]  # (F, 3, H, W) float32 in [0, 1], on the VAE's device
    frames = to_uint8_frames(decoder.video_processor, pixels, check, chunk_bytes)
    del pixels  # the float video goes before the media is built
    waveform = out["audio"][0].detach().cpu().contiguous().numpy()  # (2, S) float32
    return DecodedMedia(frames=frames, audio=waveform, sampling_rate=int(out["sampling_rate"]))


def to_uint8_frames(
    processor: Any,
    pixels: torch.Tensor,
    check: Callable[[], None] | None = None,
    chunk_bytes: int = DECODE_CHUNK_BYTES,
) -> np.ndarray:
    """(F, C, H, W) float video as the decode step's `output_type="pt"` leaves it -> (F, H, W, C) uint8, exactly the
    frames its `output_type="pil"` gives (after the same postprocess, "pil" adds the video processor's own
    `pt_to_numpy` and `numpy_to_pil`, which this applies): whole frames, at most `chunk_bytes` of float32 (at least
    one frame) at a time, written into one preallocated array. `check` runs before each chunk."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be at least 1, got {chunk_bytes}")
    count, channels, height, width = pixels.shape
    step = max(1, chunk_bytes // (channels * height * width * 4))
    frames = np.empty((count, height, width, channels), dtype=np.uint8)
    for start in range(0, count, step):
        if check is not None:
            check()
        images = processor.numpy_to_pil(processor.pt_to_numpy(pixels[start : start + step]))
        for index, image in enumerate(images, start):
            frames[index] = np.asarray(image)
    return frames


def use_cached_transformer(
    pipe: Any,
    repo: str | os.PathLike[str],
    dtype: str = "float32",
    device: torch.device | str | None = None,
    partition: str = "base",
) -> PlanPages:
    """Install the repository's transformer of `partition` loaded without its plan tensors (never read, never
    allocated; no full transformer is built: plans.load_transformer_without_adaln) and moved to `device` (default:
    the pipeline's execution device); returns the holder its PlanLinears read. Replaces a transformer of that
    partition `pipe` already holds.

    `dtype` must be the precision `pipe` was loaded with, so the transformer shares the released precision.
    """
    _check_dtype(dtype)
    holder = PlanPages()
    folder = PARTITIONS[partition]
    transformer_dir = os.path.join(os.fspath(repo), folder)
    target = torch.device(device) if device is not None else pipe._execution_device
    transformer, _, _ = load_transformer_without_adaln(transformer_dir, holder, _TRANSFORMER_DTYPES[dtype], target)
    pipe.update_components(**{folder: transformer})
    return holder


def plan_key(timestep: torch.Tensor, partition: str = "base") -> PlanKey:
    """The key of the (T,) float32 distinct timesteps a forward of `partition`'s transformer receives."""
    return PlanKey.from_tensor(timestep, partition)


def _set_shifts(pipe: Any, request: GenerationRequest) -> None:
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

    _set_shifts(pipe, request)
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
        task = request.task
        audio_rows = task == "ref2va" and request.has_reference_audio()
        steps, partition = request.num_inference_steps, request.partition
        memo_key = (steps, float(request.flow_shift), float(request.audio_flow_shift), task, audio_rows)
        with self._lock:
            if memo_key not in self._memo:
                self._video.set_shift(request.flow_shift)
                self._audio.set_shift(request.audio_flow_shift)
                self._video.set_timesteps(request.num_inference_steps)
                self._audio.set_timesteps(request.num_inference_steps)
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


def plan_holder(transformer: Any) -> PlanPages:
    """The PlanPages a cached transformer's PlanLinears read; NotCachedError for a resident one."""
    return _plan_holder(transformer)


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
            key = plan_key(got[offset : offset + want.width], want.partition)
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
    holder = _plan_holder(transformer)
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
