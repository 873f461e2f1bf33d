"""Generation requests: fields, defaults, validation against a model config, latent shapes.

Every service and CLI builds a `GenerationRequest` and calls `validate()`; a bad field
raises `RequestError(field, message)` whose message names the field and the allowed range.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from .config import TEXT_PAD_ID, DiTConfig
from .plans import ScheduleSpec

TASKS = ("t2v", "t2va")
MAX_STEPS = 1000
MAX_SHIFT = 1000.0
MAX_GUIDANCE = 100.0
MAX_SEED = 2**63 - 1
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RequestError(ValueError):
    """A request field is invalid. `field` is the request field name (underscored)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message


@dataclass(frozen=True)
class GenerationRequest:
    """One text-to-video(-audio) request. Defaults are the CLI's and the RPC's defaults."""

    request_id: str = "req-0"
    task: str = "t2v"
    """"t2v" (video only) or "t2va" (video + audio with its own schedule)."""
    prompt: str = ""
    negative_prompt: str = ""
    steps: int = 50
    """Denoise steps; 50 like the seed's workload."""
    flow_shift: float = 5.0
    """Video (and text) schedule shift, as in diffusers' FlowMatchEulerDiscreteScheduler."""
    audio_flow_shift: float | None = None
    """Audio schedule shift for t2va; None = same as flow_shift (then plans have width 1)."""
    guidance_scale: float = 5.0
    """Classifier-free guidance; <= 1 disables it (one forward per step)."""
    seed: int = 0
    frames: int = 5
    """Pixel frames; latent frames = (frames - 1) / vae_temporal + 1."""
    height: int = 64
    width: int = 64
    audio_length: int = 16
    """Audio latent frames (t2va only)."""

    # ---------------------------------------------------------------- derived
    @property
    def effective_audio_flow_shift(self) -> float:
        return self.flow_shift if self.audio_flow_shift is None else self.audio_flow_shift

    @property
    def use_guidance(self) -> bool:
        return self.guidance_scale > 1.0

    def schedule_spec(self) -> ScheduleSpec:
        return ScheduleSpec(self.task, self.steps, self.flow_shift, self.effective_audio_flow_shift)

    def video_latent_shape(self, config: DiTConfig) -> tuple[int, int, int, int]:
        """(C, F, H, W) of the video latent."""
        f = (self.frames - 1) // config.vae_temporal + 1
        return (config.video_channels, f, self.height // config.vae_spatial, self.width // config.vae_spatial)

    def audio_latent_shape(self, config: DiTConfig) -> tuple[int, int] | None:
        return (config.audio_channels, self.audio_length) if self.task == "t2va" else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], defaults: GenerationRequest | None = None) -> GenerationRequest:
        """Build from JSON-like data (JSONL line); omitted keys take `defaults`' values."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise RequestError(unknown[0], f"unknown field; allowed fields: {', '.join(names)}")
        base = defaults or cls()
        return dataclasses.replace(base, **data)

    # ---------------------------------------------------------------- validation
    def validate(self, config: DiTConfig) -> GenerationRequest:
        """Raise RequestError naming the first bad field; return self when valid."""
        _check_type(self)
        if not _REQUEST_ID.match(self.request_id):
            raise RequestError("request_id", "must be 1-128 characters of A-Z a-z 0-9 . _ : -")
        if self.task not in TASKS:
            raise RequestError("task", f"unknown task {self.task!r}; allowed: {', '.join(TASKS)}")
        for name in ("prompt", "negative_prompt"):
            n = len(getattr(self, name).encode("utf-8"))
            if n > config.text_len:
                raise RequestError(name, f"is {n} bytes; allowed at most {config.text_len} bytes (UTF-8)")
        if not 1 <= self.steps <= MAX_STEPS:
            raise RequestError("steps", f"must be in [1, {MAX_STEPS}], got {self.steps}")
        _check_shift("flow_shift", self.flow_shift)
        if self.audio_flow_shift is not None:
            _check_shift("audio_flow_shift", self.audio_flow_shift)
        if not (math.isfinite(self.guidance_scale) and 0 <= self.guidance_scale <= MAX_GUIDANCE):
            raise RequestError(
                "guidance_scale", f"must be finite and in [0, {MAX_GUIDANCE:g}], got {self.guidance_scale}"
            )
        if not 0 <= self.seed <= MAX_SEED:
            raise RequestError("seed", f"must be in [0, 2^63-1], got {self.seed}")
        _check_frames(self.frames, config)
        grid = config.vae_spatial * config.patch_size[1]
        for name, value, top in (("height", self.height, config.max_height), ("width", self.width, config.max_width)):
            if not (grid <= value <= top and value % grid == 0):
                raise RequestError(name, f"must be a multiple of {grid} in [{grid}, {top}], got {value}")
        if self.task == "t2va" and not 1 <= self.audio_length <= config.max_audio_length:
            raise RequestError(
                "audio_length", f"must be in [1, {config.max_audio_length}] for t2va, got {self.audio_length}"
            )
        return self


def _check_type(req: GenerationRequest) -> None:
    for f in dataclasses.fields(req):
        v = getattr(req, f.name)
        if f.name in ("request_id", "task", "prompt", "negative_prompt"):
            ok = isinstance(v, str)
        elif f.name in ("flow_shift", "guidance_scale", "audio_flow_shift"):
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool)) or (
                f.name == "audio_flow_shift" and v is None
            )
        else:
            ok = isinstance(v, int) and not isinstance(v, bool)
        if not ok:
            raise RequestError(f.name, f"has the wrong type ({type(v).__name__}: {v!r})")


def _check_shift(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0 < value <= MAX_SHIFT):
        raise RequestError(name, f"must be finite and in (0, {MAX_SHIFT:g}], got {value}")


def _check_frames(frames: int, config: DiTConfig) -> None:
    t, pf = config.vae_temporal, config.patch_size[0]
    ok = 1 <= frames <= config.max_frames and (frames - 1) % t == 0 and ((frames - 1) // t + 1) % pf == 0
    if not ok:
        raise RequestError("frames", f"must be {t}*k+1 in [1, {config.max_frames}], got {frames}")


def tokenize(text: str, config: DiTConfig) -> torch.Tensor:
    """UTF-8 bytes padded to `text_len`: (text_len,) int64."""
    data = text.encode("utf-8")
    if len(data) > config.text_len:
        raise RequestError("prompt", f"is {len(data)} bytes; allowed at most {config.text_len} bytes")
    ids = list(data) + [TEXT_PAD_ID] * (config.text_len - len(data))
    return torch.tensor(ids, dtype=torch.int64)
