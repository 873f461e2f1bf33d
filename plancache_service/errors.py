"""Plan-cache errors: a small hierarchy under `ditruntime.errors.ServiceError`.

Each class names its gRPC status in `grpc_code` and a stable `reason`; `ditruntime.rpc_errors`
is the one mapping (docs/architecture.md, "Errors"). A stale generation raises the shared
`ditruntime.errors.GenerationMismatchError`. Every error is raised before any cache state
changes, except `RebuildError`, raised after the failed prepare has returned its slots.
"""

from __future__ import annotations

from ditruntime.errors import ServiceError


class PlanCacheError(ServiceError):
    """Base class. `reason` is a stable machine-readable code (google.rpc ErrorInfo)."""

    reason = "PLAN_CACHE_ERROR"
    grpc_code = "INTERNAL"


class InvalidPlanRequestError(PlanCacheError):
    """A plan call's own fields are bad: plan keys empty, non-finite or wider than a slot, a step bound out of
    range, or a ReleasePlans naming both a lease_id and a request_id."""

    reason = "INVALID_PLAN_REQUEST"
    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class PlanCapacityError(PlanCacheError):
    """The request needs more plans than the slab can ever hold (names the limit and flag)."""

    reason = "PLAN_CAPACITY_EXCEEDED"
    grpc_code = "FAILED_PRECONDITION"


class PartitionUnavailableError(PlanCacheError):
    """A plan key names a transformer partition the served repository does not have (no transformer_ref/)."""

    reason = "PARTITION_UNAVAILABLE"
    grpc_code = "FAILED_PRECONDITION"


class SlabBusyError(PlanCacheError):
    """The request fits the slab, but not beside the plans other live leases hold; retry later."""

    reason = "SLAB_BUSY"
    grpc_code = "RESOURCE_EXHAUSTED"


class UnknownLeaseError(PlanCacheError):
    """No live lease has this id (already released, or its session ended)."""

    reason = "UNKNOWN_LEASE"
    grpc_code = "NOT_FOUND"


class RebuildError(PlanCacheError):
    """A rebuild pass failed (I/O error, corrupt shard); the message names the file."""

    reason = "REBUILD_FAILED"
    grpc_code = "FAILED_PRECONDITION"


class CheckpointChangedError(RebuildError):
    """The rebuild source changed on disk since the cache was opened on it."""

    reason = "CHECKPOINT_CHANGED"


class CacheBusyError(PlanCacheError):
    """An operation that needs no live leases (invalidate, retarget) found some."""

    reason = "CACHE_BUSY"
    grpc_code = "ABORTED"


class SessionError(PlanCacheError):
    """Attach refused (a session is live) or an RPC named a session that is not the live one."""

    reason = "SESSION_MISMATCH"
    grpc_code = "FAILED_PRECONDITION"


class LeaseAbandonedError(PlanCacheError):
    """ReleasePlans named this PreparePlans' request_id (its caller gave up on the answer) before the lease was
    handed out: the lease was released at once and nothing is served under it."""

    reason = "LEASE_ABANDONED"
    grpc_code = "CANCELLED"


class UpdateConflictError(PlanCacheError):
    """Another weight update is prepared, or commit/abort names a different one."""

    reason = "UPDATE_CONFLICT"
    grpc_code = "ABORTED"


class StateFileError(PlanCacheError):
    """The state file (`--state-dir`/plancache-state.json) cannot be read, breaks its schema or cannot be written;
    the message names the file, the key and the rule, and how to recover without the generation going backwards
    ("set generation to at least N"). At start the sidecar exits 2; a CommitWeightUpdate that cannot persist
    commits nothing. ErrorInfo metadata `key`, `min_generation` (empty when unknown)."""

    reason = "STATE_FILE_ERROR"
    grpc_code = "INTERNAL"

    def __init__(self, path: str, key: str, rule: str, min_generation: int | None = None, advice: str = "") -> None:
        where = f"{path}: {key}: " if key else f"{path}: "
        super().__init__(
            f"{where}{rule}" + (f"; {advice}" if advice else ""),
            {"key": key, "min_generation": "" if min_generation is None else str(min_generation)},
        )
        self.path = path
        self.key = key
        self.rule = rule
        self.min_generation = min_generation
