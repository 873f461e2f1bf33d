"""Request rules beyond the field ranges: a request id is matched whole, a prompt must hold a visible character and no
control character but tab / line feed / carriage return, the prompt's tokens are counted with the served model's
tokenizer (diffusers encodes every one of them: nothing truncates) within --max-prompt-tokens, and admission checks
keyframes by their headers only (their pixels are decoded when the request runs, and a fault only the pixels show
still names the field)."""

from __future__ import annotations

import argparse
import dataclasses
import io
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

import ditcore.media_cache as media_cache
from ditcore.keyframes import MediaError
from ditcore.request import (
    MAX_PROMPT_BYTES,
    MAX_PROMPT_TOKENS,
    GenerationRequest,
    RequestError,
    RequestLimits,
    check_prompt_tokens,
    prompt_tokens,
)

GOOD = GenerationRequest(prompt="a red fox")


def refused(field: str, **change: Any) -> str:
    with pytest.raises(RequestError) as info:
        dataclasses.replace(GOOD, **change).validate()
    assert info.value.field == field, info.value
    return info.value.description


def png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 10)).save(buf, format="PNG")
    return buf.getvalue()


def jpeg(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise((width, height), 60).convert("RGB").save(buf, format="JPEG")
    return buf.getvalue()


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_one_row(width: int, height: int) -> bytes:
    """A well-formed PNG (CRCs, IEND) whose deflate stream ends after its first row."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\0" + bytes(3 * width))
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", rows) + png_chunk(b"IEND", b"")


# --------------------------------------------------------------------------------------------------- request id
@pytest.mark.parametrize("rid", ["abc\n", "\nabc", "abc\r", "a" * 129, "", "a b"])
def test_a_request_id_is_matched_whole(rid: str) -> None:
    assert "1-128 characters" in refused("request_id", request_id=rid)


def test_good_request_ids_pass() -> None:
    for rid in ("abc", "a" * 128, "req-0", "A.b_c:d-9"):
        dataclasses.replace(GOOD, request_id=rid).validate()


# ------------------------------------------------------------------------------------------------------- prompt
INVISIBLE = {
    "zero-width-space": "\u200b",
    "zero-width-joiners-and-bom": "\u200b\u200c\u200d\ufeff\u2060",
    "bidi-override": "\u202e\u202c",
    "no-break-and-ideographic-spaces": "\u00a0\u3000\u2003",
    "tab-newline-return": "\t\n\r ",
    "hangul-filler": "\u3164",
    "hangul-choseong-jungseong-fillers": "\u115f\u1160",
    "combining-marks-alone": "\u0301\u0308",
    "variation-selector": "\ufe0f",
    "unassigned": "\u0378",
    "private-use": "\ue000",
}


@pytest.mark.parametrize("prompt", INVISIBLE.values(), ids=INVISIBLE.keys())
def test_a_prompt_without_a_visible_character_is_refused(prompt: str) -> None:
    message = refused("prompt", prompt=prompt)
    assert message.startswith("must not be empty") and "no visible character" in message


@pytest.mark.parametrize(
    ("prompt", "code", "at"),
    [("\x00\x00", "U+0000", 0), ("a\x00b", "U+0000", 1), ("a fox\x1b[31m", "U+001B", 5), ("a\x7f", "U+007F", 1),
     ("a\x85b", "U+0085", 1), ("\x08a fox", "U+0008", 0)],
)  # fmt: skip
def test_a_control_character_other_than_tab_newline_return_is_refused(prompt: str, code: str, at: int) -> None:
    assert refused("prompt", prompt=prompt) == (
        f"holds the control character {code} at character {at}; of the control characters only tab, line feed and "
        "carriage return are allowed"
    )


def test_a_lone_surrogate_is_refused_not_raised_as_an_encoding_error() -> None:
    """A str can hold one (json.loads('"\\ud800"')); its UTF-8 byte count would raise UnicodeEncodeError."""
    assert refused("prompt", prompt="a \ud800 fox").startswith("holds an unpaired surrogate (U+D800 at character 2)")


@pytest.mark.parametrize(
    "prompt",
    ["a red fox", "a\tred\nfox\r\n", "é", "日本の狐", "🦊", "👩\u200d🚀", "١٢٣", "क्\u200dष", "a\u200bb", "‼", "x\u0301",
     " \u200b.", "ঃ"],
)  # fmt: skip
def test_prompts_with_a_visible_character_pass(prompt: str) -> None:
    dataclasses.replace(GOOD, prompt=prompt).validate()


# ---------------------------------------------------------------------------------------------- prompt tokens
@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt: Path) -> Any:
    """The tiny checkpoint's Qwen2 tokenizer, as the pipeline loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_ckpt / "tokenizer")


def test_diffusers_text_block_encodes_every_token_so_the_cap_is_ours(tiny_ckpt: Path) -> None:
    """diffusers' MiniMax-H3 text block tokenizes with `tokenizer(prompt, add_special_tokens=False)` (no
    max_sequence_length, no truncation, no padding): a prompt's embedding has one row per token, as many as
    `prompt_tokens` counts, however long it is. So the token count needs a limit of its own (--max-prompt-tokens)."""
    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep

    from ditcore import load_model

    model = load_model(tiny_ckpt, "resident")
    prompt = ("a red fox runs through the snow, " * 600)[:MAX_PROMPT_BYTES]
    state = PipelineState()
    state.set("prompt", prompt)
    _, state = MiniMaxH3TextEncoderStep()(model.pipe, state)
    rows = state.get("prompt_embeds").shape[1]
    assert rows == prompt_tokens(model.pipe.tokenizer, prompt) > 4000


def test_prompt_tokens_counts_as_the_text_block_tokenizes(tokenizer: Any) -> None:
    prompt = "a red fox on a snowy hill at dawn"
    assert prompt_tokens(tokenizer, prompt) == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("special", ["<|image_pad|>", "<|vision_start|>", "<|endoftext|>", "<|im_start|>"])
def test_a_prompt_holding_a_special_token_is_refused(tokenizer: Any, special: str) -> None:
    """A special token would be read as a marker of MiniMax-H3's presentation, not as text: an fl2va prompt with
    "<|image_pad|>" makes diffusers' text encoder fail (image tokens and image features no longer match)."""
    with pytest.raises(RequestError) as info:
        prompt_tokens(tokenizer, f"a fox {special} in the snow")
    assert info.value.field == "prompt"
    assert info.value.description.startswith(f"holds the text encoder's special token {special!r}")
    assert prompt_tokens(tokenizer, "a fox <think> in the snow") > 0  # an added token that is not special: text


def test_the_default_token_limit_admits_every_prompt_within_the_byte_limit(tokenizer: Any) -> None:
    """The longest a prompt within the byte limit can get: U+1D160 (4 UTF-8 bytes) is 3 code points, 12 bytes, after
    the tokenizer's NFC normalization, and the tiny tokenizer has no merge for them; still within the default."""
    worst = "\U0001d160" * (MAX_PROMPT_BYTES // 4)
    assert len(worst.encode("utf-8")) == MAX_PROMPT_BYTES
    assert check_prompt_tokens(tokenizer, worst) == MAX_PROMPT_TOKENS == RequestLimits().max_prompt_tokens
    with pytest.raises(RequestError, match=f"is {MAX_PROMPT_TOKENS} tokens; allowed at most 100"):
        check_prompt_tokens(tokenizer, worst, RequestLimits(max_prompt_tokens=100))


@pytest.fixture(scope="module")
def backend(tiny_ckpt: Path) -> Any:
    from generator_service.backends.resident import ResidentBackend

    return ResidentBackend(tiny_ckpt, torch.device("cpu"))


def test_the_backend_counts_with_the_served_tokenizer_and_admission_names_the_flag(backend: Any) -> None:
    from generator_service.backends.base import check_prompt_tokens as admit

    tokenizer = backend.model().pipe.tokenizer
    request = dataclasses.replace(GOOD, prompt="a red fox on a snowy hill")
    count = len(tokenizer(request.prompt, add_special_tokens=False)["input_ids"])
    assert backend.prompt_tokens(request.prompt) == count
    assert admit(backend, request, RequestLimits()) == count
    assert admit(backend, request, RequestLimits(max_prompt_tokens=count)) == count
    with pytest.raises(RequestError) as info:
        admit(backend, request, RequestLimits(max_prompt_tokens=count - 1))
    assert str(info.value) == f"prompt: is {count} tokens; allowed at most {count - 1} (--max-prompt-tokens)"
    with pytest.raises(RequestError, match=re.escape("special token '<|image_pad|>'")):
        admit(backend, dataclasses.replace(GOOD, prompt="<|image_pad|>"), RequestLimits())


def test_max_prompt_tokens_is_a_generator_flag(tmp_path: Path) -> None:
    from ditruntime.flags import add_flags, from_args
    from generator_service.config import GeneratorConfig

    parser = argparse.ArgumentParser()
    add_flags(parser, GeneratorConfig)
    base = ["--adaln-mode", "resident", "--checkpoint", str(tmp_path)]
    assert from_args(GeneratorConfig, parser.parse_args(base)).limits.max_prompt_tokens == MAX_PROMPT_TOKENS
    config = from_args(GeneratorConfig, parser.parse_args([*base, "--max-prompt-tokens", "77"]))
    assert config.limits.max_prompt_tokens == 77


# ------------------------------------------------------------------------------------------------- keyframes
BAD_KEYFRAMES = {
    "not-an-image": (b"not an image", "is not a PNG or JPEG image"),
    "gif": (b"GIF89a" + bytes(64), "is not a PNG or JPEG image"),
    "truncated-png": (png(64, 48)[: len(png(64, 48)) // 2], "truncated"),
    "truncated-jpeg": (jpeg(64, 48)[:-40], "truncated"),
    "aspect-20-to-1": (png(200, 10), "aspect ratio"),
    "bomb-header": (
        png(32, 32)[:16] + struct.pack(">II", 60000, 60000) + png(32, 32)[24:29]
        + struct.pack(">I", zlib.crc32(b"IHDR" + struct.pack(">II", 60000, 60000) + png(32, 32)[24:29]))
        + png(32, 32)[33:],
        "60000x60000",
    ),
    "jpeg-scan-cut": (
        (lambda d: d[: d.index(b"\xff\xda") + 2 + struct.unpack_from(">H", d, d.index(b"\xff\xda") + 2)[0] + 8]
         + b"\xff\xd9")(jpeg(256, 256)),
        "too little image data",
    ),
}  # fmt: skip


@pytest.fixture
def no_decode(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    """Records (and forbids) every keyframe decode."""
    decoded: list[bytes] = []

    def decode(data: bytes, limits: object) -> object:
        decoded.append(data)
        raise AssertionError("a keyframe was decoded")

    media_cache.decoded_keyframe.cache_clear()
    monkeypatch.setattr(media_cache, "decode_image", decode)
    yield decoded
    media_cache.decoded_keyframe.cache_clear()


@pytest.mark.parametrize(("data", "expect"), BAD_KEYFRAMES.values(), ids=BAD_KEYFRAMES.keys())
def test_validate_refuses_bad_keyframes_from_their_headers_without_decoding(
    no_decode: list[bytes], data: bytes, expect: str
) -> None:
    for field in ("first_frame", "last_frame"):
        message = refused(field, task="fl2va", **{field: data})
        assert expect in message
    assert no_decode == []


def test_validate_decodes_no_keyframe_and_the_pipeline_inputs_do(no_decode: list[bytes]) -> None:
    first, last = png(64, 48), jpeg(48, 64)
    req = dataclasses.replace(GOOD, task="fl2va", first_frame=first, last_frame=last).validate()
    assert no_decode == []
    with pytest.raises(AssertionError, match="a keyframe was decoded"):
        req.pipeline_inputs()
    assert no_decode == [first]


def test_a_fault_only_the_pixels_show_is_found_at_decode_and_names_the_field() -> None:
    """A PNG whose rows run out after the first passes the header checks; decoding it (when the request runs)
    raises RequestError naming the field, its MediaError the cause (the executor answers INVALID_ARGUMENT)."""
    req = dataclasses.replace(GOOD, task="fl2va", last_frame=png_one_row(64, 48)).validate()
    with pytest.raises(RequestError) as info:
        req.pipeline_inputs()
    assert info.value.field == "last_frame"
    assert info.value.description.startswith("has too little image data: the PNG's image data inflates to 193 bytes")
    assert isinstance(info.value.__cause__, MediaError)


def test_keyframes_apply_tighter_operator_limits_and_decode_once() -> None:
    data = png(64, 48)
    req = dataclasses.replace(GOOD, task="fl2va", first_frame=data)
    with pytest.raises(RequestError, match="over the limit of 3071"):
        req.keyframes(RequestLimits(max_keyframe_pixels=64 * 48 - 1))
    media_cache.decoded_keyframe.cache_clear()
    tight = req.keyframes(RequestLimits(max_keyframe_pixels=64 * 48))["image"]
    assert req.pipeline_inputs()["image"] is tight  # decoded once, whatever limits each caller checks
    assert media_cache.decoded_keyframe.cache_info().misses == 1
