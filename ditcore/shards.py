"""A diffusers transformer folder's safetensors shards: which shard holds each tensor, a tensor read as stored, and
the cached transformer built from them without ever reading or allocating a plan tensor."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from safetensors import safe_open

from .plans import LayerLoader, PlanPages, install_plan_modules, is_plan_tensor

INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"
SINGLE_FILE = "diffusion_pytorch_model.safetensors"
# safetensors header dtype names -> bytes per element (for the bytes a cached load skips)
_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}


def shard_map(transformer_dir: str) -> dict[str, str]:
    """Tensor name -> shard file name of a diffusers transformer directory (sharded with an index, or single-file)."""
    index_path = os.path.join(transformer_dir, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            return dict(json.load(f)["weight_map"])
    single = os.path.join(transformer_dir, SINGLE_FILE)
    if not os.path.exists(single):
        raise FileNotFoundError(f"{transformer_dir} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), SINGLE_FILE)


def load_dtype(name: str, torch_dtype: torch.dtype, keep_fp32: list[str]) -> torch.dtype:
    """from_pretrained's rule: float32 for a name with a `_keep_in_fp32_modules` entry as a component, else torch_dtype."""
    return torch.float32 if any(k in name.split(".") for k in keep_fp32) else torch_dtype


def read_tensor(transformer_dir: str, files: Mapping[str, str], name: str) -> torch.Tensor:
    """One tensor's data as stored, from the shard `files` (a `shard_map`) places it in."""
    if name not in files:
        raise KeyError(f"{name} is not in {transformer_dir}'s checkpoint")
    with safe_open(os.path.join(transformer_dir, files[name]), "pt") as f:
        return f.get_tensor(name)


def safetensors_layer_loader(transformer_dir: str, torch_dtype: torch.dtype | None = None) -> LayerLoader:
    """A LayerLoader reading one projection's weight and bias from the shards (as stored, or cast to torch_dtype)."""
    files = shard_map(transformer_dir)

    def load(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        weight, bias = (read_tensor(transformer_dir, files, f"{prefix}.{part}") for part in ("weight", "bias"))
        if torch_dtype is not None:
            weight, bias = weight.to(torch_dtype), bias.to(torch_dtype)
        return weight, bias

    return load


def _read_state_dict(
    transformer_dir: str, torch_dtype: torch.dtype, keep_fp32: list[str], device: torch.device | None = None
) -> tuple[dict[str, torch.Tensor], int, int]:
    """Every tensor except the plan tensors, cast by the from_pretrained rule and moved to `device` one at a time (so
    the host holds one tensor, not the transformer). Returns (state, bytes read, skipped)."""
    by_file: dict[str, list[str]] = {}
    for name, file in shard_map(transformer_dir).items():
        by_file.setdefault(file, []).append(name)
    state: dict[str, torch.Tensor] = {}
    read = skipped = 0
    for file, names in sorted(by_file.items()):
        with safe_open(os.path.join(transformer_dir, file), "pt") as f:
            for name in names:
                if is_plan_tensor(name):  # header only: shape and dtype, no data
                    meta = f.get_slice(name)
                    skipped += _DTYPE_BYTES[meta.get_dtype()] * int(torch.Size(meta.get_shape()).numel())
                    continue
                t = f.get_tensor(name)
                read += t.numel() * t.element_size()
                state[name] = t.to(device=device, dtype=load_dtype(name, torch_dtype, keep_fp32))
                del t
    return state, read, skipped


def load_transformer_without_adaln(
    transformer_dir: str,
    holder: PlanPages,
    torch_dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[Any, int, int]:
    """Cached-mode construction of diffusers' MiniMaxH3Transformer3DModel: never reads nor allocates a plan tensor.

    Builds on meta, installs PlanLinear modules (dtype = torch_dtype, the projections' dtype under the from_pretrained
    rule), then assigns every other tensor from the shards. torch_dtype=bfloat16 on the released checkpoint gives the
    released mixed precision. Each tensor goes to `device` (default: stays on the CPU) as it is read, so no host copy
    of the transformer is ever whole. Returns (model in eval mode, bytes read, plan-tensor bytes skipped).
    """
    from accelerate import init_empty_weights
    from diffusers import MiniMaxH3Transformer3DModel

    config = MiniMaxH3Transformer3DModel.load_config(transformer_dir)
    with init_empty_weights():  # parameters on meta; buffers (rope.inv_freq, computed, float32) stay real
        model = MiniMaxH3Transformer3DModel.from_config(config)
    for owner in [*(block.adaln_proj for block in model.transformer_blocks), model.norm_out]:
        owner.linear.to(torch_dtype)  # still on meta; the PlanLinear anchors take this dtype
    install_plan_modules(model, holder)
    keep_fp32 = list(model._keep_in_fp32_modules or [])
    target = torch.device(device) if device is not None else None
    state, read, skipped = _read_state_dict(transformer_dir, torch_dtype, keep_fp32, target)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    del state
    if target is not None and target.type != "cpu":
        model.to(target)  # the buffers (rope, the PlanLinear anchors) follow; the parameters are there already
    if missing or unexpected:
        raise ValueError(f"{transformer_dir}: tensors missing {missing}, unexpected {unexpected}")
    meta_left = [n for n, p in model.named_parameters() if p.is_meta]
    if meta_left:
        raise ValueError(f"{transformer_dir}: no tensor for {meta_left}")
    return model.eval(), read, skipped
