"""ditcore: the DiT model family (config, checkpoints, model, schedules, plans), pure torch."""

from .checkpoint import (
    CheckpointError,
    CheckpointInfo,
    CheckpointNotFoundError,
    CheckpointReader,
    fingerprint,
    validate_checkpoint,
    write_checkpoint,
)
from .config import PRESETS, ConfigError, DiTConfig, get_preset, param_counts, param_shapes
from .loader import ADALN_MODES, load_model
from .local_plans import LocalPlanProvider
from .model import DiT
from .plans import PlanKey, ScheduleSpec, StepPlan, build_pages, project
from .report import CacheReport
from .request import GenerationRequest, RequestError
from .sampler import GenerationResult, PlanLease, PlanProvider, generate, latents_sha256
from .schedule import flow_schedule

__all__ = [
    "ADALN_MODES",
    "PRESETS",
    "CacheReport",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "ConfigError",
    "DiT",
    "DiTConfig",
    "GenerationRequest",
    "GenerationResult",
    "LocalPlanProvider",
    "PlanKey",
    "PlanLease",
    "PlanProvider",
    "RequestError",
    "ScheduleSpec",
    "StepPlan",
    "build_pages",
    "fingerprint",
    "flow_schedule",
    "generate",
    "get_preset",
    "latents_sha256",
    "load_model",
    "param_counts",
    "param_shapes",
    "project",
    "validate_checkpoint",
    "write_checkpoint",
]
