"""The denoise loop: determinism, cached == resident bit for bit, guidance, shapes, sha256."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from servicekit import REPO_ROOT

from ditcore import (
    DiT,
    GenerationRequest,
    LocalPlanProvider,
    RequestError,
    generate,
    get_preset,
    latents_sha256,
    load_model,
    validate_checkpoint,
    write_checkpoint,
)

TINY = get_preset("tiny")

BASE = GenerationRequest(
    request_id="gen",
    task="t2v",
    prompt="a cat on a skateboard",
    negative_prompt="low quality",
    steps=6,
    flow_shift=5.0,
    guidance_scale=5.0,
    seed=7,
    frames=5,
    height=32,
    width=32,
    audio_length=8,
)
T2VA = dataclasses.replace(BASE, task="t2va", audio_flow_shift=2.5)


@dataclasses.dataclass
class Models:
    resident: DiT
    cached: DiT
    provider: LocalPlanProvider


def _models(root: Path) -> Models:
    info = validate_checkpoint(root)
    cached = load_model(info, "cached")
    return Models(load_model(info, "resident"), cached, LocalPlanProvider(info, cached.time_embed))


@pytest.fixture(scope="module")
def models(tiny_ckpt: Path) -> Models:
    return _models(tiny_ckpt)


@pytest.fixture(scope="module")
def bf16_models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    root = write_checkpoint(TINY.replace(dtype="bfloat16"), tmp_path_factory.mktemp("bf16") / "ckpt", seed=0)
    return _models(root)


def _assert_same(
    a_video: torch.Tensor, a_audio: torch.Tensor | None, b_video: torch.Tensor, b_audio: torch.Tensor | None
) -> None:
    assert torch.equal(a_video, b_video)
    assert (a_audio is None) == (b_audio is None)
    if a_audio is not None and b_audio is not None:
        assert torch.equal(a_audio, b_audio)


# ----------------------------------------------------------------------------- determinism
def test_same_request_same_sha(models: Models) -> None:
    a = generate(models.resident, BASE)
    b = generate(models.resident, BASE)
    assert a.sha256 == b.sha256
    _assert_same(a.video, a.audio, b.video, b.audio)
    c = generate(models.cached, BASE, models.provider)
    d = generate(models.cached, BASE, models.provider)
    assert c.sha256 == d.sha256 == a.sha256


def test_deterministic_across_processes(models: Models, tiny_ckpt: Path) -> None:
    req = GenerationRequest(
        request_id="req-0", prompt="a lighthouse", steps=4, height=32, width=48, seed=3, guidance_scale=3.0
    )
    expected = generate(models.resident, req).sha256
    argv = [
        sys.executable, "-m", "ditserve", "generate-local", "--checkpoint", str(tiny_ckpt),
        "--prompt", "a lighthouse", "--steps", "4", "--height", "32", "--width", "48",
        "--seed", "3", "--guidance-scale", "3",
    ]  # fmt: skip
    # two fresh interpreters, run concurrently
    procs = [
        subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    shas = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            lines = [json.loads(line) for line in out.splitlines() if line.strip()]
            assert len(lines) == 1
            assert lines[0]["request_id"] == "req-0"
            shas.append(lines[0]["sha256"])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert shas == [expected, expected]


# ----------------------------------------------------------------------------- cached == resident
@pytest.mark.parametrize("task", ["t2v", "t2va"])
@pytest.mark.parametrize("guidance", [5.0, 1.0])
def test_cached_equals_resident(models: Models, task: str, guidance: float) -> None:
    req = dataclasses.replace(T2VA if task == "t2va" else BASE, guidance_scale=guidance)
    if task == "t2va":
        assert req.audio_flow_shift != req.flow_shift
        widths = [sp.key.width for sp in req.schedule_spec().step_plans()]
        assert 2 in widths  # the width-2 plans are exercised
    want = generate(models.resident, req)
    got = generate(models.cached, req, models.provider)
    _assert_same(got.video, got.audio, want.video, want.audio)
    assert got.sha256 == want.sha256
    assert want.cache is None
    assert got.cache is not None
    assert set(got.cache.to_dict()) == {
        "gpu_hit_plans",
        "host_hit_plans",
        "built_plans",
        "rebuild_s",
        "swap_in_s",
        "host_stored",
    }
    assert got.cache.built_plans == len(set(req.schedule_spec().plan_keys())) == req.steps


def test_cached_equals_resident_equal_audio_shift(models: Models) -> None:
    req = dataclasses.replace(T2VA, audio_flow_shift=None, steps=5)
    assert all(sp.key.width == 1 for sp in req.schedule_spec().step_plans())
    want = generate(models.resident, req)
    got = generate(models.cached, req, models.provider)
    _assert_same(got.video, got.audio, want.video, want.audio)
    # None means "same as flow_shift"
    explicit = generate(models.resident, dataclasses.replace(req, audio_flow_shift=req.flow_shift))
    assert explicit.sha256 == want.sha256


@pytest.mark.parametrize("task", ["t2v", "t2va"])
def test_bfloat16_cached_equals_resident(bf16_models: Models, task: str) -> None:
    req = dataclasses.replace(T2VA if task == "t2va" else BASE, steps=5)
    assert bf16_models.resident.video_embed.weight.dtype == torch.bfloat16
    want = generate(bf16_models.resident, req)
    got = generate(bf16_models.cached, req, bf16_models.provider)
    assert want.video.dtype == torch.float32  # latents stay float32
    _assert_same(got.video, got.audio, want.video, want.audio)
    assert torch.isfinite(want.video).all()


def test_cached_model_needs_a_provider(models: Models) -> None:
    with pytest.raises(ValueError, match="plan provider"):
        generate(models.cached, BASE)


# ----------------------------------------------------------------------------- sensitivity
@pytest.mark.parametrize(
    "change",
    [
        {"seed": 8},
        {"prompt": "a dog on a skateboard"},
        {"negative_prompt": "oversaturated"},
        {"steps": 7},
        {"flow_shift": 3.0},
        {"guidance_scale": 4.0},
    ],
    ids=lambda c: next(iter(c)),
)
def test_different_inputs_different_sha(models: Models, change: dict[str, object]) -> None:
    base = generate(models.resident, BASE).sha256
    assert generate(models.resident, dataclasses.replace(BASE, **change)).sha256 != base


def test_audio_shift_changes_t2va(models: Models) -> None:
    a = generate(models.resident, T2VA)
    b = generate(models.resident, dataclasses.replace(T2VA, audio_flow_shift=4.0))
    assert a.audio is not None and b.audio is not None
    assert not torch.equal(a.audio, b.audio)


def test_request_id_does_not_change_output(models: Models) -> None:
    a = generate(models.resident, BASE)
    b = generate(models.resident, dataclasses.replace(BASE, request_id="other"))
    assert b.request_id == "other"
    assert a.sha256 == b.sha256


def test_guidance_changes_output(models: Models) -> None:
    assert BASE.prompt != BASE.negative_prompt
    guided = generate(models.resident, BASE)
    unguided = generate(models.resident, dataclasses.replace(BASE, guidance_scale=1.0))
    assert not torch.equal(guided.video, unguided.video)
    assert guided.sha256 != unguided.sha256
    # guidance_scale <= 1 disables CFG entirely: the negative prompt no longer matters
    other_neg = generate(models.resident, dataclasses.replace(BASE, guidance_scale=1.0, negative_prompt="xyz"))
    assert other_neg.sha256 == unguided.sha256


# ----------------------------------------------------------------------------- outputs
@pytest.mark.parametrize("task", ["t2v", "t2va"])
def test_sha256_definition(models: Models, task: str) -> None:
    res = generate(models.resident, dataclasses.replace(T2VA if task == "t2va" else BASE, steps=4))
    assert res.video.dtype == torch.float32 and res.video.is_contiguous()
    data = res.video.numpy().astype("<f4").tobytes()
    if task == "t2va":
        assert res.audio is not None and res.audio.dtype == torch.float32
        data += res.audio.numpy().astype("<f4").tobytes()
    else:
        assert res.audio is None
    assert res.sha256 == hashlib.sha256(data).hexdigest()
    assert res.sha256 == latents_sha256(res.video, res.audio)


@pytest.mark.parametrize(
    ("frames", "height", "width", "audio_length"),
    [(1, 16, 16, 1), (5, 32, 48, 8), (9, 64, 16, 32), (17, 16, 32, 3)],
)
def test_output_shapes_follow_request(models: Models, frames: int, height: int, width: int, audio_length: int) -> None:
    req = dataclasses.replace(
        T2VA, steps=1, guidance_scale=1.0, frames=frames, height=height, width=width, audio_length=audio_length
    )
    res = generate(models.resident, req)
    assert res.video.shape == (TINY.video_channels, (frames - 1) // 4 + 1, height // 8, width // 8)
    assert res.video.shape == req.video_latent_shape(TINY)
    assert res.audio is not None
    assert res.audio.shape == (TINY.audio_channels, audio_length)
    assert torch.isfinite(res.video).all() and torch.isfinite(res.audio).all()
    t2v = generate(models.resident, dataclasses.replace(req, task="t2v"))
    assert t2v.audio is None
    assert t2v.video.shape == res.video.shape


def test_steps_callback_and_timings(models: Models) -> None:
    seen: list[tuple[int, int]] = []
    res = generate(models.cached, BASE, models.provider, on_step=lambda i, n: seen.append((i, n)))
    assert seen == [(i, BASE.steps) for i in range(1, BASE.steps + 1)]
    assert set(res.timings_ms) >= {"encode", "plans", "denoise", "total"}
    assert all(v >= 0 for v in res.timings_ms.values())


def test_generate_validates_the_request(models: Models) -> None:
    with pytest.raises(RequestError) as ei:
        generate(models.resident, dataclasses.replace(BASE, height=72))
    assert ei.value.field == "height"
