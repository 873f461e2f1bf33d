"""The placement chosen at start: `--text-encoder-device auto` and `--partitions auto` decided once, at the first load,
from the memory model at the largest admitted canvas and the device's real free memory (ditcore.placement); a named
placement is held to the same model. What cannot fit is refused then (PlacementError naming the flags), never at the
first request; every later load (a weight update) keeps the choice."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from ditcore.checkpoint import CheckpointInfo
from ditcore.footprint import Placement, memory_report, meta_components
from ditcore.model import RunOptions
from ditcore.parallel import ParallelSpec
from ditcore.placement import Choice, Footprint, PlacementError, decide, embedding_bytes, rank_needs
from ditcore.repo import TEXT_LAYERS
from ditcore.request import CANVAS_MULTIPLE, MIN_FRAMES, RequestLimits
from ditcore.sizing import Canvas, ModelShapes, device_class
from ditcore.text_encoder import AUTO, TextEncoderPlacement
from ditruntime import memory
from ditruntime.memory import MemoryBudget

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartChoice:
    """What GetStatus reports: the choice, whether the model made it, and what it was held to."""

    choice: Choice
    decided: bool
    budget: MemoryBudget
    canvas: Canvas


def _text_request(te: TextEncoderPlacement) -> str:
    if te.offload:
        return "offload"
    return "auto" if te.device == AUTO else "cpu" if te.device == "cpu" else "device"


def _placed(te: TextEncoderPlacement, text: str) -> TextEncoderPlacement:
    """The chosen text placement as the loader reads it (AUTO: the model's device)."""
    if text == "cpu":
        return TextEncoderPlacement("cpu")
    return TextEncoderPlacement(te.device if te.device != "cpu" else AUTO, text == "offload")


RELEASED_CANVAS = (768, 1344)


def largest_canvas(limits: RequestLimits, prompt_tokens: int = 256) -> Canvas:
    """The largest canvas `limits` admit, in the released aspect ratio: what the start placement is sized at (the
    defaults: 768 x 1344 x 345; a canvas the limits admit but the model says does not fit is still refused at
    admission, RequestTooLargeForDeviceError)."""
    h0, w0 = RELEASED_CANVAS
    scale = math.sqrt(limits.max_pixels / (h0 * w0))
    h = max(CANVAS_MULTIPLE, min(limits.max_height, int(h0 * scale) // CANVAS_MULTIPLE * CANVAS_MULTIPLE))
    w = max(CANVAS_MULTIPLE, min(limits.max_width, int(w0 * scale) // CANVAS_MULTIPLE * CANVAS_MULTIPLE))
    frames = min(limits.max_num_frames, limits.max_video_pixels // (h * w))
    frames = max(MIN_FRAMES, frames - (frames - 5) % 17)  # H3's 17n + 5
    return Canvas(h, w, frames, prompt_tokens)


class StartPlacement:
    """Resolves a generator's RunOptions at its first load (`resolve`) and keeps the result for every later one."""

    def __init__(
        self, device: torch.device, spec: ParallelSpec, canvas: Canvas, mode: str, reserve_bytes: int = 0
    ) -> None:
        self.device, self.spec, self.canvas, self.mode = device, spec, canvas, mode
        self.reserve_bytes = reserve_bytes
        """Kept free beyond the model (--memory-reserve-gb: the allocator's fragmentation, kernel workspaces)."""
        self.chosen: StartChoice | None = None
        self._options: RunOptions | None = None

    def free(self) -> MemoryBudget:
        """The device's real free memory (after a cached-mode sidecar's slab, already allocated), less the reserve."""
        budget = memory.free_memory(self.device)
        if budget.bytes <= 0:
            return budget
        return MemoryBudget(max(1, budget.bytes - self.reserve_bytes), f"{budget.source}, less the reserve")

    def resolve(self, info: CheckpointInfo, options: RunOptions) -> RunOptions:
        """`options` with its text encoder and partitions placed (PlacementError when nothing fits)."""
        if self._options is not None:
            return self._options
        budget = self.free()
        text = _text_request(options.text_encoder)
        names = tuple(options.partitions_for(info))
        auto = options.partitions == AUTO
        decided = text == "auto" or auto
        if self.device.type != "cuda" and text == "auto":
            text = "device"  # a model on the host: the encoder is in host memory wherever it computes
        fp = self.footprint(info, options)
        first = "device" if text == "auto" else text
        kept = Choice(first, names, rank_needs(fp, first, len(names), self.spec), max(0, budget.bytes), self.spec)
        if budget.bytes <= 0:  # no figure could be read: the flags' placement, unchecked
            self.chosen = StartChoice(kept, False, budget, self.canvas)
        else:
            try:
                choice = decide(fp, budget.bytes, self.spec, text, names, auto, cuda=self.device.type == "cuda")
                self.chosen = StartChoice(choice, decided, budget, self.canvas)
            except PlacementError as e:
                if self.device.type == "cuda":
                    raise
                # host memory is everyone's and moves: a request the free memory cannot take is refused at admission
                log.warning("start placement: %s; on the host the flags' placement is kept", e)
                self.chosen = StartChoice(kept, False, budget, self.canvas)
        choice = self.chosen.choice
        for line in choice.table():
            log.info("start placement: %s", line)
        log.info("start placement: free memory %s; canvas %s", budget.source, self._canvas_text())
        every = auto and choice.partitions == names  # "auto" kept: an update's repository decides its own
        self._options = replace(
            options, text_encoder=_placed(options.text_encoder, choice.text_encoder),
            partitions=AUTO if every else ",".join(choice.partitions),
        )  # fmt: skip
        return self._options

    def _canvas_text(self) -> str:
        c = self.canvas
        return f"{c.height} x {c.width} x {c.num_frames}"

    def footprint(self, info: CheckpointInfo, options: RunOptions) -> Footprint:
        """The memory model of the repository's own configs at the canvas, on this device's class."""
        components = meta_components(repository=info.path)
        decode = options.decode_dtype_for(info.precision)
        shapes = ModelShapes.of_components(
            components, info.precision, text_layers=TEXT_LAYERS, decode_dtype=decode,
            attention_backend=options.attention_backend if options.attention_backend != AUTO else "native",
            device_type=self.device.type,
        )  # fmt: skip
        dev = device_class(memory.device_name(self.device))
        report = memory_report(components, shapes, self.canvas, Placement(partitions=1), dev, info.precision)
        return Footprint.of_report(report, shapes, self.mode, embedding_bytes(components, info.precision), False)

    def to_status(self) -> dict[str, Any] | None:
        """GetStatus' StartPlacement fields (None before the first load)."""
        if self.chosen is None:
            return None
        c = self.chosen.choice
        return {
            "text_encoder": c.text_encoder, "partitions": list(c.partitions), "decided": self.chosen.decided,
            "free_bytes": max(0, c.free_bytes), "free_source": self.chosen.budget.source,
            "need_bytes": c.need if c.needs else 0, "left_bytes": c.left if c.needs else 0,
            "canvas": self._canvas_text(),
            "ranks": [{"ranks": n.ranks, "bytes": n.total, "items": dict(n.items)} for n in c.needs],
        }  # fmt: skip
