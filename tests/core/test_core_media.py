"""ditcore.keyframes and ditcore.media: keyframe images in (every refusal names its rule), MP4 and frames+WAV out (checked by reading the
bytes back with PyAV, zipfile and wave)."""

from __future__ import annotations

import hashlib
import io
import struct
import subprocess
import sys
import time
import tracemalloc
import wave
import zipfile
import zlib
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from ditcore.keyframes import DEFAULT_IMAGE_LIMITS, ImageLimits, MediaError, decode_image
from ditcore.media import FPS, OUTPUT_TYPES, DecodedMedia, encode, h264_encoder, output_type_for_path


# ------------------------------------------------------------------------------------------------------ helpers
def gradient(width: int, height: int) -> np.ndarray:
    """(H, W, 3) uint8 with distinct rows, columns and channels."""
    x = np.linspace(0, 255, width, dtype=np.float64)[None, :]
    y = np.linspace(0, 255, height, dtype=np.float64)[:, None]
    rgb = np.stack(np.broadcast_arrays(x + 0 * y, y + 0 * x, (x + y) / 2), axis=-1)
    return rgb.round().astype(np.uint8)


def saved(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kwargs)
    return out.getvalue()


def png(width: int = 64, height: int = 48) -> bytes:
    return saved(Image.fromarray(gradient(width, height)), "PNG")


def jpeg(width: int = 64, height: int = 48) -> bytes:
    return saved(Image.fromarray(gradient(width, height)), "JPEG", quality=95)


def patch_png_size(data: bytes, width: int, height: int) -> bytes:
    """Rewrite a PNG's IHDR width/height and fix the chunk's CRC (a valid file that claims another size)."""
    assert data[12:16] == b"IHDR"
    ihdr = bytearray(data[12:29])  # type + 13 data bytes
    ihdr[4:12] = struct.pack(">II", width, height)
    crc = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return data[:12] + bytes(ihdr) + crc + data[33:]


def patch_jpeg_size(data: bytes, width: int, height: int) -> bytes:
    """Rewrite a baseline JPEG's SOF0 height/width."""
    at = data.index(b"\xff\xc0")
    return data[: at + 5] + struct.pack(">HH", height, width) + data[at + 9 :]


def refused(data: bytes, limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> str:
    with pytest.raises(MediaError) as info:
        decode_image(data, limits)
    assert info.value.description == str(info.value)
    return info.value.description


# ------------------------------------------------------------------------------------------------ decode_image
def test_png_round_trip_is_exact() -> None:
    image = decode_image(png(64, 48))
    assert (image.mode, image.size) == ("RGB", (64, 48))
    np.testing.assert_array_equal(np.asarray(image), gradient(64, 48))


def test_jpeg_round_trip_is_close() -> None:
    image = decode_image(jpeg(64, 48))
    assert (image.mode, image.size) == ("RGB", (64, 48))
    assert np.abs(np.asarray(image).astype(int) - gradient(64, 48)).mean() < 3


@pytest.mark.parametrize(
    ("image", "save_kwargs"),
    [
        (Image.new("L", (6, 4), 77), {}),
        (Image.new("1", (6, 4), 1), {}),
        (Image.new("LA", (6, 4), (10, 0)), {}),
        (Image.fromarray(np.arange(24, dtype=np.uint8).reshape(4, 6, 1).repeat(4, axis=2)), {}),
        (Image.new("RGB", (6, 4), (1, 2, 3)), {"transparency": (1, 2, 3)}),
        (Image.new("I;16", (6, 4), 40000), {}),
        (Image.new("P", (6, 4), 1), {"transparency": 1}),
    ],
    ids=["grey", "bilevel", "grey-alpha", "rgba", "rgb-trns", "grey16", "palette-trns"],
)
def test_modes_become_rgb_as_diffusers_load_image_makes_them(
    image: Image.Image, save_kwargs: dict[str, object]
) -> None:
    """Whatever the PNG's mode, the keyframe is exactly what diffusers' own `load_image` gives a diffusers user for
    the same file (EXIF transpose, then Pillow's convert("RGB")): the model is conditioned as in diffusers."""
    from diffusers.utils import load_image

    data = saved(image, "PNG", **save_kwargs)
    out = decode_image(data)
    want = load_image(Image.open(io.BytesIO(data)))
    assert (out.mode, out.size) == ("RGB", (6, 4))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_exif_orientation_is_applied_as_diffusers_does() -> None:
    from diffusers.utils import load_image

    image = Image.fromarray(gradient(64, 48))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to show
    data = saved(image, "JPEG", exif=exif.tobytes())
    out = decode_image(data)
    assert out.size == (48, 64)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(load_image(Image.open(io.BytesIO(data)))))


def test_cmyk_jpeg_becomes_rgb() -> None:
    out = decode_image(saved(Image.new("CMYK", (16, 8), (0, 255, 255, 0)), "JPEG", quality=95))
    assert (out.mode, out.size) == ("RGB", (16, 8))
    assert np.abs(np.asarray(out).astype(int) - [255, 0, 0]).max() < 8


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = saved(Image.fromarray(gradient(64, 32)), "JPEG", quality=95, exif=exif.tobytes())
    assert Image.open(io.BytesIO(data)).size == (64, 32)
    assert decode_image(data).size == (32, 64)


@pytest.mark.parametrize(
    "data",
    [
        np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        b"hello, not an image",
        saved(Image.new("RGB", (8, 8)), "GIF"),
        saved(Image.new("RGB", (8, 8)), "BMP"),
        saved(Image.new("RGB", (8, 8)), "WEBP"),
        saved(Image.new("RGB", (8, 8)), "TIFF"),
    ],
    ids=["random", "text", "gif", "bmp", "webp", "tiff"],
)
def test_only_png_and_jpeg_are_read(data: bytes) -> None:
    assert "is not a PNG or JPEG image" in refused(data)


@pytest.mark.parametrize("lenient", [False, True], ids=["strict-pil", "LOAD_TRUNCATED_IMAGES"])
@pytest.mark.parametrize(
    "cut",
    [
        lambda d: d[: len(d) // 2],  # half a PNG
        lambda d: d[:-12],  # everything but IEND
        lambda d: d[:40],  # the header only
    ],
    ids=["half", "no-iend", "header-only"],
)
def test_truncated_png_is_refused(monkeypatch: pytest.MonkeyPatch, lenient: bool, cut: object) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", lenient)
    assert callable(cut)
    message = refused(cut(png(128, 96)))
    assert "truncated" in message


@pytest.mark.parametrize("lenient", [False, True], ids=["strict-pil", "LOAD_TRUNCATED_IMAGES"])
@pytest.mark.parametrize("keep", [0.5, -2], ids=["half", "no-eoi"])
def test_truncated_jpeg_is_refused(monkeypatch: pytest.MonkeyPatch, lenient: bool, keep: float) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", lenient)
    data = jpeg(128, 96)
    cut = data[: int(len(data) * keep)] if keep > 0 else data[: int(keep)]
    assert "truncated" in refused(cut)


def test_progressive_jpeg_with_trailing_bytes_is_read() -> None:
    data = saved(Image.fromarray(gradient(64, 48)), "JPEG", quality=90, progressive=True) + b"\x00trailer"
    assert decode_image(data).size == (64, 48)


def test_corrupt_png_chunk_is_refused() -> None:
    data = bytearray(png(64, 48))
    at = data.index(b"IDAT") + 20
    data[at] ^= 0xFF
    assert "CRC mismatch in the PNG's IDAT chunk" in refused(bytes(data))


def test_empty_and_too_many_bytes() -> None:
    assert refused(b"") == "is empty"
    data = png(64, 48)
    limit = len(data) - 1
    assert refused(data, ImageLimits(max_bytes=limit)) == f"is {len(data)} bytes, over the limit of {limit} bytes"
    assert decode_image(data, ImageLimits(max_bytes=len(data))).size == (64, 48)


@pytest.mark.parametrize("make", [png, jpeg], ids=["png", "jpeg"])
def test_huge_header_is_refused_without_decoding(make: object) -> None:
    assert callable(make)
    small = make(32, 32)
    data = patch_png_size(small, 60000, 60000) if small.startswith(b"\x89PNG") else patch_jpeg_size(small, 60000, 60000)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        message = refused(data)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert message == "is 60000x60000 = 3600000000 pixels, over the limit of 16777216 (decompression-bomb guard)"
    assert elapsed < 1.0
    assert peak < 8 * 2**20  # 60000^2 RGB would be 10 GB


def test_pixel_limit_is_ours_not_pils(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # Pillow's own guard off: ours still holds
    data = patch_png_size(png(32, 32), 5000, 5000)
    assert refused(data) == "is 5000x5000 = 25000000 pixels, over the limit of 16777216 (decompression-bomb guard)"
    limits = ImageLimits(max_pixels=64 * 48 - 1)
    assert refused(png(64, 48), limits) == (
        f"is 64x48 = 3072 pixels, over the limit of {64 * 48 - 1} (decompression-bomb guard)"
    )
    assert decode_image(png(64, 48), ImageLimits(max_pixels=64 * 48)).size == (64, 48)


def test_zero_width_is_refused() -> None:
    assert refused(patch_png_size(png(8, 8), 0, 8)) == "has a zero width or height (0x8)"
    assert refused(patch_png_size(png(8, 8), 8, 0)) == "has a zero width or height (8x0)"


@pytest.mark.parametrize(
    ("size", "ok"),
    [((100, 20), False), ((80, 20), True), ((20, 100), False), ((20, 80), True), ((33, 32), True)],
)
def test_aspect_ratio_is_one_to_four_either_way(size: tuple[int, int], ok: bool) -> None:
    data = png(*size)
    if ok:
        assert decode_image(data).size == size
    else:
        message = refused(data)
        assert f"{size[0]}x{size[1]}" in message and "outside [0.25, 4]" in message


def test_media_error_is_a_value_error() -> None:
    assert issubclass(MediaError, ValueError)


# ------------------------------------------------------------------------------------------------------- encode
RATE = 16000


def synthetic(frames: int = 29, height: int = 32, width: int = 64, seconds: float = 1.2) -> DecodedMedia:
    video = np.stack([np.roll(gradient(width, height), 3 * i, axis=1) for i in range(frames)])
    t = np.arange(round(seconds * RATE)) / RATE
    chirp = 0.5 * np.sin(2 * np.pi * (200 * t + 800 * t**2))
    return DecodedMedia(frames=video, audio=np.stack([chirp, -0.5 * chirp]).astype(np.float32), sampling_rate=RATE)


def test_mp4_streams_rate_and_content() -> None:
    av = pytest.importorskip("av")
    media = synthetic()
    with encode(media, "mp4") as out:
        data = out.read_all()
    assert (out.output_type, out.content_type, out.suffix) == ("mp4", "video/mp4", ".mp4")
    assert out.sha256 == hashlib.sha256(data).hexdigest() and out.size == len(data)
    assert data.index(b"moov") < data.index(b"mdat")  # index first (faststart)
    samples = media.audio.shape[1]
    with av.open(io.BytesIO(data)) as container:
        assert len(container.streams.video) == 1 and len(container.streams.audio) == 1
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert video.codec_context.name == "h264"
        assert video.average_rate == FPS == 24
        assert (video.width, video.height) == (64, 32)
        assert audio.codec_context.name == "aac"
        assert (audio.channels, audio.sample_rate) == (2, RATE)
        assert abs(float(audio.duration * audio.time_base) - samples / RATE) <= 1024 / RATE
        decoded = [f for f in container.decode(video=0)]
        assert [f.pts * f.time_base for f in decoded] == [Fraction(i, 24) for i in range(len(media.frames))]
        pixels = np.stack([f.to_ndarray(format="rgb24") for f in decoded])
    assert pixels.shape == media.frames.shape
    assert np.abs(pixels.astype(int) - media.frames).mean() < 6  # lossy, but the same picture
    with av.open(io.BytesIO(data)) as container:
        sound = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
    assert sound.shape[0] == 2 and samples <= sound.shape[1] < samples + 2 * 1024  # one frame of padding at most
    assert np.abs(sound[:, :samples] - media.audio).mean() < 0.01  # aligned: the encoder's priming is skipped


def test_mp4_is_deterministic() -> None:
    """Scrolling, slightly noisy frames: with x264's macroblock tree on, these encode differently run to run on
    AVX-512 CPUs (media.X264_OPTIONS turns it off)."""
    pytest.importorskip("av")
    rng = np.random.default_rng(0)
    base = gradient(224, 128).astype(np.float64)
    video = [np.roll(base, 3 * i, axis=1) + rng.normal(0, 8, base.shape) for i in range(48)]
    frames = np.clip(np.stack(video), 0, 255).astype(np.uint8)
    media = DecodedMedia(frames=frames, audio=synthetic(frames=1, seconds=2).audio, sampling_rate=RATE)
    digests = {encode(media, "mp4").sha256 for _ in range(4)}
    assert len(digests) == 1


def test_mp4_refuses_odd_sizes() -> None:
    media = synthetic(frames=3)
    odd = DecodedMedia(frames=media.frames[:, :, :63], audio=media.audio, sampling_rate=RATE)
    with pytest.raises(ValueError, match="even width and height; got 63x32"):
        encode(odd, "mp4")


def test_h264_encoder_is_found() -> None:
    pytest.importorskip("av")
    assert h264_encoder() in ("libx264", "libopenh264") or "264" in h264_encoder()


def test_frames_and_wav_is_exact() -> None:
    media = synthetic(frames=7, height=16, width=24, seconds=0.25)
    audio = media.audio.copy()
    audio[0, :4] = [1.5, -2.0, 0.5, -0.25]  # clipped, clipped, exact halves
    audio[1, 0] = np.nan
    media = DecodedMedia(frames=media.frames, audio=audio, sampling_rate=RATE)
    with encode(media, "frames_and_wav") as out:
        data = out.read_all()
    assert (out.output_type, out.content_type, out.suffix) == ("frames_and_wav", "application/zip", ".zip")
    assert out.sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        assert names == [f"frames/{i:06d}.png" for i in range(7)] + ["audio.wav"]
        for i in range(7):
            with Image.open(io.BytesIO(archive.read(names[i]))) as frame:
                assert frame.format == "PNG" and frame.mode == "RGB"
                np.testing.assert_array_equal(np.asarray(frame), media.frames[i])
        with wave.open(io.BytesIO(archive.read("audio.wav"))) as wav:
            assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (2, 2, RATE)
            assert wav.getnframes() == audio.shape[1]
            pcm = np.frombuffer(wav.readframes(wav.getnframes()), "<i2").reshape(-1, 2).T
    expected = np.round(np.clip(np.nan_to_num(audio.astype(np.float64)), -1, 1) * 32767).astype(np.int16)
    np.testing.assert_array_equal(pcm, expected)
    assert pcm[0, :4].tolist() == [32767, -32767, 16384, -8192] and pcm[1, 0] == 0


def test_frames_and_wav_is_deterministic() -> None:
    media = synthetic(frames=5, height=16, width=16, seconds=0.1)
    first = encode(media, "frames_and_wav")
    time.sleep(1.1)  # a ZIP timestamp from the clock would change now (2-second resolution: try twice)
    second = encode(media, "frames_and_wav")
    time.sleep(1.1)
    third = encode(media, "frames_and_wav")
    assert first.read_all() == second.read_all() == third.read_all() and first.sha256 == third.sha256


@pytest.mark.parametrize("output_type", ["latents", "png", ""])
def test_encode_refuses_other_types(output_type: str) -> None:
    with pytest.raises(ValueError, match="cannot encode media"):
        encode(synthetic(frames=2), output_type)


def test_decoded_media_shapes_are_checked() -> None:
    good = synthetic(frames=2)
    with pytest.raises(ValueError, match="frames must be"):
        encode(DecodedMedia(good.frames.astype(np.float32), good.audio, RATE), "frames_and_wav")
    with pytest.raises(ValueError, match="audio must be"):
        encode(DecodedMedia(good.frames, good.audio[:1], RATE), "frames_and_wav")


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("out.mp4", "mp4"),
        (Path("dir/out.MP4"), "mp4"),
        ("out.zip", "frames_and_wav"),
        ("a.b/out.safetensors", "latents"),
        ("out.wav", None),
        ("out", None),
        ("out.tar.gz", None),
    ],
)
def test_output_type_for_path(path: str | Path, expected: str | None) -> None:
    assert output_type_for_path(path) == expected
    assert expected is None or expected in OUTPUT_TYPES


@pytest.mark.processes
def test_import_is_cheap_and_layered() -> None:
    code = "import sys, ditcore.keyframes, ditcore.media; print(sorted(m for m in ('av', 'grpc') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
