"""ditcore.keyframes.probe_image: every refusal decode_image makes from a keyframe's header and structure is made by the
probe too, without decoding a pixel; real PNGs and JPEGs probe to the upright size decode_image gives; and image
data that is far too short for its header (a JPEG whose scans were cut, a PNG whose rows run out) is refused instead
of decoding to grey or black."""

from __future__ import annotations

import io
import re
import struct
import tracemalloc
import zlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from PIL import Image, ImageFile, PngImagePlugin

from ditcore.keyframes import DEFLATE_MAX_RATIO, ImageLimits, ImageProbe, MediaError, decode_image, probe_image


# ------------------------------------------------------------------------------------------------------ helpers
def saved(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kwargs)
    return out.getvalue()


def noise(width: int = 256, height: int = 256, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def flat(width: int = 256, height: int = 256) -> Image.Image:
    return Image.new("RGB", (width, height), (30, 60, 90))


def exif(orientation: int) -> bytes:
    tags = Image.Exif()
    tags[0x0112] = orientation
    return tags.tobytes()


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_of(width: int, height: int, rows: bytes | None, colour: int = 2, depth: int = 8, interlace: int = 0) -> bytes:
    """A PNG with an IHDR of this size and one IDAT holding `rows` deflated (None: no IDAT chunk)."""
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, interlace)
    idat = png_chunk(b"IDAT", zlib.compress(rows)) if rows is not None else b""
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + idat + png_chunk(b"IEND", b"")


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, the whole chunk) of each chunk after the signature."""
    out, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack_from(">I", data, pos)
        out.append((data[pos + 4 : pos + 8], data[pos : pos + 12 + length]))
        pos += 12 + length
    return out


def png_moved_after_idat(data: bytes, kind: bytes) -> bytes:
    """The PNG with its `kind` chunk moved after the IDAT chunks (where Pillow reads it only when decoding)."""
    chunks = png_chunks(data)
    moved = [c for k, c in chunks if k == kind]
    rest = [(k, c) for k, c in chunks if k != kind]
    last = max(i for i, (k, _) in enumerate(rest) if k == b"IDAT")
    ordered = [c for _, c in rest[: last + 1]] + moved + [c for _, c in rest[last + 1 :]]
    return data[:8] + b"".join(ordered)


ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def interlaced_png(pixels: np.ndarray) -> bytes:
    """An Adam7-interlaced RGB PNG of `pixels` (Pillow writes none)."""
    height, width, _ = pixels.shape
    rows = b"".join(b"\0" + row.tobytes() for x0, y0, dx, dy in ADAM7 for row in pixels[y0::dy, x0::dx] if row.size)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 1)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(rows))
        + png_chunk(b"IEND", b"")
    )


def jpeg_segments(data: bytes) -> Iterator[tuple[int, int, int]]:
    """(marker, start, end) of each JPEG segment after SOI, a scan's entropy-coded data included in its SOS; EOI last."""
    pos = 2
    while True:
        assert data[pos] == 0xFF
        marker = data[pos + 1]
        if marker == 0xD9:
            yield marker, pos, pos + 2
            return
        (length,) = struct.unpack_from(">H", data, pos + 2)
        end = pos + 2 + length
        if marker == 0xDA:
            while not (data[end] == 0xFF and data[end + 1] not in (0x00, *range(0xD0, 0xD8))):
                end += 1
        yield marker, pos, end
        pos = end


def jpeg_cut(data: bytes, keep: int) -> bytes:
    """The JPEG's headers through its first SOS, `keep` bytes of that scan's data, then EOI: complete markers, far
    too little data."""
    sos = data.index(b"\xff\xda")
    (length,) = struct.unpack_from(">H", data, sos + 2)
    return data[: sos + 2 + length + keep] + b"\xff\xd9"


def jpeg_sof_as(data: bytes, marker: int) -> bytes:
    """The baseline JPEG with its SOF0 marker replaced (another coding process, the same bytes)."""
    at = data.index(b"\xff\xc0")
    return data[: at + 1] + bytes([marker]) + data[at + 2 :]


DEFAULT = ImageLimits()


def refused_alike(data: bytes, limits: ImageLimits = DEFAULT) -> str:
    """The probe refuses `data` with the very message decode_image refuses it with."""
    with pytest.raises(MediaError) as decoded:
        decode_image(data, limits)
    with pytest.raises(MediaError) as probed:
        probe_image(data, limits)
    assert probed.value.description == decoded.value.description
    assert probed.value.limit == decoded.value.limit
    return probed.value.description


# -------------------------------------------------------------------------------- real images probe as they decode
def _orientation_cases() -> dict[str, Callable[[], bytes]]:
    cases: dict[str, Callable[[], bytes]] = {}
    for o in range(1, 9):
        cases[f"jpeg-exif-{o}"] = lambda o=o: saved(noise(96, 48), "JPEG", exif=exif(o))
        cases[f"png-exif-{o}"] = lambda o=o: saved(noise(96, 48), "PNG", exif=exif(o))
    cases["png-exif-after-idat"] = lambda: png_moved_after_idat(saved(noise(96, 48), "PNG", exif=exif(6)), b"eXIf")
    xmp = '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:Description tiff:Orientation="8"/></x:xmpmeta>'
    info = PngImagePlugin.PngInfo()
    info.add_itxt("XML:com.adobe.xmp", xmp)
    cases["png-xmp"] = lambda: saved(noise(96, 48), "PNG", pnginfo=info)
    raw = PngImagePlugin.PngInfo()
    body = exif(5)
    raw.add_text("Raw profile type exif", f"\nexif\n{len(body):8}\n{body.hex()}\n")
    cases["png-raw-profile"] = lambda: saved(noise(96, 48), "PNG", pnginfo=raw)
    return cases


REAL: dict[str, Callable[[], bytes]] = {
    "jpeg-420": lambda: saved(noise(), "JPEG"),
    "jpeg-444": lambda: saved(noise(), "JPEG", subsampling=0),
    "jpeg-422": lambda: saved(noise(), "JPEG", subsampling=1),
    "jpeg-progressive": lambda: saved(noise(), "JPEG", progressive=True),
    "jpeg-restart-markers": lambda: saved(noise(), "JPEG", restart_marker_blocks=1),
    "jpeg-optimized": lambda: saved(noise(), "JPEG", optimize=True),
    "jpeg-grey": lambda: saved(noise().convert("L"), "JPEG"),
    "jpeg-cmyk": lambda: saved(noise().convert("CMYK"), "JPEG"),
    "jpeg-flat": lambda: saved(flat(), "JPEG", optimize=True),
    "jpeg-flat-progressive": lambda: saved(flat(), "JPEG", optimize=True, progressive=True),
    "jpeg-flat-444": lambda: saved(flat(), "JPEG", optimize=True, subsampling=0, quality=10),
    "jpeg-flat-large": lambda: saved(flat(2048, 1024), "JPEG", optimize=True, quality=1),
    "jpeg-1x1": lambda: saved(flat(1, 1), "JPEG", optimize=True),
    "jpeg-odd-17x9": lambda: saved(noise(17, 9), "JPEG"),
    "jpeg-trailing-bytes": lambda: saved(noise(64, 48), "JPEG", progressive=True) + b"\x00trailer",
    "mpo": lambda: saved(noise(), "MPO", save_all=True, append_images=[noise(seed=1)]),
    "png-rgb": lambda: saved(noise(), "PNG"),
    "png-flat-4096": lambda: saved(flat(4096, 4096), "PNG", compress_level=9),
    "png-grey16": lambda: saved(Image.new("I;16", (40, 30), 40000), "PNG"),
    "png-bilevel": lambda: saved(noise(40, 30).convert("1"), "PNG"),
    "png-palette": lambda: saved(noise(40, 30).convert("P"), "PNG"),
    "png-rgba": lambda: saved(noise(40, 30).convert("RGBA"), "PNG"),
    "png-interlaced": lambda: interlaced_png(np.asarray(noise(37, 21))),
    "apng": lambda: saved(noise(64, 48), "PNG", save_all=True, append_images=[noise(64, 48, seed=1)]),
    "png-many-idat": lambda: b"".join(
        c if k != b"IDAT" else b"".join(png_chunk(b"IDAT", c[8 + i : 8 + i + 100]) for i in range(0, len(c) - 12, 100))
        for k, c in [(b"", saved(noise(64, 48), "PNG")[:8]), *png_chunks(saved(noise(64, 48), "PNG"))]
    ),
    **_orientation_cases(),
}


@pytest.mark.parametrize("make", REAL.values(), ids=REAL.keys())
def test_real_images_probe_to_the_size_they_decode_to(make: Callable[[], bytes]) -> None:
    data = make()
    image = decode_image(data)
    probe = probe_image(data)
    assert isinstance(probe, ImageProbe)
    assert probe == (("PNG" if data.startswith(b"\x89PNG") else "JPEG"), *image.size)
    assert image.mode == "RGB"


@pytest.mark.parametrize("orientation", [6, 8, 5, 7])
def test_an_orientation_that_swaps_the_sides_is_checked_on_the_upright_size(orientation: int) -> None:
    """A 100 x 20 JPEG whose EXIF turns it upright to 20 x 100: the aspect rule sees 1:5 (the upright keyframe)."""
    data = saved(noise(100, 20), "JPEG", exif=exif(orientation))
    message = refused_alike(data)
    assert "width/height of 20x100" in message and "outside [0.25, 4]" in message
    assert probe_image(saved(noise(80, 20), "JPEG", exif=exif(orientation))) == ("JPEG", 20, 80)


def test_the_probe_decodes_no_pixel_and_holds_no_image() -> None:
    """Only 2 x 1 skeletons are decoded (every Pillow load is recorded), whatever the image's size: a 4096 x 4096
    keyframe is probed with well under 1 MB of Python allocations (its RGB pixels are 48 MB)."""
    loaded: list[tuple[int, int]] = []
    original = ImageFile.ImageFile.load

    def recording_load(self: ImageFile.ImageFile) -> object:
        loaded.append(self.size)
        return original(self)

    cases = [saved(flat(4096, 4096), "JPEG", quality=50), saved(flat(4096, 4096), "PNG"), saved(noise(), "JPEG")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ImageFile.ImageFile, "load", recording_load)
        for data in cases:
            probe_image(data)
            tracemalloc.start()
            try:
                probe_image(data)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert peak < 2**20, peak
    assert loaded and set(loaded) == {(2, 1)}, loaded


# ------------------------------------------------------------------------------------ header refusals: probe = decode
HEADER_FAULTS: dict[str, Callable[[], bytes]] = {
    # libjpeg refuses these when it reads the headers (Pillow's own open accepts them): the skeleton finds them
    "jpeg-no-quantization-table": lambda: b"".join(
        (lambda d: d[s:e] if m != 0xDB else b"")(saved(noise(64, 48), "JPEG"))
        for m, s, e in [(0xD8, 0, 2), *jpeg_segments(saved(noise(64, 48), "JPEG"))]
    ),
    "jpeg-lossless-with-dct-tables": lambda: jpeg_sof_as(saved(noise(64, 48), "JPEG"), 0xC3),
    # read by Pillow only after the image data, when decoding: the skeleton keeps it after its own IDAT
    "png-bad-ztxt-after-idat": lambda: png_moved_after_idat(
        saved(noise(64, 48), "PNG")[:-12] + png_chunk(b"zTXt", b"note\x00\x07xx") + png_chunk(b"IEND", b""), b"zTXt"
    ),
    "png-eight-bit-grey-as-depth-3": lambda: png_of(8, 8, b"\0" * 72, colour=0, depth=3),
    "png-no-idat": lambda: png_of(64, 48, None),
    "jpeg-hierarchical": lambda: jpeg_sof_as(saved(noise(64, 48), "JPEG"), 0xC5),
    "jpeg-cut": lambda: jpeg_cut(saved(noise(), "JPEG"), 64),
}


@pytest.mark.parametrize("make", HEADER_FAULTS.values(), ids=HEADER_FAULTS.keys())
def test_what_decode_refuses_from_the_header_the_probe_refuses_alike(make: Callable[[], bytes]) -> None:
    refused_alike(make())


def test_a_hierarchical_jpeg_is_refused_by_name() -> None:
    assert "hierarchical JPEG coding (SOF5)" in refused_alike(jpeg_sof_as(saved(noise(64, 48), "JPEG"), 0xC5))


def test_a_png_without_image_data_is_refused_by_name() -> None:
    assert refused_alike(png_of(64, 48, None)) == "has no image data (the PNG has no IDAT chunk)"


# ------------------------------------------------------------------------------------- far too little image data
@pytest.mark.parametrize(
    "save_kwargs", [{}, {"progressive": True}, {"restart_marker_blocks": 1}, {"subsampling": 0}],
    ids=["baseline", "progressive", "restart-markers", "444"],
)  # fmt: skip
def test_a_jpeg_with_complete_markers_and_far_too_little_data_is_refused(save_kwargs: dict[str, object]) -> None:
    """SOI..SOS and EOI kept, the scan's data cut to 64 bytes: libjpeg fills the rest with grey and only warns, so
    Pillow would hand it over as a keyframe; the probe counts the scan's bytes against its blocks."""
    cut = jpeg_cut(saved(noise(), "JPEG", **save_kwargs), 64)
    with Image.open(io.BytesIO(cut)) as image:  # what was accepted before: it decodes, mostly flat grey
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    assert (np.abs(pixels - 128).max(axis=-1) <= 8).mean() > 0.9
    blocks = 1024 * 3 if save_kwargs.get("subsampling") == 0 else 1024 + 2 * 256  # Y, Cb, Cr 8 x 8 blocks at 256^2
    message = refused_alike(cut)
    assert message == (
        f"has too little image data: scan 1 of the JPEG holds 64 bytes of entropy-coded data, but its {blocks} "
        f"blocks of 8 x 8 samples need at least {blocks // 8} (each costs at least 1 bit); the file was cut short or "
        "its data removed"
    )


def test_the_jpeg_data_bound_is_one_bit_per_block() -> None:
    data = saved(noise(), "JPEG")  # 1536 blocks: 192 bytes at least
    assert "need at least 192" in refused_alike(jpeg_cut(data, 191))
    assert probe_image(jpeg_cut(data, 192)) == ("JPEG", 256, 256)


def test_a_jpeg_component_that_no_scan_codes_is_refused() -> None:
    """A baseline JPEG whose one scan names only Y: Cb and Cr would decode as grey (libjpeg does not complain)."""
    data = bytearray(saved(noise(64, 48), "JPEG"))
    sos = data.index(b"\xff\xda")
    assert data[sos + 4] == 3  # Ns
    data[sos + 2 : sos + 4] = struct.pack(">H", 8)
    data[sos + 4 : sos + 11] = bytes([1, data[sos + 5], data[sos + 6], 0, 63, 0])
    with Image.open(io.BytesIO(bytes(data))) as image:
        image.load()  # accepted by Pillow
    assert "no scan codes the JPEG's component 2" in refused_alike(bytes(data))


def test_a_progressive_jpeg_without_its_dc_scan_is_refused() -> None:
    data = saved(noise(64, 48), "JPEG", progressive=True)
    segments = [(0xD8, 0, 2), *jpeg_segments(data)]
    first_scan = next(i for i, (m, _, _) in enumerate(segments) if m == 0xDA)
    kept = b"".join(data[s:e] for i, (_, s, e) in enumerate(segments) if i != first_scan)
    with Image.open(io.BytesIO(kept)) as image:
        image.load()  # accepted by Pillow
    assert "no DC scan (the first scan of its coefficient 0) codes the JPEG's component 1" in refused_alike(kept)


def test_an_arithmetic_coded_jpeg_has_no_data_bound() -> None:
    """Arithmetic coding can spend a fraction of a bit on a predictable block, so no byte count is too small: a cut
    one is accepted as libjpeg decodes it (a known limit; such files are rare)."""
    cut = jpeg_sof_as(jpeg_cut(saved(noise(), "JPEG"), 8), 0xC9)
    assert probe_image(cut) == ("JPEG", 256, 256)
    assert decode_image(cut).size == (256, 256)


@pytest.mark.parametrize("lenient", [False, True], ids=["strict-pil", "LOAD_TRUNCATED_IMAGES"])
def test_a_png_whose_rows_run_out_is_refused(monkeypatch: pytest.MonkeyPatch, lenient: bool) -> None:
    """One row of data under a 64 x 64 header, its deflate stream and CRCs valid: Pillow leaves 63 rows black and
    says nothing. The probe cannot tell from the bytes (12 KB of rows can deflate into 12 bytes); the decode inflates
    the stream and counts the rows."""
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", lenient)
    data = png_of(64, 64, b"\0" + bytes(range(192)))
    with Image.open(io.BytesIO(data)) as image:
        image.load()  # accepted by Pillow
    assert probe_image(data) == ("PNG", 64, 64)
    with pytest.raises(MediaError) as info:
        decode_image(data)
    assert info.value.description == (
        "has too little image data: the PNG's image data inflates to 193 bytes of rows, but its 64x64 pixels need "
        "12352; the file was cut short or its data removed"
    )


def test_a_large_png_with_far_too_little_data_is_refused_by_the_probe() -> None:
    """A 2048 x 2048 header over one deflated row: fewer IDAT bytes than deflate's best ratio allows, refused
    before any decode."""
    data = png_of(2048, 2048, b"\0" * (2048 * 3 + 1))
    raw = 2048 * (1 + 2048 * 3)
    stored = len(zlib.compress(b"\0" * (2048 * 3 + 1)))
    assert refused_alike(data) == (
        f"has too little image data: the PNG's IDAT chunks hold {stored} bytes, but 2048x2048 pixels are {raw} bytes "
        f"of rows, which need at least {raw // DEFLATE_MAX_RATIO} (deflate compresses at most 1032:1); the file was "
        "cut short or its data removed"
    )


def test_deflate_at_its_best_is_within_the_png_bound() -> None:
    """zlib's best on all-zero rows (the flattest PNG there is) stays under 1032:1, so the bound refuses none."""
    rows = b"\0" * (4096 * (1 + 4096 * 4))
    assert len(rows) / len(zlib.compress(rows, 9)) < DEFLATE_MAX_RATIO
    data = png_of(4096, 4096, rows, colour=6)
    assert probe_image(data) == ("PNG", 4096, 4096)


def test_a_corrupt_png_stream_is_refused_at_decode() -> None:
    ihdr = struct.pack(">IIBBBBB", 64, 48, 8, 2, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", b"x\x9c" + b"\xff" * 200)
    data += png_chunk(b"IEND", b"")
    assert probe_image(data) == ("PNG", 64, 48)
    with pytest.raises(MediaError, match="could not be decoded as PNG"):
        decode_image(data)


# ------------------------------------------------------------------------- bounded cost: refused before Pillow's parse
def _png_with(chunks: bytes) -> bytes:
    rows = zlib.compress(b"\0" * (64 * 3 + 1) * 64)
    ihdr = png_chunk(b"IHDR", struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + ihdr + chunks + png_chunk(b"IDAT", rows) + png_chunk(b"IEND", b"")


def _jpeg_before_scan(extra: bytes) -> bytes:
    data = saved(noise(64, 48), "JPEG")
    sos = data.index(b"\xff\xda")
    return data[:sos] + extra + data[sos:]


COSTLY: dict[str, tuple[Callable[[], bytes], str]] = {
    "jpeg-padding": (lambda: _jpeg_before_scan(b"\xff" * 70000), "more than 65536 fill or stray bytes"),
    "jpeg-standalone-markers": (lambda: _jpeg_before_scan(b"\xff\x01" * 40000), "more than 65536 fill or stray"),
    "jpeg-segments": (lambda: _jpeg_before_scan(b"\xff\xfe\x00\x02" * 9000), "more than 8192 JPEG segments"),
    "jpeg-ff-in-scans": (
        lambda: saved(noise(64, 48), "JPEG")[:-2] + b"\xff\x00" * (2**20 + 1) + b"\xff\xd9",
        "more than 1048576 bytes 0xFF in its scans",
    ),
    "png-chunks": (lambda: _png_with(png_chunk(b"IDAT", b"") * 40000), "more than 32768 chunks"),
    "png-ancillary": (lambda: _png_with(png_chunk(b"tEXt", b"a\0b") * 1001), "more than 1000 but IDAT"),
    "png-iccp-inflation": (
        lambda: _png_with(png_chunk(b"iCCP", b"icc\0\0" + zlib.compress(bytes(10**6), 9)) * 9),
        "inflate to more than 8388608 bytes",
    ),
    "png-itxt-inflation": (
        lambda: _png_with(png_chunk(b"iTXt", b"k\0\1\0en\0k\0" + zlib.compress(b"a" * 9 * 10**6, 9))),
        "inflate to more than 8388608 bytes",
    ),
}


@pytest.mark.parametrize(("make", "expect"), COSTLY.values(), ids=COSTLY.keys())
def test_a_file_whose_parse_would_cost_seconds_is_refused_before_pillow_reads_it(
    monkeypatch: pytest.MonkeyPatch, make: Callable[[], bytes], expect: str
) -> None:
    """Pillow parses headers in Python: a chunk, a segment, a padding byte, an ICC profile inflated at a time (1000
    iCCP chunks in a 1 MB PNG took 1.6 s to open). The walk caps each before Pillow's open is called at all."""
    data = make()
    opened: list[object] = []
    original = Image.open

    def recording_open(*args: object, **kwargs: object) -> object:
        opened.append(args)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Image, "open", recording_open)
    with pytest.raises(MediaError, match=re.escape(expect)):
        probe_image(data)
    assert opened == []


def test_a_restart_marker_without_a_restart_interval_ends_the_scans_data() -> None:
    """Without DRI libjpeg reads a scan's data only up to a restart marker and skips the rest: 64 real bytes, then
    RST0 and 10 kB of anything, decode as grey; the bound counts the 64."""
    data = saved(noise(), "JPEG")
    cut = jpeg_cut(data, 64)
    padded = cut[:-2] + b"\xff\xd0" + bytes(range(1, 255)) * 40 + b"\xff\xd9"
    assert "holds 64 bytes of entropy-coded data" in refused_alike(padded)
