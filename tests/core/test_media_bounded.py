"""Media memory bounded at the released size: decode makes uint8 frames a chunk at a time from the float video the
decode step leaves on the VAE's device (bit for bit diffusers' own "pil" frames), encode writes a spooled temporary
file (never one `bytes`, the same bytes as the whole-bytes encode before it), and `check` stops either promptly."""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import tracemalloc
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ditcore import media as media_module
from ditcore.decode import decode, load_decoder, to_uint8_frames
from ditcore.media import CONTENT_TYPES, SPOOL_MAX_BYTES, DecodedMedia, encode
from ditcore.pipeline import load_pipeline

RATE = 16000
FRAMES, HEIGHT, WIDTH = 124, 32, 64  # 17 * 7 + 5 frames: 37 latent frames, 2 x 4 latents


class Stop(Exception):
    """What the tests' `check` raises."""


class Counter:
    """A `check` that counts its calls and raises Stop on call `stop_at` (never when 0)."""

    def __init__(self, stop_at: int = 0) -> None:
        self.calls = 0
        self.stop_at = stop_at

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == self.stop_at:
            raise Stop(f"call {self.calls}")


def reference_media() -> DecodedMedia:
    """Small media from integer arithmetic only (no libm), so its encodes do not depend on the CPU."""
    f, h, w = 9, 48, 64
    i, y = np.arange(f)[:, None, None, None], np.arange(h)[None, :, None, None]
    x, c = np.arange(w)[None, None, :, None], np.arange(3)[None, None, None, :]
    frames = ((x * 3 + y * 5 + i * 7 + c * 11) % 256).astype(np.uint8)
    s = np.arange(8000)
    audio = np.stack([((s * 37) % 2001 - 1000) / 1000.0, ((s * 53) % 1601 - 800) / 1000.0]).astype(np.float32)
    return DecodedMedia(frames=frames, audio=audio, sampling_rate=RATE)


# What the whole-bytes encode (BytesIO + getvalue, before the spool) gave for reference_media(), computed with it
# before it was replaced, with av 18.1.0 (libx264), Pillow 13.0.0, zlib 1.2.13: (size, sha256).
OLD_ENCODES = {
    "mp4": (16627, "8e08e25b1be82cfa10c75ac380f1992459eed66193066db76b9a99231adbfd23"),
    "frames_and_wav": (36011, "a5935845df4525812efc726329d011220c857f7e5128f144fe89782728b64c48"),
}
OLD_LIBS = ("18.1.0", "13.0.0", "1.2.13")


def libs() -> tuple[str, str, str]:
    import zlib

    import av
    import PIL

    return av.__version__, PIL.__version__, zlib.ZLIB_RUNTIME_VERSION


def whole_bytes_zip(media: DecodedMedia) -> bytes:
    """The frames+WAV ZIP as the whole-bytes encoder wrote it (into a BytesIO), kept here as the reference."""
    import wave

    from PIL import Image

    out = io.BytesIO()
    with zipfile.ZipFile(out, mode="w", compression=zipfile.ZIP_STORED) as archive:
        for index, frame in enumerate(media.frames):
            png = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(frame)).save(png, format="PNG")
            archive.writestr(media_module._zip_entry(f"frames/{index:06d}.png"), png.getvalue())
        wav = io.BytesIO()
        with wave.open(wav, "wb") as writer:
            writer.setnchannels(2)
            writer.setsampwidth(2)
            writer.setframerate(media.sampling_rate)
            writer.writeframes(np.ascontiguousarray(media_module._pcm16(media.audio).T).astype("<i2").tobytes())
        archive.writestr(media_module._zip_entry("audio.wav"), wav.getvalue())
    return out.getvalue()


def bytes_io_mp4(media: DecodedMedia) -> bytes:
    """The mp4 muxed into a BytesIO, the whole-bytes encoder's container (its faststart reader on a BytesIO)."""
    out = io.BytesIO()
    media_module._encode_mp4(media, out, lambda: None)
    return out.getvalue()


@pytest.fixture
def spools(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every spooled file encode creates, to look at after it returns or raises."""
    made: list[Any] = []
    real = tempfile.SpooledTemporaryFile

    def spool(*args: Any, **kwargs: Any) -> Any:
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(media_module.tempfile, "SpooledTemporaryFile", spool)
    return made


# --------------------------------------------------------------------------------------------------------- encode
@pytest.mark.parametrize("output_type", ["mp4", "frames_and_wav"])
def test_encode_writes_the_bytes_the_whole_bytes_encode_wrote(output_type: str) -> None:
    """In memory or rolled over to disk, the spooled encode has exactly the bytes (and sha256) of the encode it
    replaced: the pinned digests of the old code (this library build) and the whole-bytes writers kept above."""
    pytest.importorskip("av")
    media = reference_media()
    want = whole_bytes_zip(media) if output_type == "frames_and_wav" else bytes_io_mp4(media)
    for spool_max_bytes in (SPOOL_MAX_BYTES, 1):
        with encode(media, output_type, spool_max_bytes=spool_max_bytes) as out:
            assert out.on_disk == (spool_max_bytes == 1)
            data = out.read_all()
            assert data == want and out.size == len(want) and out.sha256 == hashlib.sha256(want).hexdigest()
            assert (out.output_type, out.content_type) == (output_type, CONTENT_TYPES[output_type])
            if libs() == OLD_LIBS:
                assert (out.size, out.sha256) == OLD_ENCODES[output_type]


def test_chunks_cover_the_file_exactly() -> None:
    with encode(reference_media(), "frames_and_wav", spool_max_bytes=1000) as out:
        data = out.read_all()
        for chunk_bytes in (1, 7, 4096, out.size, out.size + 5):
            for start in (0, 5, out.size - 1, out.size):
                parts = list(out.chunks(chunk_bytes, start))
                assert b"".join(parts) == data[start:]
                assert all(0 < len(p) <= chunk_bytes for p in parts)
                assert len(parts) == -(-(out.size - start) // chunk_bytes)
        first, second = out.chunks(1000), out.chunks(333, 10)  # interleaved readers keep their own positions
        got: dict[int, list[bytes]] = {0: [], 1: []}
        for a, b in zip(first, second, strict=False):
            got[0].append(a)
            got[1].append(b)
        got[0].extend(first)
        got[1].extend(second)
        assert b"".join(got[0]) == data and b"".join(got[1]) == data[10:]
        for bad in ((0, 0), (-1, 0), (10, -1), (10, out.size + 1)):
            with pytest.raises(ValueError):
                out.chunks(*bad)


def test_close_frees_the_file_and_is_idempotent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file over the spool's limit lives in tempfile's directory (TMPDIR) as an unnamed file, freed on close; a
    closed result refuses to be read; close twice is fine; `with` closes."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # what TMPDIR sets (tempfile caches it)
    out = encode(reference_media(), "frames_and_wav", spool_max_bytes=1)
    assert out.on_disk and not out.closed
    fd = out._file.fileno()
    if os.path.isdir("/proc/self/fd"):
        assert os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path))  # unnamed: "#123 (deleted)" there
    assert list(tmp_path.iterdir()) == []  # nothing named is left behind, even before close
    reader = out.chunks(100)
    next(reader)
    out.close()
    out.close()
    assert out.closed
    with pytest.raises(OSError):
        os.fstat(fd)
    for read in (out.read_all, lambda: next(reader), lambda: next(out.chunks())):
        with pytest.raises(ValueError, match="closed"):
            read()
    with encode(reference_media(), "mp4") as other:
        assert not other.closed and not other.on_disk
    assert other.closed and "closed" in repr(other)


def test_a_large_encode_spills_to_disk_at_the_default_limit() -> None:
    frames = np.random.default_rng(0).integers(0, 256, (2, 2048, 2800, 3), dtype=np.uint8)  # PNGs of noise: 17 MB
    with encode(DecodedMedia(frames, np.zeros((2, 800), np.float32), RATE), "frames_and_wav") as out:
        assert out.size > SPOOL_MAX_BYTES and out.on_disk


def test_encode_holds_neither_the_file_nor_a_copy_in_memory() -> None:
    """The whole-bytes encode held the whole file in a BytesIO (a peak of 1.2 times its size here); the spooled
    one holds at most its in-memory limit and a frame's PNG."""
    frames = np.random.default_rng(1).integers(0, 256, (16, 512, 512, 3), dtype=np.uint8)
    media = DecodedMedia(frames, np.zeros((2, 16000), np.float32), RATE)
    tracemalloc.start()
    try:
        out = encode(media, "frames_and_wav", spool_max_bytes=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    with out:
        assert out.size > 12_000_000 and out.on_disk
        assert peak < out.size / 2  # about 3 MB here, 15 MB with the whole-bytes encode
        assert zipfile.ZipFile(io.BytesIO(out.read_all())).testzip() is None


@pytest.mark.parametrize("output_type", ["mp4", "frames_and_wav"])
def test_check_stops_the_encode_at_once_and_frees_its_file(output_type: str, spools: list[Any]) -> None:
    pytest.importorskip("av")
    media = reference_media()
    counter = Counter()
    encode(media, output_type, counter).close()
    assert counter.calls == len(media.frames)  # once before each frame
    stop = Counter(stop_at=3)
    with pytest.raises(Stop, match="call 3"):
        encode(media, output_type, stop)
    assert stop.calls == 3  # nothing encoded after the check raised
    assert len(spools) == 2 and all(s.closed for s in spools)


# --------------------------------------------------------------------------------------------------------- decode
@pytest.fixture(scope="module")
def decoder(tiny_ckpt: Path) -> Any:
    """The released recipe's decoder on the tiny mixed repository: both VAEs in bfloat16."""
    return load_decoder(load_pipeline(tiny_ckpt, "mixed"), tiny_ckpt, "bfloat16")


def latents(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(1, 24, 37, HEIGHT // 16, WIDTH // 16, generator=g)  # (1, C, F_lat, h, w)
    audio = torch.randn(2, 32, 207, generator=g)  # (stereo, C_a, N)
    return video, audio


def diffusers_frames(decoder: Any, video: torch.Tensor, audio: torch.Tensor) -> dict[str, Any]:
    out = decoder(latents=video, audio_latents=audio, output_type="pil", output=["videos", "audio", "sampling_rate"])
    return {**out, "frames": np.stack([np.asarray(image) for image in out["videos"][0]])}


def test_chunked_decode_is_diffusers_pil_decode_bit_for_bit(decoder: Any) -> None:
    """A real tiny decode: the uint8 frames made a chunk at a time (one frame, 7 frames, all) are exactly the frames
    diffusers' decode step hands over as PIL images, and exactly round(x * 255) of its float32 video."""
    video, audio = latents()
    want = diffusers_frames(decoder, video, audio)
    assert want["frames"].shape == (FRAMES, HEIGHT, WIDTH, 3)
    frame_bytes = 3 * HEIGHT * WIDTH * 4
    for chunk_bytes in (1, 7 * frame_bytes, 10**9):
        media = decode(decoder, video, audio, chunk_bytes=chunk_bytes)
        assert media.frames.dtype == np.uint8 and np.array_equal(media.frames, want["frames"])
        assert torch.equal(torch.from_numpy(media.audio), want["audio"][0])
    pt = decoder(latents=video, audio_latents=audio, output_type="pt", output=["videos"])["videos"][0]
    arithmetic = (pt.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)  # float32 * 255, half to even
    assert np.array_equal(arithmetic, want["frames"])


def edge_pixels(frames: int) -> torch.Tensor:
    """(F, 3, H, W) float32 in [0, 1] full of what rounding can get wrong: 0, 1, every k / 255 and (k + 0.5) / 255
    and their float32 neighbours, and random values."""
    edges = np.concatenate([np.arange(256) / 255, (np.arange(255) + 0.5) / 255]).astype(np.float32)
    edges = np.concatenate([edges, np.nextafter(edges, 2), np.nextafter(edges, -1), [0, 1]]).astype(np.float32)
    rng = np.random.default_rng(5)
    values = rng.random(frames * 3 * HEIGHT * WIDTH).astype(np.float32)
    values[rng.permutation(values.size)[: edges.size]] = edges
    return torch.from_numpy(np.clip(values, 0, 1).reshape(frames, 3, HEIGHT, WIDTH))


def test_uint8_conversion_equals_diffusers_on_edge_values(decoder: Any) -> None:
    pixels = edge_pixels(29)
    processor = decoder.video_processor
    want = np.stack([np.asarray(i) for i in processor.postprocess_video(pixels.permute(1, 0, 2, 3)[None], "pil")[0]])
    for chunk_bytes in (1, 3 * pixels[0].numel() * 4, 10**9):
        assert np.array_equal(to_uint8_frames(processor, pixels, chunk_bytes=chunk_bytes), want)


def test_decode_step_edge_values_through_the_whole_chain(decoder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The VAE's output replaced by values the step's own denormalization and clamp act on (-1, 1, far outside,
    values that land on rounding boundaries): the chunked decode still equals diffusers' "pil" decode."""
    mean = torch.tensor(decoder.pixel_mean).view(1, 3, 1, 1)
    std = torch.tensor(decoder.pixel_std).view(1, 3, 1, 1)
    sample = (edge_pixels(FRAMES) - mean) / std  # VAE space: the step computes sample * std + mean
    flat = sample.view(-1)
    flat[:6] = torch.tensor([-1.0, 1.0, -50.0, 50.0, 0.0, float(torch.finfo(torch.bfloat16).max)])
    fake = sample.permute(1, 0, 2, 3)[None].contiguous()  # (1, 3, F, H, W); float32 keeps the boundary values
    monkeypatch.setattr(decoder.vae, "decode", lambda z, return_dict=False: (fake,))
    video, audio = latents()
    want = diffusers_frames(decoder, video, audio)["frames"]
    assert np.array_equal(decode(decoder, video, audio, chunk_bytes=1).frames, want)


@pytest.fixture
def forwards(decoder: Any) -> Iterator[dict[str, int]]:
    """How many forwards each VAE decoder ran (the video one: once per spatial tile of each temporal clip)."""
    seen = {"vae": 0, "audio_vae": 0}
    handles = []
    for name in seen:

        def count(*_: Any, name: str = name) -> None:
            seen[name] += 1

        handles.append(getattr(decoder, name).decoder.register_forward_hook(count))
    yield seen
    for h in handles:
        h.remove()


def test_check_runs_between_tiles_and_chunks_and_stops_the_decode(decoder: Any, forwards: dict[str, int]) -> None:
    video, audio = latents()
    frame_bytes = 3 * HEIGHT * WIDTH * 4
    counter = Counter()
    decode(decoder, video, audio, counter, chunk_bytes=10 * frame_bytes)
    tiles, chunks = forwards["vae"], -(-FRAMES // 10)
    assert tiles == 7 and forwards["audio_vae"] == 1  # 7 temporal clips (37 latent frames), one tile each at 32 x 64
    assert counter.calls == 1 + tiles + 1 + chunks  # before, each VAE decoder forward, each chunk
    for stop_at, tiles_run in ((1, 0), (2, 0), (4, 2), (tiles + 2, tiles)):
        forwards.update(vae=0, audio_vae=0)
        stop = Counter(stop_at)
        with pytest.raises(Stop):
            decode(decoder, video, audio, stop, chunk_bytes=10 * frame_bytes)
        assert stop.calls == stop_at and forwards["vae"] == tiles_run and forwards["audio_vae"] == 0
    stop = Counter(stop_at=1 + tiles + 1 + 2)  # the second chunk: the VAEs have run, the conversion stops
    with pytest.raises(Stop):
        decode(decoder, video, audio, stop, chunk_bytes=10 * frame_bytes)
    assert stop.calls == 1 + tiles + 1 + 2
    assert not decoder.vae.decoder._forward_pre_hooks and not decoder.audio_vae.decoder._forward_pre_hooks


def test_conversion_holds_no_float_copy_of_the_video() -> None:
    """numpy's allocations (tracemalloc sees them; torch's it does not): diffusers' whole-video "pil" conversion
    makes two float32 copies of the video on the host, the chunked one at most a chunk's."""
    from diffusers.video_processor import VideoProcessor

    processor = VideoProcessor(vae_scale_factor=16, do_normalize=False)  # the decode step's configuration
    pixels = edge_pixels(40)
    float_bytes = pixels.numel() * 4
    tracemalloc.start()
    try:
        processor.postprocess_video(pixels.permute(1, 0, 2, 3)[None], "pil")
        whole = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        frames = to_uint8_frames(processor, pixels, chunk_bytes=4 * 3 * HEIGHT * WIDTH * 4)
        chunked = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert whole >= 2 * float_bytes  # the measure sees the copies
    assert chunked < frames.nbytes + float_bytes / 4  # the frames themselves, plus a 4-frame chunk's temporaries
