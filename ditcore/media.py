"""Media in and out: keyframe images a request brings (fl2va), and the files a generation leaves as.

In: `decode_image(data, limits)` turns a keyframe's bytes into an RGB `PIL.Image.Image` or raises `MediaError` whose
message names the rule and the numbers (the caller prefixes the request field). Only PNG and JPEG are read, sniffed
from the bytes, never trusted from a name. The checks run cheapest first and before any pixel is decoded: the byte
count, the format, the width and height from the header (the decompression-bomb guard: a 100 kB PNG can claim
60000 x 60000), then the file's structure to its end (a PNG's chunks and their CRCs through IEND, a JPEG's segments
through EOI), so a truncated file is refused by this module itself, whatever `PIL.ImageFile.LOAD_TRUNCATED_IMAGES`
says. Then the pixels are decoded and turned into what a diffusers user passes as `image`: diffusers'
`load_image` on the opened file (EXIF orientation applied, then Pillow's `convert("RGB")`, which drops any
transparency and clips 16-bit grey as Pillow does), so a keyframe conditions the model exactly as it would in
diffusers; the aspect ratio is checked on that upright image.

Out: `encode(DecodedMedia, output_type)` -> `EncodedMedia`:

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
import struct
import wave
import zipfile
import zlib
from dataclasses import dataclass
from fractions import Fraction
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

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

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_JPEG_SOI = b"\xff\xd8\xff"
# JPEG start-of-frame markers (they carry the size): C0..CF except DHT (C4), JPG (C8), DAC (CC)
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}  # RSTn, TEM: no length field


class MediaError(ValueError):
    """Input media (a keyframe image) breaks a rule. `description` names the rule and the numbers; `limit` is the
    ImageLimits field it is over ("max_bytes", "max_pixels"), "" for any other rule."""

    def __init__(self, description: str, limit: str = "") -> None:
        super().__init__(description)
        self.description = description
        self.limit = limit


@dataclass(frozen=True)
class ImageLimits:
    """What a keyframe may be: its size in bytes and pixels, and its aspect ratio (width / height)."""

    max_bytes: int = 20 * 2**20
    max_pixels: int = 4096 * 4096
    min_aspect: float = 1 / 4
    max_aspect: float = 4.0


DEFAULT_IMAGE_LIMITS = ImageLimits()

# ---------------------------------------------------------------------------------------------------------------- in


def decode_image(data: bytes, limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> Image.Image:
    """Decode PNG or JPEG `data` into a fully loaded 8-bit RGB image, upright; MediaError for anything else."""
    if not data:
        raise MediaError("is empty")
    if len(data) > limits.max_bytes:
        raise MediaError(f"is {len(data)} bytes, over the limit of {limits.max_bytes} bytes", "max_bytes")
    from diffusers.utils import load_image

    data = bytes(data)
    try:
        image = Image.open(io.BytesIO(data), formats=["PNG", "JPEG"])
    except Image.DecompressionBombError as e:  # Pillow's own guard fired first: say it with our numbers
        raise _bomb_error(data, limits, str(e)) from None
    except (OSError, SyntaxError, ValueError, struct.error, IndexError) as e:  # UnidentifiedImageError is an OSError
        raise MediaError(_unreadable_message(data, e)) from None
    with image:
        width, height = image.size
        kind = str(image.format)
        if width <= 0 or height <= 0:
            raise MediaError(f"has a zero width or height ({width}x{height})")
        pixels = width * height
        if pixels > limits.max_pixels:
            raise _pixels_error(width, height, limits.max_pixels)
        _check_complete(data, kind)  # truncation is ours to refuse, not LOAD_TRUNCATED_IMAGES's
        try:
            image.load()
            upright = load_image(image)  # diffusers' own: exif_transpose, then convert("RGB")
        except Image.DecompressionBombError as e:
            raise _bomb_error(data, limits, str(e)) from None
        except (OSError, SyntaxError, ValueError, struct.error, IndexError) as e:
            raise MediaError(f"could not be decoded as {kind} ({e})") from None
    width, height = upright.size
    aspect = width / height
    if not limits.min_aspect <= aspect <= limits.max_aspect:
        raise MediaError(
            f"has aspect ratio {aspect:.4g} (width/height of {width}x{height}), "
            f"outside [{limits.min_aspect:.4g}, {limits.max_aspect:.4g}]"
        )
    return upright


def _unreadable_message(data: bytes, error: Exception) -> str:
    """Why Pillow could not open `data`: our own walk names truncation, corruption or a zero size where it can."""
    kind = "PNG" if data.startswith(_PNG_SIGNATURE) else "JPEG" if data.startswith(_JPEG_SOI) else ""
    if not kind:
        return f"is not a PNG or JPEG image (starts with {data[:8].hex()})"
    width, height = _check_complete(data, kind)  # raises for a truncated or corrupt file
    if width <= 0 or height <= 0:
        return f"has a zero width or height ({width}x{height})"
    return f"is not a readable {kind} image ({error})"


def _pixels_error(width: int, height: int, limit: int) -> MediaError:
    return MediaError(
        f"is {width}x{height} = {width * height} pixels, over the limit of {limit} (decompression-bomb guard)",
        "max_pixels",
    )


def _bomb_error(data: bytes, limits: ImageLimits, pil_message: str) -> MediaError:
    """Pillow's own decompression-bomb refusal, said with our numbers where the header gives them."""
    try:
        width, height = _check_complete(data, "PNG" if data.startswith(_PNG_SIGNATURE) else "JPEG")
    except MediaError:
        return MediaError(f"is too large to decode ({pil_message}) (decompression-bomb guard)")
    if width * height > limits.max_pixels:
        return _pixels_error(width, height, limits.max_pixels)
    return MediaError(f"is {width}x{height} = {width * height} pixels, over Pillow's limit ({pil_message})")


def _check_complete(data: bytes, kind: str) -> tuple[int, int]:
    """Walk the file's structure to its end marker without decoding pixels; return (width, height) from it."""
    if kind == "PNG":
        return _png_walk(data)
    if kind in ("JPEG", "MPO"):
        return _jpeg_walk(data)
    raise MediaError(f"is {kind}, not PNG or JPEG")


def _png_walk(data: bytes) -> tuple[int, int]:
    view = memoryview(data)
    if not data.startswith(_PNG_SIGNATURE):
        raise MediaError("is not a PNG image (bad signature)")
    pos, size = len(_PNG_SIGNATURE), (0, 0)
    while True:
        if pos + 12 > len(data):
            raise MediaError(f"is truncated: the PNG ends at byte {len(data)} before its IEND chunk")
        (length,) = struct.unpack_from(">I", data, pos)
        kind = bytes(view[pos + 4 : pos + 8])
        end = pos + 12 + length
        if end > len(data):
            name = kind.decode("latin-1")
            raise MediaError(
                f"is truncated: the PNG's {name} chunk at byte {pos} needs {end} bytes, the file has {len(data)}"
            )
        (crc,) = struct.unpack_from(">I", data, pos + 8 + length)
        if zlib.crc32(view[pos + 4 : pos + 8 + length]) != crc:
            raise MediaError(f"is corrupt: CRC mismatch in the PNG's {kind.decode('latin-1')} chunk at byte {pos}")
        if pos == len(_PNG_SIGNATURE):
            if kind != b"IHDR" or length < 8:
                raise MediaError("is not a well-formed PNG (its first chunk is not IHDR)")
            size = struct.unpack_from(">II", data, pos + 8)
        if kind == b"IEND":
            return size
        pos = end


def _jpeg_walk(data: bytes) -> tuple[int, int]:
    n = len(data)
    if not data.startswith(_JPEG_SOI):
        raise MediaError("is not a JPEG image (no start-of-image marker)")
    truncated = MediaError(f"is truncated: the JPEG ends at byte {n} before its end-of-image marker")
    pos, size = 2, (0, 0)
    while True:
        pos = data.find(b"\xff", pos)  # bytes between segments are skipped, as libjpeg does
        while 0 <= pos < n - 1 and data[pos + 1] == 0xFF:  # fill bytes
            pos += 1
        if pos < 0 or pos + 1 >= n:
            raise truncated
        marker = data[pos + 1]
        if marker == 0xD9:  # EOI
            return size
        if marker in _JPEG_STANDALONE or marker == 0x00:
            pos += 2
            continue
        if pos + 4 > n:
            raise truncated
        (length,) = struct.unpack_from(">H", data, pos + 2)
        end = pos + 2 + length
        if length < 2 or end > n:
            raise truncated
        if marker in _JPEG_SOF and length >= 7:
            height, width = struct.unpack_from(">HH", data, pos + 5)
            size = (width, height)
        pos = end
        if marker == 0xDA:  # start of scan: skip its entropy-coded data to the next real marker
            while True:
                pos = data.find(b"\xff", pos)
                if pos < 0 or pos + 1 >= n:
                    raise truncated
                following = data[pos + 1]
                if following == 0x00 or 0xD0 <= following <= 0xD7:  # stuffed byte or restart marker
                    pos += 2
                elif following == 0xFF:  # fill byte before a marker
                    pos += 1
                else:
                    break


# --------------------------------------------------------------------------------------------------------------- out


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


@dataclass(frozen=True)
class EncodedMedia:
    """Encoded output bytes, with what a response or a file needs to name them."""

    output_type: str
    content_type: str
    data: bytes
    sha256: str
    suffix: str

    @property
    def size(self) -> int:
        return len(self.data)


def encode(media: DecodedMedia, output_type: str) -> EncodedMedia:
    """Encode `media` as "mp4" or "frames_and_wav" (the module docstring says what each holds)."""
    media.check()
    if output_type == "mp4":
        data = _encode_mp4(media)
    elif output_type == "frames_and_wav":
        data = _encode_zip(media)
    else:
        raise ValueError(f"cannot encode media as {output_type!r}; media output types: {sorted(CONTENT_TYPES)}")
    return EncodedMedia(
        output_type=output_type,
        content_type=CONTENT_TYPES[output_type],
        data=data,
        sha256=hashlib.sha256(data).hexdigest(),
        suffix=SUFFIXES[output_type],
    )


def output_type_for_path(path: str | os.PathLike[str]) -> str | None:
    """The output type a file name asks for by its suffix (".mp4", ".zip", ".safetensors"); None for others."""
    return _PATH_TYPES.get(PurePath(path).suffix.lower())


def _pcm16(audio: np.ndarray) -> np.ndarray:
    """(2, S) float -> (2, S) int16: round(clip(x, -1, 1) * 32767); NaN becomes 0."""
    clipped = np.clip(np.nan_to_num(audio.astype(np.float64), nan=0.0), -1.0, 1.0)
    return np.round(clipped * 32767).astype(np.int16)


def _encode_zip(media: DecodedMedia) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, mode="w", compression=zipfile.ZIP_STORED) as archive:
        for index, frame in enumerate(media.frames):
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
    return out.getvalue()


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
    """A second, read-only cursor on the BytesIO being muxed: the mp4 muxer reads its own output back to move the
    index (moov) to the front ("+faststart"); with a file it reopens the path, in memory it gets this."""

    def __init__(self, buffer: io.BytesIO) -> None:
        super().__init__()
        self._buffer = buffer
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        with self._buffer.getbuffer() as view:
            chunk = view[self._pos : self._pos + len(target)]
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
            self._pos = len(self._buffer.getbuffer()) + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def _encode_mp4(media: DecodedMedia) -> bytes:
    import av
    from av.video.reformatter import ColorRange, Colorspace

    frames, audio, rate = media.frames, media.audio, media.sampling_rate
    _, height, width, _ = frames.shape
    if width % 2 or height % 2:
        raise ValueError(f"mp4 (H.264 yuv420p) needs an even width and height; got {width}x{height}")
    encoder = h264_encoder()
    buffer = io.BytesIO()

    def io_open(url: str, flags: int, options: dict[str, str]) -> _Reader:
        return _Reader(buffer)

    container = av.open(buffer, mode="w", format="mp4", container_options={"movflags": "+faststart"}, io_open=io_open)
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
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
            frame = frame.reformat(format="yuv420p", dst_colorspace=Colorspace.ITU709, dst_color_range=ColorRange.MPEG)
            frame.pts, frame.time_base = index, Fraction(1, media.fps)
            container.mux(video.encode(frame))
            feed_audio((index + 1) * rate // media.fps)
        container.mux(video.encode(None))
        feed_audio(samples.shape[1])
        container.mux(sound.encode(None))
    return buffer.getvalue()
