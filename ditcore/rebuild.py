"""The sidecar's page computation: many plans' pages in one streamed pass over a diffusers H3 checkpoint's shards.

Protocol:

    builder = PlanBuilder(transformer_dir)          # config, time_proj/time_embedder (float32), shard headers
    outputs = [torch.empty(len(k), builder.layout.page_numel, dtype=builder.projection_dtype) for k in keys]
    builder.build(keys, outputs)                    # each adaln_proj / norm_out tensor read once, one GEMM per key

A key is one plan: the step's sorted distinct float32 timesteps, as a tensor or as their int32 bit patterns. Each
key gets its own GEMM with M = its width, so its pages are bitwise `plans.build_pages` for that key alone (a GEMM
row's bits depend on M). Only the time embedder's and the plan tensors' bytes are ever read from the shards.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from .plans import PageLayout, PlanKey, is_plan_tensor, load_dtype, plan_inputs, read_tensor, shard_map

TIME_EMBEDDER = "time_embedder"
# safetensors header dtype names -> torch dtypes a projection may be stored in
_STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}

PlanKeyLike = PlanKey | torch.Tensor | tuple[int, ...]
"""A PlanKey, (T,) float32 timesteps, or their float32 bit patterns (signed or unsigned 32-bit)."""


def key_timesteps(key: PlanKeyLike, where: str = "key") -> torch.Tensor:
    """A key as the (T,) float32 timestep tensor the transformer receives; ValueError naming `where` if invalid."""
    if isinstance(key, PlanKey):
        key = key.bits
    if isinstance(key, torch.Tensor):
        if key.dtype != torch.float32 or key.ndim != 1:
            raise ValueError(
                f"{where}: timesteps must be a 1-D float32 tensor, got {key.dtype} of shape {tuple(key.shape)}"
            )
        t = key.detach().cpu()
    else:
        # bit patterns may come signed (int32 view) or unsigned (uint32); both name the same float32
        bits = [int(b) - (1 << 32) if int(b) >= 1 << 31 else int(b) for b in key]
        if any(not -(1 << 31) <= b < 1 << 31 for b in bits):
            raise ValueError(f"{where}: {tuple(key)} holds a value that is not a 32-bit pattern")
        t = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    if t.numel() == 0:
        raise ValueError(f"{where} is empty: a plan has 1 to 4 distinct timesteps")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{where}: timesteps {t.tolist()} include a non-finite value; H3's timesteps lie in [0, 1]")
    return t


def _time_modules(config: dict[str, Any]) -> tuple[nn.Module, nn.Module, list[str]]:
    """The transformer's own `time_proj` and `time_embedder`, built by its constructor on meta (no bytes allocated for
    the rest), and its `_keep_in_fp32_modules`. time_embedder's parameters stay on meta until loaded."""
    from accelerate import init_empty_weights
    from diffusers import MiniMaxH3Transformer3DModel

    with init_empty_weights():
        model = MiniMaxH3Transformer3DModel.from_config(config)
    return model.time_proj, model.time_embedder, list(model._keep_in_fp32_modules or [])


class PlanBuilder:
    """Computes plan pages exactly as diffusers' MiniMaxH3Transformer3DModel does, from its checkpoint directory.

    Holds only the time embedder (float32, as `_keep_in_fp32_modules` keeps it); the projections are streamed one at
    a time during `build`. `tensor_reads` / `bytes_read` count every tensor read from the shards (tests, metrics).
    """

    def __init__(self, transformer_dir: str | os.PathLike[str], device: torch.device | str = "cpu") -> None:
        self.transformer_dir = os.fspath(transformer_dir)
        self.device = torch.device(device)
        with open(os.path.join(self.transformer_dir, "config.json")) as f:
            config = json.load(f)
        self.layout = PageLayout.from_config(config)
        """Where each projection's rows sit in a page."""
        self.files = shard_map(self.transformer_dir)
        self.tensor_reads: Counter[str] = Counter()
        """tensor name -> times its data was read from the shards."""
        self.bytes_read = 0
        """bytes of tensor data read from the shards (as stored)."""
        self.time_proj, self.time_embedder, self.keep_fp32 = _time_modules(config)
        self._load_time_embedder()
        self.projection_dtype = self._projection_dtype()
        """dtype of every projection and of the pages: as stored, under from_pretrained's keep-in-fp32 rule."""

    def _read(self, name: str) -> torch.Tensor:
        """One tensor's data, as stored, on the builder's device."""
        t = read_tensor(self.transformer_dir, self.files, name)
        self.tensor_reads[name] += 1
        self.bytes_read += t.numel() * t.element_size()
        return t.to(self.device)

    def _load_time_embedder(self) -> None:
        """Assign the time embedder's tensors from the shards in float32 (`_keep_in_fp32_modules` keeps it so)."""
        prefix = TIME_EMBEDDER + "."
        state = {n[len(prefix) :]: self._read(n).float() for n in self.files if n.startswith(prefix)}
        self.time_embedder.load_state_dict(state, strict=True, assign=True)
        self.time_embedder.eval()
        self.time_proj.eval()

    def _stored_dtype(self, name: str) -> torch.dtype:
        """A tensor's stored dtype, from the shard header alone (no data read)."""
        with safe_open(os.path.join(self.transformer_dir, self.files[name]), "pt") as f:
            stored = f.get_slice(name).get_dtype()
        if stored not in _STORED_DTYPES:
            raise ValueError(
                f"{name} in {self.files[name]} is stored as {stored}; expected one of {sorted(_STORED_DTYPES)}"
            )
        return _STORED_DTYPES[stored]

    def _projection_dtype(self) -> torch.dtype:
        """The one dtype every projection weight and bias loads at; ValueError naming a tensor that differs."""
        dtypes = {}
        for prefix, _, _ in self.layout.projections():
            for name in (f"{prefix}.weight", f"{prefix}.bias"):
                if name not in self.files:
                    raise ValueError(f"{name} is not in {self.transformer_dir}'s checkpoint")
                dtypes[name] = load_dtype(name, self._stored_dtype(name), self.keep_fp32)
        first = next(iter(dtypes.values()))
        odd = {n: d for n, d in dtypes.items() if d != first}
        if odd:
            raise ValueError(f"{self.transformer_dir}: projections load at {first}, but {odd}")
        return first

    @torch.no_grad()
    def activations(self, timesteps: torch.Tensor) -> torch.Tensor:
        """(T,) float32 -> (T, E) `silu(temb)` at temb's precision, cast to the projection dtype, as diffusers does."""
        temb = plan_inputs(self.time_proj, self.time_embedder, timesteps.to(self.device))
        return F.silu(temb).to(self.projection_dtype)

    def _check(self, keys: Sequence[PlanKeyLike], outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Every key's timesteps; ValueError naming the first bad key or output, before any projection is read."""
        if len(keys) != len(outputs):
            raise ValueError(f"{len(keys)} keys but {len(outputs)} outputs: one (width, page_numel) output per key")
        timesteps = [key_timesteps(key, f"key {k} {key!r}") for k, key in enumerate(keys)]
        for k, (t, out) in enumerate(zip(timesteps, outputs, strict=True)):
            want = (t.numel(), self.layout.page_numel)
            if tuple(out.shape) != want or out.dtype != self.projection_dtype or out.device != self.device:
                raise ValueError(
                    f"output {k} is {out.dtype} {tuple(out.shape)} on {out.device}; "
                    f"key {k} needs {self.projection_dtype} {want} on {self.device}"
                )
        return timesteps

    @torch.no_grad()
    def build(self, keys: Sequence[PlanKeyLike], outputs: Sequence[torch.Tensor]) -> None:
        """One pass over the projections: each weight/bias read once, then one GEMM per key (M = its width).

        outputs[k]: (width_k, page_numel) in `projection_dtype` on the builder's device, written in place.
        """
        acts = [self.activations(t) for t in self._check(keys, outputs)]  # (T_k, E) each
        for prefix, offset, numel in self.layout.projections():
            weight = self._read(f"{prefix}.weight").to(self.projection_dtype)  # (numel, E)
            bias = self._read(f"{prefix}.bias").to(self.projection_dtype)  # (numel,)
            if weight.shape != (numel, self.layout.time_embed_dim) or bias.shape != (numel,):
                raise ValueError(
                    f"{prefix}: weight {tuple(weight.shape)} / bias {tuple(bias.shape)}, "
                    f"expected {(numel, self.layout.time_embed_dim)} / {(numel,)}"
                )
            for act, out in zip(acts, outputs, strict=True):
                out[:, offset : offset + numel] = F.linear(act, weight, bias)  # (T_k, numel)
            del weight, bias  # one projection resident at a time

    def build_one(self, key: PlanKeyLike) -> torch.Tensor:
        """One key's (width, page_numel) pages (a pass of its own)."""
        width = key_timesteps(key).numel()
        out = torch.empty(width, self.layout.page_numel, dtype=self.projection_dtype, device=self.device)
        self.build([key], [out])
        return out


def plan_tensor_names(transformer_dir: str | os.PathLike[str]) -> list[str]:
    """The checkpoint's `adaln_proj` and `norm_out.linear` tensor names (what a pass reads, once each)."""
    return sorted(n for n in shard_map(os.fspath(transformer_dir)) if is_plan_tensor(n))
