"""Media in and out: keyframe images a request brings (fl2va), and the files a generation leaves as.

In: `probe_image(data, limits)` makes every check that the bytes' header and structure decide, without decoding a
pixel (admission runs it); `decode_image(data, limits)` makes them again, then decodes the keyframe into an RGB
`PIL.Image.Image`. Both raise `MediaError` whose message names the rule and the numbers (the caller prefixes the
request field). Only PNG and JPEG are read, sniffed from the bytes, never trusted from a name. The probe runs cheapest
first: the byte count, the format, the file's structure to its end (a PNG's chunks and their CRCs through IEND, a
JPEG's segments through EOI), so a truncated file is refused by this module itself, whatever
`PIL.ImageFile.LOAD_TRUNCATED_IMAGES` says, and within caps that bound what the walk and Pillow's header parse (Python,
a chunk, segment or padding byte at a time) can cost: a PNG's chunks and the bytes its compressed metadata inflates
to, a JPEG's segments, padding and 0xFF bytes (`_PNG_MAX_*`, `_JPEG_MAX_*`: far above any real file's); then
Pillow's header parse, for the width and height (the decompression-bomb guard: a 100 kB PNG can claim 60000 x 60000);
then what the structure shows of the image data: a PNG needs IDAT chunks
of at least 1/1032 of its rows' bytes (deflate's best ratio), a JPEG a scan coding each component and, when
Huffman-coded, at least one bit per 8 x 8 block in each DC or sequential scan (libjpeg fills missing data with grey
and only warns, which Pillow does not report; arithmetic coding has no such bound). Last, Pillow decodes the file's
skeleton: every header, table and metadata chunk or segment as it is, around a 2 x 1 image (a PNG's IHDR resized and
its IDAT replaced, a JPEG's frame header resized and its scans' data left out), so a header Pillow or libjpeg would
refuse is refused here, and the EXIF orientation (whether it swaps the sides) is Pillow's own; the aspect ratio is
checked on the upright size. The probe's cost is the walk over the bytes plus a constant, whatever the pixel count.
The decode then turns the pixels into what a diffusers user passes as `image`: diffusers' `load_image` on the opened
file (EXIF orientation applied, then Pillow's `convert("RGB")`, which drops any transparency and clips 16-bit grey as
Pillow does), so a keyframe conditions the model exactly as it would in diffusers. Only faults of the pixel data
itself are left to the decode: a PNG whose zlib stream is corrupt or inflates to fewer rows than its header says
(Pillow would leave the missing rows black and say nothing).

Out: `encode(DecodedMedia, output_type, check)` -> `EncodedMedia`, written into a spooled temporary file (in memory up
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
import re
import struct
import tempfile
import threading
import wave
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import PurePath
from typing import IO, TYPE_CHECKING, Any, NamedTuple

import numpy as np
from PIL import Image, UnidentifiedImageError

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


class ImageProbe(NamedTuple):
    """What `probe_image` reads from a keyframe's bytes without decoding its pixels."""

    format: str
    """"PNG" or "JPEG" (an MPO file, a JPEG with more images appended, counts as a JPEG: its first image is read)."""
    width: int
    """Upright width (the EXIF orientation applied), as `decode_image` returns the image."""
    height: int
    """Upright height."""


def probe_image(data: bytes, limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> ImageProbe:
    """Every check of `decode_image` that the bytes' header and structure decide, without decoding their pixels;
    MediaError (naming the rule and the numbers) for anything refused. Admission runs this; the decode comes later.

    The cost is one walk over the bytes (a PNG's CRCs, a JPEG's segments) plus a constant: Pillow decodes the file's
    2 x 1 "skeleton" (its headers, tables and metadata around 2 x 1 pixels, the module docstring says how), so what
    Pillow or libjpeg refuses in a header, and the EXIF orientation `decode_image` applies, are found exactly as the
    full decode finds them. What only the pixel data can show is left to `decode_image`."""
    probe, _ = _probe(data, limits)
    return probe


def decode_image(data: bytes, limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> Image.Image:
    """Decode PNG or JPEG `data` into a fully loaded 8-bit RGB image, upright; MediaError for anything else: first
    everything `probe_image` refuses, then what only the pixel data shows (a PNG whose image data is corrupt or
    inflates to fewer rows than its header says)."""
    probe, walk = _probe(data, limits)
    data = bytes(data)
    if walk.raw_bytes:
        _check_png_rows(data, walk)
    upright = _load(data, probe.format, limits)
    if upright.size != (probe.width, probe.height):  # the skeleton and the file agree on the orientation
        raise MediaError(
            f"decoded as {upright.width}x{upright.height}, not the {probe.width}x{probe.height} of its header"
        )
    return upright


def _probe(data: bytes, limits: ImageLimits) -> tuple[ImageProbe, _Walk]:
    if not data:
        raise MediaError("is empty")
    if len(data) > limits.max_bytes:
        raise MediaError(f"is {len(data)} bytes, over the limit of {limits.max_bytes} bytes", "max_bytes")
    data = bytes(data)
    kind = "PNG" if data.startswith(_PNG_SIGNATURE) else "JPEG" if data.startswith(_JPEG_SOI) else ""
    # First our own walk, whose cost is bounded (_PNG_MAX_CHUNKS, _JPEG_MAX_SEGMENTS, _JPEG_MAX_PADDING), then
    # Pillow's header parse, which is Python per chunk, segment and padding byte. Truncation is ours to refuse, not
    # LOAD_TRUNCATED_IMAGES's.
    walk = _check_complete(data, kind) if kind else None
    try:
        image = Image.open(io.BytesIO(data), formats=["PNG", "JPEG"])  # the header only: no pixel is decoded
    except Image.DecompressionBombError as e:  # Pillow's own guard fired first: say it with our numbers
        raise _bomb_error(data, limits, str(e)) from None
    except (OSError, SyntaxError, ValueError, struct.error, IndexError) as e:  # UnidentifiedImageError is an OSError
        raise MediaError(_unreadable_message(data, walk, e)) from None
    with image:
        width, height = image.size
    if walk is None:  # not reached: Pillow opens only PNG and JPEG here, which the signatures above name
        raise MediaError(f"is not a PNG or JPEG image (starts with {data[:8].hex()})")
    if width <= 0 or height <= 0:
        raise MediaError(f"has a zero width or height ({width}x{height})")
    if width * height > limits.max_pixels:
        raise _pixels_error(width, height, limits.max_pixels)
    if walk.data_error:
        raise MediaError(walk.data_error)
    skeleton = _load(walk.skeleton, kind, limits)
    if skeleton.width < skeleton.height:  # the 2 x 1 skeleton came out 1 x 2: the orientation swaps the sides
        width, height = height, width
    aspect = width / height
    if not limits.min_aspect <= aspect <= limits.max_aspect:
        raise MediaError(
            f"has aspect ratio {aspect:.4g} (width/height of {width}x{height}), "
            f"outside [{limits.min_aspect:.4g}, {limits.max_aspect:.4g}]"
        )
    return ImageProbe(kind, width, height), walk


def _load(data: bytes, kind: str, limits: ImageLimits) -> Image.Image:
    """Pillow's decode, then diffusers' own `load_image` (exif_transpose, then convert("RGB")); MediaError on failure."""
    from diffusers.utils import load_image

    try:
        with Image.open(io.BytesIO(data), formats=["PNG", "JPEG"]) as image:
            image.load()
            upright: Image.Image = load_image(image)
    except Image.DecompressionBombError as e:
        raise _bomb_error(data, limits, str(e)) from None
    except (OSError, SyntaxError, ValueError, struct.error, IndexError) as e:
        raise MediaError(f"could not be decoded as {kind} ({e})") from None
    return upright


def _unreadable_message(data: bytes, walk: _Walk | None, error: Exception) -> str:
    """Why Pillow could not open `data`, which our own walk found complete (None: neither PNG nor JPEG)."""
    if walk is None:
        return f"is not a PNG or JPEG image (starts with {data[:8].hex()})"
    kind = "PNG" if data.startswith(_PNG_SIGNATURE) else "JPEG"
    if walk.width <= 0 or walk.height <= 0:
        return f"has a zero width or height ({walk.width}x{walk.height})"
    if isinstance(error, UnidentifiedImageError):  # its message names the BytesIO object, not the file
        return f"is not a readable {kind} image (Pillow cannot identify it: a header it does not support)"
    return f"is not a readable {kind} image ({error})"


def _pixels_error(width: int, height: int, limit: int) -> MediaError:
    return MediaError(
        f"is {width}x{height} = {width * height} pixels, over the limit of {limit} (decompression-bomb guard)",
        "max_pixels",
    )


def _bomb_error(data: bytes, limits: ImageLimits, pil_message: str) -> MediaError:
    """Pillow's own decompression-bomb refusal, said with our numbers where the header gives them."""
    try:
        walk = _check_complete(data, "PNG" if data.startswith(_PNG_SIGNATURE) else "JPEG")
    except MediaError:
        return MediaError(f"is too large to decode ({pil_message}) (decompression-bomb guard)")
    width, height = walk.width, walk.height
    if width * height > limits.max_pixels:
        return _pixels_error(width, height, limits.max_pixels)
    return MediaError(f"is {width}x{height} = {width * height} pixels, over Pillow's limit ({pil_message})")


@dataclass(frozen=True)
class _Walk:
    """What the structure walk found without decoding pixels: the size its header gives, the file's skeleton (its
    headers, tables and metadata around 2 x 1 pixels, for Pillow to decode), the first problem of its image data
    that the structure shows ("" if none), and for a PNG its IDAT chunks' spans and the bytes of rows they must
    inflate to (0: not checked)."""

    width: int
    height: int
    skeleton: bytes
    data_error: str = ""
    idat: tuple[tuple[int, int], ...] = ()
    raw_bytes: int = 0


def _check_complete(data: bytes, kind: str) -> _Walk:
    """Walk the file's structure to its end marker without decoding pixels (MediaError for a truncated or corrupt
    one)."""
    if kind == "PNG":
        return _png_walk(data)
    if kind in ("JPEG", "MPO"):
        return _jpeg_walk(data)
    raise MediaError(f"is {kind}, not PNG or JPEG")


_PNG_MAX_CHUNKS = 32768
"""Most chunks a PNG may have (an encoder writes an IDAT per 8 to 64 KiB: a few thousand at most), and most
ancillary (not IDAT) ones, libpng's own default cap on the chunks it keeps: each costs Python time in the walk and in
Pillow, so a file of millions of tiny chunks is refused before it costs seconds."""
_PNG_MAX_ANCILLARY = 1000
_PNG_MAX_INFLATED = 8 * 2**20
"""Most bytes a PNG's compressed metadata (iCCP, zTXt, compressed iTXt) may inflate to, in all: Pillow inflates each
such chunk when it reads the header (up to 1 MB each, an ICC profile whatever its count), so 1000 of them in a 1 MB
file would cost seconds. A real ICC profile is under 1 MB, text far less."""
_PNG_COMPRESSED = frozenset({b"iCCP", b"zTXt", b"iTXt"})
_JPEG_MAX_SEGMENTS = 8192
"""Most marker segments a JPEG may have (a real one has tens; 255 ICC pieces and a large XMP stay far under it)."""
_JPEG_MAX_PADDING = 65536
"""Most fill (0xFF) or stray bytes a JPEG may have between its segments, in all: legal, never written by encoders,
and parsed by Pillow a byte at a time in Python."""
_JPEG_MAX_FF_IN_SCANS = 2**20
"""Most 0xFF bytes a JPEG may hold from its first scan on (its entropy-coded data, where each costs the walk's regex
about 10 ns): random-looking coded data has one in 256 bytes, some 80 thousand in a 20 MiB file."""
_SKELETON_WIDTH, _SKELETON_HEIGHT = 2, 1  # wider than high: an orientation that swaps the sides shows as 1 x 2
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by colour type: grey, RGB, palette, grey + alpha, RGBA
_PNG_ANIMATION = (b"acTL", b"fcTL", b"fdAT")  # APNG's chunks: the skeleton is a still image
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
"""The interlaced passes' (x0, y0, dx, dy)."""
DEFLATE_MAX_RATIO = 1032
"""Deflate's best compression: a 258-byte match coded in 2 bits (1-bit length and distance codes)."""


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_raw_bytes(width: int, height: int, depth: int, colour: int, interlaced: bool) -> int:
    """The bytes of filtered rows a PNG's IDAT stream inflates to (0 for a colour type that has none)."""
    bits = _PNG_CHANNELS.get(colour, 0) * depth

    def rows(w: int, h: int) -> int:
        return h * (1 + (w * bits + 7) // 8) if w > 0 and h > 0 else 0

    if not interlaced:
        return rows(width, height)
    return sum(rows((width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy) for x0, y0, dx, dy in _ADAM7)


def _png_walk(data: bytes) -> _Walk:
    view = memoryview(data)
    if not data.startswith(_PNG_SIGNATURE):
        raise MediaError("is not a PNG image (bad signature)")
    pos, header, ancillary, inflated = len(_PNG_SIGNATURE), b"", 0, 0
    chunks: list[tuple[bytes, int, int]] = []  # (type, start, end) of every chunk before IEND
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
            if kind != b"IHDR" or length < 13:
                raise MediaError("is not a well-formed PNG (its first chunk is not IHDR)")
            header = data[pos + 8 : pos + 21]
        if kind == b"IEND":
            return _png_result(data, header, chunks)
        chunks.append((kind, pos, end))
        ancillary += kind != b"IDAT"
        if kind in _PNG_COMPRESSED:
            inflated += _png_inflated_metadata(data, kind, pos + 8, end - 4, _PNG_MAX_INFLATED - inflated)
            if inflated > _PNG_MAX_INFLATED:
                raise MediaError(
                    f"has compressed text or ICC chunks that inflate to more than {_PNG_MAX_INFLATED} bytes (the "
                    "limit on a PNG's metadata)"
                )
        if len(chunks) > _PNG_MAX_CHUNKS or ancillary > _PNG_MAX_ANCILLARY:
            which = f"{_PNG_MAX_CHUNKS} chunks" if len(chunks) > _PNG_MAX_CHUNKS else f"{_PNG_MAX_ANCILLARY} but IDAT"
            raise MediaError(f"has more than {which} (the limit on a PNG's chunks)")
        pos = end


def _png_result(data: bytes, header: bytes, chunks: list[tuple[bytes, int, int]]) -> _Walk:
    """The walked PNG's skeleton and its image-data checks."""
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(">IIBBBBB", header)
    idat = tuple((start + 8, end - 4) for kind, start, end in chunks if kind == b"IDAT")
    animated = any(kind in _PNG_ANIMATION for kind, _, _ in chunks)  # frame 0 may be another size than IHDR's
    raw = 0 if animated else _png_raw_bytes(width, height, depth, colour, bool(interlace))
    stored = sum(end - start for start, end in idat)
    error = ""
    if not idat:
        error = "has no image data (the PNG has no IDAT chunk)"
    elif raw and stored < raw // DEFLATE_MAX_RATIO:
        error = (
            f"has too little image data: the PNG's IDAT chunks hold {stored} bytes, but {width}x{height} pixels are "
            f"{raw} bytes of rows, which need at least {raw // DEFLATE_MAX_RATIO} (deflate compresses at most "
            f"{DEFLATE_MAX_RATIO}:1); the file was cut short or its data removed"
        )
    row = b"\0" + b"\0" * ((_SKELETON_WIDTH * _PNG_CHANNELS.get(colour, 4) * depth + 7) // 8)
    ihdr = struct.pack(">IIBBBBB", _SKELETON_WIDTH, _SKELETON_HEIGHT, depth, colour, compression, filtering, 0)
    skeleton = [_PNG_SIGNATURE, _png_chunk(b"IHDR", ihdr)]
    for kind, start, end in chunks[1:]:  # every other chunk as it is, in its place: Pillow reads them all
        if kind == b"IDAT":
            if start + 8 == idat[0][0]:
                skeleton.append(_png_chunk(b"IDAT", zlib.compress(row * _SKELETON_HEIGHT)))
        elif kind not in _PNG_ANIMATION:
            skeleton.append(data[start:end])
    skeleton.append(_png_chunk(b"IEND", b""))
    return _Walk(width, height, b"".join(skeleton), error, idat, raw)


INFLATE_PIECE = 64 * 1024
"""`_inflated` feeds zlib this many bytes at a time, and takes at most INFLATE_OUT out per call."""
INFLATE_OUT = 2**20


def _inflated(data: bytes, spans: Iterable[tuple[int, int]], limit: int) -> int:
    """How many bytes the zlib stream in `data`'s `spans` (in order) inflates to, counted up to about `limit` (the
    count then stops there or a little past it). A piece at a time: no more than INFLATE_PIECE in and INFLATE_OUT out
    are held at once. zlib.error for a corrupt stream."""
    view, inflater, got = memoryview(data), zlib.decompressobj(), 0
    for start, end in spans:
        for at in range(start, end, INFLATE_PIECE):
            pending: bytes | memoryview = view[at : min(at + INFLATE_PIECE, end)]
            while not inflater.eof and got <= limit:
                out = len(inflater.decompress(pending, INFLATE_OUT))
                got, pending = got + out, inflater.unconsumed_tail
                if not pending and out < INFLATE_OUT:  # all in, and nothing held back: the next piece
                    break
            if inflater.eof or got > limit:
                return got
    return got


def _png_inflated_metadata(data: bytes, kind: bytes, start: int, end: int, limit: int) -> int:
    """What the compressed part of an iCCP, zTXt or iTXt chunk (body `data[start:end]`) inflates to, counted up to
    about `limit`; 0 for an uncompressed iTXt or a chunk too malformed to read (Pillow judges it)."""
    name_end = data.find(b"\0", start, end)
    if name_end < 0:
        return 0
    stream = name_end + 2  # iCCP, zTXt: name, NUL, compression method, the stream
    if kind == b"iTXt":  # keyword, NUL, compressed flag, method, language, NUL, translated keyword, NUL, text
        if name_end + 1 >= end or data[name_end + 1] == 0:
            return 0
        language_end = data.find(b"\0", name_end + 3, end)
        translated_end = data.find(b"\0", language_end + 1, end) if language_end >= 0 else -1
        if translated_end < 0:
            return 0
        stream = translated_end + 1
    try:
        return _inflated(data, [(stream, end)], limit)
    except zlib.error:
        return 0


def _check_png_rows(data: bytes, walk: _Walk) -> None:
    """The PNG's IDAT stream inflates to all the rows its header says: Pillow fills the rows of a stream that ends
    early with zeros and says nothing. Inflates in bounded pieces, keeping none of them."""
    try:
        got = _inflated(data, walk.idat, walk.raw_bytes)
    except zlib.error as e:
        raise MediaError(f"could not be decoded as PNG (its image data is corrupt: {e})") from None
    if got < walk.raw_bytes:
        raise MediaError(
            f"has too little image data: the PNG's image data inflates to {got} bytes of rows, but its "
            f"{walk.width}x{walk.height} pixels need {walk.raw_bytes}; the file was cut short or its data removed"
        )


_JPEG_MARKER = re.compile(rb"\xff[^\xff]")
"""A marker: 0xFF (the last of any fill bytes) and its code."""
_JPEG_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
"""The end of a scan's entropy-coded data: the last 0xFF (of any fill bytes) before a code that is neither a stuffed
0x00 nor a restart marker's. A literal first byte: re skips to each 0xFF in C, so the search costs little more than
the 0xFF bytes in the data (about 5 ns each)."""
_JPEG_RESTART = re.compile(rb"\xff[\xd0-\xd7]")
"""A restart marker in entropy-coded data (there 0xFF is followed by 0x00, 0xFF or a marker's code)."""
_JPEG_HIERARCHICAL = frozenset({0xC5, 0xC6, 0xC7, 0xCD, 0xCE, 0xCF})  # differential frames: libjpeg has none
_JPEG_PROGRESSIVE = frozenset({0xC2, 0xCA})
_JPEG_LOSSLESS = frozenset({0xC3, 0xCB})
_JPEG_ARITHMETIC = frozenset({0xC9, 0xCA, 0xCB})


@dataclass(frozen=True)
class _JpegFrame:
    """A JPEG's start-of-frame: its marker and each component's (id, blocks) (8 x 8 blocks of its samples)."""

    marker: int
    components: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class _JpegScan:
    """One scan: its components' ids, its spectral start (Ss; a lossless scan's predictor), its successive
    approximation high bit (Ah), and the entropy-coded bytes it holds (restart markers not counted)."""

    components: tuple[int, ...]
    start: int
    high: int
    data_bytes: int


def _jpeg_frame(marker: int, segment: bytes) -> _JpegFrame | None:
    """The frame header of a start-of-frame segment; None for one too malformed to read (libjpeg refuses it: the
    skeleton's decode says so)."""
    if len(segment) < 10:
        return None
    height, width = struct.unpack_from(">HH", segment, 5)
    count = segment[9]
    fields = segment[10 : 10 + 3 * count]
    if count < 1 or len(fields) < 3 * count:
        return None
    sampling = [(fields[3 * i], fields[3 * i + 1] >> 4, fields[3 * i + 1] & 15) for i in range(count)]
    h_max, v_max = max(h for _, h, _ in sampling), max(v for _, _, v in sampling)
    if min(min(h, v) for _, h, v in sampling) < 1:
        return None
    blocks = []
    for ident, h, v in sampling:
        samples_w, samples_h = -(-width * h // h_max), -(-height * v // v_max)
        blocks.append((ident, -(-samples_w // 8) * -(-samples_h // 8)))
    return _JpegFrame(marker, tuple(blocks))


def _jpeg_scan(segment: bytes, data_bytes: int) -> _JpegScan | None:
    """A start-of-scan header; None for one too malformed to read (the skeleton's decode refuses it)."""
    count = segment[4] if len(segment) > 4 else 0
    if count < 1 or len(segment) < 8 + 2 * count:
        return None
    ids = tuple(segment[5 + 2 * i] for i in range(count))
    return _JpegScan(ids, segment[5 + 2 * count], segment[7 + 2 * count] >> 4, data_bytes)


def _jpeg_data_error(frame: _JpegFrame | None, scans: list[_JpegScan]) -> str:
    """The first problem of the JPEG's image data its headers show ("" if none): a hierarchical frame, a component
    no scan codes (progressive: no DC scan codes), or a Huffman-coded scan with fewer bytes than blocks / 8 (each
    block costs at least one bit of a DC or sequential scan; libjpeg fills what is missing with grey and only warns).
    An arithmetic-coded scan has no such bound: its coder can spend a small fraction of a bit on a predictable block."""
    if frame is None:
        return ""
    if frame.marker in _JPEG_HIERARCHICAL:
        return f"uses hierarchical JPEG coding (SOF{frame.marker - 0xC0}), which libjpeg cannot decode"
    lossless, progressive = frame.marker in _JPEG_LOSSLESS, frame.marker in _JPEG_PROGRESSIVE
    blocks = dict(frame.components)
    for ident in blocks:
        coded = [s for s in scans if ident in s.components and (lossless or not progressive or s.start == 0 == s.high)]
        if not coded:
            which = "DC scan (the first scan of its coefficient 0)" if progressive else "scan"
            return (
                f"is incomplete: no {which} codes the JPEG's component {ident}, so its pixels would decode "
                "as grey; the file was cut short or its data removed"
            )
    if frame.marker in _JPEG_ARITHMETIC:
        return ""
    for index, scan in enumerate(scans, 1):
        if not (lossless or scan.start == 0):  # an AC scan of a progressive JPEG can code a band of blocks in bits
            continue
        count = sum(blocks.get(ident, 0) for ident in scan.components)
        need = -(-count // 8)
        if scan.data_bytes < need:
            return (
                f"has too little image data: scan {index} of the JPEG holds {scan.data_bytes} bytes of entropy-coded "
                f"data, but its {count} blocks of 8 x 8 samples need at least {need} (each costs at least 1 bit); "
                "the file was cut short or its data removed"
            )
    return ""


def _jpeg_scan_end(data: bytes, pos: int) -> int:
    """Where the entropy-coded data from `pos` ends: the last 0xFF before the next marker's code (-1: none)."""
    found = _JPEG_SCAN_END.search(data, pos)
    return found.start() if found is not None else -1


def _jpeg_scan_bytes(data: bytes, start: int, end: int, interval: int) -> int:
    """The entropy-coded bytes libjpeg reads of the scan data in [start, end]: with a restart interval, all but its
    restart markers; without one, those before its first restart marker (libjpeg stops the scan's data there and
    skips the rest as stray bytes)."""
    if interval:
        return end - start - 2 * len(_JPEG_RESTART.findall(data, start, end))
    first = _JPEG_RESTART.search(data, start, end)
    return (first.start() if first is not None else end) - start


def _jpeg_walk(data: bytes) -> _Walk:
    n = len(data)
    if not data.startswith(_JPEG_SOI):
        raise MediaError("is not a JPEG image (no start-of-image marker)")
    truncated = MediaError(f"is truncated: the JPEG ends at byte {n} before its end-of-image marker")
    pos, size = 2, (0, 0)
    skeleton = [_JPEG_SOI[:2]]  # every segment as it is (a frame header resized), no entropy-coded data
    frame: _JpegFrame | None = None
    scans: list[_JpegScan] = []
    padding, segments, interval = 0, 0, 0
    while True:
        # bytes between segments are skipped, as libjpeg does (fill bytes, stray ones), up to _JPEG_MAX_PADDING
        found = _JPEG_MARKER.search(data, pos, pos + _JPEG_MAX_PADDING - padding + 2)
        if found is None:
            if pos + _JPEG_MAX_PADDING - padding + 2 >= n:
                raise truncated
            raise MediaError(f"has more than {_JPEG_MAX_PADDING} fill or stray bytes between its JPEG segments")
        padding += found.start() - pos
        pos = found.start()
        marker = data[pos + 1]
        if marker == 0xD9:  # EOI
            skeleton.append(b"\xff\xd9")
            return _Walk(size[0], size[1], b"".join(skeleton), _jpeg_data_error(frame, scans))
        if marker in _JPEG_STANDALONE or marker == 0x00:  # no length field: skipped, and counted as padding
            pos, padding = pos + 2, padding + 2
            continue
        if pos + 4 > n:
            raise truncated
        (length,) = struct.unpack_from(">H", data, pos + 2)
        end = pos + 2 + length
        if length < 2 or end > n:
            raise truncated
        segments += 1
        if segments > _JPEG_MAX_SEGMENTS:
            raise MediaError(f"has more than {_JPEG_MAX_SEGMENTS} JPEG segments (the limit on a keyframe's)")
        segment = data[pos:end]
        if marker in _JPEG_SOF and length >= 7:
            height, width = struct.unpack_from(">HH", data, pos + 5)
            size = (width, height)
            frame = frame or _jpeg_frame(marker, segment)  # a second frame header: libjpeg refuses the file
            segment = segment[:5] + struct.pack(">HH", _SKELETON_HEIGHT, _SKELETON_WIDTH) + segment[9:]
        skeleton.append(segment)
        pos = end
        if marker == 0xDD and length >= 4:  # DRI: the restart interval of the scans that follow
            (interval,) = struct.unpack_from(">H", data, pos - 2)
        if marker == 0xDA:  # start of scan: skip its entropy-coded data to the next real marker
            if not scans and data.count(b"\xff", pos) > _JPEG_MAX_FF_IN_SCANS:
                raise MediaError(
                    f"has more than {_JPEG_MAX_FF_IN_SCANS} bytes 0xFF in its scans (fill bytes or stuffing; coded "
                    "image data holds about one in 256)"
                )
            start, pos = pos, _jpeg_scan_end(data, pos)
            if pos < 0:
                raise truncated
            scan = _jpeg_scan(segment, _jpeg_scan_bytes(data, start, pos, interval))
            if scan is not None:
                scans.append(scan)


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
