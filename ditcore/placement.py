"""Where the model goes at start (`--text-encoder-device auto`, `--partitions auto`): the text encoder on the device,
offloaded from pinned host memory, or on the CPU, and the transformer partitions, decided from the memory model
(ditcore.footprint) and the bytes each device has free; a layout that cannot fit is refused naming the flags that
would make it fit. Pure arithmetic: the caller reads the free bytes.

    fp = Footprint.of_report(report, "cached", embed_bytes)        # ditcore.footprint's figures at the largest canvas
    choice = decide(fp, free_bytes=139 * GIB, spec=ParallelSpec(4))  # or PlacementError naming flags

Rule. Each rank of a replica holds every loaded partition, both VAEs and its share of the sidecar's slab (and its
rebuild working set, in cached mode); rank 0 also holds the text encoder (all of it on the device, its token
embeddings offloaded, nothing on the CPU), the text encoding's and the decode's activations. A denoise step's
activations split over the ranks (the packed sequence does), plus the all-to-all (Ulysses) and key/value-ring (ring)
buffers: 4·(S/N)·I·e each. Candidates are tried in order, partitions first (a partition dropped is a task not served;
a text encoder moved is only a slower encode):
    partitions   every one the repository has, then base alone          (auto; else the named)
    text encoder device, then offload (CUDA only), then cpu             (auto; else the named)
The first whose every rank needs no more than `free_bytes` is chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from .parallel import ParallelSpec
from .sizing import dtype_bytes

GIB = 1024**3
TEXT_ORDER = ("device", "offload", "cpu")
"""What `--text-encoder-device auto` tries, first to last."""


class PlacementError(ValueError):
    """No placement fits the device: the message names the flags that would make one fit."""


@dataclass(frozen=True)
class Footprint:
    """The bytes the decision adds up, at the largest canvas the server admits (ditcore.footprint's figures)."""

    transformer_bytes: int
    """One partition's transformer in the serving mode (cached: without its plan tensors)."""
    text_bytes: int
    """The text encoder's weights as loaded (trimmed to the layers H3 reads, or whole)."""
    text_offload_bytes: int
    """What an offloaded text encoder keeps on the device between encodes (its token embeddings)."""
    vae_bytes: int
    """Both VAEs."""
    step_bytes: int
    """One denoise step's activation peak on one device."""
    text_act_bytes: int
    """The text encoding's activation peak (on the device unless the encoder runs on the CPU)."""
    decode_bytes: int
    sidecar_bytes: int
    """The sidecar's slab and rebuild working set on each rank's device (0: resident, or already allocated)."""
    rows: int
    """Rows of the packed sequence (S)."""
    inner: int
    """The transformer's heads x head_dim (I)."""
    act_dtype_bytes: int = 2
    cached_transformer_bytes: int = 0
    """One partition without its plan tensors (what `--adaln-mode cached` would hold; 0: unknown)."""
    cached_sidecar_bytes: int = 0
    """The sidecar's slab and rebuild working set `--adaln-mode cached` would add."""

    @classmethod
    def of_report(cls, report: Any, shapes: Any, mode: str, text_offload_bytes: int, sidecar: bool = True) -> Footprint:
        """From a ditcore.footprint.MemoryReport made with the text encoder on the device (so its activations are
        counted) and its ModelShapes; `sidecar` False: the slab is already allocated (a running sidecar's), so the
        free memory read excludes it."""
        w = {(c.name, c.variant): c.bytes for c in report.weights}
        text = next(c.bytes for c in report.weights if c.name == "text_encoder" and c.variant != "whole")
        if report.placement.text_encoder == "whole":
            text = w["text_encoder", "whole"]
        vae = sum(c.bytes for c in report.weights if c.name in ("vae", "audio_vae"))
        sidecar_bytes = report.slab_bytes + report.rebuild_bytes if sidecar else 0
        slab = sidecar_bytes if mode == "cached" else 0
        a = report.activations
        return cls(
            w["transformer", mode], text, text_offload_bytes, vae, a.step, a.text, a.decode, slab,
            report.tokens.total, shapes.transformer.inner, dtype_bytes(shapes.compute_dtype), w["transformer", "cached"],
            sidecar_bytes,
        )  # fmt: skip


@dataclass(frozen=True)
class RankNeed:
    """What one rank (or each of ranks 1..N-1) holds under a placement, by item."""

    ranks: str
    """"0", "1..3", or "0" alone on one device."""
    items: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.items.values())


@dataclass(frozen=True)
class Choice:
    """A placement: where the text encoder goes, which partitions load, and what each rank then needs."""

    text_encoder: str
    """One of TEXT_ORDER."""
    partitions: tuple[str, ...]
    needs: tuple[RankNeed, ...]
    free_bytes: int
    spec: ParallelSpec = field(default_factory=ParallelSpec)

    @property
    def need(self) -> int:
        """The most any rank needs."""
        return max(n.total for n in self.needs)

    @property
    def left(self) -> int:
        return self.free_bytes - self.need

    @property
    def fits(self) -> bool:
        return self.left >= 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "text_encoder": self.text_encoder, "partitions": list(self.partitions), "free_bytes": self.free_bytes,
            "need_bytes": self.need, "left_bytes": self.left, "fits": self.fits,
            "ulysses_degree": self.spec.ulysses_degree, "ring_degree": self.spec.ring_degree,
            "ranks": [{"ranks": n.ranks, "bytes": n.total, "items": dict(n.items)} for n in self.needs],
        }  # fmt: skip

    def table(self) -> list[str]:
        """The placement as log or inspect lines."""
        head = (
            f"text encoder {self.text_encoder}, partitions {','.join(self.partitions)}, {self.spec.degree} rank(s) "
            f"(Ulysses {self.spec.ulysses_degree} x ring {self.spec.ring_degree}): "
            f"{'FITS' if self.fits else 'DOES NOT FIT'}, {self.left / GIB:,.2f} GiB left of {self.free_bytes / GIB:,.2f} "
            "GiB free per device"
        )
        rows = [head]
        for n in self.needs:
            items = ", ".join(f"{k} {v / GIB:,.2f}" for k, v in n.items.items() if v)
            rows.append(f"rank {n.ranks}: {n.total / GIB:,.2f} GiB ({items})")
        return rows


def embedding_bytes(components: Any, precision: str = "mixed") -> int:
    """What an offloaded text encoder keeps on the device: its token embeddings (ditcore.text_encoder)."""
    embed = components.text_encoder.model.language_model.embed_tokens.weight
    return int(embed.numel()) * dtype_bytes("bfloat16" if precision == "mixed" else "float32")


def rank_needs(fp: Footprint, text: str, partitions: int, spec: ParallelSpec) -> tuple[RankNeed, ...]:
    """Each rank's bytes under a placement (module doc)."""
    n = spec.degree
    share = math.ceil(fp.rows / n) * fp.inner * fp.act_dtype_bytes
    buffers = 4 * share * (int(spec.ulysses_degree > 1) + int(spec.ring_degree > 1))
    step = math.ceil(fp.step_bytes / n) + buffers
    text_weights = {"device": fp.text_bytes, "offload": fp.text_offload_bytes, "cpu": 0}[text]
    text_act = 0 if text == "cpu" else fp.text_act_bytes
    common = {"transformer": partitions * fp.transformer_bytes, "vae": fp.vae_bytes, "sidecar": fp.sidecar_bytes}
    rank0 = RankNeed("0", {**common, "text_encoder": text_weights, "activations": max(step, text_act, fp.decode_bytes)})
    if n == 1:
        return (rank0,)
    others = RankNeed(f"1..{n - 1}", {**common, "text_encoder": 0, "activations": step})
    return rank0, others


def candidates(
    text: str, partitions: tuple[str, ...], partitions_auto: bool, cuda: bool
) -> list[tuple[str, tuple[str, ...]]]:
    """(text encoder, partitions) in the order tried: `text` "auto" tries TEXT_ORDER (offload only on CUDA), else
    only itself; `partitions_auto` tries every one, then base alone."""
    texts = [t for t in TEXT_ORDER if cuda or t != "offload"] if text == "auto" else [text]
    parts = [partitions]
    if partitions_auto and partitions != ("base",):
        parts.append(("base",))
    return [(t, p) for p in parts for t in texts]


def decide(
    fp: Footprint,
    free_bytes: int,
    spec: ParallelSpec | None = None,
    text: str = "auto",
    partitions: tuple[str, ...] = ("base", "ref"),
    partitions_auto: bool = True,
    cuda: bool = True,
) -> Choice:
    """The first candidate placement that fits `free_bytes` on every rank (module doc); PlacementError naming the
    flags that would make one fit when none does."""
    spec = spec if spec is not None else ParallelSpec()
    tried = []
    for t, p in candidates(text, partitions, partitions_auto, cuda):
        choice = Choice(t, p, rank_needs(fp, t, len(p), spec), free_bytes, spec)
        if choice.fits:
            return choice
        tried.append(choice)
    raise PlacementError(refusal(fp, free_bytes, spec, tried[-1], cuda))


def refusal(fp: Footprint, free_bytes: int, spec: ParallelSpec, last: Choice, cuda: bool) -> str:
    """Why nothing fits, and each flag that alone would make it fit."""
    fixes = []

    def fits(t: str, parts: int, s: ParallelSpec = spec, f: Footprint = fp) -> bool:
        return max(n.total for n in rank_needs(f, t, parts, s)) <= free_bytes

    if last.text_encoder != "cpu" and fits("cpu", len(last.partitions)):
        fixes.append("--text-encoder-device cpu")
    if cuda and last.text_encoder == "device" and fits("offload", len(last.partitions)):
        fixes.append("--text-encoder-offload")
    if len(last.partitions) > 1 and fits(last.text_encoder, 1):
        fixes.append("--partitions base")
    if fp.cached_transformer_bytes and fp.transformer_bytes > fp.cached_transformer_bytes:
        cached = replace(fp, transformer_bytes=fp.cached_transformer_bytes, sidecar_bytes=fp.cached_sidecar_bytes)
        if fits(last.text_encoder, len(last.partitions), f=cached):
            fixes.append("--adaln-mode cached (plans from the sidecar's slab)")
    for more in (ParallelSpec(2), ParallelSpec(4), ParallelSpec(8), ParallelSpec(8, 2)):  # 56 heads: Ulysses <= 8
        if more.degree > spec.degree and fits(last.text_encoder, len(last.partitions), more):
            fixes.append(
                f"{more.degree} ranks (`ditserve serve --nproc {more.degree}`, --ulysses-degree {more.ulysses_degree}"
                f"{f' --ring-degree {more.ring_degree}' if more.ring_degree > 1 else ''})"
            )
            break
    weights = max(n.total - n.items["activations"] for n in last.needs)
    if weights <= free_bytes:
        fixes.append("a smaller largest canvas (--max-num-frames, --max-canvas-pixels)")
    rank0 = ", ".join(f"{k} {v / GIB:,.2f} GiB" for k, v in last.needs[0].items.items() if v)
    return (
        f"the model does not fit: text encoder {last.text_encoder} and partitions {','.join(last.partitions)} need "
        f"{last.need / GIB:,.2f} GiB on a device (rank 0: {rank0}) but {free_bytes / GIB:,.2f} GiB is free; "
        f"{'would fit with: ' + '; or '.join(fixes) if fixes else 'nothing one flag changes makes it fit'}"
    )
