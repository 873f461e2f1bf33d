"""MiniMax-H3's pipeline: diffusers' own modular blocks loaded on a repository, resident or cached. The t2va, fl2va and
ref2va denoise loops that run on it are denoise.py's, each step's plan key schedule.py's, and diffusers' own decode
steps after them decode.py's.

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

import dataclasses
import functools
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .checkpoint_files import PARTITIONS
from .plans import PlanLinear, PlanPages
from .replica import Replica
from .shards import load_transformer_without_adaln
from .text_encoder import TextEncoderPlacement, load_text_encoder, receive_text_encoder, share_prompt_embeddings

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
DECODE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""The dtypes the VAEs may decode in (load_decoder)."""
VAES = ("vae", "audio_vae")
"""The two VAEs: loaded at the dtype they decode in (load_pipeline's `vae_dtype`, decode.load_decoder)."""
_TRANSFORMERS = tuple(PARTITIONS.values())  # loaded last, per the `partitions` asked for


class H3PipelineError(Exception):
    """Base of the errors the pipeline modules raise (pipeline, schedule, denoise)."""


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
            at = DECODE_DTYPES[vae_dtype] if vae_dtype is not None and name in VAES else _LOAD_DTYPES[dtype]
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


DIFFUSERS_BLOCKS_LOGGER = "diffusers.modular_pipelines.modular_pipeline"
"""The logger diffusers' modular blocks log every exception that leaves a block to (its traceback, once per
nesting level: five for a denoise step, more for a decode)."""


@dataclasses.dataclass(frozen=True)
class _UnlessHandling:
    """A logging filter: drops the records logged while one of `kinds` is being handled (sys.exc_info is the
    logging thread's)."""

    kinds: tuple[type[BaseException], ...]

    def filter(self, record: logging.LogRecord) -> bool:
        return not isinstance(sys.exc_info()[1], self.kinds)


def quiet_block_errors(*kinds: type[BaseException]) -> None:
    """Drop diffusers' blocks' records of exceptions of `kinds` (a run stopped on purpose: a cancel, a deadline, a
    rank told to stop), which is no block's error: the caller logs it in one line. Once per process and kinds;
    every other exception's records stay."""
    logger = logging.getLogger(DIFFUSERS_BLOCKS_LOGGER)
    quiet = _UnlessHandling(kinds)
    if quiet not in logger.filters:
        logger.addFilter(quiet)


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


def use_cached_transformer(
    pipe: Any,
    repo: str | os.PathLike[str],
    dtype: str = "float32",
    device: torch.device | str | None = None,
    partition: str = "base",
) -> PlanPages:
    """Install the repository's transformer of `partition` loaded without its plan tensors (never read, never
    allocated; no full transformer is built: shards.load_transformer_without_adaln) and moved to `device` (default:
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
