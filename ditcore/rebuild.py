"""The sidecar's page computation: many plans' pages in one streamed pass over a diffusers H3 checkpoint's shards.

Protocol:

    builder = PlanBuilder(transformer_dir)          # config, time_proj/time_embedder (float32), shard headers
    outputs = [torch.empty(len(k), builder.layout.page_numel, dtype=builder.projection_dtype) for k in keys]
    builder.build(keys, outputs)                    # each adaln_proj / norm_out tensor read once, one GEMM per key

A key is one plan: the step's sorted distinct float32 timesteps, as a tensor or as their int32 bit patterns. Each
key gets its own GEMM with M = its width, so its pages are bitwise `plans.build_pages` for that key alone (a GEMM
row's bits depend on M). Only the time embedder's and the plan tensors' bytes are ever read from the shards.

A rebuild shared by N devices gives each builder a `Shard`: in "rows" mode device r computes rows
[numel·r/N, numel·(r+1)/N) of every projection's output features from the same rows of its weight and bias
(safetensors `get_slice`: each device reads 1/N of the plan tensors' bytes), in "projections" mode whole
projections round-robin (projection j on device j mod N, at full width). Either way the builder writes only its own
page columns (`Shard.spans`); the caller copies each device's columns into every other device's pages. A row of
`F.linear` is a dot product over E whatever N is, so row slices are bitwise the full GEMM's columns wherever the
kernel's reduction over E does not depend on N. It can: on CPU the tiny preset's float32 norm_out (128 features)
split 3 ways (42 / 43 / 43 columns) differs from the full GEMM, while 2, 4 and 8 ways, bfloat16, and the released
shapes at 2, 3, 4, 8 ways are exact. So the mode is measured per device, dtype, layout and N (`row_split_is_exact`,
`shard_mode`); "projections" is bit-exact by construction (the same GEMMs as unsharded), at the cost of an uneven
split (N need not divide the L + 1 projections).

A pass reads the plan tensors through `ditcore.plan_stream.PlanStream` (`streamed=True`, the default): each
projection's byte ranges (from the shard headers) in large sequential reads into a fixed pool of buffers on the
builder's device (pinned staging and a side stream on cuda), read ahead on a thread of their own while the previous
projection's GEMMs run; the bytes and the tensors they make are the same as `streamed=False`'s (safetensors'
`get_tensor` / `get_slice`, one tensor at a time, then `.to(device)`), so the pages are bitwise the same. Either way
`read_bytes` / `read_s` count the plan-tensor bytes read and the seconds spent reading them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from .adapter_plans import ModulationDeltas, lora_linear
from .plan_stream import KEEP_BUFFER_BYTES, KEEP_BUFFER_BYTES_CPU, PlanStream, ReadConfig, projection_reads
from .plans import PageLayout, PlanKey, is_plan_tensor, plan_inputs
from .shards import load_dtype, read_tensor, shard_map

TIME_EMBEDDER = "time_embedder"
# safetensors header dtype names -> torch dtypes a projection may be stored in
_STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}

SHARD_MODES = ("rows", "projections")
"""How a rebuild is split across devices (Shard.mode)."""

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


@dataclass(frozen=True)
class Shard:
    """Device `index` of `count`'s part of every rebuild (see the module docstring); Shard() is the whole."""

    index: int = 0
    count: int = 1
    mode: str = "rows"

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard index must lie in [0, {self.count}) with count >= 1, got {self.index}")
        if self.mode not in SHARD_MODES:
            raise ValueError(f"shard mode must be one of {list(SHARD_MODES)}, got {self.mode!r}")

    def spans(self, layout: PageLayout) -> Iterator[tuple[str, int, int, int]]:
        """(projection prefix, page offset, first row, end row) of every output-feature range this shard computes:
        page columns [offset + first, offset + end) from rows [first, end) of the projection."""
        for j, (prefix, offset, numel) in enumerate(layout.projections()):
            if self.mode == "rows":
                first, end = numel * self.index // self.count, numel * (self.index + 1) // self.count
                if end > first:
                    yield prefix, offset, first, end
            elif j % self.count == self.index:
                yield prefix, offset, 0, numel

    def columns(self, layout: PageLayout) -> list[tuple[int, int]]:
        """The page columns [start, stop) this shard writes, in page order."""
        return [(offset + first, offset + end) for _, offset, first, end in self.spans(layout)]


def row_split_is_exact(
    layout: PageLayout, dtype: torch.dtype, count: int, device: torch.device | str = "cpu", seed: int = 0
) -> bool:
    """Whether `count` row slices of a projection's GEMM are bitwise its full GEMM's columns on `device` in `dtype`,
    at every plan width (1..MAX_PLAN_WIDTH) and both projection shapes of `layout` (random values: a kernel's
    blocking follows the shapes, not the values). Decides Shard mode "rows" vs "projections" per device."""
    from .plans import MAX_PLAN_WIDTH

    generator = torch.Generator().manual_seed(seed)
    for numel in sorted({layout.block_numel, layout.norm_out_numel}):
        weight = torch.randn(numel, layout.time_embed_dim, generator=generator).to(dtype=dtype, device=device)
        bias = torch.randn(numel, generator=generator).to(dtype=dtype, device=device)
        for width in range(1, MAX_PLAN_WIDTH + 1):
            act = torch.randn(width, layout.time_embed_dim, generator=generator).to(dtype=dtype, device=device)
            full = F.linear(act, weight, bias)
            for r in range(count):
                first, end = numel * r // count, numel * (r + 1) // count
                if not torch.equal(F.linear(act, weight[first:end], bias[first:end]), full[:, first:end]):
                    return False
    return True


def shard_mode(layout: PageLayout, dtype: torch.dtype, count: int, device: torch.device | str = "cpu") -> str:
    """The Shard mode a rebuild split `count` ways on `device` uses: "rows" where its slices are measured bitwise
    the unsharded GEMM's (row_split_is_exact), else "projections"."""
    return "rows" if count == 1 or row_split_is_exact(layout, dtype, count, device) else "projections"


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

    Holds only the time embedder (float32, as `_keep_in_fp32_modules` keeps it); the projections are streamed during
    `build` (a fixed pool of buffers, see ditcore.plan_stream). `tensor_reads` / `bytes_read` count every tensor read
    from the shards (tests, metrics); `read_bytes` / `read_s` the plan-tensor bytes and the seconds reading them.
    """

    def __init__(
        self,
        transformer_dir: str | os.PathLike[str],
        device: torch.device | str = "cpu",
        shard: Shard | None = None,
        streamed: bool = True,
        read_config: ReadConfig | None = None,
    ) -> None:
        self.transformer_dir = os.fspath(transformer_dir)
        self.device = torch.device(device)
        self.shard = shard if shard is not None else Shard()
        """The part of every page this builder computes (Shard(): all of it)."""
        self.streamed = streamed and sys.byteorder == "little"  # safetensors' bytes are little-endian
        """Whether a pass reads the plan tensors through a PlanStream (else one tensor at a time, safetensors')."""
        self.read_config = read_config if read_config is not None else ReadConfig.for_device(self.device)
        self.read_bytes = 0
        """Plan-tensor bytes the passes read from the shards (as stored; 1/N of them per device when sharded)."""
        self.read_s = 0.0
        """Seconds the passes spent reading them (streamed: while at least one read was in flight)."""
        self._streamed: dict[str, torch.Tensor] = {}
        self._buffers: list[torch.Tensor] = []  # the last pass's projection buffers, kept while small
        with open(os.path.join(self.transformer_dir, "config.json")) as f:
            config = json.load(f)
        self.layout = PageLayout.from_config(config)
        """Where each projection's rows sit in a page."""
        self.files = shard_map(self.transformer_dir)
        self.tensor_reads: Counter[str] = Counter()
        """tensor name -> times its data was read from the shards."""
        self.bytes_read = 0
        """bytes of tensor data read from the shards (as stored)."""
        self.plan_bytes_read = 0
        """of which plan tensors' (adaln_proj, norm_out.linear): 1/N of theirs per device of a sharded rebuild."""
        self.time_proj, self.time_embedder, self.keep_fp32 = _time_modules(config)
        self._load_time_embedder()
        self.projection_dtype = self._projection_dtype()
        """dtype of every projection and of the pages: as stored, under from_pretrained's keep-in-fp32 rule."""

    def _read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor's data as stored (only its rows [first, end) when `rows` is given), on the builder's device:
        during a streamed pass the view its PlanStream read, else read now."""
        streamed = self._streamed.pop(name, None)
        if streamed is not None:
            t = streamed
        else:
            t0 = time.perf_counter()
            if rows is None:
                t = read_tensor(self.transformer_dir, self.files, name)
            else:
                with safe_open(os.path.join(self.transformer_dir, self.files[name]), "pt") as f:
                    t = f.get_slice(name)[rows[0] : rows[1]]
            t = t.to(self.device)
            if is_plan_tensor(name):
                self.read_s += time.perf_counter() - t0
                self.read_bytes += t.numel() * t.element_size()
        nbytes = t.numel() * t.element_size()
        self.tensor_reads[name] += 1
        self.bytes_read += nbytes
        if is_plan_tensor(name):
            self.plan_bytes_read += nbytes
        return t

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
    def build(
        self, keys: Sequence[PlanKeyLike], outputs: Sequence[torch.Tensor], deltas: ModulationDeltas | None = None
    ) -> None:
        """One pass over the shard's projection rows: each weight/bias slice read once, then one GEMM per key
        (M = its width).

        outputs[k]: (width_k, page_numel) in `projection_dtype` on the builder's device, written in place: all of it
        for Shard(), else only `shard.columns(layout)`. `deltas`: every key's pages built with these adapters'
        modulation parts, as PEFT computes them (ditcore.adapter_plans): the time embedder's terms in `temb`, each
        projection's term on its whole output, sliced to this shard's rows.
        """
        timesteps = self._check(keys, outputs)
        with deltas.on_time_embedder(self.time_embedder) if deltas is not None else nullcontext():
            acts = [self.activations(t) for t in timesteps]  # (T_k, E) each
        whole = self.shard.count == 1
        spans = list(self.shard.spans(self.layout))
        if not self.streamed:
            self._project(spans, acts, outputs, deltas, None)
            return
        reads = projection_reads(
            self.transformer_dir, self.files, [(p, None if whole else (a, b)) for p, _, a, b in spans], self.device
        )
        stream = PlanStream(reads, self.device, self.read_config, self._buffers)
        try:
            with stream:
                self._project(spans, acts, outputs, deltas, stream)
        finally:
            self._streamed = {}
            kept = stream.buffers
            bound = KEEP_BUFFER_BYTES_CPU if self.device.type == "cpu" else KEEP_BUFFER_BYTES
            self._buffers = kept if sum(b.nbytes for b in kept) <= bound else []
            self.read_bytes += stream.read_bytes
            self.read_s += stream.read_s

    def _project(
        self,
        spans: list[tuple[str, int, int, int]],
        acts: list[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        deltas: ModulationDeltas | None,
        stream: PlanStream | None,
    ) -> None:
        """Every span's GEMMs, its weight and bias taken from `stream` (in span order) or read one at a time."""
        whole = self.shard.count == 1
        for prefix, offset, first, end in spans:
            rows = None if whole else (first, end)
            if stream is not None:
                self._streamed = next(stream)
            weight = self._read(f"{prefix}.weight", rows).to(self.projection_dtype)  # (end - first, E)
            bias = self._read(f"{prefix}.bias", rows).to(self.projection_dtype)  # (end - first,)
            if weight.shape != (end - first, self.layout.time_embed_dim) or bias.shape != (end - first,):
                raise ValueError(
                    f"{prefix}: weight {tuple(weight.shape)} / bias {tuple(bias.shape)} (rows {first}:{end}), "
                    f"expected {(end - first, self.layout.time_embed_dim)} / {(end - first,)}"
                )
            if deltas is not None:
                weight = deltas.changed(prefix, "weight", weight, rows)
                bias = deltas.changed(prefix, "bias", bias, rows)
            terms = deltas.of(prefix) if deltas is not None else []
            for act, out in zip(acts, outputs, strict=True):
                rows_out = F.linear(act, weight, bias)  # (T_k, end - first)
                if terms:
                    rows_out = lora_linear(rows_out, act, terms, None if whole else (first, end))
                out[:, offset + first : offset + end] = rows_out
            del weight, bias  # the stream's buffer goes back to its reader at the next span

    def build_one(self, key: PlanKeyLike, deltas: ModulationDeltas | None = None) -> torch.Tensor:
        """One key's (width, page_numel) pages (a pass of its own), with `deltas`' adapters if given."""
        width = key_timesteps(key).numel()
        out = torch.empty(width, self.layout.page_numel, dtype=self.projection_dtype, device=self.device)
        self.build([key], [out], deltas)
        return out

    @property
    def time_dtype(self) -> torch.dtype:
        """The time embedder's dtype (float32: `_keep_in_fp32_modules`)."""
        return next(self.time_embedder.parameters()).dtype


def plan_tensor_names(transformer_dir: str | os.PathLike[str]) -> list[str]:
    """The checkpoint's `adaln_proj` and `norm_out.linear` tensor names (what a pass reads, once each)."""
    return sorted(n for n in shard_map(os.fspath(transformer_dir)) if is_plan_tensor(n))
