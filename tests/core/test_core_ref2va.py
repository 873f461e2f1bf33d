"""Oracle tests for ref2va in ditcore.denoise: its resident and cached loops on the `transformer_ref` partition give
torch.equal latents (and decoded frames and waveform) to diffusers' own ref2va workflow on the same tiny repository,
for image-only references, a video with its soundtrack, and an image with an audio clip, in float32 and in the
released mixed precision; ref2va plans are keyed in the "ref" partition (up to 4 wide with audio reference rows at
1.0) and a plan of the base partition is refused by the loop."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from oracle import diffusers_outputs, reference_from_bytes
from refmedia import image_bytes, video_bytes, wav_bytes

from ditcore.decode import decode, load_decoder
from ditcore.denoise import PlanKeyMismatchError, generate_latents
from ditcore.pipeline import PartitionNotLoadedError, load_pipeline, released_decode_dtype, transformer_for
from ditcore.plans import PlanKey
from ditcore.rebuild import PlanBuilder
from ditcore.references import Reference
from ditcore.repo import write_repository
from ditcore.request import GenerationRequest
from ditcore.schedule import ScheduleKeys, plan_keys

DTYPES = ("float32", "mixed")
BASE = GenerationRequest(prompt="a red fox runs", num_inference_steps=4, seed=11, height=32, width=32, task="ref2va")
CASES: dict[str, tuple[tuple[bytes, str], ...]] = {
    "images": ((image_bytes(80, 48, seed=1), "image"), (image_bytes(40, 60, seed=2, fmt="JPEG"), "image")),
    "video_with_audio": ((video_bytes(frames=30, fps=30, audio_rate=32000, seed=3), "video"),),
    "image_and_audio": ((image_bytes(64, 64, seed=4), "image"), (wav_bytes(1.5, 32000, channels=1, seed=5), "audio")),
}


def request_for(case: str) -> GenerationRequest:
    refs = tuple(Reference(data) for data, _ in CASES[case])
    return dataclasses.replace(BASE, references=refs).validate()


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("ref2va")
    return {d: write_repository(base / d, "tiny", seed=0, dtype=d) for d in DTYPES}


@pytest.fixture(scope="module")
def oracle(repos: dict[str, Path]) -> dict[tuple[str, str], dict[str, Any]]:
    """diffusers' own ref2va outputs (decoded too) per (dtype, case), its references read by diffusers' from_file."""
    out = {}
    for dtype in DTYPES:
        for case, refs in CASES.items():
            r = BASE
            out[dtype, case] = diffusers_outputs(
                repos[dtype], r.prompt, r.num_inference_steps, r.seed, r.height, r.width, r.num_frames,
                references=[reference_from_bytes(data, kind) for data, kind in refs], decode=True,
            )  # fmt: skip
    return out


def built_pages(repo: Path) -> Any:
    """pages_for_step from the ref partition's own checkpoint folder: ditcore's PlanBuilder on transformer_ref/."""
    builder = PlanBuilder(repo / "transformer_ref")
    built: list[PlanKey] = []

    def pages_for_step(i: int, key: PlanKey) -> torch.Tensor:
        built.append(key)
        return builder.build_one(key)

    return pages_for_step, built


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_resident_ref2va_equals_diffusers(
    repos: dict[str, Path], oracle: dict[Any, Any], dtype: str, case: str
) -> None:
    pipe = load_pipeline(repos[dtype], dtype)
    video, audio = generate_latents(pipe, request_for(case))
    want = oracle[dtype, case]
    assert torch.equal(video, want["latents"]) and torch.equal(audio, want["audio_latents"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_ref2va_equals_diffusers(repos: dict[str, Path], oracle: dict[Any, Any], dtype: str, case: str) -> None:
    pipe = load_pipeline(repos[dtype], dtype, cached=True)
    for partition in ("base", "ref"):  # both partitions' transformers, neither holding its plan tensors
        names = [n for n, _ in transformer_for(pipe, partition).named_parameters()]
        assert names and not any(".adaln_proj." in n or n.startswith("norm_out.linear") for n in names)
    request = request_for(case)
    pages_for_step, built = built_pages(repos[dtype])
    video, audio = generate_latents(pipe, request, pages_for_step)
    want = oracle[dtype, case]
    assert torch.equal(video, want["latents"]) and torch.equal(audio, want["audio_latents"])
    assert [k.partition for k in built] == ["ref"] * request.steps
    assert [tuple(k.bits) for k in built] == [tuple(b & 0xFFFFFFFF for b in t) for t in want["timesteps"]]
    media = decode(load_decoder(pipe, repos[dtype], released_decode_dtype(dtype)), video, audio)
    assert np.array_equal(media.frames, np.stack([np.asarray(im) for im in want["videos"][0]]))
    assert torch.equal(torch.from_numpy(media.audio), want["audio"][0].cpu())


def test_ref2va_keys_are_the_ref_partitions_and_up_to_four_wide(repos: dict[str, Path]) -> None:
    pipe = load_pipeline(repos["float32"])
    mirror = ScheduleKeys(repos["float32"])
    widths = {}
    for case in CASES:
        request = request_for(case)
        keys = plan_keys(pipe, request)
        assert keys == mirror.keys(request)
        assert {k.partition for k in keys} == {"ref"}
        widths[case] = max(k.width for k in keys)
    # image and video reference rows at max(t, 0.999); audio reference rows (a clip, a soundtrack) at 1.0
    assert widths == {"images": 3, "video_with_audio": 4, "image_and_audio": 4}
    t2va = dataclasses.replace(BASE, task="t2va", references=())
    assert {k.partition for k in mirror.keys(t2va)} == {"base"}
    assert [k.bits for k in mirror.keys(t2va)] != [k.bits for k in mirror.keys(request_for("images"))]


def test_a_base_plan_never_serves_a_ref2va_loop(repos: dict[str, Path]) -> None:
    """The fence in the model layer: keys of the other partition are refused before the first forward, whatever
    their timesteps, and a loop given pages of the base partition's builder would not match diffusers anyway."""
    pipe = load_pipeline(repos["float32"], cached=True)
    request = request_for("images")
    keys = plan_keys(pipe, request)
    pages_for_step, built = built_pages(repos["float32"])
    with pytest.raises(PlanKeyMismatchError, match="'base' partition"):
        generate_latents(pipe, request, pages_for_step, [k.in_partition("base") for k in keys])
    assert built == []


def test_a_repository_without_transformer_ref_refuses_ref2va(tmp_path: Path) -> None:
    repo = write_repository(tmp_path / "base-only", "tiny", seed=0, partitions=("base",))
    pipe = load_pipeline(repo)
    with pytest.raises(PartitionNotLoadedError, match="transformer_ref"):
        generate_latents(pipe, request_for("images"))
    with pytest.raises(PartitionNotLoadedError, match="transformer_ref"):
        load_pipeline(repo, partitions=("base", "ref"))


def test_resampled_references_equal_diffusers(repos: dict[str, Path]) -> None:
    """A 30 fps video with a 48 kHz soundtrack, a 44.1 kHz stereo WAV and a WebM: diffusers' setup step resamples
    them onto 24 fps and the audio VAE's 32 kHz (torchaudio), the same in both."""
    refs = (
        (video_bytes(frames=36, fps=30, width=48, height=48, audio_rate=48000, seed=6), "video"),
        (wav_bytes(1.2, 44100, channels=2, seed=7), "audio"),
        (video_bytes(frames=20, fps=20, audio_rate=48000, seed=8, fmt="webm"), "video"),
    )
    request = dataclasses.replace(BASE, references=tuple(Reference(d) for d, _ in refs)).validate()
    video, audio = generate_latents(load_pipeline(repos["float32"]), request)
    r = BASE
    want = diffusers_outputs(
        repos["float32"], r.prompt, r.num_inference_steps, r.seed, r.height, r.width, r.num_frames,
        references=[reference_from_bytes(d, k) for d, k in refs],
    )  # fmt: skip
    assert torch.equal(video, want["latents"]) and torch.equal(audio, want["audio_latents"])
