"""Build a DiT from a checkpoint: construct on `meta`, read tensors memory-mapped, assign.

In `cached` mode the model has no adaln_proj modules and the loader never reads those
tensors (a checkpoint stripped of them loads fine in cached mode).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import CheckpointInfo, CheckpointReader, validate_checkpoint
from .config import is_adaln_name
from .model import DiT

ADALN_MODES = ("resident", "cached")


def load_model(checkpoint: str | Path | CheckpointInfo, adaln_mode: str = "resident") -> DiT:
    """Validate and load a checkpoint into an eval-mode DiT on CPU."""
    if adaln_mode not in ADALN_MODES:
        raise ValueError(f"adaln_mode must be one of {ADALN_MODES}, got {adaln_mode!r}")
    resident = adaln_mode == "resident"
    info = (
        checkpoint
        if isinstance(checkpoint, CheckpointInfo)
        else validate_checkpoint(checkpoint, require_adaln=resident)
    )
    with torch.device("meta"):
        model = DiT(info.config, with_adaln=resident)
    names = list(model.state_dict())
    assert all(resident or not is_adaln_name(n) for n in names)
    with CheckpointReader(info) as reader:
        state = reader.tensors(names)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
