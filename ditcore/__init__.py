"""ditcore: the model layer. MiniMax-H3 as diffusers ships it, plus the plan math the cache is built on; pure torch.

Modules: `repo` (presets and offline repositories of the real classes), `checkpoint` (validation, fingerprints),
`plans` (plan keys, page layout, the modules that read pages), `rebuild` (the sidecar's streaming page builder),
`pipeline` (diffusers' t2va blocks, resident or cached), `request` (H3's request rules), `model` (a loaded
checkpoint and `generate`), `report` (where a request's plans came from).
"""

from .checkpoint import CheckpointError, CheckpointInfo, CheckpointNotFoundError, fingerprint, validate_checkpoint
from .model import (
    ADALN_MODES,
    GenerationResult,
    H3Model,
    ModelMemory,
    PlanLease,
    PlanProvider,
    generate,
    latents_sha256,
    load_model,
)
from .plans import PageLayout, PlanKey, distinct_keys
from .rebuild import PlanBuilder
from .repo import PRESETS, PresetError, figures, get_preset, write_repository
from .report import CacheReport
from .request import H3_LIMITS, GenerationRequest, RequestError, RequestLimits

__all__ = [
    "ADALN_MODES",
    "H3_LIMITS",
    "PRESETS",
    "CacheReport",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "GenerationRequest",
    "GenerationResult",
    "H3Model",
    "ModelMemory",
    "PageLayout",
    "PlanBuilder",
    "PlanKey",
    "PlanLease",
    "PlanProvider",
    "PresetError",
    "RequestError",
    "RequestLimits",
    "distinct_keys",
    "figures",
    "fingerprint",
    "generate",
    "get_preset",
    "latents_sha256",
    "load_model",
    "validate_checkpoint",
    "write_repository",
]
