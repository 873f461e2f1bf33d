"""The base of every service error, and the one generation-mismatch error both services raise.

Errors stay free of grpc: each names its status in `grpc_code` (a `grpc.StatusCode` member
name) and a stable `reason`; `ditruntime.rpc_errors` is the one mapping to a gRPC status.
"""

from __future__ import annotations

from collections.abc import Mapping


class ServiceError(Exception):
    """Base class. `reason` is the ErrorInfo reason; `metadata` goes into ErrorInfo.metadata."""

    reason = "INTERNAL"
    grpc_code = "INTERNAL"

    def __init__(self, message: str, metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.metadata: dict[str, str] = dict(metadata or {})


class GenerationMismatchError(ServiceError):
    """The caller named a weight generation that is not the one served (ABORTED).

    One metadata schema wherever it is raised: `current_generation` (what the server serves)
    and `requested_generation` (what the caller sent or expected).
    """

    reason = "GENERATION_MISMATCH"
    grpc_code = "ABORTED"

    def __init__(self, current: int, requested: int, field: str = "expected_generation") -> None:
        super().__init__(
            f"{field} {requested} does not match the served generation {current}",
            {"current_generation": str(current), "requested_generation": str(requested)},
        )
        self.current_generation = current
        self.requested_generation = requested
