"""Plan pages for diffusers' MiniMax-H3 transformer: their layout, how the sidecar computes them, and the modules
that read them in place of every block's `adaln_proj.linear` and of `norm_out.linear`.

Protocol (docs/architecture.md, "Plans, slots, pages and groups"):

    temb  = plan_inputs(time_proj, time_embedder, timestep)       # (T, E) float32, T = the plan's width (1..4)
    pages = build_pages(layout, temb, load_layer)                 # (T, page_numel), one GEMM per projection, M = T
    holder.set(pages)                                             # per step, before the transformer's forward
    transformer(...)                                              # PlanLinear modules return rows of `pages`

A page is one timestep's rows of every projection, in the transformer's own order:
`[block 0: video 6H | text 6H | audio 6H] ... [block L-1: ...] [norm_out: shift H | scale H]`, each 6H being
`shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp`. A GEMM row's bits depend on M, so a plan is the
step's whole sorted tuple of distinct timesteps and its pages are computed together, never shared across plans.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MODALITIES = 3  # diffusers' MINIMAX_H3_MODALITY_NUM: video, text, audio rows per timestep
CHUNKS = 6  # shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp
NORM_OUT = "norm_out.linear"

MAX_PLAN_WIDTH = 4  # t2va: video (+ text) and audio; fl2va adds the keyframe level, ref2va the reference level
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Page dtypes by name (the projections' dtype: bfloat16 in the released checkpoint, float32 in a float32 one)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The DTYPES name of a torch dtype; ValueError for one pages cannot have."""
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"pages cannot be {dtype}; allowed: {sorted(DTYPES)}")


def f32_bits(value: float) -> int:
    """The IEEE-754 float32 bit pattern (unsigned) of `value` rounded to float32."""
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


def bits_f32(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


PARTITION_CODES: dict[str, int] = {"base": 0, "ref": 1}
"""The transformer partitions (ditcore.checkpoint_files.PARTITIONS) by the code a slot-table row records."""


@dataclass(frozen=True, order=True)
class PlanKey:
    """One step's plan: the transformer partition it belongs to and the float32 bit patterns (unsigned) of the
    distinct timesteps that partition's transformer receives.

    Exactly diffusers' `timestep` argument for that step: `torch.unique(row_timesteps, sorted=True)`, so ascending
    (H3's t = 1 - sigma lies in [0, 1], where the bit patterns sort as the values do). Width 1 to 4. Two partitions'
    pages of the same timesteps differ (each has its own adaln_proj), so the partition is part of the identity: a
    key of one never matches, and its slot never serves, the other.
    """

    bits: tuple[int, ...]
    partition: str = "base"
    """"base" (transformer/: t2va, fl2va) or "ref" (transformer_ref/: ref2va)."""
    adapters: str = ""
    """The digest of the modulation-changing adapters its pages are built with, in order, at their scales
    (ditcore.adapter_plans.modulation_digest); "" for the base weights' plan."""

    def __post_init__(self) -> None:
        if self.partition not in PARTITION_CODES:
            raise ValueError(f"unknown partition {self.partition!r}; partitions: {list(PARTITION_CODES)}")

    @property
    def partition_code(self) -> int:
        """The partition's PARTITION_CODES value (what a slot-table row records)."""
        return PARTITION_CODES[self.partition]

    def in_partition(self, partition: str) -> PlanKey:
        """The same timesteps keyed for `partition`."""
        return PlanKey(self.bits, partition, self.adapters)

    @property
    def adapters_code(self) -> int:
        """The adapters' digest as a slot-table row records it: its first 8 bytes as a signed int64 (0: none)."""
        if not self.adapters:
            return 0
        return int.from_bytes(bytes.fromhex(self.adapters[:16]), "little", signed=True) or 1

    def with_adapters(self, digest: str) -> PlanKey:
        """The same timesteps and partition, pages built with the adapters of `digest` ("" : the base weights')."""
        return PlanKey(self.bits, self.partition, digest)

    @property
    def width(self) -> int:
        return len(self.bits)

    def timesteps(self) -> torch.Tensor:
        """(width,) float32 tensor holding exactly these bit patterns."""
        raw = struct.pack(f"<{len(self.bits)}I", *self.bits)
        return torch.frombuffer(bytearray(raw), dtype=torch.float32).clone()

    @classmethod
    def from_tensor(cls, timestep: torch.Tensor, partition: str = "base") -> PlanKey:
        """The key of the (T,) float32 `timestep` a forward of `partition`'s transformer receives, in its order."""
        if timestep.dtype != torch.float32 or timestep.ndim != 1:
            raise ValueError(f"timestep must be 1-D float32, got {timestep.dtype} of shape {tuple(timestep.shape)}")
        return cls(tuple(int(b) & 0xFFFFFFFF for b in timestep.detach().cpu().view(torch.int32).tolist()), partition)

    @classmethod
    def from_timesteps(cls, *timesteps: float, partition: str = "base") -> PlanKey:
        """The distinct values (rounded to float32), sorted ascending as torch.unique sorts them."""
        values = torch.tensor([float(t) for t in timesteps], dtype=torch.float32)
        return cls.from_tensor(torch.unique(values, sorted=True), partition)

    def is_finite(self) -> bool:
        return all((b >> 23) & 0xFF != 0xFF for b in self.bits)  # exponent all ones = inf or nan

    def __str__(self) -> str:
        values = "(" + ", ".join(f"{bits_f32(b):.4f}" for b in self.bits) + ")"
        return values if self.partition == "base" else f"{self.partition}:{values}"


def distinct_keys(keys: Iterable[PlanKey]) -> list[PlanKey]:
    """A request's *group*: its plan keys deduplicated, first-seen order kept."""
    return list(dict.fromkeys(keys))


# (weight (out, in), bias (out,)) of one projection, by its checkpoint prefix, e.g. "transformer_blocks.3.adaln_proj.linear"
LayerLoader = Callable[[str], tuple[torch.Tensor, torch.Tensor]]


def block_projection(i: int) -> str:
    """Checkpoint prefix of block `i`'s modulation projection."""
    return f"transformer_blocks.{i}.adaln_proj.linear"


def is_plan_tensor(name: str) -> bool:
    """True for the tensors a cached generator never reads: `adaln_proj.*` and `norm_out.linear.*`."""
    return ".adaln_proj." in name or name.startswith(NORM_OUT + ".")


@dataclass(frozen=True)
class PageLayout:
    """Where each projection's rows sit in a page.

    H3's released config (50 layers, hidden 5376, time_embed_dim 2688) gives `page_numel` = 50·18·5376 + 2·5376 =
    4,849,152 elements = 9,698,304 bytes (9.25 MiB) in bf16, and `adaln_proj` = 50·96768·(2688 + 1) elements =
    26,020,915,200 bytes = 24.23 GiB in bf16.
    """

    num_layers: int
    """Transformer blocks, one `adaln_proj` each."""
    hidden: int
    """hidden_size H: each block contributes 18H values per timestep, norm_out 2H."""
    time_embed_dim: int
    """E, the projections' input width (temb's last dimension)."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> PageLayout:
        """From a transformer config (`model.config` or the parsed `config.json`)."""
        return cls(int(config["num_layers"]), int(config["hidden_size"]), int(config["time_embed_dim"]))

    @property
    def block_numel(self) -> int:
        return CHUNKS * MODALITIES * self.hidden

    @property
    def norm_out_numel(self) -> int:
        return 2 * self.hidden

    @property
    def page_numel(self) -> int:
        return self.num_layers * self.block_numel + self.norm_out_numel

    @property
    def norm_out_offset(self) -> int:
        return self.num_layers * self.block_numel

    def block_offset(self, i: int) -> int:
        if not 0 <= i < self.num_layers:
            raise IndexError(f"block {i} out of range: the transformer has blocks 0..{self.num_layers - 1}")
        return i * self.block_numel

    def page_bytes(self, dtype: torch.dtype) -> int:
        return self.page_numel * dtype.itemsize

    def adaln_proj_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of every block's `adaln_proj.linear` weight and bias (what a cached generator does not hold)."""
        return self.num_layers * self.block_numel * (self.time_embed_dim + 1) * dtype.itemsize

    def plan_tensor_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of every plan tensor: each block's `adaln_proj.linear` and `norm_out.linear`, weight and bias."""
        return self.page_numel * (self.time_embed_dim + 1) * dtype.itemsize

    def projections(self) -> Iterator[tuple[str, int, int]]:
        """(checkpoint prefix, offset, numel) of every projection, in page order."""
        for i in range(self.num_layers):
            yield block_projection(i), self.block_offset(i), self.block_numel
        yield NORM_OUT, self.norm_out_offset, self.norm_out_numel


@torch.no_grad()
def plan_inputs(time_proj: nn.Module, time_embedder: nn.Module, timestep: torch.Tensor) -> torch.Tensor:
    """The transformer's `temb` for a plan, computed by the transformer's own modules as its forward does.

    timestep: (T,) float32, the step's distinct timesteps sorted ascending (H3's t = 1 - sigma).
    Returns (T, E) at the time embedder's dtype (float32 in the released checkpoint).
    """
    from diffusers.models.modeling_utils import get_parameter_dtype

    return time_embedder(time_proj(timestep).to(get_parameter_dtype(time_embedder)))


@torch.no_grad()
def build_pages(layout: PageLayout, temb: torch.Tensor, load_layer: LayerLoader) -> torch.Tensor:
    """Compute a plan's pages: (T, E) temb -> (T, page_numel) in the projections' dtype.

    Each projection is one GEMM with M = T, `linear(silu(temb).to(weight dtype))` as diffusers'
    MiniMaxH3AdaLayerNormModulation / MiniMaxH3AdaLayerNormOut compute it. Weights are requested one projection at a
    time, so a caller can stream them from the checkpoint's shards and drop each after use.
    """
    act = F.silu(temb)  # (T, E) at temb's precision; cast to each projection's dtype below, as diffusers does
    pages: torch.Tensor | None = None
    for name, offset, numel in layout.projections():
        weight, bias = load_layer(name)  # (numel, E), (numel,)
        if weight.shape != (numel, layout.time_embed_dim):
            raise ValueError(
                f"{name}.weight has shape {tuple(weight.shape)}, expected {(numel, layout.time_embed_dim)}"
            )
        rows = F.linear(act.to(weight.dtype), weight, bias)  # (T, numel)
        if pages is None:
            pages = torch.empty(temb.shape[0], layout.page_numel, dtype=rows.dtype, device=rows.device)
        pages[:, offset : offset + numel] = rows
    assert pages is not None  # a layout always has norm_out
    return pages


class PlanPages:
    """The current step's pages, shared by every PlanLinear of one transformer. Set once per step."""

    def __init__(self) -> None:
        self._pages: torch.Tensor | None = None

    def set(self, pages: torch.Tensor) -> None:
        """pages: (T, page_numel) in the projections' dtype, T = the step's number of distinct timesteps."""
        self._pages = pages

    def get(self) -> torch.Tensor:
        if self._pages is None:
            raise RuntimeError("no plan pages set for this step: call PlanPages.set(pages) before the forward")
        return self._pages

    def clear(self) -> None:
        """Drop the last step's pages (after a request: no reference to a lease's memory outlives it)."""
        self._pages = None


class SlotReads:
    """One request's plan reads from a slab, prepared once before the denoise loop; one indexed read per step.

    slab: (S, W, P), contiguous, on the model's device. `slots[i]` is step i's slot and `widths[i]` its plan width.
    Before the loop (host work, once): every step's flat row indices `slot·W + j` (j < width) go to the slab's device
    in one int64 tensor, and a (max width, P) page buffer is allocated there. In the loop, `read(i)` is one
    `index_select` of step i's rows (a slice of that device index tensor, bounds known on the host) into the buffer:
    no `.item()`, no host copy, no allocation, fixed addresses (a CUDA graph can capture it). Docs:
    docs/architecture.md, "The slab and the lease protocol".
    """

    def __init__(self, slab: torch.Tensor, slots: Sequence[int], widths: Sequence[int]) -> None:
        if slab.ndim != 3:
            raise ValueError(f"the slab must be (slots, width, page_numel), got shape {tuple(slab.shape)}")
        if len(slots) != len(widths) or not slots:
            raise ValueError(f"{len(slots)} slots for {len(widths)} steps")
        n, w, p = slab.shape
        rows: list[int] = []
        self.spans: list[tuple[int, int]] = []
        for step, (slot, width) in enumerate(zip(slots, widths, strict=True)):
            if not 0 <= slot < n:
                raise ValueError(f"step {step}: slot {slot} is outside the slab's {n} slots")
            if not 1 <= width <= w:
                raise ValueError(f"step {step}: plan width {width} does not fit a slot of {w} pages")
            self.spans.append((len(rows), len(rows) + width))
            rows.extend(slot * w + j for j in range(width))
        self.source = slab.view(n * w, p)  # rows of pages; a view, never a copy (the slab never moves)
        self.index = torch.tensor(rows, dtype=torch.int64).to(slab.device)  # the one host-to-device copy
        self.buffer = torch.empty(max(widths), p, dtype=slab.dtype, device=slab.device)

    @property
    def steps(self) -> int:
        return len(self.spans)

    def read(self, step: int) -> torch.Tensor:
        """(width, P) pages of step `step`: one gather from the slab into the request's page buffer."""
        a, b = self.spans[step]
        out = self.buffer[: b - a]
        torch.index_select(self.source, 0, self.index[a:b], out=out)
        return out

    def close(self) -> None:
        """Drop the slab view, the index and the page buffer, once the request's reads have finished: whoever still
        holds this object (the loop's frames, kept by a failed request's traceback) no longer reaches the slab, so
        closing the slab's mapping frees it. No step can be read from here on (`steps` is 0)."""
        self.spans = []
        self.source = self.index = self.buffer = torch.empty(0)


class PlanLinear(nn.Module):
    """Stands in for a projection `nn.Linear`: returns its rows of the current pages and ignores its input.

    Holds no weight. A 0-element buffer carries the projection dtype, because the calling diffusers module casts its
    input with `get_parameter_dtype(self.linear)` (which looks at parameters, then floating buffers).
    """

    dtype_anchor: torch.Tensor

    def __init__(self, holder: PlanPages, offset: int, numel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.holder, self.offset, self.numel = holder, offset, numel
        self.register_buffer("dtype_anchor", torch.empty(0, dtype=dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (T, E), unused. Returns (T, numel); contiguous because MiniMaxH3AdaLayerNormModulation calls .view on it.
        pages = self.holder.get()
        return pages[:, self.offset : self.offset + self.numel].contiguous()


def install_plan_modules(transformer: Any, holder: PlanPages) -> None:
    """Replace every block's `adaln_proj.linear` and `norm_out.linear` by a PlanLinear reading from `holder`.

    transformer: diffusers' MiniMaxH3Transformer3DModel (typed Any: diffusers is not type-checked here).
    Each PlanLinear keeps the dtype of the projection it replaces (which may still be on `meta`).
    """
    layout = PageLayout.from_config(transformer.config)
    owners = [block.adaln_proj for block in transformer.transformer_blocks] + [transformer.norm_out]
    for owner, (_, offset, numel) in zip(owners, layout.projections(), strict=True):
        dtype = owner.linear.weight.dtype
        owner.linear = PlanLinear(holder, offset, numel, dtype)
