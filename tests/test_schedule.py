"""Rectified-flow schedules: shape, monotonicity, the shift formula, and diffusers' exact grid."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from ditcore.schedule import NUM_TRAIN_TIMESTEPS, Schedule, flow_schedule

# Golden float32 bit patterns of
#     FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=s).set_timesteps(N)
# `.timesteps` and `.sigmas`, keyed by (s, N). Generated once with diffusers 0.42.1 and
# torch 2.13.0+cpu in a throwaway venv outside the repo (diffusers is not a dependency):
#     sch = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=s)
#     sch.set_timesteps(N)
#     [struct.unpack("<I", struct.pack("<f", float(t)))[0] for t in sch.timesteps]
# (0.1, 5) is an extra case: for small shifts diffusers' first sigma is not exactly 1
# (float32 rounding of its training sigmas), and the grid must reproduce that too.
# fmt: off
GOLDEN_TIMESTEPS: dict[tuple[float, int], tuple[int, ...]] = {
    (1.0, 5): (
        0x447A0000, 0x443B9000, 0x43FA4001, 0x437AC000, 0x3F800000,
    ),
    (5.0, 7): (
        0x447A0000, 0x44707099, 0x44636D42, 0x4450AD93, 0x44335451, 0x43FDB2BF, 0x41C35002,
    ),
    (3.0, 50): (
        0x447A0000, 0x447847F6, 0x447683A7, 0x4474B28C, 0x4472D41B, 0x4470E7BC, 0x446EECD3, 0x446CE2B9,
        0x446AC8BB, 0x44689E1C, 0x44666216, 0x446413D2, 0x4461B26D, 0x445F3CF6, 0x445CB26B, 0x445A11B7,
        0x445759B4, 0x44548926, 0x44519EBB, 0x444E9909, 0x444B7688, 0x44483597, 0x4444D46F, 0x4441512B,
        0x443DA9B9, 0x4439DBE1, 0x4435E53A, 0x4431C322, 0x442D72C2, 0x4428F0FE, 0x44243A72, 0x441F4B6B,
        0x441A1FD7, 0x4414B342, 0x440F00C1, 0x440902EB, 0x4402B3C1, 0x43F81940, 0x43EA0C44, 0x43DB3017,
        0x43CB7249, 0x43BABE2B, 0x43A8FC70, 0x439612C5, 0x4381E34A, 0x435897EE, 0x432A4BB6, 0x42F110BF,
        0x4285CCE4, 0x410EDB6E,
    ),
    (12.0, 50): (
        0x447A0000, 0x4479926C, 0x447920A3, 0x4478AA67, 0x44782F71, 0x4477AF7A, 0x44772A30, 0x44769F3D,
        0x44760E44, 0x447576DB, 0x4474D895, 0x447432F7, 0x4473857B, 0x4472CF8D, 0x4472108B, 0x447147C5,
        0x44707474, 0x446F95BE, 0x446EAAB3, 0x446DB241, 0x446CAB3E, 0x446B9455, 0x446A6C0B, 0x446930B3,
        0x4467E067, 0x446678FC, 0x4464F7FC, 0x44635A91, 0x44619D78, 0x445FBCE6, 0x445DB470, 0x445B7EEA,
        0x44591634, 0x44567306, 0x44538CA8, 0x44505889, 0x444CC9C7, 0x4448D07A, 0x444458C8, 0x443F4991,
        0x44398297, 0x4432D9C1, 0x442B170E, 0x4421EE47, 0x4416F509, 0x44099227, 0x43F1C18B, 0x43C6F61A,
        0x438E20BD, 0x42FBF7F0,
    ),
    (0.5, 4): (
        0x447A0000, 0x43FA1804, 0x43483D7B, 0x3E801898,
    ),
    (0.1, 5): (
        0x4479FFD9, 0x4366CAF1, 0x42B5D9E8, 0x4201150C, 0x3C24009B,
    ),
}
GOLDEN_SIGMAS: dict[tuple[float, int], tuple[int, ...]] = {
    (1.0, 5): (
        0x3F800000, 0x3F401062, 0x3F0020C5, 0x3E80624E, 0x3A83126F, 0x00000000,
    ),
    (5.0, 7): (
        0x3F800000, 0x3F7635DC, 0x3F68E291, 0x3F55AFB1, 0x3F37A21E, 0x3F01E4BC, 0x3CC80002, 0x00000000,
    ),
    (3.0, 50): (
        0x3F800000, 0x3F7E3D66, 0x3F7C6E3C, 0x3F7A91F8, 0x3F78A80B, 0x3F76AFDB, 0x3F74A8C8, 0x3F729226,
        0x3F706B3E, 0x3F6E3350, 0x3F6BE98F, 0x3F698D21, 0x3F671D1C, 0x3F649889, 0x3F61FE61, 0x3F5F4D88,
        0x3F5C84D1, 0x3F59A2F8, 0x3F56A6A3, 0x3F538E5F, 0x3F50589C, 0x3F4D03AD, 0x3F498DC2, 0x3F45F4E8,
        0x3F423703, 0x3F3E51CC, 0x3F3A42CB, 0x3F36074E, 0x3F319C6D, 0x3F2CFEF8, 0x3F282B77, 0x3F231E20,
        0x3F1DD2C8, 0x3F1844DF, 0x3F126F5D, 0x3F0C4CB7, 0x3F05D6CA, 0x3EFE0D91, 0x3EEFAA42, 0x3EE072C8,
        0x3ED05443, 0x3EBF3984, 0x3EAD0AB0, 0x3E99ACD2, 0x3E850152, 0x3E5DCAAE, 0x3E2E6202, 0x3DF6D9DA,
        0x3D8902F6, 0x3C124925, 0x00000000,
    ),
    (12.0, 50): (
        0x3F800000, 0x3F7F8FCB, 0x3F7F1B47, 0x3F7EA234, 0x3F7E244B, 0x3F7DA142, 0x3F7D18C5, 0x3F7C8A7C,
        0x3F7BF608, 0x3F7B5AFD, 0x3F7AB8EB, 0x3F7A0F53, 0x3F795DAD, 0x3F78A361, 0x3F77DFCA, 0x3F771232,
        0x3F7639CF, 0x3F7555C1, 0x3F746511, 0x3F7366A9, 0x3F725956, 0x3F713BBB, 0x3F700C55, 0x3F6EC96C,
        0x3F6D710D, 0x3F6C0102, 0x3F6A76C5, 0x3F68CF6E, 0x3F6707A6, 0x3F651B8B, 0x3F630698, 0x3F60C37F,
        0x3F5E4BFC, 0x3F5B989A, 0x3F58A06A, 0x3F55589D, 0x3F51B3FF, 0x3F4DA248, 0x3F490F23, 0x3F43E0D6,
        0x3F3DF65D, 0x3F37249D, 0x3F2F323B, 0x3F25D12E, 0x3F1A9484, 0x3F0CDF63, 0x3EF78EE4, 0x3ECBBC85,
        0x3E9189F9, 0x3E010204, 0x00000000,
    ),
    (0.5, 4): (
        0x3F800000, 0x3F000C4C, 0x3E4D0BC2, 0x39832B9E, 0x00000000,
    ),
    (0.1, 5): (
        0x3F7FFFD8, 0x3E6C54EF, 0x3DBA3733, 0x3D042E21, 0x3727F03C, 0x00000000,
    ),
}
# fmt: on


def _bits(t: torch.Tensor) -> tuple[int, ...]:
    assert t.dtype == torch.float32
    return tuple(struct.unpack(f"<{t.numel()}I", t.contiguous().numpy().tobytes()))


@pytest.mark.parametrize(("shift", "steps"), sorted(GOLDEN_TIMESTEPS))
def test_matches_diffusers_bit_for_bit(shift: float, steps: int) -> None:
    sched = flow_schedule(steps, shift)
    assert sched.timesteps.dtype == torch.float32
    assert sched.sigmas.dtype == torch.float32
    assert len(GOLDEN_TIMESTEPS[(shift, steps)]) == steps
    assert [f"{b:08X}" for b in _bits(sched.timesteps)] == [f"{b:08X}" for b in GOLDEN_TIMESTEPS[(shift, steps)]]
    assert [f"{b:08X}" for b in _bits(sched.sigmas)] == [f"{b:08X}" for b in GOLDEN_SIGMAS[(shift, steps)]]


SHIFTS = [0.5, 0.75, 1.0, 2.0, 3.0, 5.0, 7.0, 12.0, 100.0, 1000.0]
STEPS = [1, 2, 3, 4, 10, 50, 100, 1000]


@pytest.mark.parametrize("shift", SHIFTS)
def test_sigmas_monotone_from_one_to_zero(shift: float) -> None:
    for steps in STEPS:
        s = flow_schedule(steps, shift)
        assert isinstance(s, Schedule)
        assert s.steps == steps
        assert s.timesteps.shape == (steps,)
        assert s.sigmas.shape == (steps + 1,)
        assert s.sigmas[0].item() == 1.0, (shift, steps)
        assert s.sigmas[-1].item() == 0.0
        diffs = s.sigmas[1:] - s.sigmas[:-1]
        assert bool((diffs < 0).all()), f"not strictly decreasing for shift={shift} steps={steps}"
        assert torch.isfinite(s.sigmas).all()
        # timesteps are exactly 1000*sigma in float32
        assert torch.equal(s.timesteps, s.sigmas[:-1] * NUM_TRAIN_TIMESTEPS)


@pytest.mark.parametrize("shift", [0.001, 0.01, 0.1, 0.2, 0.4])
def test_small_shifts_still_strictly_decreasing(shift: float) -> None:
    # The first sigma may differ from 1 by float32 rounding here (as in diffusers, see the
    # (0.1, 5) golden case), but the grid must still go strictly down to exactly 0.
    for steps in STEPS:
        s = flow_schedule(steps, shift)
        assert bool((s.sigmas[1:] < s.sigmas[:-1]).all())
        assert s.sigmas[-1].item() == 0.0
        assert abs(s.sigmas[0].item() - 1.0) < 0.02


def _shifted(x: float, shift: float) -> float:
    return shift * x / (1 + (shift - 1) * x)


@pytest.mark.parametrize("shift", [0.5, 1.0, 3.0, 5.0, 12.0])
@pytest.mark.parametrize("steps", [2, 7, 50])
def test_shift_formula(shift: float, steps: int) -> None:
    """sigma_i = shift(t_i) for t = linspace(1, shift(1/1000), steps): diffusers shifts twice,
    so the last timestep is 1000*shift(shift(1/1000)), not 1000*shift(1/1000)."""
    s = flow_schedule(steps, shift)
    sigma_min_train = _shifted(1 / NUM_TRAIN_TIMESTEPS, shift)
    lin = np.linspace(1.0, sigma_min_train, steps)
    expected = [_shifted(float(x), shift) for x in lin]
    got = s.sigmas[:-1].double().tolist()
    assert got == pytest.approx(expected, rel=2e-6, abs=1e-9)
    assert s.timesteps[-1].item() == pytest.approx(1000 * _shifted(_shifted(0.001, shift), shift), rel=1e-6)
    if shift != 1.0:
        # The doubly shifted last timestep is not the singly shifted one.
        assert not math.isclose(s.timesteps[-1].item(), 1000 * _shifted(0.001, shift), rel_tol=1e-3)


def test_shift_one_is_linear() -> None:
    s = flow_schedule(5, 1.0)
    assert s.timesteps.tolist() == pytest.approx([1000.0, 750.25, 500.5, 250.75, 1.0], rel=1e-6)


def test_larger_shift_spends_more_steps_at_high_noise() -> None:
    lo, hi = flow_schedule(20, 1.0), flow_schedule(20, 5.0)
    assert bool((hi.sigmas[1:-1] > lo.sigmas[1:-1]).all())


def test_single_step() -> None:
    s = flow_schedule(1, 5.0)
    assert s.steps == 1
    assert s.timesteps.tolist() == [1000.0]
    assert s.sigmas.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("steps", [0, -1, -50])
def test_invalid_steps_raise(steps: int) -> None:
    with pytest.raises(ValueError, match="steps"):
        flow_schedule(steps, 5.0)


@pytest.mark.parametrize("shift", [0.0, -1.0, -0.5, math.nan, math.inf, -math.inf])
def test_invalid_shift_raises(shift: float) -> None:
    with pytest.raises(ValueError, match="shift"):
        flow_schedule(10, shift)
