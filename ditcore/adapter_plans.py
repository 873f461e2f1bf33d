"""Plans built with adapters: what a modulation-changing adapter (LoRA on `adaln_proj`, `norm_out` or the time
embedder) does to a plan, computed the way PEFT computes it in a resident model, so cached pages equal resident
ones bit for bit.

PEFT's `lora.Linear.forward` (peft 0.21), vanilla LoRA, for every active adapter in the order `set_adapters` gave:

    result = base_layer(x)                                   # F.linear(x, W, b)
    x = x.to(lora_A.dtype)                                   # (a no-op when equal)
    result = result + lora_B(lora_A(x)) * scaling            # scaling = scale * lora_alpha / r
    result = result.to(base dtype)

`ModulationDeltas` holds each targeted module's factors, loaded as diffusers' loader converts them
(`MiniMaxH3LoraLoaderMixin.lora_state_dict`, alpha folding included) and cast to the dtype PEFT gives them (the
base layer's: the projections' dtype, float32 for the time embedder), with PEFT's scaling. `PlanBuilder.build` adds
them: the time embedder's first (hooks on its two linears, so `temb` is the adapted one), then each projection's
term, computed on its whole output (lora_B over every row, as PEFT does) and sliced to the rows a shard writes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .adapters import MODULATION_GROUPS, AdapterInfo

_PREFIXES = {"base": "transformer.", "ref": "transformer_ref."}


def modulation_uses(uses: Sequence[tuple[AdapterInfo, float]]) -> list[tuple[AdapterInfo, float]]:
    """The uses whose adapter changes the modulation, in the request's order."""
    return [(info, scale) for info, scale in uses if info.changes_modulation]


def modulation_digest(uses: Sequence[tuple[AdapterInfo, float]]) -> str:
    """What a plan key records of a request's adapters: sha256 of the modulation-changing ones' identities and
    scales, in order ("" when none: trunk-only adapters share the base plans)."""
    mods = modulation_uses(uses)
    if not mods:
        return ""
    h = hashlib.sha256()
    for info, scale in mods:
        h.update(f"{info.identity}:{float(scale).hex()};".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class LoraTerm:
    """One adapter's factors on one module, as PEFT holds them."""

    down: torch.Tensor
    """lora_A.weight (r, in)."""
    up: torch.Tensor
    """lora_B.weight (out, r)."""
    scaling: float
    """scale x lora_alpha / r (PEFT's set_scale)."""

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """lora_B(lora_A(x)) * scaling, x already in the factors' dtype (lora_linear casts it)."""
        return F.linear(F.linear(x, self.down), self.up) * self.scaling


def lora_linear(result: torch.Tensor, x: torch.Tensor, terms: Sequence[LoraTerm],
                rows: tuple[int, int] | None = None) -> torch.Tensor:  # fmt: skip
    """PEFT's forward after its base layer: `result` (the base layer's output, or its rows [first, end)) plus every
    term in order, back at the base output's dtype."""
    dtype = result.dtype
    for term in terms:
        x = x if x.dtype == term.down.dtype else x.to(term.down.dtype)  # PEFT's _cast_input_dtype, kept for the next
        delta = term.delta(x)
        result = result + (delta if rows is None else delta[:, rows[0] : rows[1]])
    return result.to(dtype)


@dataclass
class ModulationDeltas:
    """The modulation parts of a request's adapters, by module (diffusers' names), in the request's order."""

    digest: str
    terms: dict[str, list[LoraTerm]] = field(default_factory=dict)

    @classmethod
    def load(cls, uses: Sequence[tuple[AdapterInfo, float]], partition: str, projection_dtype: torch.dtype,
             time_dtype: torch.dtype, device: torch.device | str = "cpu") -> ModulationDeltas:  # fmt: skip
        """Read each modulation-changing adapter's modulation and time factors (diffusers' conversion), as PEFT
        would hold them in `partition`'s transformer."""
        from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin

        mods = modulation_uses(uses)
        out = cls(modulation_digest(uses))
        prefix = _PREFIXES[partition]
        for info, scale in mods:
            state, metadata = MiniMaxH3LoraLoaderMixin.lora_state_dict(str(info.path), return_lora_metadata=True)
            alpha = _network_alpha(metadata, prefix)
            wanted = {m for g in MODULATION_GROUPS for m in info.targets.get(g, ())}
            for module in sorted(wanted):
                down = state[f"{prefix}{module}.lora_A.weight"]
                up = state[f"{prefix}{module}.lora_B.weight"]
                rank = int(down.shape[0])
                dtype = time_dtype if module.startswith("time_embedder.") else projection_dtype
                lora_alpha = alpha if alpha is not None else rank
                term = LoraTerm(down.to(device=device, dtype=dtype), up.to(device=device, dtype=dtype),
                                float(scale) * lora_alpha / rank)  # fmt: skip
                out.terms.setdefault(module, []).append(term)
        return out

    def of(self, module: str) -> list[LoraTerm]:
        return self.terms.get(module, [])

    @contextmanager
    def on_time_embedder(self, time_embedder: nn.Module) -> Iterator[None]:
        """The time embedder's linears compute PEFT's LoRA forward meanwhile (forward hooks adding each term)."""
        handles = []
        for name in ("linear_1", "linear_2"):
            terms = self.of(f"time_embedder.{name}")
            if terms:

                def hook(module: Any, args: tuple[Any, ...], output: torch.Tensor, terms: Any = terms) -> torch.Tensor:
                    return lora_linear(output, args[0], terms)

                handles.append(getattr(time_embedder, name).register_forward_hook(hook))
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def _network_alpha(metadata: Any, prefix: str) -> float | None:
    """The uniform network alpha diffusers' loader honors from a file's `__metadata__` (None: alpha = rank)."""
    if not metadata:
        return None
    for key in (f"{prefix}lora_alpha", "lora_alpha"):
        if key in metadata and metadata[key] is not None:
            return float(metadata[key])
    return None
