"""Plan math, defined once: plan keys, page layout and the AdaLN projection.

A *plan* is everything the blocks need from `adaln_proj` for one denoise step: for each of
the step's distinct timesteps (video first, then audio if it differs), one *page* of
`num_layers*6*3*hidden + 2*hidden` elements. Page layout, for page row r:

    page[r, i*18h:(i+1)*18h]  = blocks.{i}.adaln_proj(silu(temb[r]))   viewed as (3 mod, 6 chunk, h)
    page[r, L*18h:L*18h+2h]   = final_layer.adaln_proj(silu(temb[r]))  viewed as (2, h)

Bit-exactness rule: the resident forward and every rebuild call `project()` with the same
GEMM shape, M = the plan's width (its number of distinct timesteps). CPU GEMMs on 1 and 2
rows give different bits for the same row, so the shape is part of the contract.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import DiTConfig, adaln_layer_names
from .schedule import flow_schedule


def f32_bits(value: float) -> int:
    """The IEEE-754 float32 bit pattern of `value` (rounded to float32)."""
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


def bits_f32(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


@dataclass(frozen=True, order=True)
class PlanKey:
    """Exact float32 bit patterns of one step's distinct timesteps, video first then audio."""

    bits: tuple[int, ...]

    @property
    def width(self) -> int:
        return len(self.bits)

    def timesteps(self) -> torch.Tensor:
        """(width,) float32 tensor holding exactly these bit patterns."""
        raw = struct.pack(f"<{len(self.bits)}I", *self.bits)
        return torch.frombuffer(bytearray(raw), dtype=torch.float32).clone()

    @classmethod
    def from_timesteps(cls, *timesteps: torch.Tensor | float) -> PlanKey:
        """Deduplicate (by bits, keeping order) the given float32 timesteps into a key."""
        seen: list[int] = []
        for t in timesteps:
            b = f32_bits(float(t))
            if b not in seen:
                seen.append(b)
        return cls(tuple(seen))

    def is_finite(self) -> bool:
        # float32 exponent all ones = inf or nan
        return all((b >> 23) & 0xFF != 0xFF for b in self.bits)

    def __str__(self) -> str:
        return "(" + ", ".join(f"{bits_f32(b):.4f}" for b in self.bits) + ")"


@dataclass(frozen=True)
class StepPlan:
    """Which plan one step uses and which page row each modality reads."""

    key: PlanKey
    video_row: int  # text reads the video row too
    audio_row: int  # == video_row for t2v (unused) and for equal timesteps


@dataclass(frozen=True)
class ScheduleSpec:
    """The request knobs that determine plans (every other knob leaves plans unchanged)."""

    task: str
    steps: int
    flow_shift: float
    audio_flow_shift: float

    def step_plans(self) -> list[StepPlan]:
        video = flow_schedule(self.steps, self.flow_shift)
        audio = flow_schedule(self.steps, self.audio_flow_shift) if self.task == "t2va" else None
        plans = []
        for i in range(self.steps):
            tv = video.timesteps[i]
            if audio is None:
                plans.append(StepPlan(PlanKey.from_timesteps(tv), 0, 0))
                continue
            key = PlanKey.from_timesteps(tv, audio.timesteps[i])
            plans.append(StepPlan(key, 0, key.width - 1))
        return plans

    def plan_keys(self) -> list[PlanKey]:
        return [p.key for p in self.step_plans()]


def distinct_keys(keys: Iterable[PlanKey]) -> list[PlanKey]:
    """A request's *group*: its plan keys deduplicated, first-seen order kept."""
    return list(dict.fromkeys(keys))


# ------------------------------------------------------------------- the projection
def project(adaln_input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """THE AdaLN projection: (M, T) silu(temb) -> (M, N). M must be the plan's width."""
    return F.linear(adaln_input, weight, bias)


def page_slices(config: DiTConfig) -> list[slice]:
    """Column range of each adaln_proj inside a page, in `adaln_layer_names` order."""
    step = config.block_mod_numel
    out = [slice(i * step, (i + 1) * step) for i in range(config.num_layers)]
    base = config.num_layers * step
    out.append(slice(base, base + config.final_mod_numel))
    return out


LayerSource = Callable[[str], tuple[torch.Tensor, torch.Tensor]]
"""Loads (weight, bias) of one adaln_proj by module prefix; called once per layer per pass."""


def build_pages(
    config: DiTConfig,
    load_layer: LayerSource,
    adaln_inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
) -> None:
    """One rebuild pass: stream every adaln_proj once and project every plan.

    `adaln_inputs[k]` is silu(temb) of plan k, shape (width_k, T); `outputs[k]` is where its
    pages go, shape (width_k, page_numel) (a slab slot view is fine). One layer is held in
    memory at a time; each plan gets its own GEMM with M = its width (bit-exactness rule).
    """
    if len(adaln_inputs) != len(outputs):
        raise ValueError("adaln_inputs and outputs must have the same length")
    for name, cols in zip(adaln_layer_names(config), page_slices(config), strict=True):
        weight, bias = load_layer(name)
        for x, out in zip(adaln_inputs, outputs, strict=True):
            out[:, cols].copy_(project(x, weight, bias))
        del weight, bias
