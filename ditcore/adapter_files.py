"""Random MiniMax-H3 LoRA adapter files, in the public key layouts diffusers' own H3 loader converts.

Owns: the mapping between the original checkpoint's module names (what every non-diffusers trainer writes against)
and `MiniMaxH3Transformer3DModel`'s, the grouping of those modules into target groups, the encoding of one set of
random factors into each layout, and the refusal of what a layout cannot carry. It does not load adapters: that is
diffusers' `MiniMaxH3LoraLoaderMixin` (`lora_state_dict` -> `_convert_non_diffusers_minimax_h3_lora_to_diffusers`),
which is the contract every layout here is written against (diffusers 0.42.1).

Target groups (diffusers module names):

- `trunk`: every block's attention and feed-forward linears, in the main stack and the text token refiner:
  `transformer_blocks.N.attn.{to_q,to_k,to_v,to_out.0}`, `transformer_blocks.N.ff.net.{0.proj,2}` and the same under
  `token_refiner.refiner_blocks.N.` (the original fused `attn.qkv_proj`, `attn.out_proj`, `mlp.fc1`, `mlp.fc2`).
- `modulation`: every block's `adaln_proj.linear` and `norm_out.linear` (`final_layer.adaln_proj.linear`).
- `time`: `time_embedder.linear_1` / `linear_2` (`time_embedder.proj_in` / `proj_out`).
- `all`: the three.

Layouts, one example key each (alpha: how the file carries it; absent when `alpha` is None, which diffusers loads
at `alpha == rank`, i.e. scale 1.0):

- `diffusers`: `transformer.transformer_blocks.0.attn.to_q.lora_A.weight` (`transformer_ref.` for `partition="ref"`,
  the only layout that can name that partition); alpha as a `__metadata__` `alpha` entry (scale `alpha / rank`).
- `ai-toolkit`: `diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight`; alpha in `__metadata__`.
- `musubi`: `lora_unet_blocks_0_attn_qkv_proj.lora_down.weight` (+ `.lora_up.weight`, `.alpha`); alpha as one
  float32 scalar per module, which diffusers folds into the factors (PEFT scale 1.0, product `alpha / rank`).
- `kohya`: `blocks.0.attn.qkv_proj.lora_down.weight` (+ `.lora_up.weight`, `.alpha`), the unprefixed original
  names; alpha as per-module scalars, folded like musubi's.
- `diffsynth`: `blocks.0.attn.qkv_proj.lora_A.default.weight`, unprefixed with peft's `.default.` infix, the fused
  QKV `lora_B` rows per-head interleaved (`[head0: q k v, head1: q k v, ...]`) as the raw checkpoint's are; alpha in
  `__metadata__`.

What each layout cannot carry (refused with `AdapterError`, naming the layout and the group):

- `partition="ref"` with any layout but `diffusers`: the converter prefixes every non-diffusers file with
  `transformer.`, so such a file cannot name `transformer_ref` (load it with `load_into_transformer_ref=True`).
- `kohya` and `diffsynth` with `targets="time"`: an unprefixed file is recognized as non-diffusers only by a
  `blocks.` / `token_refiner.blocks.` / `final_layer.` key, which a time-embedder-only file lacks; diffusers then
  passes its original names through unconverted (kohya's `.alpha` keys fail its `'lora'` check, diffsynth's names
  miss every module). With `trunk` or `modulation` beside it (`all`) the time group converts fine.
- `diffsynth` with `trunk` (so `all`) unless the attention head is 128 wide: the converter de-interleaves the fused
  QKV with a fixed `head_dim = 128` (every released partition's). The `tiny` / `small` / `bench` presets have 32-wide
  heads, so a diffsynth adapter for them carries `modulation` only.

Full-parameter deltas (`deltas=GROUP`, as FastH3 ships for its time embedder): each module of that group gets a
`.diff` (the weight's delta, (out, in)) and a `.diff_b` (the bias's) beside whatever LoRA factors `targets` writes
(`targets="none"`: deltas only). Diffusers' converter does not read them: ditcore.adapters splits them off
(`delta_modules` maps their names) and applies them as their producers define them (parameter + scale x delta).
Written in the original checkpoint's names (`diffusion_model.time_embedder.proj_in.diff`, ai-toolkit; unprefixed,
kohya) or diffusers' (`transformer.time_embedder.linear_1.diff`, diffusers); musubi and diffsynth carry none.

Every layout encodes the same factors: for a given seed, each module's `lora_A` / `lora_B` (in diffusers' terms,
once converted) are the same whatever the layout and whatever else is targeted, each module seeded from `seed` and
its own name. `lora_A` ~ N(0, 1/in_features), `lora_B` ~ N(0, 0.02²): `lora_B` is not zero, so the adapter changes
the outputs, and small, so they stay finite. The fused QKV shares one `lora_A` between `to_q`, `to_k` and `to_v`
(the diffusers layout writes three copies), as the fused original does.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .presets import H3Preset, get_preset

LAYOUTS: tuple[str, ...] = ("diffusers", "ai-toolkit", "musubi", "kohya", "diffsynth")
GROUPS: tuple[str, ...] = ("trunk", "modulation", "time")
TARGETS: tuple[str, ...] = (*GROUPS, "all")
TARGET_CHOICES: tuple[str, ...] = (*TARGETS, "none")
"""What `targets` / `deltas` may say: "none" writes no LoRA factors (a deltas-only file) or no deltas."""
DELTA_SUFFIXES = {".diff": "weight", ".diff_b": "bias"}
"""A full-parameter delta's key suffix and the parameter it changes."""
DELTA_LAYOUTS = frozenset({"diffusers", "ai-toolkit", "kohya"})
DELTA_STD = 0.01
PARTITIONS: tuple[str, ...] = ("base", "ref")
PARTITION_PREFIX = {"base": "transformer", "ref": "transformer_ref"}
"""The component prefix diffusers' H3 mixin routes a diffusers-layout file by."""
DIFFSYNTH_HEAD_DIM = 128
"""The head width diffusers' converter assumes when it de-interleaves a DiffSynth fused QKV."""
B_STD = 0.02

_ALPHA_TENSOR_LAYOUTS = frozenset({"musubi", "kohya"})
_UNPREFIXED_LAYOUTS = frozenset({"kohya", "diffsynth"})
_UNPREFIXED_NEEDS = frozenset({"trunk", "modulation"})
"""The groups whose original names (`blocks.`, `token_refiner.blocks.`, `final_layer.`) let diffusers recognize an
unprefixed file as non-diffusers."""


class AdapterError(ValueError):
    """An adapter that cannot be written: a bad argument, or a layout that cannot carry what was asked.
    `params` names the arguments at fault (`write_adapter`'s names), for a caller that maps them to flags."""

    def __init__(self, message: str, params: tuple[str, ...]) -> None:
        super().__init__(message)
        self.params = params


@dataclass(frozen=True)
class AdapterModule:
    """One LoRA-able module of the original checkpoint and the diffusers modules it becomes."""

    group: str
    source: str
    """the original checkpoint's name, e.g. `blocks.0.attn.qkv_proj`."""
    targets: tuple[str, ...]
    """diffusers' names: three for the fused QKV (`to_q`, `to_k`, `to_v`), else one."""
    kind: str
    """`qkv` (fused, lora_B rows [q; k; v] in diffusers' order), `fc1` (fused SwiGLU: diffusers [value; gate], the
    original [gate; value]) or `plain`."""
    in_features: int
    out_features: int
    """rows of the (fused) lora_B."""
    has_bias: bool = True
    """Every target linear has a bias (a bias delta is written only then)."""


def groups_of(targets: str, param: str = "targets") -> tuple[str, ...]:
    """The groups `targets` ("trunk" | "modulation" | "time" | "all" | "none") selects."""
    if targets not in TARGET_CHOICES:
        raise AdapterError(f"unknown {param} {targets!r}; choose one of {', '.join(TARGET_CHOICES)}", (param,))
    return GROUPS if targets == "all" else () if targets == "none" else (targets,)


_ORIGINAL_BLOCK = re.compile(
    r"(?P<stack>blocks|token_refiner\.blocks)\.(?P<i>\d+)\.(?P<tail>attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2|"
    r"adaln_proj\.linear)"
)
_ORIGINAL_STACK = {"blocks": "transformer_blocks", "token_refiner.blocks": "token_refiner.refiner_blocks"}
_ORIGINAL_TAIL = {"attn.qkv_proj": ("attn.to_q", "attn.to_k", "attn.to_v"), "attn.out_proj": ("attn.to_out.0",),
                  "mlp.fc1": ("ff.net.0.proj",), "mlp.fc2": ("ff.net.2",), "adaln_proj.linear": ("adaln_proj.linear",)}  # fmt: skip
_ORIGINAL_STANDALONE = {"final_layer.adaln_proj.linear": "norm_out.linear",
                        "time_embedder.proj_in": "time_embedder.linear_1",
                        "time_embedder.proj_out": "time_embedder.linear_2"}  # fmt: skip


def delta_modules(name: str, delta: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """A full-parameter delta of module `name` (diffusers' name, or the original checkpoint's as every non-diffusers
    trainer writes it) as deltas of diffusers' modules: the fused QKV's rows split in [q; k; v] thirds, the fused
    SwiGLU's [gate; value] halves swapped to diffusers' [value; gate]. None when `name` is no module a target group
    holds (or a fused delta's rows do not split)."""
    if group_of(name) is not None:
        return {name: delta}
    if name in _ORIGINAL_STANDALONE:
        return {_ORIGINAL_STANDALONE[name]: delta}
    match = _ORIGINAL_BLOCK.fullmatch(name)
    if match is None:
        return None
    stack, index, tail = _ORIGINAL_STACK[match["stack"]], match["i"], match["tail"]
    if tail == "adaln_proj.linear" and stack != "transformer_blocks":
        return None  # a refiner block has no AdaLN projection
    parts: tuple[torch.Tensor, ...] = (delta,)
    if tail == "attn.qkv_proj":
        if delta.shape[0] % 3:
            return None
        parts = tuple(delta.chunk(3, dim=0))
    elif tail == "mlp.fc1":
        if delta.shape[0] % 2:
            return None
        gate, value = delta.chunk(2, dim=0)
        parts = (torch.cat([value, gate], dim=0),)
    return {f"{stack}.{index}.{m}": p.contiguous() for m, p in zip(_ORIGINAL_TAIL[tail], parts, strict=True)}


def group_of(diffusers_module: str) -> str | None:
    """The target group of a `MiniMaxH3Transformer3DModel` module name, or None for a module no group holds."""
    parts = diffusers_module.split(".")
    if parts[0] == "transformer_blocks" or parts[:2] == ["token_refiner", "refiner_blocks"]:
        tail = ".".join(parts[3:] if parts[0] == "token_refiner" else parts[2:])
        if tail in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2"):
            return "trunk"
        if tail == "adaln_proj.linear" and parts[0] == "transformer_blocks":
            return "modulation"
        return None
    if diffusers_module == "norm_out.linear":
        return "modulation"
    if diffusers_module in ("time_embedder.linear_1", "time_embedder.linear_2"):
        return "time"
    return None


def transformer_config(shapes_source: str | H3Preset | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """`MiniMaxH3Transformer3DModel`'s config from a preset (name or object), a repository directory (its
    `transformer/config.json`, else `transformer_ref/config.json`) or a config mapping."""
    if isinstance(shapes_source, H3Preset):
        return shapes_source.transformer_kwargs()
    if isinstance(shapes_source, str):
        return get_preset(shapes_source).transformer_kwargs()
    if isinstance(shapes_source, Mapping):
        return dict(shapes_source)
    repo = Path(shapes_source)
    for folder in ("transformer", "transformer_ref"):
        config = repo / folder / "config.json"
        if config.is_file():
            loaded: dict[str, Any] = json.loads(config.read_text())
            return loaded
    raise AdapterError(f"{repo} is not a MiniMax-H3 repository: no transformer/config.json", ("shapes_source",))


def adapter_modules(config: Mapping[str, Any], groups: tuple[str, ...] = GROUPS) -> list[AdapterModule]:
    """The modules of `groups` in the transformer `config` describes (shapes read off the real class, on meta)."""
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel.from_config(dict(config))

    def linear(name: str) -> torch.nn.Linear:
        module = model.get_submodule(name)
        assert isinstance(module, torch.nn.Linear), name
        return module

    def unit(group: str, source: str, targets: tuple[str, ...], kind: str) -> AdapterModule:
        first = linear(targets[0])
        out = sum(linear(t).out_features for t in targets)
        has_bias = all(linear(t).bias is not None for t in targets)
        return AdapterModule(group, source, targets, kind, first.in_features, out, has_bias)

    units: list[AdapterModule] = []
    if "trunk" in groups:
        stacks = (
            ("blocks", "transformer_blocks", len(model.transformer_blocks)),
            ("token_refiner.blocks", "token_refiner.refiner_blocks", len(model.token_refiner.refiner_blocks)),
        )
        for source_prefix, target_prefix, count in stacks:
            for i in range(count):
                src, dst = f"{source_prefix}.{i}", f"{target_prefix}.{i}"
                qkv = tuple(f"{dst}.attn.{p}" for p in ("to_q", "to_k", "to_v"))
                units += [
                    unit("trunk", f"{src}.attn.qkv_proj", qkv, "qkv"),
                    unit("trunk", f"{src}.attn.out_proj", (f"{dst}.attn.to_out.0",), "plain"),
                    unit("trunk", f"{src}.mlp.fc1", (f"{dst}.ff.net.0.proj",), "fc1"),
                    unit("trunk", f"{src}.mlp.fc2", (f"{dst}.ff.net.2",), "plain"),
                ]
    if "modulation" in groups:
        for i in range(len(model.transformer_blocks)):
            source, target = f"blocks.{i}.adaln_proj.linear", f"transformer_blocks.{i}.adaln_proj.linear"
            units.append(unit("modulation", source, (target,), "plain"))
        units.append(unit("modulation", "final_layer.adaln_proj.linear", ("norm_out.linear",), "plain"))
    if "time" in groups:
        units.append(unit("time", "time_embedder.proj_in", ("time_embedder.linear_1",), "plain"))
        units.append(unit("time", "time_embedder.proj_out", ("time_embedder.linear_2",), "plain"))
    return units


def check_adapter(
    config: Mapping[str, Any], targets: str, layout: str, rank: int, alpha: float | None, partition: str,
    deltas: str = "none",
) -> tuple[str, ...]:  # fmt: skip
    """Refuse what `layout` cannot carry (see the module docstring); the groups `targets` selects."""
    if layout not in LAYOUTS:
        raise AdapterError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}", ("layout",))
    groups = groups_of(targets)
    delta_groups = groups_of(deltas, "deltas")
    if not groups and not delta_groups:
        raise AdapterError("targets 'none' without deltas writes nothing; name a group", ("targets", "deltas"))
    if delta_groups and layout not in DELTA_LAYOUTS:
        raise AdapterError(
            f"layout {layout!r} carries no full-parameter deltas; use {', '.join(sorted(DELTA_LAYOUTS))}",
            ("layout", "deltas"),
        )
    if partition not in PARTITIONS:
        raise AdapterError(f"unknown partition {partition!r}; choose one of {', '.join(PARTITIONS)}", ("partition",))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"rank must be an integer >= 1, got {rank!r}", ("rank",))
    if alpha is not None and not (math.isfinite(alpha) and alpha > 0):
        raise AdapterError(f"alpha must be a finite number > 0 (or omitted), got {alpha!r}", ("alpha",))
    if partition == "ref" and layout != "diffusers":
        raise AdapterError(
            f"layout {layout!r} cannot target partition 'ref' (transformer_ref): diffusers converts every "
            f"{layout} file to `transformer.` keys; write layout 'diffusers', or load this one with "
            "load_into_transformer_ref=True",
            ("layout", "partition"),
        )
    if not groups:  # a deltas-only file: diffusers' converter never sees it
        return groups
    if layout in _UNPREFIXED_LAYOUTS and not _UNPREFIXED_NEEDS & set(groups):
        raise AdapterError(
            f"layout {layout!r} cannot carry group {targets!r} alone: its keys are unprefixed, and diffusers "
            "recognizes an unprefixed MiniMax-H3 file only by a blocks./token_refiner.blocks./final_layer. key, "
            f"which a {targets}-only file lacks; use targets 'all', or layout diffusers, ai-toolkit or musubi",
            ("layout", "targets"),
        )
    head_dim = int(config["attention_head_dim"])
    if layout == "diffsynth" and "trunk" in groups and head_dim != DIFFSYNTH_HEAD_DIM:
        raise AdapterError(
            f"layout 'diffsynth' cannot carry group 'trunk' for {head_dim}-wide attention heads: diffusers "
            f"de-interleaves a DiffSynth fused QKV assuming {DIFFSYNTH_HEAD_DIM}-wide heads (the released shapes); "
            "use targets 'modulation', or another layout",
            ("layout", "targets"),
        )
    return groups


def _module_seed(seed: int, source: str) -> int:
    digest = hashlib.sha256(f"{seed}:{source}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def random_factors(unit: AdapterModule, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A (rank, in), lora_B (out, rank)) of `unit` in diffusers' row order, float32; depends only on
    (`seed`, `unit.source`, `rank`) and the shapes."""
    g = torch.Generator().manual_seed(_module_seed(seed, unit.source))
    down = torch.randn(rank, unit.in_features, generator=g) / math.sqrt(unit.in_features)
    up = torch.randn(unit.out_features, rank, generator=g) * B_STD
    return down, up


def _original_up(unit: AdapterModule, up: torch.Tensor, layout: str, head_dim: int) -> torch.Tensor:
    """`up` (diffusers' row order) in the original checkpoint's order for `layout`."""
    if unit.kind == "fc1":  # diffusers [value; gate] -> original [gate; value]
        value, gate = up.chunk(2, dim=0)
        return torch.cat([gate, value], dim=0)
    if unit.kind == "qkv" and layout == "diffsynth":  # [q_all; k_all; v_all] -> [head0: q k v, head1: q k v, ...]
        rows, rank = up.shape
        heads = rows // (3 * head_dim)
        return up.reshape(3, heads, head_dim, rank).transpose(0, 1).reshape(rows, rank)
    return up


def encode(
    unit: AdapterModule, down: torch.Tensor, up: torch.Tensor, layout: str, partition: str, head_dim: int
) -> dict[str, torch.Tensor]:
    """`unit`'s factors (diffusers' row order) as `layout`'s keys, without alpha."""
    if layout == "diffusers":
        prefix = PARTITION_PREFIX[partition]
        ups = up.chunk(3, dim=0) if unit.kind == "qkv" else (up,)
        out: dict[str, torch.Tensor] = {}
        for target, part in zip(unit.targets, ups, strict=True):
            out[f"{prefix}.{target}.lora_A.weight"] = down.clone()
            out[f"{prefix}.{target}.lora_B.weight"] = part.contiguous()
        return out
    up = _original_up(unit, up, layout, head_dim).contiguous()
    if layout == "ai-toolkit":
        base, a, b = f"diffusion_model.{unit.source}", "lora_A.weight", "lora_B.weight"
    elif layout == "musubi":
        base, a, b = "lora_unet_" + unit.source.replace(".", "_"), "lora_down.weight", "lora_up.weight"
    elif layout == "kohya":
        base, a, b = unit.source, "lora_down.weight", "lora_up.weight"
    elif layout == "diffsynth":
        base, a, b = unit.source, "lora_A.default.weight", "lora_B.default.weight"
    else:
        raise AdapterError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}", ("layout",))
    return {f"{base}.{a}": down, f"{base}.{b}": up}


def random_delta(unit: AdapterModule, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight delta (out, in), bias delta (out,)) of `unit` in diffusers' row order, float32, ~ N(0, DELTA_STD²);
    depends only on (`seed`, `unit.source`) and the shapes."""
    g = torch.Generator().manual_seed(_module_seed(seed, f"{unit.source}.diff"))
    weight = torch.randn(unit.out_features, unit.in_features, generator=g) * DELTA_STD
    bias = torch.randn(unit.out_features, generator=g) * DELTA_STD
    return weight, bias


def encode_delta(
    unit: AdapterModule, weight: torch.Tensor, bias: torch.Tensor, layout: str, partition: str
) -> dict[str, torch.Tensor]:
    """`unit`'s full-parameter deltas (diffusers' row order) as `layout`'s `.diff` / `.diff_b` keys (no `.diff_b`
    for a linear without a bias)."""
    out: dict[str, torch.Tensor] = {}
    if layout == "diffusers":
        prefix = PARTITION_PREFIX[partition]
        count = 3 if unit.kind == "qkv" else 1
        for target, w, b in zip(unit.targets, weight.chunk(count), bias.chunk(count), strict=True):
            out[f"{prefix}.{target}.diff"] = w.contiguous()
            if unit.has_bias:
                out[f"{prefix}.{target}.diff_b"] = b.contiguous()
        return out
    if unit.kind == "fc1":  # diffusers [value; gate] -> the original [gate; value]
        weight, bias = (torch.cat(t.chunk(2)[::-1]) for t in (weight, bias))
    base = f"diffusion_model.{unit.source}" if layout == "ai-toolkit" else unit.source
    out[f"{base}.diff"] = weight.contiguous()
    if unit.has_bias:
        out[f"{base}.diff_b"] = bias.contiguous()
    return out


def alpha_key(unit: AdapterModule, layout: str) -> str:
    """The per-module `.alpha` key of a musubi / kohya file."""
    base = "lora_unet_" + unit.source.replace(".", "_") if layout == "musubi" else unit.source
    return f"{base}.alpha"


def build_adapter(
    shapes_source: str | H3Preset | os.PathLike[str] | Mapping[str, Any],
    targets: str,
    layout: str,
    rank: int,
    alpha: float | None,
    seed: int,
    partition: str = "base",
    dtype: torch.dtype = torch.float32,
    deltas: str = "none",
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and `__metadata__` `write_adapter` writes (see it)."""
    config = transformer_config(shapes_source)
    groups = check_adapter(config, targets, layout, rank, alpha, partition, deltas)
    head_dim = int(config["attention_head_dim"])
    tensors: dict[str, torch.Tensor] = {}
    for unit in adapter_modules(config, groups):
        down, up = random_factors(unit, rank, seed)
        for key, value in encode(unit, down, up, layout, partition, head_dim).items():
            tensors[key] = value.to(dtype).contiguous()
        if alpha is not None and layout in _ALPHA_TENSOR_LAYOUTS:
            tensors[alpha_key(unit, layout)] = torch.tensor(float(alpha), dtype=torch.float32)
    for unit in adapter_modules(config, groups_of(deltas, "deltas")):
        weight, bias = random_delta(unit, seed)
        for key, value in encode_delta(unit, weight, bias, layout, partition).items():
            tensors[key] = value.to(dtype).contiguous()
    metadata = {
        "format": "pt",
        "ditserve_adapter": json.dumps(
            {
                "layout": layout,
                "targets": targets,
                "rank": rank,
                "alpha": alpha,
                "seed": seed,
                "partition": partition,
                "deltas": deltas,
            }
        ),
    }
    if alpha is not None and layout not in _ALPHA_TENSOR_LAYOUTS:
        metadata["alpha"] = repr(float(alpha))
    return tensors, metadata


def write_adapter(
    out: Path,
    shapes_source: str | H3Preset | os.PathLike[str] | Mapping[str, Any],
    targets: str,
    layout: str,
    rank: int,
    alpha: float | None,
    seed: int,
    partition: str = "base",
    dtype: torch.dtype = torch.float32,
    deltas: str = "none",
) -> Path:
    """Write a random LoRA adapter for the transformer `shapes_source` describes (a preset name or `H3Preset`, a
    repository directory, or a transformer config mapping) to the safetensors file `out`, and return `out`.

    `targets`: trunk | modulation | time | all | none; `deltas`: the groups given full-parameter deltas too
    (`.diff` / `.diff_b`; none, the default); `layout`: diffusers | ai-toolkit | musubi | kohya | diffsynth;
    `rank` >= 1; `alpha` > 0 or None (no alpha written: diffusers loads it at scale 1.0); `partition`: base | ref
    (ref: `transformer_ref`, diffusers layout only). Deterministic for the arguments. `AdapterError` (a ValueError,
    nothing written) for a bad argument or a layout that cannot carry the request (the module docstring lists them).
    """
    from safetensors.torch import save_file

    tensors, metadata = build_adapter(shapes_source, targets, layout, rank, alpha, seed, partition, dtype, deltas)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=metadata)
    return out
