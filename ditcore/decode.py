"""diffusers' own MiniMax-H3 decode steps after the loop: a decoder sharing the pipeline's two VAEs (loaded again at
the decode dtype if asked), and final latents decoded to uint8 frames (chunked), the stereo waveform and its rate."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .media import DecodedMedia
from .pipeline import DECODE_DTYPES, VAES, quiet

DECODE_CHUNK_BYTES = 64 * 1024 * 1024
"""decode turns this much float32 video (whole frames, at least one) into uint8 frames at a time: about 5 frames at
768 x 1344, so the host holds the uint8 frames plus a few chunks' temporaries, never a float copy of the video."""


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
    decoder.load_components(names=list(VAES), dtype=DECODE_DTYPES[dtype])
    device = pipe.vae.device
    vaes = {name: getattr(decoder, name).to(device) for name in VAES}  # a move, no cast
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
        hooks = [getattr(decoder, name).decoder.register_forward_pre_hook(call) for name in VAES]
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
