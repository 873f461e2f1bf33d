"""Oracle tests for ditcore.pipeline and what runs on it (schedule, denoise, decode): its resident and cached t2va and
fl2va loops give torch.equal latents, and its decode the same frames and waveform, as diffusers' own MiniMax-H3
pipeline called directly on the same tiny repository, in float32 and in the released mixed precision (decoding at
the released bfloat16, or a dtype asked for, against diffusers with its VAEs at the same dtype)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from oracle import diffusers_latents, diffusers_outputs, pil_image

from ditcore.decode import decode, load_decoder, vae_dtype
from ditcore.denoise import PlanKeyMismatchError, generate_latents
from ditcore.pipeline import DECODE_DTYPES, NotCachedError, load_pipeline, released_decode_dtype, use_cached_transformer
from ditcore.plans import PageLayout, PlanKey, build_pages, plan_inputs
from ditcore.repo import write_repository
from ditcore.request import GenerationRequest
from ditcore.schedule import KEYFRAME_NOISE_AUG, ScheduleKeys, plan_key, plan_keys
from ditcore.shards import safetensors_layer_loader

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

DTYPES = ("float32", "mixed")
REQUEST = GenerationRequest(prompt="a red fox runs through the snow", num_inference_steps=4, seed=7, height=32,
                            width=32, num_frames=124)  # fmt: skip


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("h3pipe")
    return {d: write_repository(base / d, "tiny", seed=0, dtype=d) for d in DTYPES}


def diffusers_reference(repo: Path, dtype: str) -> tuple[torch.Tensor, torch.Tensor, list[PlanKey]]:
    """diffusers' t2va pipeline called directly (tests/oracle.py): latents and the keys its transformer received."""
    r = REQUEST
    video, audio, seen = diffusers_latents(repo, r.prompt, r.num_inference_steps, r.seed, r.height, r.width,
                                           r.num_frames, r.flow_shift, r.audio_flow_shift)  # fmt: skip
    return video, audio, [PlanKey(k) for k in seen]


@pytest.fixture(scope="module")
def reference(repos: dict[str, Path]) -> dict[str, tuple[torch.Tensor, torch.Tensor, list[PlanKey]]]:
    return {d: diffusers_reference(repos[d], d) for d in DTYPES}


def sidecar(repo: Path, pipe: Any) -> tuple[Any, list[int]]:
    """pages_for_step built from the key alone: temb by the transformer's modules, rows streamed from the shards."""
    transformer_dir = os.path.join(repo, "transformer")
    layout = PageLayout.from_config(pipe.transformer.config)
    load = safetensors_layer_loader(transformer_dir)  # as stored: float32, or bfloat16 in the mixed repository
    built: list[int] = []

    def pages_for_step(i: int, key: PlanKey) -> torch.Tensor:
        built.append(i)
        timestep = key.timesteps()
        temb = plan_inputs(pipe.transformer.time_proj, pipe.transformer.time_embedder, timestep)
        return build_pages(layout, temb, load)

    return pages_for_step, built


@pytest.mark.parametrize("dtype", DTYPES)
def test_resident_equals_diffusers(repos: dict[str, Path], reference: dict[str, Any], dtype: str) -> None:
    video, audio = generate_latents(load_pipeline(repos[dtype], dtype), REQUEST)
    ref_video, ref_audio, _ = reference[dtype]
    assert video.shape == (1, 24, 37, 2, 2) and audio.shape == (2, 32, 207)
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cached_equals_diffusers(repos: dict[str, Path], reference: dict[str, Any], dtype: str) -> None:
    pipe = load_pipeline(repos[dtype], dtype)
    use_cached_transformer(pipe, repos[dtype], dtype)
    assert not any(".adaln_proj.linear." in n for n, _ in pipe.transformer.named_parameters())
    pages_for_step, built = sidecar(repos[dtype], pipe)
    video, audio = generate_latents(pipe, REQUEST, pages_for_step)
    ref_video, ref_audio, ref_keys = reference[dtype]
    assert built == list(range(len(ref_keys)))
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)


def test_plan_keys_are_what_the_transformer_receives(repos: dict[str, Path], reference: dict[str, Any]) -> None:
    keys = plan_keys(load_pipeline(repos["float32"]), REQUEST)
    assert keys == reference["float32"][2]
    assert [k.width for k in keys] == [1] + [2] * (len(keys) - 1)
    for key in keys:
        values = key.timesteps()
        assert torch.equal(values, values.sort().values) and plan_key(values) == key
    assert keys[0] == PlanKey((0,))  # the first step: video and audio both at t = 1 - sigma = 0.0


def test_shift_changes_the_keys(repos: dict[str, Path]) -> None:
    pipe = load_pipeline(repos["float32"])
    shifted = dataclasses.replace(REQUEST, flow_shift=5.0)
    assert plan_keys(pipe, shifted)[1] != plan_keys(pipe, REQUEST)[1]


def test_wrong_key_and_resident_transformer_are_refused(repos: dict[str, Path]) -> None:
    pipe = load_pipeline(repos["float32"])
    with pytest.raises(NotCachedError):
        generate_latents(pipe, REQUEST, lambda i, k: torch.empty(0))
    use_cached_transformer(pipe, repos["float32"])
    keys = plan_keys(pipe, REQUEST)
    wrong = [keys[0], keys[2], keys[1]]
    pages_for_step, _ = sidecar(repos["float32"], pipe)
    with pytest.raises(PlanKeyMismatchError, match="step 1"):
        generate_latents(pipe, REQUEST, pages_for_step, wrong)
    with pytest.raises(PlanKeyMismatchError, match="plan has 4 steps"):
        generate_latents(pipe, REQUEST, pages_for_step, [*keys, keys[-1]])


@pytest.mark.parametrize(
    ("steps", "shift", "audio_shift"), [(4, 12.0, 3.0), (50, 12.0, 3.0), (7, 5.0, 5.0), (2, 1.0, 0.5), (13, 30.0, 1.0)]
)
def test_schedule_keys_mirror_the_set_timesteps_block(repos: dict[str, Path], steps: int, shift: float,
                                                      audio_shift: float) -> None:  # fmt: skip
    """ScheduleKeys (the schedulers alone, no text encoding) gives exactly the keys diffusers' own
    MiniMaxH3SetTimestepsStep stages, for the release shifts and others (equal shifts collapse to width 1)."""
    request = dataclasses.replace(REQUEST, num_inference_steps=steps, flow_shift=shift, audio_flow_shift=audio_shift)
    pipe = load_pipeline(repos["float32"])
    mirror = ScheduleKeys(repos["float32"])
    assert mirror.keys(request) == plan_keys(pipe, request)
    assert len(mirror.keys(request)) == steps - 1
    if shift == audio_shift:
        assert {k.width for k in mirror.keys(request)} == {1}


# ---------------------------------------------------------------- fl2va and decoding


def keyframe_png(width: int, height: int, seed: int) -> bytes:
    """A PNG keyframe of random colours (bytes, as a request carries it)."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


FIRST, LAST = keyframe_png(48, 40, 1), keyframe_png(40, 64, 2)
FL2VA = {
    "first": dataclasses.replace(REQUEST, task="fl2va", first_frame=FIRST),
    "last": dataclasses.replace(REQUEST, task="fl2va", last_frame=LAST),
    "both": dataclasses.replace(REQUEST, task="fl2va", first_frame=FIRST, last_frame=LAST),
}


def test_keyframe_noise_aug_is_diffusers(repos: dict[str, Path]) -> None:
    assert load_pipeline(repos["float32"]).keyframe_noise_aug == KEYFRAME_NOISE_AUG


@pytest.mark.parametrize("which", sorted(FL2VA))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fl2va_resident_and_cached_equal_diffusers(repos: dict[str, Path], dtype: str, which: str) -> None:
    """fl2va through ditcore's pipeline (resident, then cached with pages built from the keys alone) gives exactly
    diffusers' fl2va latents for the same keyframes, and its transformer received exactly ScheduleKeys' keys."""
    request = FL2VA[which]
    ref_video, ref_audio, seen = diffusers_request(repos[dtype], request)
    pipe = load_pipeline(repos[dtype], dtype)
    video, audio = generate_latents(pipe, request)
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)
    keys = ScheduleKeys(repos[dtype]).keys(request)
    assert keys == seen and keys == plan_keys(pipe, request)
    use_cached_transformer(pipe, repos[dtype], dtype)
    pages_for_step, built = sidecar(repos[dtype], pipe)
    video, audio = generate_latents(pipe, request, pages_for_step, keys)
    assert built == list(range(len(keys)))
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)


def diffusers_request(repo: Path, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor, list[PlanKey]]:
    r = request
    kwargs = {name: pil_image(data) for name, data in (("image", r.first_frame), ("last_image", r.last_frame)) if data}
    video, audio, seen = diffusers_latents(repo, r.prompt, r.num_inference_steps, r.seed, r.height, r.width,
                                           r.num_frames, r.flow_shift, r.audio_flow_shift, **kwargs)  # fmt: skip
    return video, audio, [PlanKey(k) for k in seen]


@pytest.mark.parametrize(("steps", "shift", "audio_shift"), [(4, 12.0, 3.0), (9, 5.0, 5.0), (30, 12.0, 3.0)])
def test_fl2va_keys_are_wider_and_apart_from_t2va(repos: dict[str, Path], steps: int, shift: float,
                                                  audio_shift: float) -> None:  # fmt: skip
    """An fl2va step holds its keyframe rows at max(video t, 0.999): 3 distinct timesteps where the video and audio
    ones differ (2 with equal shifts), mirrored exactly by ScheduleKeys; no fl2va key of another width equals a
    t2va key of the same request, and each fl2va key contains its t2va key."""
    t2va = dataclasses.replace(REQUEST, num_inference_steps=steps, flow_shift=shift, audio_flow_shift=audio_shift)
    fl2va = dataclasses.replace(t2va, task="fl2va", first_frame=FIRST)
    pipe = load_pipeline(repos["float32"])
    mirror = ScheduleKeys(repos["float32"])
    assert mirror.keys(fl2va) == plan_keys(pipe, fl2va)
    plain, keyed = mirror.keys(t2va), mirror.keys(fl2va)
    assert max(k.width for k in keyed) == (2 if shift == audio_shift else 3)
    for a, b in zip(plain, keyed, strict=True):
        assert set(a.bits) <= set(b.bits)
        assert a == b or a.width != b.width


DECODES = [("float32", None), ("mixed", None), ("mixed", "float16")]
"""(stored precision, decode dtype; None: the released one, bfloat16 for mixed and float32 for float32). A mixed
repository decoding in float32 is test_decode_dtype_is_the_video_vaes_and_leaves_its_encoder_float32's."""


@pytest.mark.parametrize(("dtype", "decode_dtype"), DECODES)
def test_decode_equals_diffusers(repos: dict[str, Path], dtype: str, decode_dtype: str | None) -> None:
    """ditcore's decode (diffusers' decode steps run on the final latents, the VAEs loaded at the decode dtype and
    shared with fl2va's keyframe encoder) gives exactly the frames (uint8, as output_type "pil" hands them over) and
    the waveform of diffusers' full pipeline loaded with the VAEs at the same dtype (the released recipe for a mixed
    repository: every component at bfloat16), for t2va and fl2va (fl2va alone off the released recipe: the decode
    steps are the same, and fl2va also runs the keyframe encoder on the shared VAE)."""
    import numpy as np

    want_dtype = decode_dtype or released_decode_dtype(dtype)
    released = (dtype, decode_dtype) == ("mixed", None)
    for request in (REQUEST, FL2VA["both"]) if released else (FL2VA["both"],):
        r = request
        kwargs = {n: pil_image(d) for n, d in (("image", r.first_frame), ("last_image", r.last_frame)) if d}
        want = diffusers_outputs(repos[dtype], r.prompt, r.num_inference_steps, r.seed, r.height, r.width,
                                 r.num_frames, r.flow_shift, r.audio_flow_shift, decode=True, decode_dtype=want_dtype,
                                 **kwargs)  # fmt: skip
        pipe = load_pipeline(repos[dtype], dtype)
        decoder = load_decoder(pipe, repos[dtype], want_dtype)
        assert decoder.vae is pipe.vae and decoder.audio_vae is pipe.audio_vae and vae_dtype(pipe) == want_dtype
        video, audio = generate_latents(pipe, request)  # fl2va: the keyframes encoded by the decode-dtype VAE
        assert torch.equal(video, want["latents"]) and torch.equal(audio, want["audio_latents"])
        media = decode(decoder, video, audio)
        frames = np.stack([np.asarray(image) for image in want["videos"][0]])
        assert media.frames.dtype == np.uint8 and media.frames.shape == (r.num_frames, r.height, r.width, 3)
        assert np.array_equal(media.frames, frames)
        assert torch.equal(torch.from_numpy(media.audio), want["audio"][0])
        assert media.audio.shape[0] == 2 and media.sampling_rate == want["sampling_rate"]


def test_decode_dtype_is_the_video_vaes_and_leaves_its_encoder_float32(repos: dict[str, Path]) -> None:
    """At a half decode dtype diffusers' loader keeps the video VAE's encoder path (encoder, quant_conv) and the
    whole audio VAE in float32 (`_keep_in_fp32_modules`): the video decoder is what changes, so the frames differ
    from a float32 decode while the keyframe latents and the waveform are the same bits."""
    import numpy as np

    out = {}
    for decode_dtype in ("float32", "bfloat16"):
        pipe = load_pipeline(repos["mixed"], "mixed")
        decoder = load_decoder(pipe, repos["mixed"], decode_dtype)
        vae = pipe.vae
        assert {p.dtype for p in [*vae.encoder.parameters(), *vae.quant_conv.parameters()]} == {torch.float32}
        assert {p.dtype for p in pipe.audio_vae.parameters()} == {torch.float32}
        assert vae.post_quant_conv.weight.dtype == DECODE_DTYPES[decode_dtype]
        video, audio = generate_latents(pipe, FL2VA["both"])
        out[decode_dtype] = (video, audio, decode(decoder, video, audio))
    (v32, a32, m32), (v16, a16, m16) = out["float32"], out["bfloat16"]
    assert torch.equal(v32, v16) and torch.equal(a32, a16)
    assert np.array_equal(m32.audio, m16.audio)
    assert not np.array_equal(m32.frames, m16.frames)


def test_decode_dtype_default_is_the_release_and_an_unknown_one_is_refused(repos: dict[str, Path]) -> None:
    assert (released_decode_dtype("mixed"), released_decode_dtype("float32")) == ("bfloat16", "float32")
    pipe = load_pipeline(repos["float32"])
    with pytest.raises(ValueError, match=r"decode dtype must be one of \['bfloat16', 'float16', 'float32'\]"):
        load_decoder(pipe, repos["float32"], "float64")
