"""Generator errors; each names its gRPC status in `grpc_code` (see ditruntime.rpc_errors)."""

from __future__ import annotations


class GeneratorError(Exception):
    reason = "GENERATOR_ERROR"
    grpc_code = "INTERNAL"
    metadata: dict[str, str] = {}  # noqa: RUF012 - overridden per instance


class QueueFullError(GeneratorError):
    reason = "QUEUE_FULL"
    grpc_code = "RESOURCE_EXHAUSTED"


class GenerationMismatchError(GeneratorError):
    """`expected_generation` does not match the served generation."""

    reason = "GENERATION_MISMATCH"
    grpc_code = "ABORTED"

    def __init__(self, current: int, expected: int) -> None:
        super().__init__(f"expected_generation {expected} does not match the served generation {current}")
        self.metadata = {"current_generation": str(current), "expected_generation": str(expected)}


class SidecarUnavailableError(GeneratorError):
    """The plan-cache sidecar is not attached, or went away during the request."""

    reason = "SIDECAR_UNAVAILABLE"
    grpc_code = "UNAVAILABLE"


class NotServingError(GeneratorError):
    reason = "NOT_SERVING"
    grpc_code = "UNAVAILABLE"


class PlanCapacityError(GeneratorError):
    """The request can never fit this server's slab."""

    reason = "PLAN_CAPACITY_EXCEEDED"
    grpc_code = "FAILED_PRECONDITION"


class CancelledError(GeneratorError):
    reason = "CANCELLED"
    grpc_code = "CANCELLED"


class DeadlineExceededError(GeneratorError):
    reason = "DEADLINE_EXCEEDED"
    grpc_code = "DEADLINE_EXCEEDED"


class ResultTooLargeError(GeneratorError):
    reason = "RESULT_TOO_LARGE"
    grpc_code = "RESOURCE_EXHAUSTED"


class LeaseCheckError(GeneratorError):
    """A leased slot's table row is not READY with the lease's generation and key."""

    reason = "LEASE_CHECK_FAILED"
    grpc_code = "UNAVAILABLE"


class SidecarError(GeneratorError):
    """The sidecar refused a call; carries the sidecar's status code name and reason."""

    def __init__(self, code: str, reason: str, message: str, metadata: dict[str, str] | None = None) -> None:
        super().__init__(f"plan cache: {message}")
        self.grpc_code = code
        self.reason = reason or "SIDECAR_ERROR"
        self.metadata = dict(metadata or {})
