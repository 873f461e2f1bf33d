"""Media out: the files a generation leaves as (keyframe images in: ditcore.keyframes).

`encode(DecodedMedia, output_type, check)` -> `EncodedMedia`, written into a spooled temporary file (in memory up
to SPOOL_MAX_BYTES, then an unnamed file in tempfile's directory, TMPDIR), never held as one `bytes`: a caller reads
it back in chunks (`chunks`, for streams and files) or whole (`read_all`, for a unary response) and closes it when it
is sent; `size` and `sha256` are known when encode returns. `check` (optional) is called before each frame is
encoded and raises to stop the encode there (cancel, deadline); the partial file is freed.

- "mp4": H.264 (libx264 where PyAV has it), yuv420p, BT.709 limited range, exactly `fps` frames per second (time
  base 1/fps, frame i at pts i), plus a stereo AAC track (ffmpeg's native encoder) at the media's sampling rate;
  muxed in memory with the index (moov) first, so a player can start before the whole file arrives. Two encodes of
  the same media with the same PyAV/FFmpeg/x264 build are byte-identical (nothing time- or host-dependent is written).
- "frames_and_wav": a ZIP of `frames/000000.png`, ... (lossless, one per frame) and `audio.wav` (16-bit PCM stereo,
  interleaved, at the sampling rate; samples are round(clip(x, -1, 1) * 32767)). Entries are stored with fixed
  timestamps and attributes, so the bytes are deterministic.

`av` (PyAV) is imported inside the functions that need it, so importing ditcore stays cheap.
"""

from __future__ import annotations

import hashlib
import io
import tempfile
import threading
import wave
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import PurePath
from typing import IO, TYPE_CHECKING, Any

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import os

OUTPUT_TYPES = ("latents", "mp4", "frames_and_wav")
FPS = 24
CONTENT_TYPES = {"mp4": "video/mp4", "frames_and_wav": "application/zip"}
SUFFIXES = {"mp4": ".mp4", "frames_and_wav": ".zip"}
_PATH_TYPES = {".mp4": "mp4", ".zip": "frames_and_wav", ".safetensors": "latents"}
H264_ENCODERS = ("libx264", "libopenh264", "h264")
"""H.264 encoders tried in order; "h264" is whatever encoder the FFmpeg build registers for H.264 (maybe hardware)."""
X264_OPTIONS = {"preset": "medium", "crf": "18", "x264-params": "mbtree=0"}
"""libx264 settings: near-transparent quality at the default speed. The macroblock tree is off because x264's AVX-512
code for it reads uninitialised memory: with it on, two encodes of the same frames differ on AVX-512 CPUs (seen with
the x264 in PyAV 18.1.0's wheel; `asm` without AVX-512, or no asm, is deterministic too). It costs some bitrate."""
AAC_BITRATE = 192_000
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest time a ZIP entry can carry: fixed, so the archive is deterministic
SPOOL_MAX_BYTES = 32 * 1024 * 1024
"""An encoded file stays in memory up to this size, then moves to an unnamed temporary file (tempfile's directory:
TMPDIR, else /tmp): a released-size result (hundreds of MB) is never a `bytes` in the server's memory."""
CHUNK_BYTES = 1024 * 1024
"""EncodedMedia.chunks' default chunk (and sha256's read size)."""
Check = Callable[[], None]
"""Called between units of work (frames, tiles); raises to stop there (the executor's cancel and deadline checks)."""


@dataclass(frozen=True)
class DecodedMedia:
    """A generation's decoded output: RGB frames and stereo audio."""

    frames: np.ndarray  # (F, H, W, 3) uint8
    audio: np.ndarray  # (2, S) float32 in [-1, 1], channels first
    sampling_rate: int
    fps: int = FPS

    def check(self) -> None:
        """ValueError unless the arrays have the documented shapes and dtypes."""
        f = self.frames
        if f.ndim != 4 or f.shape[-1] != 3 or f.dtype != np.uint8 or f.shape[0] < 1 or 0 in f.shape:
            raise ValueError(f"frames must be (F, H, W, 3) uint8 with F >= 1; got {f.shape} {f.dtype}")
        a = self.audio
        if a.ndim != 2 or a.shape[0] != 2 or a.shape[1] < 1 or not np.issubdtype(a.dtype, np.floating):
            raise ValueError(f"audio must be (2, S) float with S >= 1; got {a.shape} {a.dtype}")
        if self.sampling_rate <= 0 or self.fps <= 0:
            raise ValueError(f"sampling_rate and fps must be positive; got {self.sampling_rate}, {self.fps}")


class EncodedMedia:
    """An encoded result file, held in the spooled temporary file encode wrote (memory up to SPOOL_MAX_BYTES, then
    disk), with what a response or a file needs to name it. Read it with `chunks` (sequential, a chunk at a time;
    safe from several threads) or `read_all`; `close` frees it (idempotent; also `with media:`). Whoever holds the
    result closes it once it is sent or written."""

    def __init__(self, output_type: str, file: IO[bytes], size: int, sha256: str) -> None:
        self.output_type = output_type
        self.content_type = CONTENT_TYPES[output_type]
        self.suffix = SUFFIXES[output_type]
        self.size = size
        self.sha256 = sha256
        self._file = file
        self._lock = threading.Lock()  # one seek + read at a time: chunk readers share the file's position

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("on disk" if self.on_disk else "in memory")
        return f"EncodedMedia({self.output_type}, {self.size} bytes, sha256 {self.sha256[:16]}, {state})"

    @property
    def closed(self) -> bool:
        return self._file.closed

    @property
    def on_disk(self) -> bool:
        """The spool has rolled over to its temporary file (the file is over SPOOL_MAX_BYTES)."""
        return bool(getattr(self._file, "_rolled", not isinstance(self._file, io.BytesIO)))

    def chunks(self, chunk_bytes: int = CHUNK_BYTES, start: int = 0) -> Iterator[bytes]:
        """The file's bytes from offset `start` to its end, at most `chunk_bytes` per chunk, read as they are asked
        for (never the whole file at once). ValueError for a bad argument now, or on reading a closed file."""
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be at least 1, got {chunk_bytes}")
        if not 0 <= start <= self.size:
            raise ValueError(f"start must be in [0, {self.size}], got {start}")
        return self._chunks(chunk_bytes, start)

    def _chunks(self, chunk_bytes: int, pos: int) -> Iterator[bytes]:
        while pos < self.size:
            chunk = self._read(pos, min(chunk_bytes, self.size - pos))
            pos += len(chunk)
            yield chunk

    def read_all(self) -> bytes:
        """The whole file as one `bytes` (a unary response, a small result): the one full copy."""
        return self._read(0, self.size)

    def _read(self, pos: int, count: int) -> bytes:
        with self._lock:
            if self._file.closed:
                raise ValueError(f"{self!r} is closed")
            self._file.seek(pos)
            data = self._file.read(count)
        if len(data) != count:  # the file is written once, before this object exists: an invariant
            raise RuntimeError(f"{self!r}: read {len(data)} bytes at {pos}, expected {count}")
        return data

    def close(self) -> None:
        """Free the file (its memory, or its unnamed temporary file's disk space). Idempotent."""
        with self._lock:
            self._file.close()

    def __enter__(self) -> EncodedMedia:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def encode(
    media: DecodedMedia, output_type: str, check: Check | None = None, *, spool_max_bytes: int = SPOOL_MAX_BYTES
) -> EncodedMedia:
    """Encode `media` as "mp4" or "frames_and_wav" (the module docstring says what each holds) into a spooled file
    (memory up to `spool_max_bytes`, then disk). `check` is called before each frame; what it raises stops the encode
    and propagates, the partial file freed."""
    media.check()
    writers = {"mp4": _encode_mp4, "frames_and_wav": _encode_zip}
    if output_type not in writers:
        raise ValueError(f"cannot encode media as {output_type!r}; media output types: {sorted(CONTENT_TYPES)}")
    out = tempfile.SpooledTemporaryFile(max_size=spool_max_bytes, mode="w+b")  # noqa: SIM115 (EncodedMedia owns it)
    try:
        writers[output_type](media, out, check or _no_check)
        size, digest = _size_and_sha256(out)
    except BaseException:
        out.close()
        raise
    return EncodedMedia(output_type, out, size, digest)


def _no_check() -> None:
    pass


def _size_and_sha256(file: IO[bytes]) -> tuple[int, str]:
    """One sequential pass over the finished file (the muxer seeks back and rewrites, so not while writing)."""
    file.seek(0)
    digest, size = hashlib.sha256(), 0
    while chunk := file.read(CHUNK_BYTES):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def output_type_for_path(path: str | os.PathLike[str]) -> str | None:
    """The output type a file name asks for by its suffix (".mp4", ".zip", ".safetensors"); None for others."""
    return _PATH_TYPES.get(PurePath(path).suffix.lower())


def _pcm16(audio: np.ndarray) -> np.ndarray:
    """(2, S) float -> (2, S) int16: round(clip(x, -1, 1) * 32767); NaN becomes 0."""
    clipped = np.clip(np.nan_to_num(audio.astype(np.float64), nan=0.0), -1.0, 1.0)
    return np.round(clipped * 32767).astype(np.int16)


def _encode_zip(media: DecodedMedia, out: IO[bytes], check: Check) -> None:
    with zipfile.ZipFile(out, mode="w", compression=zipfile.ZIP_STORED) as archive:
        for index, frame in enumerate(media.frames):
            check()
            png = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(frame)).save(png, format="PNG")
            archive.writestr(_zip_entry(f"frames/{index:06d}.png"), png.getvalue())
        wav = io.BytesIO()
        with wave.open(wav, "wb") as writer:
            writer.setnchannels(2)
            writer.setsampwidth(2)
            writer.setframerate(media.sampling_rate)
            writer.writeframes(np.ascontiguousarray(_pcm16(media.audio).T).astype("<i2").tobytes())
        archive.writestr(_zip_entry("audio.wav"), wav.getvalue())


def _zip_entry(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
    info.compress_type = zipfile.ZIP_STORED
    info.create_system = 3  # Unix, whatever the host, so the bytes do not depend on it
    info.external_attr = 0o100644 << 16  # a regular file, rw-r--r--
    return info


def h264_encoder() -> str:
    """The H.264 encoder PyAV will use (libx264 preferred); RuntimeError when the FFmpeg build has none."""
    import av

    for name in H264_ENCODERS:
        try:
            codec = av.codec.Codec(name, "w")
        except Exception:  # av raises its own lookup errors (UnknownCodecError, ValueError by version)
            continue
        if codec.type == "video" and codec.name != "libx264rgb":
            return str(codec.name)
    raise RuntimeError(f"this PyAV/FFmpeg build has no H.264 encoder (tried {', '.join(H264_ENCODERS)})")


class _Reader(io.RawIOBase):
    """A second, read-only cursor on the file being muxed: the mp4 muxer reads its own output back to move the index
    (moov) to the front ("+faststart"); with a path it reopens the file, with a file object it gets this. Each read
    puts the writer's position back, so the muxer's own cursor (it tracks it, it does not ask) stays valid; the muxer
    is single-threaded, so nothing writes between the two seeks."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__()
        self._file = file
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        writer_at = self._file.tell()
        try:
            self._file.seek(self._pos)
            chunk = self._file.read(len(target))
        finally:
            self._file.seek(writer_at)
        count = len(chunk)
        target[:count] = chunk
        self._pos += count
        return count

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self._pos = offset
        elif whence == io.SEEK_CUR:
            self._pos += offset
        else:
            writer_at = self._file.tell()
            self._pos = self._file.seek(0, io.SEEK_END) + offset
            self._file.seek(writer_at)
        return self._pos

    def tell(self) -> int:
        return self._pos


def _encode_mp4(media: DecodedMedia, out: IO[bytes], check: Check) -> None:
    import av
    from av.video.reformatter import ColorRange, Colorspace

    frames, audio, rate = media.frames, media.audio, media.sampling_rate
    _, height, width, _ = frames.shape
    if width % 2 or height % 2:
        raise ValueError(f"mp4 (H.264 yuv420p) needs an even width and height; got {width}x{height}")
    encoder = h264_encoder()

    def io_open(url: str, flags: int, options: dict[str, str]) -> _Reader:
        return _Reader(out)

    container = av.open(out, mode="w", format="mp4", container_options={"movflags": "+faststart"}, io_open=io_open)
    with container:
        video = container.add_stream(encoder, rate=media.fps, options=X264_OPTIONS if encoder == "libx264" else {})
        assert isinstance(video, av.VideoStream)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        video.codec_context.time_base = Fraction(1, media.fps)
        context = video.codec_context
        context.colorspace, context.color_primaries, context.color_trc = 1, 1, 1  # BT.709
        context.color_range = int(ColorRange.MPEG)
        sound = container.add_stream("aac", rate=rate)
        sound.layout, sound.format, sound.bit_rate = "stereo", "fltp", AAC_BITRATE
        samples = np.clip(np.nan_to_num(audio.astype(np.float32), nan=0.0), -1.0, 1.0)
        step = sound.codec_context.frame_size or 1024
        fed = 0  # audio samples sent to the encoder

        def feed_audio(until: int) -> None:  # whole encoder frames up to `until` samples (the rest at the end)
            nonlocal fed
            while fed < samples.shape[1] and (fed + step <= until or until >= samples.shape[1]):
                chunk = av.AudioFrame.from_ndarray(
                    np.ascontiguousarray(samples[:, fed : fed + step]), format="fltp", layout="stereo"
                )
                chunk.sample_rate, chunk.pts, chunk.time_base = rate, fed, Fraction(1, rate)
                container.mux(sound.encode(chunk))
                fed += chunk.samples

        for index, pixels in enumerate(frames):  # audio fed alongside the video, so the muxer interleaves evenly
            check()
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
            frame = frame.reformat(format="yuv420p", dst_colorspace=Colorspace.ITU709, dst_color_range=ColorRange.MPEG)
            frame.pts, frame.time_base = index, Fraction(1, media.fps)
            container.mux(video.encode(frame))
            feed_audio((index + 1) * rate // media.fps)
        container.mux(video.encode(None))
        feed_audio(samples.shape[1])
        container.mux(sound.encode(None))
