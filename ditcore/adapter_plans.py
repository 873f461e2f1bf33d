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

Full-parameter deltas (`.diff` / `.diff_b`) on these modules change the parameters themselves, before any LoRA term,
as a resident model applies them (ditcore.adapters.with_delta, in the request's order): the time embedder's
parameters are swapped for the changed ones meanwhile, and each projection's weight and bias rows get the same rows
of their deltas (an elementwise sum, so a shard's rows equal the whole's).
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

from .adapter_files import group_of
from .adapters import MODULATION_GROUPS, AdapterInfo, lora_state, read_deltas, with_delta

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
    diffs: dict[str, list[tuple[dict[str, torch.Tensor], float]]] = field(default_factory=dict)
    """module -> each adapter's full-parameter deltas on it ({"weight" | "bias": delta} at the module's dtype) and
    its scale, in the request's order."""

    @classmethod
    def load(cls, uses: Sequence[tuple[AdapterInfo, float]], partition: str, projection_dtype: torch.dtype,
             time_dtype: torch.dtype, device: torch.device | str = "cpu") -> ModulationDeltas:  # fmt: skip
        """Read each modulation-changing adapter's modulation and time factors (diffusers' conversion), as PEFT
        would hold them in `partition`'s transformer."""
        mods = modulation_uses(uses)
        out = cls(modulation_digest(uses))
        prefix = _PREFIXES[partition]
        for info, scale in mods:
            if info.deltas:
                for module, params in read_deltas(info.path)[0].items():
                    if group_of(module) in MODULATION_GROUPS:
                        dtype = time_dtype if module.startswith("time_embedder.") else projection_dtype
                        moved = {p: d.to(device=device, dtype=dtype) for p, d in params.items()}
                        out.diffs.setdefault(module, []).append((moved, float(scale)))
            state, metadata = lora_state(info.path)
            alpha = _network_alpha(metadata, prefix)
            wanted = {m for g in MODULATION_GROUPS for m in info.targets.get(g, ())}
            for module in sorted(wanted):
                if f"{prefix}{module}.lora_A.weight" not in state:
                    continue  # a module it changes by deltas only
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

    def changed(
        self, module: str, param: str, value: torch.Tensor, rows: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """`module`'s parameter `param` (or its rows [first, end)) with every full-parameter delta on it added."""
        for deltas, scale in self.diffs.get(module, []):
            delta = deltas.get(param)
            if delta is not None:
                value = with_delta(value, delta if rows is None else delta[rows[0] : rows[1]], scale)
        return value

    @contextmanager
    def on_time_embedder(self, time_embedder: nn.Module) -> Iterator[None]:
        """The time embedder's linears compute the adapted forward meanwhile: their parameters changed by the
        full-parameter deltas, then PEFT's LoRA terms added by forward hooks."""
        saved: list[tuple[nn.Parameter, torch.Tensor]] = []
        for name in ("linear_1", "linear_2"):
            linear = getattr(time_embedder, name)
            for param in ("weight", "bias"):
                tensor = getattr(linear, param)
                new = self.changed(f"time_embedder.{name}", param, tensor.data)
                if new is not tensor.data:
                    saved.append((tensor, tensor.data))
                    tensor.data = new
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
            for tensor, data in saved:
                tensor.data = data


def _network_alpha(metadata: Any, prefix: str) -> float | None:
    """The uniform network alpha diffusers' loader honors from a file's `__metadata__` (None: alpha = rank)."""
    if not metadata:
        return None
    for key in (f"{prefix}lora_alpha", "lora_alpha"):
        if key in metadata and metadata[key] is not None:
            return float(metadata[key])
    return None
