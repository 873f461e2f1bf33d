"""Keyframe images in: the PNG or JPEG bytes an fl2va request brings, checked and decoded (the files a generation
leaves as: ditcore.media).

`probe_image(data, limits)` makes every check that the bytes' header and structure decide, without decoding a
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
"""

from __future__ import annotations

import io
import re
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from PIL import Image, UnidentifiedImageError

if TYPE_CHECKING:
    pass

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
