"""H3's request rules: every bad field raises RequestError naming the field and stating the rule; good ones pass."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from ditcore.request import (
    MAX_FRAMES,
    MIN_FRAMES,
    GenerationRequest,
    RequestError,
    RequestLimits,
    infer_task,
)

GOOD = GenerationRequest(prompt="a red fox")


def png(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 10)).save(buf, format="PNG")
    return buf.getvalue()


PNG, WIDE = png(64, 48), png(100, 20)


def test_defaults_are_a_valid_t2va_request() -> None:
    req = GOOD.validate()
    assert (req.task, req.num_inference_steps, req.flow_shift, req.audio_flow_shift) == ("t2va", 50, 12.0, 3.0)
    assert (req.height, req.width, req.num_frames, req.steps) == (32, 32, 124, 49)


def test_frame_range_is_five_to_fifteen_seconds_of_17n_plus_5() -> None:
    assert (MIN_FRAMES, MAX_FRAMES) == (124, 345)
    for frames in (124, 141, 345):
        dataclasses.replace(GOOD, num_frames=frames).validate()


@pytest.mark.parametrize(
    ("change", "field", "needle"),
    [
        ({"num_frames": 125}, "num_frames", "17n + 5"),
        ({"num_frames": 107}, "num_frames", "5 to 15 seconds"),
        ({"num_frames": 362}, "num_frames", "124, 141, ..., 345"),
        ({"height": 48}, "height", "multiple of 32"),
        ({"width": 0}, "width", "multiple of 32"),
        ({"height": 32, "width": 160}, "width", "1:4 and 4:1"),
        ({"height": 160, "width": 32}, "width", "1:4 and 4:1"),
        ({"height": 8192}, "height", "[32, 1344]"),  # the released envelope by default
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": "   "}, "prompt", "must not be empty"),
        ({"prompt": "é" * 8193}, "prompt", "16386 bytes; allowed at most 16384"),
        ({"num_inference_steps": 1}, "num_inference_steps", "[2, 1000]"),
        ({"num_inference_steps": 1001}, "num_inference_steps", "[2, 1000]"),
        ({"flow_shift": 0.0}, "flow_shift", "(0, 1000]"),
        ({"audio_flow_shift": float("nan")}, "audio_flow_shift", "finite"),
        ({"flow_shift": float("inf")}, "flow_shift", "finite"),
        ({"seed": -1}, "seed", "[0, 2^63-1]"),
        ({"seed": 2**63}, "seed", "[0, 2^63-1]"),
        ({"task": "t2v"}, "task", "allowed: t2va, fl2va"),
        ({"task": "ref2va"}, "references", "ref2va needs at least one image or video reference"),
        ({"task": "fl2va"}, "first_frame", "needs a first_frame and/or a last_frame"),
        ({"first_frame": PNG}, "first_frame", "t2va takes no keyframe"),
        ({"task": "t2va", "last_frame": PNG}, "last_frame", "t2va takes no keyframe"),
        ({"task": "fl2va", "first_frame": b"GIF89a not a png"}, "first_frame", "PNG or JPEG"),
        ({"task": "fl2va", "last_frame": PNG[: len(PNG) // 2]}, "last_frame", "truncated"),
        ({"task": "fl2va", "first_frame": WIDE}, "first_frame", "aspect"),
        ({"output_type": "gif"}, "output_type", "latents, mp4, frames_and_wav"),
        ({"first_frame": "img.png"}, "first_frame", "wrong type"),
        ({"request_id": "bad id"}, "request_id", "1-128 characters"),
        ({"num_frames": "124"}, "num_frames", "wrong type"),
        ({"flow_shift": True}, "flow_shift", "wrong type"),
    ],
)
def test_bad_field_names_field_and_rule(change: dict[str, Any], field: str, needle: str) -> None:
    with pytest.raises(RequestError) as info:
        dataclasses.replace(GOOD, **change).validate()
    assert info.value.field == field
    assert needle in str(info.value), str(info.value)
    assert str(info.value).startswith(f"{field}: ")


def test_operator_limits_are_tighter_and_named() -> None:
    limits = RequestLimits(max_num_frames=141, max_height=64, max_width=64, max_prompt_bytes=4,
                           max_keyframe_bytes=len(PNG) + 64, max_keyframe_pixels=64 * 48)  # fmt: skip
    dataclasses.replace(GOOD, prompt="fox", num_frames=141, height=64, width=64).validate(limits)
    for change, field, needle in [
        ({"num_frames": 158}, "num_frames", "at most 141 on this server"),
        ({"height": 96}, "height", "[32, 64]"),
        ({"width": 96}, "width", "[32, 64]"),
        ({"prompt": "a red fox"}, "prompt", "at most 4 bytes"),
        ({"task": "fl2va", "first_frame": png(64, 49)}, "first_frame", str(64 * 48)),
        ({"task": "fl2va", "last_frame": PNG + b"\0" * 65}, "last_frame", f"limit of {len(PNG) + 64} bytes"),
    ]:
        with pytest.raises(RequestError, match=re.escape(needle)) as info:
            dataclasses.replace(GOOD, **{"prompt": "fox", **change}).validate(limits)
        assert info.value.field == field


def test_from_dict_takes_defaults_and_refuses_unknown_keys() -> None:
    req = GenerationRequest.from_dict({"prompt": "p", "num_frames": 141}, defaults=GOOD)
    assert (req.prompt, req.num_frames, req.num_inference_steps) == ("p", 141, 50)
    for gone in ("guidance_scale", "negative_prompt", "steps", "frames", "audio_length"):
        with pytest.raises(RequestError, match="unknown field") as info:
            GenerationRequest.from_dict({gone: 1})
        assert info.value.field == gone


def test_from_dict_reads_references_as_reference_bytes_or_mappings() -> None:
    from ditcore.references import Reference

    png_bytes = png(64, 48)
    req = GenerationRequest.from_dict({"prompt": "p", "references": [png_bytes, Reference(png_bytes, "image"),
                                       {"data": png_bytes}, {"data": png_bytes, "kind": "image"}]})  # fmt: skip
    assert req.references == (Reference(png_bytes), Reference(png_bytes, "image"), Reference(png_bytes),
                              Reference(png_bytes, "image"))  # fmt: skip
    for bad in ({"kind": "image"}, {"data": png_bytes, "type": "image"}):
        with pytest.raises(RequestError, match=r'"data" .* and "kind"') as info:
            GenerationRequest.from_dict({"prompt": "p", "references": [png_bytes, bad]})
        assert info.value.field == "references[1]"
    with pytest.raises(RequestError, match="wrong type") as info:
        GenerationRequest.from_dict({"prompt": "p", "task": "ref2va", "references": ["fox.png"]}).validate()
    assert info.value.field == "references"


def test_pipeline_inputs_are_what_diffusers_blocks_take() -> None:
    assert GOOD.pipeline_inputs() == {
        "prompt": "a red fox", "height": 32, "width": 32, "num_frames": 124, "num_inference_steps": 50,
    }  # fmt: skip


def test_fl2va_keyframes_become_diffusers_image_inputs() -> None:
    req = dataclasses.replace(GOOD, task="fl2va", first_frame=PNG, last_frame=png(48, 64)).validate()
    inputs = req.pipeline_inputs()
    assert inputs["image"].mode == "RGB" and inputs["image"].size == (64, 48)
    assert inputs["last_image"].size == (48, 64)
    only_last = dataclasses.replace(GOOD, task="fl2va", last_frame=PNG).validate().pipeline_inputs()
    assert "image" not in only_last and only_last["last_image"].size == (64, 48)


def test_infer_task_and_json_safe_dict() -> None:
    assert (infer_task(None, False), infer_task("", True), infer_task("t2va", True)) == ("t2va", "fl2va", "t2va")
    import hashlib
    import json

    req = dataclasses.replace(GOOD, task="fl2va", first_frame=PNG, output_type="mp4")
    out = json.loads(json.dumps(req.to_dict()))
    assert out["first_frame"] == {"bytes": len(PNG), "sha256": hashlib.sha256(PNG).hexdigest()}
    assert out["last_frame"] is None and out["output_type"] == "mp4" and req.decodes and not GOOD.decodes


def test_the_pixels_x_frames_budget_is_the_released_envelope_and_names_its_flag() -> None:
    from generator_service.execution.admission import check_request

    released = GenerationRequest(prompt="a fox", height=768, width=1344, num_frames=345)
    released.validate()  # the released envelope itself is inside
    raised = RequestLimits(max_height=4096, max_width=4096, max_pixels=4096 * 4096)  # sides and area raised only
    GenerationRequest(prompt="a fox", height=1344, width=1344, num_frames=124).validate(raised)  # fewer frames fit
    huge = GenerationRequest(prompt="a fox", height=4096, width=4096, num_frames=345)
    with pytest.raises(RequestError) as e:
        huge.validate(raised)
    assert e.value.field == "num_frames"
    assert "height x width x num_frames must be at most 356,106,240 pixels (768 x 1344 x 345" in str(e.value)
    with pytest.raises(RequestError, match=r"\(this server's --max-video-pixels is 356106240\)"):
        check_request(huge, raised)
    huge.validate(dataclasses.replace(raised, max_video_pixels=4096 * 4096 * 345))  # the operator raised it too
