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


class BatchingProbe:
    """Decides, by experiment on this device, whether batching plans is bit-exact.

    Batching k plans of equal width w into one GEMM (M = k*w) reads each layer once instead
    of k times, but a GEMM's bits for a row may depend on M (CPU: GEMV at M=1, other kernels
    at other sizes). For each (w, k) the probe projects random inputs both ways with a
    weight of the real layer shape and keeps the answer; a pass batches only sizes proven
    exact, and falls back to one GEMM per plan otherwise. Results are cached per size.
    """

    def __init__(self, config: DiTConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        t = config.time_embed_dim
        self._shapes = {n: (n, t) for n in (config.block_mod_numel, config.final_mod_numel)}
        self._w = {
            n: (torch.randn(shape, generator=gen) / t**0.5).to(device, dtype) for n, shape in self._shapes.items()
        }
        self._b = {n: torch.randn(n, generator=gen).to(device, dtype) for n in self._shapes}
        self._x_gen = gen
        self._t = t
        self._device, self._dtype = device, dtype
        self._exact: dict[tuple[int, int], bool] = {}

    def exact(self, width: int, count: int) -> bool:
        """True if `count` plans of `width` rows give the same bits in one GEMM as one by one."""
        key = (width, count)
        if self.disabled:
            return False
        if key not in self._exact:
            self._exact[key] = count > 1 and all(self._check(n, width, count) for n in self._shapes)
        return self._exact[key]

    def _check(self, n: int, width: int, count: int) -> bool:
        x = torch.randn(count * width, self._t, generator=self._x_gen).to(self._device, self._dtype)
        w, b = self._w[n], self._b[n]
        batched = project(x, w, b)
        single = torch.cat([project(x[i * width : (i + 1) * width], w, b) for i in range(count)])
        return bool(torch.equal(batched, single))

    def warm(self, widths: Sequence[int], counts: Sequence[int]) -> bool:
        """Probe the given sizes now (start-up). If none is exact, batching is off for good
        (no more probes); otherwise other sizes are probed when first needed."""
        found = [self.exact(w, c) for w in widths for c in counts]
        if not any(found):
            self.disabled = True
        return any(found)

    disabled = False


def build_pages(
    config: DiTConfig,
    load_layer: LayerSource,
    adaln_inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    probe: BatchingProbe | None = None,
) -> int:
    """One rebuild pass: stream every adaln_proj once and project every plan.

    `adaln_inputs[k]` is silu(temb) of plan k, shape (width_k, T); `outputs[k]` is where its
    pages go, shape (width_k, page_numel) (a slab slot view is fine). One layer is held in
    memory at a time. Each plan's rows are bit-identical to a GEMM with M = its width
    (bit-exactness rule): plans of equal width share one GEMM only where `probe` proved that
    exact on this device. Returns the number of GEMMs per layer.
    """
    if len(adaln_inputs) != len(outputs):
        raise ValueError("adaln_inputs and outputs must have the same length")
    groups: dict[int, list[int]] = {}
    for i, x in enumerate(adaln_inputs):
        groups.setdefault(int(x.shape[0]), []).append(i)
    batched = {w: probe is not None and probe.exact(w, len(idx)) for w, idx in groups.items()}
    stacked = {w: torch.cat([adaln_inputs[i] for i in idx]) for w, idx in groups.items() if batched[w]}
    gemms = 0
    for name, cols in zip(adaln_layer_names(config), page_slices(config), strict=True):
        weight, bias = load_layer(name)
        gemms = 0
        for w, idx in groups.items():
            if batched[w]:
                rows = project(stacked[w], weight, bias)  # (k*w, N): one read of the layer
                for j, i in enumerate(idx):
                    outputs[i][:, cols].copy_(rows[j * w : (j + 1) * w])
                gemms += 1
            else:
                for i in idx:
                    outputs[i][:, cols].copy_(project(adaln_inputs[i], weight, bias))
                gemms += len(idx)
        del weight, bias
    return gemms
