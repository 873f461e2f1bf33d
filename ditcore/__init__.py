"""ditcore: the model layer. MiniMax-H3 as diffusers ships it, plus the plan math the cache is built on; pure torch.

Modules: `presets` (the named sizes), `repo` (offline repositories of the real classes), `checkpoint_files` (a
repository's files as read), `checkpoint` (validation), `digests` (fingerprints, in-place edits), `plans` (plan keys,
page layout, the modules that read pages), `shards` (the transformer's shards, the cached transformer), `rebuild`
(the sidecar's streaming page builder), `pipeline` (diffusers' blocks, resident or cached), `schedule` (each step's
plan key), `denoise` (the loop), `decode` (diffusers' decode steps), `request` (H3's request rules), `model` (a
loaded checkpoint), `generation` (`generate`), `report` (where a request's plans came from).
"""

from .checkpoint import CheckpointInfo, validate_checkpoint
from .checkpoint_files import CheckpointError, CheckpointNotFoundError
from .digests import fingerprint
from .generation import GenerationResult, PlanLease, PlanProvider, generate, latents_sha256
from .model import ADALN_MODES, H3Model, ModelMemory, load_model
from .plans import PageLayout, PlanKey, distinct_keys
from .presets import PRESETS, PresetError, figures, get_preset
from .rebuild import PlanBuilder
from .repo import write_repository
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
