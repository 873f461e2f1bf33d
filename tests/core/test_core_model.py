"""ditcore.model and ditcore.generation: `generate` on a resident or cached H3Model gives diffusers' own latents
(torch.equal), reports steps and timings, releases its lease in every outcome, and a cached model holds no plan
tensor."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from oracle import diffusers_request_latents
from repokit import strip_plan_tensors

from ditcore import CacheReport, GenerationRequest, PlanBuilder, PlanKey, RequestError, generate, load_model
from ditcore.checkpoint import validate_checkpoint
from ditcore.plans import is_plan_tensor
from ditcore.repo import write_repository

REQUEST = GenerationRequest(request_id="m1", prompt="waves on a rocky shore", num_inference_steps=5, seed=3,
                            height=32, width=64, num_frames=141, flow_shift=9.0, audio_flow_shift=2.5)  # fmt: skip


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("h3model")
    return {d: write_repository(base / d, "tiny", seed=5, dtype=d) for d in ("float32", "mixed")}


class BuiltLease:
    def __init__(self, pages: dict[PlanKey, torch.Tensor], keys: Sequence[PlanKey]) -> None:
        self._pages, self._keys = pages, list(keys)
        self.released = 0

    @property
    def report(self) -> CacheReport:
        return CacheReport(built_plans=len(self._pages))

    def pages(self, step: int) -> torch.Tensor:
        return self._pages[self._keys[step]]

    def release(self) -> None:
        self.released += 1


class BuildingProvider:
    """Builds each request's plans with ditcore's PlanBuilder (the sidecar's page computation), no cache."""

    def __init__(self, repo: Path) -> None:
        self.builder = PlanBuilder(repo / "transformer")
        self.leases: list[BuiltLease] = []

    def acquire(self, keys: Sequence[PlanKey]) -> BuiltLease:
        distinct = list(dict.fromkeys(keys))
        outputs = [torch.empty(k.width, self.builder.layout.page_numel, dtype=self.builder.projection_dtype)
                   for k in distinct]  # fmt: skip
        self.builder.build(distinct, outputs)
        self.leases.append(BuiltLease(dict(zip(distinct, outputs, strict=True)), keys))
        return self.leases[-1]


@pytest.mark.parametrize("dtype", ["float32", "mixed"])
def test_resident_and_cached_equal_diffusers(repos: dict[str, Path], dtype: str) -> None:
    ref_video, ref_audio = diffusers_request_latents(repos[dtype], REQUEST)
    resident = generate(load_model(repos[dtype], "resident"), REQUEST)
    provider = BuildingProvider(repos[dtype])
    steps: list[tuple[int, int]] = []
    cached = generate(load_model(repos[dtype], "cached"), REQUEST, provider, on_step=lambda i, n: steps.append((i, n)))
    for result in (resident, cached):
        assert result.video.shape == (1, 24, 42, 2, 4) and result.audio.shape == (2, 32, 235)
        assert torch.equal(result.video, ref_video) and torch.equal(result.audio, ref_audio)
    assert resident.sha256 == cached.sha256
    assert steps == [(i, 4) for i in range(1, 5)]
    assert cached.cache == CacheReport(built_plans=4) and provider.leases[0].released == 1
    assert set(cached.timings_ms) == {"plans", "encode", "denoise", "total"}


def test_cached_model_holds_no_plan_tensor_and_reports_the_saving(repos: dict[str, Path]) -> None:
    info = validate_checkpoint(repos["mixed"])
    cached, resident = load_model(info, "cached"), load_model(info, "resident")
    assert not [n for n in cached.transformer.state_dict() if is_plan_tensor(n)]
    mem, full = cached.memory(), resident.memory()
    # both partitions' (transformer/ and transformer_ref/, one layout)
    assert mem.plan_tensor_bytes == full.plan_tensor_bytes == 2 * info.layout.plan_tensor_bytes(torch.bfloat16)
    assert (mem.held_plan_bytes, mem.saved_fraction) == (0, 1.0)
    assert (full.held_plan_bytes, full.saved_fraction) == (full.plan_tensor_bytes, 0.0)
    assert full.transformer_bytes - mem.transformer_bytes == full.plan_tensor_bytes


def test_cached_model_loads_a_repository_without_plan_tensors(repos: dict[str, Path], tmp_path: Path) -> None:
    repo = tmp_path / "stripped"
    shutil.copytree(repos["float32"], repo)
    strip_plan_tensors(repo)
    info = validate_checkpoint(repo, require_adaln=False)
    assert not info.has_adaln
    with pytest.raises(ValueError, match="native adaln_proj"):
        load_model(info, "resident")
    provider = BuildingProvider(repos["float32"])  # plans come from elsewhere: the original repository
    out = generate(load_model(info, "cached"), REQUEST, provider)
    assert out.sha256 == generate(load_model(repos["float32"], "resident"), REQUEST).sha256


def test_lease_released_when_a_step_callback_aborts(repos: dict[str, Path]) -> None:
    provider = BuildingProvider(repos["float32"])

    def abort(done: int, total: int) -> None:
        if done == 2:
            raise RuntimeError("cancelled at step 2")

    with pytest.raises(RuntimeError, match="step 2"):
        generate(load_model(repos["float32"], "cached"), REQUEST, provider, on_step=abort)
    assert provider.leases[0].released == 1


def test_mode_and_request_are_checked_before_any_lease(repos: dict[str, Path]) -> None:
    provider = BuildingProvider(repos["float32"])
    cached = load_model(repos["float32"], "cached")
    with pytest.raises(ValueError, match="needs a plan provider"):
        generate(cached, REQUEST)
    with pytest.raises(ValueError, match="takes no plan provider"):
        generate(load_model(repos["float32"], "resident"), REQUEST, provider)
    with pytest.raises(RequestError, match="num_frames"):
        generate(cached, dataclasses.replace(REQUEST, num_frames=130), provider)
    assert provider.leases == []


def test_with_tensors_changes_only_the_copy(repos: dict[str, Path]) -> None:
    model = load_model(repos["float32"], "resident")
    before = generate(model, REQUEST).sha256
    bias = model.transformer.state_dict()["proj_out.bias"]
    other = model.with_tensors({"proj_out.bias": bias + 0.5})
    assert generate(other, REQUEST).sha256 != before
    assert generate(model, REQUEST).sha256 == before
    assert other.pipe.text_encoder is model.pipe.text_encoder  # only the transformer is copied


def test_fl2va_cached_decodes_after_the_lease_and_equals_diffusers(repos: dict[str, Path]) -> None:
    """A cached fl2va request asking for media: the latents equal diffusers' fl2va latents, its plans are 3 wide,
    the lease is released once, and the decoded frames / waveform are diffusers' decode of those latents (timed as
    "decode")."""
    import io

    import numpy as np
    from PIL import Image

    from ditcore.decode import decode

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(4).integers(0, 256, (40, 72, 3), dtype=np.uint8)).save(buf, format="PNG")
    request = dataclasses.replace(REQUEST, task="fl2va", first_frame=buf.getvalue(), output_type="mp4")
    ref_video, ref_audio = diffusers_request_latents(repos["float32"], request)
    model = load_model(repos["float32"], "cached")
    assert max(k.width for k in model.plan_keys(request)) == 3
    provider = BuildingProvider(repos["float32"])
    result = generate(model, request, provider)
    assert torch.equal(result.video, ref_video) and torch.equal(result.audio, ref_audio)
    assert provider.leases[0].released == 1
    assert set(result.timings_ms) == {"plans", "encode", "denoise", "decode", "total"}
    assert result.media is not None
    want = decode(model.decoder, ref_video, ref_audio)
    assert result.media.frames.shape == (141, 32, 64, 3) and np.array_equal(result.media.frames, want.frames)
    assert np.array_equal(result.media.audio, want.audio) and result.media.sampling_rate == want.sampling_rate
    assert (
        generate(load_model(repos["float32"], "resident"), dataclasses.replace(request, output_type="latents")).media
        is None
    )
