"""What a backend needs from the other ranks of its replica, without naming the replica's code: rank 0's link
(`generator_service.replica.link.ReplicaLink` implements it). A backend with no link serves one device. No grpc here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ditcore import GenerationRequest, H3Model
from ditcore.replica import Replica
from protos.ditserve.replica.v1 import replica_pb2 as rpb

from .sidecar_port import Attachment


class ReplicaPort(Protocol):
    """Rank 0's side of a replica: every model a backend loads, every attachment and weight change, is made on every
    rank (or none); each call fails with ReplicaUnavailableError when a rank is gone."""

    replica: Replica
    """The process group and its context-parallel layout (ditcore.parallel)."""
    reports: list[rpb.RankReport]
    """What each rank held at the last `describe`, in rank order (GetStatus)."""

    @property
    def world_size(self) -> int: ...

    def attach(self, att: Attachment, local: Callable[[], None]) -> None:
        """Every rank maps the attachment's slab and loads its weights (`local`: rank 0's part)."""

    def stage(self, weights_path: str, fingerprint: str, local: Callable[[], Any]) -> Any:
        """Every rank loads a candidate beside the served weights; returns `local()`'s model."""

    def swap(self, action: rpb.SwapAction) -> None:
        """Every other rank installs, rolls back, drops or retires its staged weights."""

    def settle(self, action: rpb.SwapAction) -> None:
        """A swap after the update's outcome is decided: a failure is logged, not raised."""

    def describe(self, model: H3Model | None) -> None:
        """Ask every rank what it holds, for GetStatus."""

    def stop(self) -> None:
        """The other ranks exit (with this one)."""

    def check_split(self, request: GenerationRequest, sizer: Any, prompt_tokens: int | None) -> None:
        """RequestError unless the request's packed rows split across the ranks (any length, but on Ulysses x ring)."""
