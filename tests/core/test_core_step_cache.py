"""Step caches (ditcore.step_cache) against the oracle: diffusers' own pipeline with the same cache config enabled
through `enable_cache` (the H3 block registered with diffusers' registry, the loop in one cache context, as
ditcore.step_cache documents diffusers lacks), `torch.equal`, resident and cached (plans built with the sidecar's
builder); a request without a step cache right after one equals the lossless oracle; the skipped block forwards are
counted per step; bad definitions are refused naming the parameter."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from oracle import _pipeline, diffusers_request_latents, released_decode_dtype, stored_precision
from plankit import BuiltPages

from ditcore import GenerationRequest, generate, load_model
from ditcore.step_cache import StepCache, StepCacheError, applied, register_h3_blocks

REQUEST = GenerationRequest(request_id="s", prompt="a red fox", num_inference_steps=12, seed=7)
CACHES = {
    "first_block": {"kind": "first_block", "threshold": 0.3},
    "taylorseer": {"kind": "taylorseer", "cache_interval": 3, "disable_cache_before_step": 2},
    "mag": {"kind": "mag", "threshold": 0.5, "num_inference_steps": 11, "mag_ratios": [1.0] * 11},
}


@contextmanager
def oracle_cache(repo: Path, cache: StepCache, partition: str = "base") -> Iterator[None]:
    """diffusers' pipeline (the oracle's) with `cache` enabled through `enable_cache` on the partition's transformer,
    its loop in one context."""
    precision = stored_precision(repo)
    pipe = _pipeline(str(repo), precision, False, released_decode_dtype(precision), "native")
    transformer = pipe.transformer if partition == "base" else pipe.transformer_ref
    register_h3_blocks()
    transformer.enable_cache(cache.config())
    try:
        with transformer.cache_context("cond"):
            yield
    finally:
        transformer.disable_cache()


def run(model: Any, cache: StepCache | None, plans: Any = None) -> tuple[torch.Tensor, torch.Tensor, Any]:
    with applied(model.transformer_of("base"), cache) as counts:
        result = generate(model, REQUEST, plans)
    return result.video, result.audio, counts


@pytest.fixture(scope="module")
def models(tiny_ckpt: Path) -> dict[str, tuple[Any, Any]]:
    return {"resident": (load_model(tiny_ckpt, "resident"), None),
            "cached": (load_model(tiny_ckpt, "cached"), BuiltPages(tiny_ckpt))}  # fmt: skip


@pytest.mark.parametrize("name", list(CACHES))
@pytest.mark.parametrize("mode", ["resident", "cached"])
def test_a_step_cache_equals_diffusers_with_the_same_config(name: str, mode: str, models: Any, tiny_ckpt: Path) -> None:
    cache = StepCache.parse(CACHES[name], name)
    model, plans = models[mode]
    video, audio, counts = run(model, cache, plans)
    with oracle_cache(tiny_ckpt, cache):
        ref_video, ref_audio = diffusers_request_latents(tiny_ckpt, REQUEST)
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)
    lossless_video, _ = diffusers_request_latents(tiny_ckpt, REQUEST)
    assert not torch.equal(video, lossless_video)  # the cache did skip work
    assert counts.steps == REQUEST.num_inference_steps - 1 and counts.skipped_fraction > 0
    after_video, after_audio, plain = run(model, None, plans)  # the hooks are gone: lossless bits again
    assert torch.equal(after_video, lossless_video) and torch.equal(
        after_audio, diffusers_request_latents(tiny_ckpt, REQUEST)[1]
    )
    assert plain.skipped_fraction == 0
    assert plain.attention == plain.feed_forward == [plain.blocks] * (REQUEST.num_inference_steps - 1)


@pytest.mark.parametrize("task", ["fl2va", "ref2va"])
def test_keyframe_and_reference_tasks_with_a_step_cache_equal_diffusers(
    task: str, models: Any, tiny_ckpt: Path
) -> None:
    from refmedia import image_bytes

    from ditcore.references import Reference

    extra: dict[str, Any] = ({"first_frame": image_bytes(64, 48, seed=2)} if task == "fl2va"
                             else {"references": (Reference(image_bytes(80, 48, seed=1)),)})  # fmt: skip
    request = GenerationRequest(**{**vars(REQUEST), "task": task, **extra})
    cache = StepCache.parse(CACHES["taylorseer"], "taylorseer")
    for mode in ("resident", "cached"):
        model, plans = models[mode]
        with applied(model.transformer_of(request.partition), cache) as counts:
            result = generate(model, request, plans)
        with oracle_cache(tiny_ckpt, cache, request.partition):
            ref_video, ref_audio = diffusers_request_latents(tiny_ckpt, request)
        assert torch.equal(result.video, ref_video) and torch.equal(result.audio, ref_audio), mode
        assert counts.skipped_fraction > 0
    assert not torch.equal(result.video, diffusers_request_latents(tiny_ckpt, request)[0])


def test_first_block_cache_skips_whole_blocks_but_never_the_first(models: Any) -> None:
    model, _ = models["resident"]
    _, _, counts = run(model, StepCache.parse({"kind": "first_block", "threshold": 10.0}, "x"))
    assert counts.attention[0] == counts.feed_forward[0] == counts.blocks  # the first step computes every block
    assert set(counts.attention[1:]) == set(counts.feed_forward[1:]) == {1}  # then only block 0, whose output decides
    assert counts.skipped == [0.0] + [counts.blocks - 1.0] * (counts.steps - 1)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"kind": "teacache"}, "kind 'teacache' is not one of"),
        ({"kind": "sea"}, "kind 'sea' is not one of"),
        ({"threshold": 0.1}, 'an object with a "kind"'),
        ({"kind": "first_block", "treshold": 0.1}, "first_block takes no parameter 'treshold'"),
        ({"kind": "first_block", "threshold": float("nan")}, "threshold must be a finite number"),
        ({"kind": "mag", "threshold": 0.1}, "needs the model's calibrated mag_ratios"),
    ],
)
def test_bad_definitions_are_refused_naming_the_parameter(data: dict[str, Any], message: str) -> None:
    with pytest.raises(StepCacheError, match=message):
        StepCache.parse(data, "levels.toml [fast]")
