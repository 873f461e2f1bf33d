"""Rectified-flow timestep schedules.

The grid is exactly the one diffusers' `FlowMatchEulerDiscreteScheduler(num_train_timesteps=
1000, shift=flow_shift).set_timesteps(N)` produces, so users can bring `flow_shift` values
from Wan / HunyuanVideo / SD3 pipelines. Note what diffusers really does: the scheduler's
`sigma_min` is the *shifted* training sigma 1/1000, and `set_timesteps` shifts the linspace
once more, so the last timestep is shift(shift(1/1000))*1000, not shift(1/1000)*1000.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

NUM_TRAIN_TIMESTEPS = 1000


def _shift(sigmas: np.ndarray | torch.Tensor, shift: float):  # type: ignore[no-untyped-def]
    # sigma' = shift*s / (1 + (shift-1)*s), evaluated in the array's own dtype.
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def _train_sigma_bounds(shift: float) -> tuple[float, float]:
    """diffusers' __init__: shifted float32 training sigmas; returns (sigma_max, sigma_min)."""
    ts = np.linspace(1, NUM_TRAIN_TIMESTEPS, NUM_TRAIN_TIMESTEPS, dtype=np.float32)[::-1].copy()
    sigmas = _shift(torch.from_numpy(ts).to(torch.float32) / NUM_TRAIN_TIMESTEPS, shift)
    return float(sigmas[0].item()), float(sigmas[-1].item())


@dataclass(frozen=True)
class Schedule:
    """One modality's denoise schedule: `steps` timesteps and `steps + 1` sigmas (last is 0)."""

    timesteps: torch.Tensor  # (N,) float32, 1000*sigma
    sigmas: torch.Tensor  # (N+1,) float32, monotone decreasing to 0

    @property
    def steps(self) -> int:
        return int(self.timesteps.shape[0])


def flow_schedule(steps: int, shift: float) -> Schedule:
    """The diffusers FlowMatchEulerDiscrete grid for `steps` and `shift` (float32)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not (shift > 0 and np.isfinite(shift)):
        raise ValueError(f"shift must be finite and > 0, got {shift}")
    sigma_max, sigma_min = _train_sigma_bounds(shift)
    t = np.linspace(sigma_max * NUM_TRAIN_TIMESTEPS, sigma_min * NUM_TRAIN_TIMESTEPS, steps)
    sigmas64 = _shift(t / NUM_TRAIN_TIMESTEPS, shift)
    sigmas = torch.from_numpy(np.ascontiguousarray(sigmas64)).to(torch.float32)
    timesteps = sigmas * NUM_TRAIN_TIMESTEPS
    return Schedule(timesteps=timesteps, sigmas=torch.cat([sigmas, torch.zeros(1)]))
