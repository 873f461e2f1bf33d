"""Reference media for ref2va tests, made here with PyAV and Pillow: small PNG / JPEG images, MP4 and WebM clips with
or without a soundtrack at any frame rate, and WAV / FLAC / MP3 / AAC audio at any sample rate. Deterministic for
their arguments (pixels and samples from a seeded generator)."""

from __future__ import annotations

import io
import wave
from fractions import Fraction
from typing import Any

import numpy as np


def image_bytes(width: int = 80, height: int = 48, seed: int = 0, fmt: str = "PNG") -> bytes:
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def _tone(seconds: float, rate: int, channels: int, seed: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.RandomState(seed)
    waves = [0.3 * np.sin(2 * np.pi * (220 + 110 * c) * t) + 0.05 * rng.randn(t.size) for c in range(channels)]
    return np.stack(waves).astype(np.float32)  # (channels, samples)


def wav_bytes(seconds: float = 1.0, rate: int = 32000, channels: int = 1, seed: int = 0) -> bytes:
    """16-bit PCM WAV (the stdlib's writer)."""
    samples = (np.clip(_tone(seconds, rate, channels, seed), -1, 1) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.T.tobytes())
    return out.getvalue()


def audio_bytes(fmt: str, seconds: float = 1.0, rate: int = 32000, channels: int = 1, seed: int = 0) -> bytes:
    """An audio file in `fmt`: "flac", "mp3" or "adts" (AAC), encoded with PyAV."""
    import av

    codec = {"flac": "flac", "mp3": "libmp3lame", "adts": "aac"}[fmt]
    out = io.BytesIO()
    with av.open(out, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate, layout="mono" if channels == 1 else "stereo")
        _write_audio(container, stream, _tone(seconds, rate, channels, seed), rate)
    return out.getvalue()


def _write_audio(container: object, stream: object, samples: np.ndarray, rate: int) -> None:
    import av

    layout = "mono" if samples.shape[0] == 1 else "stereo"
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="fltp", layout=layout)
    frame.sample_rate = rate
    for packet in stream.encode(frame):  # type: ignore[attr-defined]
        container.mux(packet)  # type: ignore[attr-defined]
    for packet in stream.encode(None):  # type: ignore[attr-defined]
        container.mux(packet)  # type: ignore[attr-defined]


def video_bytes(
    frames: int = 24,
    width: int = 64,
    height: int = 36,
    fps: int = 24,
    audio_rate: int | None = 32000,
    channels: int = 2,
    seed: int = 0,
    fmt: str = "mp4",
) -> bytes:
    """An MP4 (H.264 + AAC) or WebM (VP9 + Opus: 48 kHz) clip of moving noise, with a soundtrack unless `audio_rate` is None."""
    import av

    rng = np.random.RandomState(seed)
    video_codec, audio_codec = ("libx264", "aac") if fmt == "mp4" else ("libvpx-vp9", "libopus")
    out = io.BytesIO()
    with av.open(out, mode="w", format=fmt) as container:
        stream = container.add_stream(video_codec, rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        sound = None
        if audio_rate is not None:
            sound = container.add_stream(audio_codec, rate=audio_rate, layout="mono" if channels == 1 else "stereo")
        for _ in range(frames):
            pixels = (rng.rand(height, width, 3) * 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
        if sound is not None and audio_rate is not None:
            _write_audio(container, sound, _tone(frames / fps, audio_rate, channels, seed), audio_rate)
    return out.getvalue()


def spliced_video(parts: list[tuple[int, int, int]], fps: int = 24) -> bytes:
    """A WebM (VP9, flat frames) whose one video stream runs `parts`, (width, height, frames) each from its own
    encoder, one after the other: the header (PixelWidth x PixelHeight) and the first frame give the first part's
    size, a later part's keyframe changes it (VP9 allows that). A reference bomb's shape: it probes small and
    decodes large."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="webm") as container:
        stream = container.add_stream("libvpx-vp9", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = parts[0][0], parts[0][1], "yuv420p"
        start = 0
        for width, height, frames in parts:
            for packet in _vp9_packets(width, height, frames, start, fps):
                packet.stream = stream
                container.mux(packet)
            start += frames
    return out.getvalue()


def _vp9_packets(width: int, height: int, frames: int, start: int, fps: int) -> list[Any]:
    import av

    codec = av.CodecContext.create("libvpx-vp9", "w")
    codec.width, codec.height, codec.pix_fmt = width, height, "yuv420p"
    codec.time_base, codec.framerate = Fraction(1, fps), Fraction(fps)
    codec.options = {"deadline": "realtime", "cpu-used": "8", "lag-in-frames": "0"}
    packets: list[Any] = []
    for i in range(start, start + frames):
        frame = av.VideoFrame(width, height, "yuv420p")
        for plane, value in zip(frame.planes, (16 + i % 200, 128, 128), strict=True):
            plane.update(bytes([value]) * plane.buffer_size)
        frame.pts = i
        packets += codec.encode(frame)
    packets += codec.encode(None)
    for packet in packets:
        packet.time_base = Fraction(1, fps)
    return packets


def squeezed_audio(seconds: float = 4.0, rate: int = 48000, ticks: int = 64) -> bytes:
    """An M4A (AAC, mono) whose packets each claim `ticks` samples while each decodes to 1024: its packets span
    1024 / `ticks` times less time than its samples. An audio reference bomb's shape."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("aac", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(_tone(seconds, rate, 1, 0), format="fltp", layout="mono")
        frame.sample_rate = rate
        packets = list(stream.encode(frame)) + list(stream.encode(None))
        for i, packet in enumerate(packets):
            packet.pts = packet.dts = i * ticks
            packet.duration = ticks
            container.mux(packet)
    return out.getvalue()
