"""ditcore: the model layer. MiniMax-H3 as diffusers ships it, plus the plan math the cache is built on; pure torch.

Modules: `presets` (the named sizes), `repo` (offline repositories of the real classes), `checkpoint_files` (a
repository's files as read), `checkpoint` (validation), `digests` (fingerprints, in-place edits), `plans` (plan keys,
page layout, the modules that read pages), `shards` (the transformer's shards, the cached transformer), `rebuild`
(the sidecar's streaming page builder), `pipeline` (diffusers' blocks, resident or cached), `schedule` (each step's
plan key), `denoise` (the loop), `decode` (diffusers' decode steps), `request` (H3's request rules), `model` (a
loaded checkpoint), `generation` (`generate`), `report` (where a request's plans came from).

The request rules import neither torch nor diffusers, so the client side can import them: `request` and what its
checks read (`keyframes`, `references`, `media`, `media_cache`; their decoders import diffusers when they run), and
`report`. This package imports nothing until a name is used (`from ditcore import generate` then loads the model).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_SOURCES = {
    "ADALN_MODES": "model",
    "H3_LIMITS": "request",
    "PRESETS": "presets",
    "CacheReport": "report",
    "CheckpointError": "checkpoint_files",
    "CheckpointInfo": "checkpoint",
    "CheckpointNotFoundError": "checkpoint_files",
    "GenerationRequest": "request",
    "GenerationResult": "generation",
    "H3Model": "model",
    "ModelMemory": "model",
    "PageLayout": "plans",
    "PlanBuilder": "rebuild",
    "PlanKey": "plans",
    "PlanLease": "generation",
    "PlanProvider": "generation",
    "PresetError": "presets",
    "RequestError": "request",
    "RequestLimits": "request",
    "distinct_keys": "plans",
    "figures": "presets",
    "fingerprint": "digests",
    "generate": "generation",
    "get_preset": "presets",
    "latents_sha256": "generation",
    "load_model": "model",
    "validate_checkpoint": "checkpoint",
    "write_repository": "repo",
}
"""Each exported name's submodule, imported at the name's first use (PEP 562): `import ditcore.request` (the
request rules, what a client needs) then loads neither torch nor diffusers."""


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{source}", __name__), name)
    globals()[name] = value  # once: later lookups find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})


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
