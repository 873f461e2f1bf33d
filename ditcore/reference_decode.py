"""Decoding a probed ref2va reference into diffusers' own reference dataclass (`MiniMaxH3ImageReference`,
`MiniMaxH3VideoReference`, `MiniMaxH3AudioReference`), held to its probe (ditcore.references.probe_reference).

`decode_reference` turns one probed reference into diffusers' dataclass the way diffusers' own `from_file` does
(frames as uint8 RGB at the rate the container reports, its soundtrack through diffusers' own reader at that
soundtrack's rate), but under its probe, since a container's header and packets can lie about what the bitstream
decodes to: every frame is checked as it leaves the decoder, before it is converted or kept. A video frame must be
the probed size and the frames' running bytes stay within the probed count's (the `max_decoded_bytes` it passed);
an audio frame must be at the probed rate and channel count and the samples' running float32 bytes stay within the
probed duration's plus AUDIO_SLACK_S. The decoders themselves (FFmpeg's `max_pixels`, here and in the probe) refuse a
picture far over the probed size or the pixel limit before allocating it. Resampling onto 24 fps and the audio VAE's
rate, resizing and encoding are diffusers' setup and reference-encoder blocks' work, run unchanged by ditcore.pipeline.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from .keyframes import MediaError, decode_image
from .references import (
    AUDIO_SLACK_S,
    DEFAULT_REFERENCE_LIMITS,
    Reference,
    ReferenceLimits,
    ReferenceProbe,
    decoder_options,
    open_container,
)  # fmt: skip


def decode_reference(ref: Reference, probe: ReferenceProbe, limits: ReferenceLimits = DEFAULT_REFERENCE_LIMITS) -> Any:
    """diffusers' reference dataclass for one probed reference: an image through ditcore.keyframes.decode_image
    (diffusers' load_image); a video or audio clip decoded the way the dataclass's own `from_file` decodes it, every
    frame checked against `probe` (the module doc), then handed to the dataclass. A fault of the media data itself,
    or a frame past what the probe read, raises MediaError."""
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    if probe.kind == "image":  # Pillow's: an image reference needs no PyAV (a GPU image may not carry it)
        return MiniMaxH3ImageReference(image=decode_image(ref.data, limits.image))
    import av

    try:
        with open_container(ref.data, probe.width * probe.height) as container:
            if probe.kind == "video":
                frames, fps, audio, rate = _decode_video(container, probe, limits)
                return MiniMaxH3VideoReference(frames=frames, fps=fps, audio=audio, sample_rate=rate)
            audio, rate = _decode_soundtrack(container, probe, limits)
            return MiniMaxH3AudioReference(audio=audio, sample_rate=rate)
    except MediaError:
        raise
    except (av.error.FFmpegError, ValueError, RuntimeError) as e:  # PyAV's; torch.cat's on a soundtrack of no frame
        raise MediaError(f"the {probe.format} file cannot be decoded ({type(e).__name__}: {e})") from e


def _decode_video(container: Any, probe: ReferenceProbe, limits: ReferenceLimits) -> tuple[Any, float, Any, Any]:
    """diffusers' `_decode_video_file` (MiniMaxH3VideoReference.from_file) over checked frames: (frames, fps, audio,
    sample_rate), the (N, H, W, 3) uint8 frames turned upright by the stream's rotation, its soundtrack or None."""
    import numpy as np

    stream = container.streams.video[0]
    frames, rotation = [], 0.0
    for frame in _video_frames(container, stream, probe, limits):
        rotation = frame.rotation  # the display matrix's, on every frame of the stream
        frames.append(frame.to_ndarray(format="rgb24"))
    fps = float(stream.average_rate or stream.guessed_rate)
    audio, rate = None, None
    if container.streams.audio:
        container.seek(0)  # the frames drained the container: the soundtrack is a second pass
        audio, rate = _decode_soundtrack(container, probe, limits)
    if not frames:
        raise MediaError("its video stream decodes to no frame")
    video = np.stack(frames)
    turns = round(rotation / 90.0) % 4  # ffmpeg's upright display, snapped to a quarter turn (as diffusers does)
    if turns:
        video = np.ascontiguousarray(np.rot90(video, k=-turns, axes=(1, 2)))
    return video, fps, audio, rate


def _decode_soundtrack(container: Any, probe: ReferenceProbe, limits: ReferenceLimits) -> tuple[Any, int]:
    """(waveform, sample_rate) of the first audio stream by diffusers' own reader (float32, its rate and layout),
    given a container whose `decode(stream)`, all that reader calls, yields checked frames."""
    import av
    from diffusers.modular_pipelines.minimax_h3.references import _decode_reference_soundtrack

    stream = container.streams.audio[0]
    frames = _audio_frames(container, stream, probe, limits)
    return _decode_reference_soundtrack(av, SimpleNamespace(decode=lambda _: frames), stream)


def _video_frames(container: Any, stream: Any, probe: ReferenceProbe, limits: ReferenceLimits) -> Iterator[Any]:
    """The stream's decoded frames, each refused before it is converted unless it is the probed size and the frames'
    uint8 RGB bytes so far stay within the probed count's. The decoder refuses a picture far over the probed size
    before allocating it."""
    import av

    width, height = probe.width, probe.height
    allowed = min(probe.frames * width * height * 3, limits.max_decoded_bytes)
    stream.codec_context.options = decoder_options(width * height)
    decoded = container.decode(stream)
    for n in itertools.count(1):
        try:
            frame = next(decoded, None)
        except av.error.FFmpegError as e:
            raise MediaError(
                f"its video frame {n} cannot be decoded ({type(e).__name__}: {e}): it is damaged, or larger than "
                f"the {width} x {height} its header and first frame give, which every frame must keep"
            ) from e
        if frame is None:
            return
        if (frame.width, frame.height) != (width, height):
            raise MediaError(
                f"its video frame {n} is {frame.width} x {frame.height}; its header and first frame give {width} x "
                f"{height}, and every frame of a video reference must be that size"
            )
        if n * width * height * 3 > allowed:
            raise MediaError(
                f"its video frame {n} decodes past {allowed:,} bytes: the {probe.frames} frames of {width} x {height} "
                "x 3 its packets hold", "max_decoded_bytes"
            )  # fmt: skip
        yield frame


def _audio_frames(container: Any, stream: Any, probe: ReferenceProbe, limits: ReferenceLimits) -> Iterator[Any]:
    """The stream's decoded frames, each refused before it is resampled unless it is at the probed rate and channel
    count and the float32 bytes of the samples so far stay within the probed duration's (plus AUDIO_SLACK_S)."""
    rate, channels = probe.sample_rate, probe.channels
    allowed = min(math.ceil((probe.seconds + AUDIO_SLACK_S) * rate) * channels * 4, limits.max_decoded_bytes)
    total = 0
    for n, frame in enumerate(container.decode(stream), 1):
        if (frame.sample_rate, frame.layout.nb_channels) != (rate, channels):
            raise MediaError(
                f"its audio frame {n} is {frame.sample_rate} Hz with {frame.layout.nb_channels} channels; the stream "
                f"was probed at {rate} Hz with {channels}, and every frame must keep them"
            )
        total += frame.samples * channels * 4
        if total > allowed:
            raise MediaError(
                f"its audio decodes past {allowed:,} bytes of float32 samples at frame {n}: {probe.seconds:.2f} s at "
                f"{rate} Hz x {channels} its packets span, plus {AUDIO_SLACK_S:g} s", "max_decoded_bytes"
            )  # fmt: skip
        yield frame
