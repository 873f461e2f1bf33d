"""Reference bombs (issue 32, finding 5): media whose header and first frame probe small while the bitstream decodes
large, or whose packets span less time than their samples. ditcore.references decodes every reference under its
probe: refused at the first frame past it, before that frame is converted, in bounded memory (peak RSS measured);
and ordinary references still decode exactly as diffusers' own `from_file` does."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from refmedia import audio_bytes, spliced_video, squeezed_audio, video_bytes, wav_bytes

from ditcore.keyframes import MediaError
from ditcore.reference_decode import decode_reference
from ditcore.references import AUDIO_SLACK_S, Reference, ReferenceLimits, probe_reference
from ditcore.request import GenerationRequest, RequestError

SMALL = (64, 64)
BIG = (1920, 1080)
BIG_FRAME_BYTES = BIG[0] * BIG[1] * 3  # one decoded rgb24 frame: 6.2 MB


def decode(data: bytes) -> object:
    ref = Reference(data)
    return decode_reference(ref, probe_reference(ref))


def refusal(data: bytes) -> str:
    with pytest.raises(MediaError) as info:
        decode(data)
    return info.value.description


def _peak_rss() -> int:
    found = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert found is not None
    return int(found[1]) * 1024


@contextlib.contextmanager
def rss_growth() -> Iterator[list[int]]:
    """The growth of this process's peak RSS during the block (Linux: writing 5 to clear_refs resets the peak), in
    bytes, as the list's one item; skips where the peak cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak RSS")
    before, out = _peak_rss(), list[int]()
    yield out
    out.append(_peak_rss() - before)


@pytest.fixture(scope="module", autouse=True)
def warm() -> None:
    """Imports and codecs loaded once, so a measured decode counts its frames only."""
    decode(video_bytes(fmt="webm", audio_rate=48000))


# ----------------------------------------------------------------------------- video
def test_the_bomb_probes_small_and_decodes_large() -> None:
    """What the guard is for: the header and first frame say 64 x 64, PyAV decodes 1080p from frame 2 on (at 68
    KB, 16 such frames are 100 MB of rgb24)."""
    data = spliced_video([(*SMALL, 1), (*BIG, 16)])
    probe = probe_reference(Reference(data))
    assert (probe.width, probe.height, probe.frames) == (*SMALL, 17)
    with av.open(io.BytesIO(data), mode="r") as container:
        sizes = [(f.width, f.height) for f, _ in zip(container.decode(video=0), range(3), strict=False)]
    assert sizes == [SMALL, BIG, BIG]


def test_a_lying_header_is_refused_at_its_first_big_frame_in_bounded_memory() -> None:
    data = spliced_video([(*SMALL, 1), (*BIG, 16)])
    with rss_growth() as growth:
        message = refusal(data)
    assert message.startswith("its video frame 2 cannot be decoded"), message
    assert message.endswith("or larger than the 64 x 64 its header and first frame give, which every frame must keep")
    assert growth[0] < 2 * BIG_FRAME_BYTES, growth  # the whole decode: 16 frames, about 80 MB of RSS


@pytest.mark.parametrize(("later", "how"), [((128, 128), "is 128 x 128"), (BIG, "cannot be decoded")])
def test_a_size_change_mid_stream_is_refused_at_its_first_changed_frame(later: tuple[int, int], how: str) -> None:
    """16 frames at 64 x 64, then 4 larger: 128 x 128 reaches the exact check (within the decoder's cap), 1080p is
    refused by the decoder itself."""
    data = spliced_video([(*SMALL, 16), (*later, 4)])
    with rss_growth() as growth:
        message = refusal(data)
    assert message.startswith(f"its video frame 17 {how}"), message
    assert growth[0] < 2 * BIG_FRAME_BYTES, growth


def test_the_request_names_the_reference() -> None:
    bomb = Reference(spliced_video([(*SMALL, 1), (*BIG, 16)]))
    request = GenerationRequest(prompt="a red fox", num_inference_steps=4, task="ref2va", references=(bomb,))
    with pytest.raises(RequestError) as info:
        request.decoded_references()
    assert info.value.field == "references[0]" and "video frame 2" in str(info.value)


def test_a_first_frame_over_the_pixel_limit_is_refused_at_the_probe_undecoded() -> None:
    """The probe's own decoding (FFmpeg's stream-info pass, the first frame) runs under the pixel limit too."""
    data = spliced_video([(*BIG, 1), (*SMALL, 16)])
    with rss_growth() as growth, pytest.raises(MediaError) as info:
        probe_reference(Reference(data), ReferenceLimits(max_frame_pixels=4 * SMALL[0] * SMALL[1]))
    assert info.value.limit == "max_frame_pixels"
    assert info.value.description.startswith("its first video frame does not decode within 16,384 pixels")
    assert growth[0] < BIG_FRAME_BYTES, growth
    assert probe_reference(Reference(data)).width == BIG[0]  # within the default limit: the header's size


def test_frames_past_the_probed_count_or_bytes_are_refused() -> None:
    ref = Reference(video_bytes(frames=24, width=64, height=36))
    probe = probe_reference(ref)
    with pytest.raises(MediaError, match="video frame 21 decodes past 138,240 bytes: the 20 frames") as info:
        decode_reference(ref, dataclasses.replace(probe, frames=20))
    assert info.value.limit == "max_decoded_bytes"
    with pytest.raises(MediaError, match="video frame 11 decodes past 69,120 bytes"):
        decode_reference(ref, probe, ReferenceLimits(max_decoded_bytes=10 * 64 * 36 * 3))


# ----------------------------------------------------------------------------- audio
def test_audio_past_its_packets_duration_is_refused_early() -> None:
    """An M4A whose packets claim 64 samples each while each decodes 1024: 0.25 s probed, 4 s decoded."""
    data = squeezed_audio(seconds=4.0, rate=48000, ticks=64)
    probe = probe_reference(Reference(data))
    assert probe.seconds < 0.3 and probe.sample_rate == 48000
    with pytest.raises(MediaError) as info:
        decode(data)
    assert info.value.limit == "max_decoded_bytes"
    found = re.match(r"its audio decodes past ([\d,]+) bytes of float32 samples at frame (\d+)", info.value.description)
    assert found, info.value.description
    allowed, frame = int(found[1].replace(",", "")), int(found[2])
    assert allowed == math.ceil((probe.seconds + AUDIO_SLACK_S) * 48000) * 4
    assert frame == allowed // (1024 * 4) + 1  # stopped at the first frame past it, of the ~190 it holds


@pytest.mark.parametrize(("rate", "channels", "want"), [(16000, 1, "16000 Hz with 1"), (48000, 2, "48000 Hz with 2")])
def test_a_rate_or_channel_change_mid_stream_is_refused(rate: int, channels: int, want: str) -> None:
    """Two ADTS streams back to back: probed at the first's 48 kHz mono, the second decodes at its own."""
    data = audio_bytes("adts", rate=48000, channels=1) + audio_bytes("adts", rate=rate, channels=channels)
    message = refusal(data)
    assert re.match(rf"its audio frame \d+ is {want} channels; the stream was probed at 48000 Hz with 1", message)


# ----------------------------------------------------------------------------- what diffusers decodes
@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (video_bytes(fmt="mp4"), ""),
        (video_bytes(fmt="webm", audio_rate=48000), ""),
        (video_bytes(channels=1, audio_rate=44100), ""),
        (video_bytes(audio_rate=None), ""),
        (video_bytes(), "audio"),
        (wav_bytes(channels=2), ""),
        (audio_bytes("flac"), ""),
        (audio_bytes("mp3"), ""),
        (audio_bytes("adts"), ""),
    ],
)
def test_ordinary_references_decode_as_diffusers_from_file(data: bytes, kind: str) -> None:
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference, MiniMaxH3VideoReference

    ref = Reference(data, kind)
    probe = probe_reference(ref)
    got = decode_reference(ref, probe)
    with tempfile.NamedTemporaryFile() as file:
        file.write(data)
        file.flush()
        want = (MiniMaxH3VideoReference if probe.kind == "video" else MiniMaxH3AudioReference).from_file(file.name)
    assert type(got) is type(want) and got.sample_rate == want.sample_rate
    if probe.kind == "video":
        assert np.array_equal(got.frames, want.frames) and got.fps == want.fps
    assert (got.audio is None and want.audio is None) or torch.equal(got.audio, want.audio)
