"""The memory and time model (ditcore.sizing, ditcore.footprint) against hand arithmetic at the released shapes, and against the tiny
model a server loads. The released components are counted on the meta device once per module (a few seconds)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from ditcore import GenerationRequest, load_model
from ditcore.footprint import Components, memory_report, meta_components, preset_shapes
from ditcore.repo import TEXT_LAYERS
from ditcore.request import MODEL_LIMITS, RequestError, RequestLimits, check_canvas
from ditcore.sizing import DEVICE_CLASSES, Canvas, ModelShapes, device_class

MAX = Canvas(768, 1344, 345)  # the released maximum canvas, a 256-token prompt, decoded
GIB = 1024**3
# released shapes, by hand: hidden, heads x head_dim, ffn, blocks, refiner blocks
D, INNER, F, L, R = 5376, 56 * 128, 14336, 50, 2


@pytest.fixture(scope="module")
def h3() -> Components:
    return meta_components(preset="h3")


@pytest.fixture(scope="module")
def shapes(h3: Components) -> ModelShapes:
    return ModelShapes.of_components(h3, "mixed", text_layers=TEXT_LAYERS)


def test_released_maximum_canvas_is_about_104k_tokens(shapes: ModelShapes) -> None:
    # 345 = 17 x 20 + 5 frames -> 5 x 20 + 2 = 102 latent frames; 768 / 32 = 24 and 1344 / 32 = 42 rows per frame;
    # 345 / 24 s x 40 = 575 audio latents per stereo channel
    t = shapes.tokens(MAX)
    assert (t.video, t.condition, t.audio, t.text) == (102 * 24 * 42, 0, 2 * 575, 256)
    assert t.total == 104_222
    # fl2va: each keyframe adds one latent frame of rows and a vision block (smart_resize -> 736 x 1312 -> 23 x 41
    # image tokens, its two markers and a label)
    both = shapes.tokens(dataclasses.replace(MAX, keyframes=2))
    assert both.condition == 2 * 24 * 42
    assert both.text == 256 + 2 * (23 * 41 + 2 + 13)
    # the shortest video at the smallest canvas: 124 frames -> 37 latent frames of one row
    assert shapes.tokens(Canvas(32, 32, 124, prompt_tokens=1)).total == 37 + 2 * round(124 / 24 * 40) + 1


def test_step_flops_and_time_against_the_issues_estimate(shapes: ModelShapes) -> None:
    s, sv, sa, st = 104_222, 102_816, 1_150, 256
    block = 4 * D * INNER + 3 * D * F
    linear = 2 * s * (L * block + D * (96 + 32)) + 2 * sv * 96 * D + 2 * sa * 32 * D + 2 * st * (5120 * D + R * block)
    attention = 4 * L * s * s * INNER + 4 * R * st * st * INNER
    assert shapes.step_flops(MAX) == (linear, attention)
    assert 0.78 < attention / (linear + attention) < 0.81  # "at 104k tokens attention is about 80% of the FLOPs"
    h200 = DEVICE_CLASSES["h200"]
    step = shapes.step_time_s(MAX, h200)
    assert step == pytest.approx((linear + attention) / (989e12 * 0.45))
    assert 32 <= step <= 50  # the issue's own estimate for one H200
    assert shapes.step_time_s(MAX, DEVICE_CLASSES["cpu"]) > 3600  # hours per step on a host: the model says don't


def test_activation_peak_of_a_step_against_hand_arithmetic(shapes: ModelShapes) -> None:
    s, media, st, r = 104_222, 102_816 + 1_150, 256, 6 * 16
    held = s * D * 2 + media * D * 4 + st * D * 2 + 2 * s * r * 4
    mlp = s * (3 * D + 4 * F) * 2 + 2 * s * r * 2  # the widest transient at the released shapes
    assert shapes.step_bytes(MAX) == held + mlp
    assert 16 * GIB < shapes.step_bytes(MAX) < 19 * GIB
    # a backend that materializes the (h, S, S) scores adds scores and softmax: 2.4 TB at this canvas
    math_backend = dataclasses.replace(shapes, attention_backend="_native_math")
    attention = math.ceil(s * (D + 5.25 * INNER) * 2) + 2 * 56 * s * s * 2 + 2 * s * r * 2
    assert math_backend.step_bytes(MAX) == held + attention
    assert math_backend.activations(MAX).peak > 2 * 10**12


def test_decode_and_text_peaks(shapes: ModelShapes) -> None:
    v = 3 * 345 * 768 * 1344  # pixel values
    tile_tokens = 7 * 16 * 16 + 4 + 1  # 5 + 2 latent frames per clip, a 256 px tile is 16 x 16 latents, registers
    dv = 32 * 64
    tile = tile_tokens * (3 * dv * 4 + (4 * 4 * dv + 3 * dv) * 2)
    assert shapes.decode_bytes(MAX) == max(2 * v * 2, v * 2 + 8 * v) + tile
    assert shapes.decode_bytes(dataclasses.replace(MAX, decodes=False)) == 0
    cpu = dataclasses.replace(shapes, device_type="cpu")  # + the uint8 frames and one conversion chunk
    assert cpu.decode_bytes(MAX) == shapes.decode_bytes(MAX) + v + 3 * 64 * 2**20
    # the trimmed Qwen3-VL keeps 52 hidden states of the 256 prompt tokens
    assert shapes.text_bytes(MAX) == 52 * 256 * 5120 * 2 + 256 * (5120 + 3 * 25600) * 2
    assert dataclasses.replace(shapes, text_on_device=False).text_bytes(MAX) == 0
    # one H200 decodes the released canvas in seconds at bf16 and in minutes at float32 (no tensor cores)
    h200 = DEVICE_CLASSES["h200"]
    assert (
        shapes.decode_time_s(MAX, h200)
        < 60
        < dataclasses.replace(shapes, decode_dtype="float32").decode_time_s(MAX, h200)
    )


def test_weights_and_totals_per_process(h3: Components, shapes: ModelShapes) -> None:
    report = memory_report(h3, shapes, MAX)
    w = {(x.name, x.variant): x for x in report.weights}
    resident, cached = w["transformer", "resident"], w["transformer", "cached"]
    assert resident.params == 33_122_992_896
    # cached holds everything but the plan tensors: every block's adaln_proj and norm_out.linear, bf16
    assert resident.bytes - cached.bytes == (L * 18 * D + 2 * D) * (2688 + 1) * 2 == 26_078_739_456
    whole, trimmed = w["text_encoder", "whole"], w["text_encoder", f"{TEXT_LAYERS} layers, no lm_head"]
    assert whole.params == 33_357_390_064  # Qwen3-VL-32B: 62.13 GiB in bf16, as the issue says
    layer = 5120 * 8192 * 2 + 5120 * 1024 * 2 + 3 * 5120 * 25600 + 2 * 5120 + 2 * 128  # q, o, k, v, MLP, norms
    assert whole.params - trimmed.params == 13 * layer + 151936 * 5120  # 13 layers above 51, and lm_head
    assert 13.0 * GIB < whole.bytes - trimmed.bytes < 13.5 * GIB
    assert report.slab_bytes == 128 * 3 * 4_849_152 * 2
    totals = report.totals
    rest = trimmed.bytes + w["vae", "bfloat16"].bytes + w["audio_vae", "float32"].bytes + report.activations.peak
    assert totals["cached"]["generator"] == cached.bytes + rest
    assert totals["resident"]["generator"] == resident.bytes + rest
    assert (
        totals["cached"]["sidecar"] == report.slab_bytes + report.rebuild_bytes and totals["resident"]["sidecar"] == 0
    )
    # one H200 holds both at the released maximum canvas; the plan cache leaves ~20 GiB more free
    assert totals["cached"]["free"] - totals["resident"]["free"] > 20 * GIB
    assert totals["resident"]["free"] > 0


def test_device_classes_and_canvas_rules() -> None:
    assert device_class("NVIDIA H200").name == "h200" and device_class("NVIDIA H100 80GB HBM3").name == "h100"
    assert device_class("cpu").name == "cpu" and device_class("NVIDIA A10G").name == "cuda"
    check_canvas(768, 1344, 345)  # the released maximum is inside the default envelope, either orientation
    check_canvas(1344, 768, 345)
    with pytest.raises(RequestError, match=r"at most 1,032,192 pixels \(768 x 1344") as info:
        check_canvas(1344, 1344, 124)
    assert info.value.field == "width"
    with pytest.raises(RequestError, match=r"\[32, 1344\]"):
        check_canvas(1376, 768, 124)
    check_canvas(2048, 2048, 345, MODEL_LIMITS)  # an operator may raise the limits up to the hard caps
    check_canvas(1344, 1344, 124, RequestLimits(max_pixels=1344 * 1344))


def test_a_loaded_tiny_model_is_modeled_as_it_runs(tiny_ckpt: Path) -> None:
    model = load_model(tiny_ckpt, "resident")
    shapes = ModelShapes.of_model(model)
    preset = preset_shapes("tiny")
    assert (shapes.transformer, shapes.video_decoder, shapes.text) == (
        preset.transformer,
        preset.video_decoder,
        preset.text,
    )
    assert (shapes.compute_dtype, shapes.decode_dtype, shapes.device_type) == ("bfloat16", model.decode_dtype, "cpu")
    assert shapes.attention_backend == model.attention_backend
    request = GenerationRequest(prompt="a red fox", height=64, width=96, num_frames=141)
    small, big = (shapes.activations(Canvas.of(r)).peak for r in (request, dataclasses.replace(request, height=768)))
    assert 0 < small < big  # the peak grows with the canvas
