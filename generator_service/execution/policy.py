"""The executor's policy values (GeneratorConfig builds them from its flags): the sizing policy (ditcore.sizing's
memory check and step-time factor) and which request fields the operator's limit flags tighten. No grpc here."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20
GB = 1000**3

LIMITED_FIELDS = {
    "num_frames": "max_num_frames",
    "height": "max_height",
    "width": "max_width",
    "prompt": "max_prompt_bytes",
}
"""Request field -> the GeneratorConfig (and RequestLimits) field that may tighten H3's own rule for it."""


@dataclass(frozen=True)
class SizingPolicy:
    """The generator's use of ditcore.sizing (GeneratorConfig's `memory_check`, `memory_reserve_bytes`,
    `step_time_factor`)."""

    memory_check: bool = True
    memory_reserve_bytes: int = 1 * GB
    step_time_factor: float = 2.0
