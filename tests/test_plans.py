"""Plan keys, page layout and the shared AdaLN projection."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest
import torch

from ditcore import CheckpointInfo, DiT, GenerationRequest, get_preset, param_counts, validate_checkpoint
from ditcore.checkpoint import CheckpointReader
from ditcore.config import MOD_CHUNKS, MODALITIES, PRESETS, adaln_layer_names
from ditcore.loader import load_model
from ditcore.plans import (
    PlanKey,
    ScheduleSpec,
    bits_f32,
    build_pages,
    distinct_keys,
    f32_bits,
    page_slices,
    project,
)
from ditcore.schedule import flow_schedule

GIB = 1024**3
MIB = 1024**2


def _bits(t: torch.Tensor) -> int:
    return int(struct.unpack("<I", t.to(torch.float32).reshape(1).numpy().tobytes())[0])


# ----------------------------------------------------------------------------- plan keys
@pytest.mark.parametrize(("steps", "shift"), [(1, 5.0), (4, 1.0), (10, 5.0), (50, 12.0)])
def test_t2v_keys_have_width_one(steps: int, shift: float) -> None:
    spec = ScheduleSpec("t2v", steps, shift, shift)
    plans = spec.step_plans()
    video = flow_schedule(steps, shift)
    assert len(plans) == steps
    for i, sp in enumerate(plans):
        assert sp.key.width == 1
        assert sp.key.bits == (_bits(video.timesteps[i]),)
        assert (sp.video_row, sp.audio_row) == (0, 0)


def test_t2v_ignores_audio_shift() -> None:
    assert ScheduleSpec("t2v", 8, 5.0, 5.0).plan_keys() == ScheduleSpec("t2v", 8, 5.0, 2.0).plan_keys()


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 12.0])
def test_t2va_equal_shifts_width_one(shift: float) -> None:
    # audio_flow_shift None in a request means "same as flow_shift": the same spec.
    req = GenerationRequest(task="t2va", steps=12, flow_shift=shift, audio_flow_shift=None)
    spec = req.schedule_spec()
    assert spec.audio_flow_shift == shift
    plans = spec.step_plans()
    assert [p.key.width for p in plans] == [1] * 12
    assert all((p.video_row, p.audio_row) == (0, 0) for p in plans)
    # identical to the t2v keys of the same schedule
    assert spec.plan_keys() == ScheduleSpec("t2v", 12, shift, shift).plan_keys()


@pytest.mark.parametrize(
    ("steps", "video_shift", "audio_shift"),
    [(2, 5.0, 3.0), (8, 5.0, 3.0), (10, 1.0, 7.0), (50, 12.0, 0.5), (50, 3.0, 5.0)],
)
def test_t2va_different_shifts_width_two_after_first_step(steps: int, video_shift: float, audio_shift: float) -> None:
    spec = ScheduleSpec("t2va", steps, video_shift, audio_shift)
    plans = spec.step_plans()
    video, audio = flow_schedule(steps, video_shift), flow_schedule(steps, audio_shift)
    # Step 0 is sigma=1 -> timestep 1000.0 for both modalities: deduplicated to width 1.
    assert [p.key.width for p in plans] == [1] + [2] * (steps - 1)
    assert plans[0].key.bits == (f32_bits(1000.0),)
    assert (plans[0].video_row, plans[0].audio_row) == (0, 0)
    for i, sp in enumerate(plans[1:], start=1):
        # bits are the exact float32 patterns, video first, then audio
        assert sp.key.bits == (_bits(video.timesteps[i]), _bits(audio.timesteps[i]))
        assert (sp.video_row, sp.audio_row) == (0, 1)


def test_t2va_single_step_is_width_one() -> None:
    plans = ScheduleSpec("t2va", 1, 5.0, 3.0).step_plans()
    assert [p.key.width for p in plans] == [1]


def test_plan_key_timesteps_round_trip() -> None:
    video, audio = flow_schedule(9, 5.0), flow_schedule(9, 2.0)
    for i in range(9):
        key = PlanKey.from_timesteps(video.timesteps[i], audio.timesteps[i])
        ts = key.timesteps()
        assert ts.dtype == torch.float32
        assert ts.shape == (key.width,)
        expected = torch.stack([video.timesteps[i], audio.timesteps[i]])[: key.width]
        assert torch.equal(ts, expected)
        assert tuple(_bits(t) for t in ts) == key.bits
        assert PlanKey.from_timesteps(*ts) == key


@pytest.mark.parametrize("bits", [(0x00000001,), (0x80000000, 0x00000000), (0x447A0000, 0x3F800000), (0x7F7FFFFF,)])
def test_plan_key_round_trips_odd_bit_patterns(bits: tuple[int, ...]) -> None:
    # subnormals, -0.0 vs +0.0 (equal as floats, distinct as keys), float32 max
    key = PlanKey(bits)
    ts = key.timesteps()
    assert tuple(struct.unpack(f"<{len(bits)}I", ts.numpy().tobytes())) == bits
    assert tuple(f32_bits(bits_f32(b)) for b in bits) == bits
    assert key.is_finite()


def test_plan_key_dedup_is_by_bits_and_keeps_order() -> None:
    assert PlanKey.from_timesteps(500.0, 500.0).bits == (f32_bits(500.0),)
    assert PlanKey.from_timesteps(250.0, 500.0).bits == (f32_bits(250.0), f32_bits(500.0))
    assert PlanKey.from_timesteps(500.0, 250.0).bits == (f32_bits(500.0), f32_bits(250.0))
    assert PlanKey.from_timesteps(0.0, -0.0).width == 2
    assert not PlanKey((0x7FC00000,)).is_finite()  # nan
    assert not PlanKey((f32_bits(1.0), 0x7F800000)).is_finite()  # +inf


def test_distinct_keys_keeps_first_seen_order() -> None:
    a, b, c = PlanKey((1,)), PlanKey((2,)), PlanKey((3, 4))
    assert distinct_keys([b, a, b, c, a]) == [b, a, c]
    keys = ScheduleSpec("t2va", 10, 5.0, 3.0).plan_keys()
    assert distinct_keys(keys) == keys  # every step of one schedule is distinct
    assert distinct_keys(keys + keys) == keys


# ----------------------------------------------------------------------------- page layout
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_page_numel_formula(preset: str) -> None:
    c = get_preset(preset)
    h, n_layers = c.hidden_size, c.num_layers
    assert len(MOD_CHUNKS) == 6 and len(MODALITIES) == 3
    assert c.block_mod_numel == 6 * 3 * h
    assert c.final_mod_numel == 2 * h
    assert c.page_numel == n_layers * 6 * 3 * h + 2 * h
    assert c.page_bytes == c.page_numel * (2 if c.dtype == "bfloat16" else 4)
    # page slices tile the page in adaln_layer_names order, without gaps or overlap
    slices = page_slices(c)
    names = adaln_layer_names(c)
    assert len(slices) == len(names) == n_layers + 1
    assert names[-1] == "final_layer.adaln_proj"
    pos = 0
    for name, sl in zip(names, slices, strict=True):
        assert sl.start == pos
        assert sl.stop - sl.start == (2 * h if name.startswith("final") else 18 * h)
        pos = sl.stop
    assert pos == c.page_numel


def test_h3_page_and_adaln_bytes() -> None:
    c = get_preset("h3")
    assert c.dtype == "bfloat16"
    assert c.page_numel == 50 * 18 * 5376 + 2 * 5376 == 4_849_152
    assert c.page_bytes == 9_698_304  # 9.249 MiB ("9.25 MiB" at two decimals)
    assert round(c.page_bytes / MIB, 2) == 9.25
    pc = param_counts(c)
    assert pc.adaln_bytes == pc.adaln_proj * 2
    assert 24.2 <= pc.adaln_bytes / GIB < 24.3  # ~24.29 GiB
    # float32 doubles both
    c32 = c.replace(dtype="float32")
    assert c32.page_bytes == 2 * c.page_bytes
    assert param_counts(c32).adaln_bytes == 2 * pc.adaln_bytes


@pytest.mark.parametrize("preset", ["bench", "h3"])
def test_adaln_share(preset: str) -> None:
    pc = param_counts(get_preset(preset))
    assert 0.35 <= pc.adaln_share <= 0.45
    assert pc.adaln_proj + pc.resident == pc.total
    assert math.isclose(pc.adaln_share, pc.adaln_proj / pc.total)


# ----------------------------------------------------------------------------- build_pages
@pytest.fixture(scope="module")
def tiny_model_and_info(tiny_ckpt: Path) -> tuple[DiT, CheckpointInfo]:
    info = validate_checkpoint(tiny_ckpt)
    return load_model(info, "resident"), info


def test_build_pages_equals_project_per_layer(tiny_model_and_info: tuple[DiT, CheckpointInfo]) -> None:
    """build_pages must write exactly what `project` gives per layer with M = the plan's width.

    The GEMM shape is part of the contract: on CPU, projecting 1 row and 2 rows can give
    different bits for the same row, which is why every caller (resident forward, local
    provider, plan cache) uses M = width. This test fixes M = width and does not assert on
    what other shapes would give.
    """
    model, info = tiny_model_and_info
    config = info.config
    keys = distinct_keys(ScheduleSpec("t2va", 6, 5.0, 2.0).plan_keys())
    assert {k.width for k in keys} == {1, 2}
    inputs = [model.time_embed.adaln_input(k.timesteps()) for k in keys]
    # outputs as views into one slab, like the plan cache's slots
    total_rows = sum(k.width for k in keys)
    slab = torch.full((total_rows + 1, config.page_numel), float("nan"), dtype=config.torch_dtype)
    outputs, row = [], 1
    for k in keys:
        outputs.append(slab[row : row + k.width])
        row += k.width
    loaded: list[str] = []
    with CheckpointReader(info) as reader:

        def load_layer(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
            loaded.append(prefix)
            return reader.adaln_layer(prefix)

        build_pages(config, load_layer, inputs, outputs)
        assert loaded == adaln_layer_names(config)  # each layer streamed once, in page order
        for x, out in zip(inputs, outputs, strict=True):
            assert x.shape[0] == out.shape[0]
            for name, cols in zip(adaln_layer_names(config), page_slices(config), strict=True):
                w, b = reader.adaln_layer(name)
                assert torch.equal(out[:, cols], project(x, w, b)), name
    assert torch.isnan(slab[0]).all()  # rows outside the outputs are untouched
    assert not torch.isnan(slab[1:]).any()


def test_resident_modulation_matches_pages(tiny_model_and_info: tuple[DiT, CheckpointInfo]) -> None:
    model, info = tiny_model_and_info
    config = info.config
    key = PlanKey.from_timesteps(torch.tensor(640.5), torch.tensor(320.25))
    x = model.time_embed.adaln_input(key.timesteps())
    out = torch.empty(key.width, config.page_numel)
    with CheckpointReader(info) as reader:
        build_pages(config, reader.adaln_layer, [x], [out])
    mod = model.resident_modulation(key.timesteps())
    cols = page_slices(config)
    for i in range(config.num_layers):
        assert torch.equal(mod.block(i), out[:, cols[i]])
    assert torch.equal(mod.final(), out[:, cols[-1]])


def test_build_pages_length_mismatch() -> None:
    c = get_preset("tiny")
    with pytest.raises(ValueError, match="same length"):
        build_pages(c, lambda name: (torch.zeros(1), torch.zeros(1)), [torch.zeros(1, 16)], [])
