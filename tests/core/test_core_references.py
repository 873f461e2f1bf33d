"""ditcore.references and the request's reference rules: what each kind of file probes to, and the bad-reference
corpus, every entry refused by GenerationRequest.validate (before any work) with a RequestError naming
`references[i]` (or `references`) and the rule."""

from __future__ import annotations

import dataclasses
import io
import wave

import numpy as np
import pytest
from refmedia import audio_bytes, image_bytes, video_bytes, wav_bytes

from ditcore.references import Reference, ReferenceLimits, probe_reference
from ditcore.request import GenerationRequest, RequestError, RequestLimits

BASE = GenerationRequest(prompt="a red fox", num_inference_steps=4, task="ref2va")
IMAGE = image_bytes(80, 48)


def wav_channels(channels: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(32000)
        w.writeframes(np.zeros((16000, channels), dtype="<i2").tobytes())
    return out.getvalue()


@pytest.mark.parametrize(
    ("data", "kind", "want"),
    [
        (IMAGE, "", ("image", "PNG")),
        (image_bytes(64, 64, fmt="JPEG"), "", ("image", "JPEG")),
        (video_bytes(frames=24, fps=24), "", ("video", "MP4")),
        (video_bytes(frames=30, fps=30, audio_rate=None), "", ("video", "MP4")),
        (video_bytes(frames=24, fps=24, audio_rate=48000, fmt="webm"), "", ("video", "WebM")),
        (wav_bytes(1.0, 44100, channels=2), "", ("audio", "WAV")),
        (audio_bytes("flac"), "", ("audio", "FLAC")),
        (audio_bytes("mp3", rate=44100), "", ("audio", "MP3")),
        (audio_bytes("adts"), "", ("audio", "AAC (ADTS)")),
        (
            video_bytes(frames=24, fps=24, audio_rate=32000),
            "audio",
            ("audio", "MP4 (M4A)"),
        ),  # a video's soundtrack alone
    ],
)
def test_each_kind_probes_without_decoding(data: bytes, kind: str, want: tuple[str, str]) -> None:
    probe = probe_reference(Reference(data, kind))
    assert (probe.kind, probe.format) == want


def test_probe_reads_real_counts_and_rates() -> None:
    video = probe_reference(Reference(video_bytes(frames=30, fps=30, width=64, height=36, audio_rate=48000)))
    assert (video.width, video.height, video.frames, video.fps) == (64, 36, 30, 30.0)
    assert (video.sample_rate, video.channels) == (48000, 2) and video.has_audio
    assert video.seconds == pytest.approx(1.0, abs=0.05)
    silent = probe_reference(Reference(video_bytes(audio_rate=None)))
    assert not silent.has_audio
    audio = probe_reference(Reference(wav_bytes(2.0, 16000, channels=1)))
    assert (audio.sample_rate, audio.channels) == (16000, 1) and audio.seconds == pytest.approx(2.0, abs=0.05)


MP4 = video_bytes(frames=24, fps=24)
CORPUS: dict[str, tuple[tuple[Reference, ...], RequestLimits | None, str, str]] = {
    "empty": ((Reference(b""),), None, "references[0]", "is empty"),
    "garbage": ((Reference(IMAGE), Reference(b"\x00garbage" * 50)), None, "references[1]", "not a readable"),
    "truncated_png": ((Reference(IMAGE[:-40]),), None, "references[0]", "truncated"),
    "truncated_mp4": ((Reference(IMAGE), Reference(MP4[: len(MP4) // 3])), None, "references[1]", ""),
    "gif": ((Reference(b"GIF89a" + b"\x00" * 64),), None, "references[0]", ""),
    "unknown_kind": ((Reference(IMAGE, "picture"),), None, "references[0]", "kind must be one of"),
    "mp4_as_image": ((Reference(MP4, "image"),), None, "references[0]", "not a PNG or JPEG"),
    "wav_as_video": ((Reference(IMAGE), Reference(wav_bytes(), "video")), None, "references[1]", "a video reference is"),
    "surround": ((Reference(IMAGE), Reference(wav_channels(6))), None, "references[1]", "6 channels"),
    "too_short_video": ((Reference(video_bytes(frames=8, fps=24)),), None, "references[0]", "at least 13 frames"),
    "too_long_audio": (
        (Reference(IMAGE), Reference(wav_bytes(3.0, 8000))),
        RequestLimits(max_reference_seconds=2.0), "references[1]", "at most 2 s",
    ),
    "too_many_bytes": ((Reference(IMAGE), Reference(MP4)), RequestLimits(max_reference_bytes=len(MP4) - 1),
                       "references[1]", "bytes; allowed at most"),
    "too_many_total_bytes": ((Reference(MP4), Reference(MP4)), RequestLimits(max_references_bytes=len(MP4) + 1),
                             "references", "in all"),
    "frames_too_big": ((Reference(MP4),), RequestLimits(max_reference_frame_pixels=64 * 36 - 1), "references[0]",
                       "pixels; allowed at most"),
    "decodes_too_big": ((Reference(MP4),), RequestLimits(max_reference_decoded_bytes=1000), "references[0]",
                        "decodes to"),
    "ten_images": (tuple(Reference(IMAGE) for _ in range(10)), None, "references[9]", "at most 9 image"),
    "four_videos": (tuple(Reference(MP4) for _ in range(4)), None, "references[3]", "at most 3 video"),
    "four_audios": ((Reference(IMAGE), *(Reference(wav_bytes()) for _ in range(4))), None, "references[4]",
                    "at most 3 audio"),
    "thirteen": ((*(Reference(IMAGE) for _ in range(9)), *(Reference(MP4) for _ in range(3)), Reference(wav_bytes())),
                 None, "references", "at most 12"),
    "audio_alone": ((Reference(wav_bytes()),), None, "references[0]", "paired with at least one image or video"),
    "tall_image": ((Reference(image_bytes(10, 60)),), None, "references[0]", "aspect"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_bad_references_are_refused_naming_the_index(name: str) -> None:
    refs, limits, field, words = CORPUS[name]
    request = dataclasses.replace(BASE, references=refs)
    with pytest.raises(RequestError) as caught:
        request.validate(limits or RequestLimits())
    assert caught.value.field == field, str(caught.value)
    assert str(caught.value).startswith(f"{field}: ")
    assert words.lower() in str(caught.value).lower()


def test_task_and_reference_rules() -> None:
    with pytest.raises(RequestError, match=r"^references: ref2va needs at least one"):
        BASE.validate()
    with pytest.raises(RequestError, match=r"^references: t2va takes no references"):
        dataclasses.replace(BASE, task="t2va", references=(Reference(IMAGE),)).validate()
    with pytest.raises(RequestError, match=r"^first_frame: ref2va takes no keyframe"):
        dataclasses.replace(BASE, references=(Reference(IMAGE),), first_frame=IMAGE).validate()
    unset = dataclasses.replace(BASE, task="", references=(Reference(IMAGE),)).with_task_inferred()
    assert unset.task == "ref2va" and unset.partition == "ref"
    assert dataclasses.replace(BASE, task="fl2va").partition == "base"


def test_limits_are_the_operators() -> None:
    limits = RequestLimits(max_reference_bytes=1234, max_reference_seconds=7.5).reference_limits()
    assert isinstance(limits, ReferenceLimits)
    assert (limits.max_bytes, limits.max_seconds, limits.max_images, limits.max_references) == (1234, 7.5, 9, 12)


def test_the_memory_model_counts_reference_rows() -> None:
    """ditcore.sizing: a ref2va request's references add condition rows (an image at the reference short edge, a
    video on its canvas at 24 fps, audio at 40 latents per second per channel) and vision tokens, at the released
    geometry, from the probes alone."""
    from ditcore.footprint import meta_components
    from ditcore.sizing import Canvas, ModelShapes

    shapes = ModelShapes.of_components(meta_components(preset="h3"))
    plain = GenerationRequest(prompt="a fox", height=768, width=1344, num_frames=345)
    refs = (Reference(image_bytes(800, 600)), Reference(video_bytes(frames=48, width=320, height=180)),
            Reference(wav_bytes(5.0)))  # fmt: skip
    with_refs = dataclasses.replace(plain, task="ref2va", references=refs)
    a, b = shapes.tokens(Canvas.of(plain)), shapes.tokens(Canvas.of(with_refs))
    image = (2720 // 32) * (2048 // 32)  # 800 x 600 at a 2048 short edge
    video = 15 * (768 // 32) * (1344 // 32)  # 48 frames -> 15 latent frames on the 768 x 1344 canvas
    probes = with_refs.probe_references()
    audio = sum(2 * round(p.seconds * 40) for p in probes[1:])  # the clip's ~2 s soundtrack, the 5 s WAV: stereo
    assert audio == pytest.approx(2 * 40 * 7, abs=8)
    assert (b.video, b.audio) == (a.video, a.audio)
    assert b.condition - a.condition == image + video + audio
    assert b.text > a.text
