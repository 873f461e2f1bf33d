"""ref2va references in: the image, video and audio bytes a request brings, checked and decoded into diffusers'
own reference dataclasses (`MiniMaxH3ImageReference`, `MiniMaxH3VideoReference`, `MiniMaxH3AudioReference`).

`probe_references(refs, limits)` makes every check the bytes' headers and container structure decide, without
decoding the media (admission runs it): the counts per kind and in all (diffusers' setup-step limits: 9 images,
3 videos, 3 audio clips, 12 in all, and never audio alone), the bytes per reference and in all, and per reference:
an image by ditcore.keyframes.probe_image (the keyframe rules: PNG or JPEG, pixels, 1:4 to 4:1); a video (MP4 or
WebM) or audio clip (WAV, FLAC, MP3, AAC) by PyAV opening the container and demuxing every packet (no decoding):
the container format, the streams, the real frame count and duration from the packets (a header can lie), the
frame size, the channel count (mono or stereo, what diffusers accepts) and sample rate, and what the decoded media
would weigh; then the first frame of each stream is decoded, so a stream whose codec cannot open, or whose first
frame is not the size its header gives, is refused here.

Decoding a probed reference, held to its probe frame by frame: ditcore.reference_decode.

Every error is a `MediaError` (ditcore.keyframes) whose message names the rule and the numbers; ditcore.request
prefixes the field and index (`references[3]: ...`).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .keyframes import DEFAULT_IMAGE_LIMITS, ImageLimits, MediaError, probe_image

KINDS = ("image", "video", "audio")
"""The reference kinds, in diffusers' terms (`MiniMaxH3Reference.kind`)."""
VIDEO_FORMATS = {"mov,mp4,m4a,3gp,3g2,mj2": "MP4", "matroska,webm": "WebM"}
"""FFmpeg demuxer name -> the video container it reads (what a video reference may be)."""
AUDIO_FORMATS = {
    "wav": "WAV",
    "flac": "FLAC",
    "mp3": "MP3",
    "aac": "AAC (ADTS)",
    "mov,mp4,m4a,3gp,3g2,mj2": "MP4 (M4A)",
}
"""FFmpeg demuxer name -> the audio container it reads (what an audio reference may be)."""
MAX_PACKETS = 200_000
"""Packets one reference's container may hold (bounds the probe's demux pass: far above any 60 s clip's)."""
MAX_SAMPLE_RATE = 384_000
AUDIO_SLACK_S = 1.0
"""Seconds of samples a decoded audio stream may hold beyond the duration its packets span: codec priming and
padding, a last packet whose duration the container leaves out."""
H3_FPS = 24
MIN_VIDEO_FRAMES = 13
"""Frames a video reference must run at 24 fps: diffusers' ref2va text encoder reads it at 2 fps and Qwen3-VL merges
the sampled frames in pairs (its temporal patch), so it needs two samples, 12 frames apart (0.54 s)."""


@dataclass(frozen=True)
class Reference:
    """One reference of a ref2va request: its bytes and, optionally, what kind to read them as ("" = by content:
    PNG or JPEG bytes are an image, a container with a video stream a video, one with audio only an audio clip;
    "audio" takes a video file's soundtrack alone)."""

    data: bytes
    kind: str = ""


@dataclass(frozen=True)
class ReferenceLimits:
    """What a request's references may be. The counts are diffusers' (MiniMaxH3Ref2VASetupStep's defaults, the
    released checkpoint's documented limits); the sizes are the operator's (flags)."""

    max_images: int = 9
    max_videos: int = 3
    max_audios: int = 3
    max_references: int = 12
    max_bytes: int = 64 * 2**20
    """Bytes of one reference."""
    max_total_bytes: int = 256 * 2**20
    """Bytes of all of a request's references together."""
    max_seconds: float = 60.0
    """Duration of one video or audio reference (diffusers keeps at most the generated duration, <= 15 s)."""
    max_frame_pixels: int = 3840 * 2160
    """Width x height of a video reference's frames."""
    max_decoded_bytes: int = 2 * 2**30
    """What one decoded video (uint8 frames) or audio clip (float32 samples) may weigh in host memory."""
    image: ImageLimits = DEFAULT_IMAGE_LIMITS
    """An image reference's limits: the keyframe rules."""

    def count_limit(self, kind: str) -> int:
        return {"image": self.max_images, "video": self.max_videos, "audio": self.max_audios}[kind]


DEFAULT_REFERENCE_LIMITS = ReferenceLimits()


@dataclass(frozen=True)
class ReferenceProbe:
    """What `probe_reference` read from one reference's bytes without decoding it."""

    kind: str
    format: str
    """"PNG", "JPEG", "MP4", "WebM", "WAV", "FLAC", "MP3", "AAC (ADTS)" or "MP4 (M4A)"."""
    width: int = 0
    height: int = 0
    frames: int = 0
    fps: float = 0.0
    seconds: float = 0.0
    sample_rate: int = 0
    channels: int = 0
    """Audio channels (of a video's soundtrack, or of an audio clip); 0 without audio."""

    @property
    def has_audio(self) -> bool:
        return self.channels > 0


def probe_references(
    refs: Sequence[Reference], limits: ReferenceLimits = DEFAULT_REFERENCE_LIMITS
) -> list[ReferenceProbe]:
    """Probe every reference (`probe_reference`), then check the request-wide rules. Raises `IndexedMediaError`
    naming the reference's index (or -1 for a rule over all of them)."""
    total = sum(len(r.data) for r in refs)
    if len(refs) > limits.max_references:
        raise IndexedMediaError(-1, f"holds {len(refs)} references; MiniMax-H3 accepts at most {limits.max_references}")
    if total > limits.max_total_bytes:
        raise IndexedMediaError(
            -1,
            f"the references hold {total:,} bytes in all; allowed at most {limits.max_total_bytes:,}",
            "max_total_bytes",
        )
    probes = []
    counts = dict.fromkeys(KINDS, 0)
    for i, ref in enumerate(refs):
        try:
            probe = probe_reference(ref, limits)
        except MediaError as e:
            raise IndexedMediaError(i, e.description, e.limit) from e
        counts[probe.kind] += 1
        if counts[probe.kind] > limits.count_limit(probe.kind):
            raise IndexedMediaError(
                i, f"is {probe.kind} reference number {counts[probe.kind]}; MiniMax-H3 accepts at most "
                f"{limits.count_limit(probe.kind)} {probe.kind} references"
            )  # fmt: skip
        probes.append(probe)
    if probes and all(p.kind == "audio" for p in probes):
        raise IndexedMediaError(
            0, "an audio reference has to be paired with at least one image or video reference (MiniMax-H3 cannot "
            "use audio references on their own)"
        )  # fmt: skip
    return probes


class IndexedMediaError(MediaError):
    """A MediaError of the reference at `index` (-1: of the references as a whole)."""

    def __init__(self, index: int, description: str, limit: str = "") -> None:
        super().__init__(description, limit)
        self.index = index

    @property
    def field(self) -> str:
        return "references" if self.index < 0 else f"references[{self.index}]"


def probe_reference(ref: Reference, limits: ReferenceLimits = DEFAULT_REFERENCE_LIMITS) -> ReferenceProbe:
    """Every check of one reference that its header and container structure decide (see the module doc)."""
    if ref.kind not in ("", *KINDS):
        raise MediaError(f"kind must be one of {', '.join(KINDS)} (or unset: by content), got {ref.kind!r}")
    if not ref.data:
        raise MediaError("is empty: a reference is the bytes of an image, video or audio file")
    if len(ref.data) > limits.max_bytes:
        raise MediaError(f"is {len(ref.data):,} bytes; allowed at most {limits.max_bytes:,}", "max_bytes")
    if ref.kind in ("", "image") and _is_image(ref.data):
        image = probe_image(ref.data, limits.image)
        return ReferenceProbe(kind="image", format=image.format, width=image.width, height=image.height)
    if ref.kind == "image":
        raise MediaError("kind image: the bytes are not a PNG or JPEG file")
    return _probe_container(ref, limits)


def _is_image(data: bytes) -> bool:
    return data.startswith((b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff"))


def decoder_options(pixels: int) -> dict[str, str]:
    """FFmpeg's `max_pixels`: a decoder refuses a picture over about twice `pixels` (room for its row alignment)
    before allocating it. The exact size is checked on each decoded frame."""
    return {"max_pixels": str(2 * pixels + 2**16)}


def open_container(data: bytes, max_pixels: int) -> Any:
    """The container, its streams read (FFmpeg's stream-info pass decodes a few frames, within `max_pixels`)."""
    import av

    try:
        return av.open(io.BytesIO(data), mode="r", options=decoder_options(max_pixels))
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise MediaError(
            "is not a readable image (PNG, JPEG), video (MP4, WebM) or audio (WAV, FLAC, MP3, AAC) file "
            f"({type(e).__name__}: {e})"
        ) from e


def _probe_container(ref: Reference, limits: ReferenceLimits) -> ReferenceProbe:
    import av

    with open_container(ref.data, limits.max_frame_pixels) as container:
        demuxer = container.format.name
        video = container.streams.video[0] if container.streams.video else None
        audio = container.streams.audio[0] if container.streams.audio else None
        kind = ref.kind or ("video" if video is not None else "audio")
        if kind == "video":
            if demuxer not in VIDEO_FORMATS:
                raise MediaError(f"is a {demuxer} file; a video reference is {' or '.join(VIDEO_FORMATS.values())}")
            if video is None:
                raise MediaError(f"kind video: the {VIDEO_FORMATS[demuxer]} file holds no video stream")
            fmt = VIDEO_FORMATS[demuxer]
        else:
            if demuxer not in AUDIO_FORMATS:
                raise MediaError(f"is a {demuxer} file; an audio reference is {', '.join(AUDIO_FORMATS.values())}")
            if audio is None:
                raise MediaError(f"the {AUDIO_FORMATS[demuxer]} file holds no audio stream")
            fmt = AUDIO_FORMATS[demuxer]
            video = None  # an audio reference reads the soundtrack alone
        try:
            spans = _demux(container, [s for s in (video, audio) if s is not None])
            if audio is not None:
                _decode_first(ref.data, audio.index, limits.max_frame_pixels)
        except av.error.FFmpegError as e:
            raise MediaError(f"the {fmt} file is damaged ({type(e).__name__}: {e})") from e
        probe = ReferenceProbe(kind=kind, format=fmt)
        if video is not None:
            probe = _video_probe(probe, video, spans[video.index], limits)
            _check_first_frame(ref.data, video.index, probe, limits)
        if audio is not None:
            probe = _audio_probe(probe, audio, spans[audio.index], limits, kind)
        return probe


def _demux(container: Any, streams: list[Any]) -> dict[int, tuple[int, float]]:
    """Per stream index: (packets holding data, seconds they span), from one demux pass (no decoding)."""
    first: dict[int, Fraction] = {}
    last: dict[int, Fraction] = {}
    counts = {s.index: 0 for s in streams}
    total = 0
    for packet in container.demux(streams):
        if packet.size == 0:
            continue  # a demuxer's flush packet
        total += 1
        if total > MAX_PACKETS:
            raise MediaError(f"holds more than {MAX_PACKETS:,} packets")
        index = packet.stream.index
        counts[index] += 1
        base = packet.time_base or packet.stream.time_base
        if packet.pts is not None and base is not None:
            start = Fraction(packet.pts) * Fraction(base)
            end = start + Fraction(packet.duration or 0) * Fraction(base)
            first[index] = min(first.get(index, start), start)
            last[index] = max(last.get(index, end), end)
    return {i: (counts[i], float(last[i] - first[i]) if i in first else 0.0) for i in counts}


def _decode_first(data: bytes, index: int, max_pixels: int) -> Any:
    """The first frame of stream `index` (the codec opens and reads it), decoded in a fresh container."""
    with open_container(data, max_pixels) as container:
        stream = container.streams[index]
        stream.codec_context.options = decoder_options(max_pixels)
        for frame in container.decode(stream):
            return frame
    kind = "video" if stream.type == "video" else "audio"
    raise MediaError(f"its {kind} stream decodes to no frame")


def _check_first_frame(data: bytes, index: int, probe: ReferenceProbe, limits: ReferenceLimits) -> None:
    """The first video frame decodes within the pixel limit, at the size the stream header gives."""
    import av

    try:
        frame = _decode_first(data, index, limits.max_frame_pixels)
    except av.error.ArgumentError as e:  # what a decoder's max_pixels refusal raises
        raise MediaError(
            f"its first video frame does not decode within {limits.max_frame_pixels:,} pixels ({e})", "max_frame_pixels"
        ) from e
    except av.error.FFmpegError as e:
        raise MediaError(f"the {probe.format} file is damaged ({type(e).__name__}: {e})") from e
    if (frame.width, frame.height) != (probe.width, probe.height):
        raise MediaError(
            f"its first video frame is {frame.width} x {frame.height}; its stream header says {probe.width} x "
            f"{probe.height}"
        )


def _video_probe(
    probe: ReferenceProbe, stream: Any, span: tuple[int, float], limits: ReferenceLimits
) -> ReferenceProbe:
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    frames, seconds = span
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    if width <= 0 or height <= 0:
        raise MediaError(f"its video stream has no frame size ({width} x {height})")
    if width * height > limits.max_frame_pixels:
        raise MediaError(
            f"its frames are {width} x {height} = {width * height:,} pixels; allowed at most "
            f"{limits.max_frame_pixels:,}", "max_frame_pixels"
        )  # fmt: skip
    if frames < 1:
        raise MediaError("its video stream holds no frame")
    if fps <= 0:
        raise MediaError("its video stream has no frame rate")
    seconds = max(seconds, frames / fps)
    at_24 = math.floor(frames * H3_FPS / fps + 0.5)  # diffusers' resample onto 24 fps keeps this many frames
    if at_24 < MIN_VIDEO_FRAMES:
        raise MediaError(
            f"runs {frames} frames at {fps:g} fps ({at_24} at MiniMax-H3's 24 fps); a video reference must run at "
            f"least {MIN_VIDEO_FRAMES} frames at 24 fps ({MIN_VIDEO_FRAMES / H3_FPS:.2f} s): MiniMax-H3 reads it at 2 "
            "fps in pairs"
        )
    if seconds > limits.max_seconds:
        raise MediaError(f"is {seconds:.2f} s long; allowed at most {limits.max_seconds:g} s", "max_seconds")
    decoded = frames * width * height * 3
    if decoded > limits.max_decoded_bytes:
        raise MediaError(
            f"decodes to {decoded:,} bytes of frames ({frames} x {width} x {height} x 3); allowed at most "
            f"{limits.max_decoded_bytes:,}", "max_decoded_bytes"
        )  # fmt: skip
    return ReferenceProbe(probe.kind, probe.format, width, height, frames, fps, seconds)


def _audio_probe(
    probe: ReferenceProbe, stream: Any, span: tuple[int, float], limits: ReferenceLimits, kind: str
) -> ReferenceProbe:
    rate = int(stream.codec_context.sample_rate or 0)
    channels = int(stream.codec_context.channels or 0)
    what = "its soundtrack" if kind == "video" else "its audio"
    if not 0 < rate <= MAX_SAMPLE_RATE:
        raise MediaError(f"{what} has sample rate {rate}; allowed 1 to {MAX_SAMPLE_RATE} Hz")
    if channels not in (1, 2):
        raise MediaError(f"{what} has {channels} channels; MiniMax-H3 takes mono or stereo")
    packets, seconds = span
    if packets < 1:
        raise MediaError(f"{what} stream holds no sample")
    if seconds > limits.max_seconds:
        raise MediaError(f"{what} is {seconds:.2f} s long; allowed at most {limits.max_seconds:g} s", "max_seconds")
    decoded = int(seconds * rate) * channels * 4
    if decoded > limits.max_decoded_bytes:
        raise MediaError(
            f"{what} decodes to {decoded:,} bytes of float32 samples; allowed at most {limits.max_decoded_bytes:,}",
            "max_decoded_bytes",
        )
    seconds = max(seconds, probe.seconds)
    return ReferenceProbe(
        probe.kind, probe.format, probe.width, probe.height, probe.frames, probe.fps, seconds, rate, channels
    )
