"""ditcore.attention: the served transformer's attention backend is one of diffusers' names (an unknown one refused,
listing them), "auto" resolves to what runs on the device ("native" on CPU) by a real call, falling back with a log
line; the backend is set on the transformer alone (the VAEs keep the process default), it survives the copies an
update makes, and the oracle run under the same backend gives the model's exact latents, resident and cached."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from oracle import diffusers_request_latents

import ditcore.attention as attention
from ditcore import GenerationRequest, H3Model, generate, load_model, validate_checkpoint
from ditcore.attention import AttentionBackendError
from ditcore.model import RunOptions
from plancache_service.cache import PlanCache
from plancache_service.config import CacheConfig
from plancache_service.embedded import EmbeddedPlanProvider
from plancache_service.rebuild import RebuildSource

dispatch = pytest.importorskip("diffusers.models.attention_dispatch")

REQUEST = GenerationRequest(request_id="a1", prompt="a kite over the dunes", num_inference_steps=3, seed=4,
                            height=32, width=32, num_frames=124)  # fmt: skip
CPU = torch.device("cpu")


def test_names_are_diffusers_and_an_unknown_one_is_refused_naming_them() -> None:
    assert attention.backend_names() == tuple(b.value for b in dispatch.AttentionBackendName)
    for name in ("auto", "native", "_native_cudnn", "flash"):
        attention.check_name(name)
    with pytest.raises(AttentionBackendError, match="got 'fast'") as e:
        attention.check_name("fast")
    assert all(n in str(e.value) for n in ("auto", "native", "_native_cudnn", "_native_flash", "flash", "_flash_3"))
    with pytest.raises(ValueError, match="attention backend must be one of auto, "):
        RunOptions(attention_backend="fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_is_native_on_cpu_and_a_backend_that_cannot_run_is_refused(dtype: torch.dtype) -> None:
    assert attention.resolve("auto", CPU, dtype, 2, 32) == "native"
    assert attention.resolve("_native_math", CPU, dtype, 2, 32) == "_native_math"
    with pytest.raises(AttentionBackendError, match=r"'_native_cudnn' does not run on cpu") as e:
        attention.resolve("_native_cudnn", CPU, dtype, 2, 32)
    usable = str(e.value).split("usable: ")[1].split(", ")
    assert usable[0] == "auto" and {"native", "_native_math"} <= set(usable)
    assert not {"_native_cudnn", "_native_efficient", "flash", "_flash_3", "xformers"} & set(usable)


def test_auto_falls_back_past_a_backend_that_does_not_run_with_a_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(attention, "CPU_PREFERENCE", ("_native_cudnn", "_native_math", "native"))
    with caplog.at_level(logging.INFO, logger="ditcore.attention"):
        assert attention.resolve("auto", CPU, torch.bfloat16, 2, 32) == "_native_math"
    skipped = [r.getMessage() for r in caplog.records if "_native_cudnn does not run on cpu" in r.getMessage()]
    assert skipped and "No viable backend" in skipped[0]
    assert any("attention backend: _native_math (auto on cpu" in r.getMessage() for r in caplog.records)


def test_a_kernel_that_runs_but_gives_wrong_attention_is_not_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe compares the backend's output with math attention: a kernel returning zeros is refused."""
    name = dispatch.AttentionBackendName._NATIVE_FLASH
    assert attention.probe(name.value, CPU, torch.float32, 2, 32) is None
    broken = lambda query, key, value, **_: torch.zeros_like(query)  # noqa: E731
    monkeypatch.setitem(dispatch._AttentionBackendRegistry._backends, name, broken)
    why = attention.probe(name.value, CPU, torch.float32, 2, 32)
    assert why is not None and "away from math attention" in why
    with pytest.raises(AttentionBackendError, match="away from math attention"):
        attention.resolve(name.value, CPU, torch.float32, 2, 32)


def _processors(module: Any) -> list[Any]:
    return [m.processor for m in attention._attention_modules(module)]


def test_the_backend_is_set_on_the_transformer_alone_and_survives_an_update_copy(tiny_ckpt: Path) -> None:
    default_before = dispatch._AttentionBackendRegistry.get_active_backend()[0]
    model = load_model(tiny_ckpt, "resident", options=RunOptions(attention_backend="_native_math"))
    assert model.attention_backend == "_native_math"
    assert {p._attention_backend for p in _processors(model.transformer)} == {
        dispatch.AttentionBackendName._NATIVE_MATH
    }
    vae_processors = _processors(model.pipe.vae) + _processors(model.pipe.audio_vae)
    assert vae_processors and {p._attention_backend for p in vae_processors} == {None}
    assert dispatch._AttentionBackendRegistry.get_active_backend()[0] == default_before  # the process default
    bias = model.transformer.state_dict()["proj_out.bias"]
    assert model.with_tensors({"proj_out.bias": bias + 0.5}).attention_backend == "_native_math"  # UpdateWeights
    assert load_model(tiny_ckpt, "resident").attention_backend == "native"  # auto on CPU


@pytest.fixture
def embedded(tiny_ckpt: Path) -> Iterator[EmbeddedPlanProvider]:
    """The served cached path in process: a host-memory slab built by the sidecar's rebuild code."""
    info = validate_checkpoint(tiny_ckpt)
    cache = PlanCache(CacheConfig(gpu_plans=8, plan_width=2, host_cache_bytes=0), RebuildSource(info, CPU))
    try:
        yield EmbeddedPlanProvider(cache)
    finally:
        cache.close()


@pytest.mark.parametrize("backend", ["native", "_native_math"])
def test_the_oracle_under_the_models_backend_gives_its_latents(
    tiny_ckpt: Path, embedded: EmbeddedPlanProvider, backend: str
) -> None:
    """Resident and cached, the model's latents are diffusers' own with the same backend on diffusers' transformer;
    the two backends' latents differ, so the backend is the one each forward ran."""
    models: dict[str, H3Model] = {
        m: load_model(tiny_ckpt, m, options=RunOptions(backend)) for m in ("resident", "cached")
    }
    resident, cached = generate(models["resident"], REQUEST), generate(models["cached"], REQUEST, embedded)
    video, audio = diffusers_request_latents(tiny_ckpt, REQUEST, attention_backend=backend)
    for result in (resident, cached):
        assert result.attention_backend == backend
        assert torch.equal(result.video, video) and torch.equal(result.audio, audio)
    other = "_native_math" if backend == "native" else "native"
    other_video, _ = diffusers_request_latents(tiny_ckpt, REQUEST, attention_backend=other)
    assert not torch.equal(other_video, video)
