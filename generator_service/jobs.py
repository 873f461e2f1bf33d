"""A job (one admitted request) and the events it sends back to its RPC, in order:
Queued, then PlansReady (cached mode), StepDone per denoise step, Decoding (media output
types: the loop is done, decoding and muxing begin), and one final Failed or Finished. The
adapter dispatches on them with `match`. No grpc here.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from ditcore import GenerationRequest, GenerationResult
from ditcore.media import EncodedMedia
from ditcore.report import CacheReport

from .backend import ServedLease


@dataclass(frozen=True)
class JobResult:
    result: GenerationResult
    """The latents (always: their sha256 names the result) and the cache report; its decoded `media` is dropped
    once encoded."""
    generation: int
    timings_ms: dict[str, float]  # queue_ms, prepare_ms, encode_ms, denoise_ms, decode_ms, mux_ms, total_ms
    media: EncodedMedia | None = None
    """The encoded file (output types "mp4" and "frames_and_wav"); None for "latents"."""


@dataclass(frozen=True)
class Queued:
    position: int  # 0 = runs next


@dataclass(frozen=True)
class PlansReady:
    report: CacheReport
    generation: int


@dataclass(frozen=True)
class StepDone:
    step: int  # steps done so far, 1-based
    total: int


@dataclass(frozen=True)
class Decoding:
    output_type: str  # the last step is done; decoding (then muxing) this output type begins


@dataclass(frozen=True)
class Failed:
    error: BaseException


@dataclass(frozen=True)
class Finished:
    result: JobResult


JobEvent = Queued | PlansReady | StepDone | Decoding | Failed | Finished


@dataclass
class Job:
    """One admitted request and the channel its events flow back on."""

    request: GenerationRequest
    expected_generation: int | None = None
    deadline: float | None = None  # time.monotonic() seconds
    admitted_at: float = field(default_factory=time.perf_counter)
    events: queue.Queue[JobEvent] = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    prefetched: ServedLease | None = None
    prefetching: bool = False
    prefetch_done: threading.Event = field(default_factory=threading.Event)
    prepare_ms: float = 0.0

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, event: JobEvent) -> None:
        self.events.put(event)
