"""The generator's errors: each names its gRPC status in `grpc_code` and a stable `reason`
(mapped once, by ditruntime.rpc_errors; see docs/architecture.md, "Errors"). No grpc here.
The generation-mismatch error is ditruntime.errors.GenerationMismatchError, shared with the sidecar.
"""

from __future__ import annotations

from collections.abc import Mapping

from ditruntime.errors import ServiceError


class GeneratorError(ServiceError):
    """Base class of the generator's errors (unexpected where raised as such: INTERNAL)."""

    reason = "GENERATOR_ERROR"
    grpc_code = "INTERNAL"


class QueueFullError(GeneratorError):
    """The queue holds `--max-queue-depth` requests (waiting, running or being sent); retry later. Carries
    RetryInfo (the delay from the queue's measured drain rate) and QuotaFailure (the flag); ErrorInfo metadata
    `queue_depth`, `max_queue_depth`."""

    reason = "QUEUE_FULL"
    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(
        self, message: str, retry_after_s: float, quota: str, metadata: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message, metadata)
        self.retry_after_s = retry_after_s
        """RetryInfo's retry_delay."""
        self.quota_violation = (quota, message)
        """QuotaFailure's (subject, description)."""


class HandlersBusyError(GeneratorError):
    """Every request handler (`--workers` less `--control-workers` less `--upload-watch-workers`) holds a Generate,
    GenerateStream or GetJobContent call; retry later. ErrorInfo metadata `handlers`."""

    reason = "HANDLERS_BUSY"
    grpc_code = "RESOURCE_EXHAUSTED"


class SidecarUnavailableError(GeneratorError):
    """The plan-cache sidecar is not attached, or went away during the call or the request."""

    reason = "SIDECAR_UNAVAILABLE"
    grpc_code = "UNAVAILABLE"


class CommitOutcomeUnknownError(SidecarUnavailableError):
    """CommitWeightUpdate's answer was lost: the sidecar may or may not have committed.

    The generator drops its session and serves nothing until it reattaches and learns the
    sidecar's generation (docs/architecture.md, "Weight generations and UpdateWeights").
    """

    def __init__(self, code_name: str) -> None:
        super().__init__(f"the commit's outcome is unknown ({code_name}); not serving until the sidecar is back")
        self.code_name = code_name


class NotServingError(GeneratorError):
    """The generator is shutting down: queued requests are dropped, new ones refused."""

    reason = "NOT_SERVING"
    grpc_code = "UNAVAILABLE"


class PartitionNotServedError(GeneratorError):
    """The request's task runs on a transformer partition this server does not serve (ref2va needs the repository's
    transformer_ref/, loaded: --partitions); the message names the folder and the tasks served."""

    reason = "PARTITION_NOT_SERVED"
    grpc_code = "FAILED_PRECONDITION"


class PlanCapacityError(GeneratorError):
    """The request can never fit this server's slab."""

    reason = "PLAN_CAPACITY_EXCEEDED"
    grpc_code = "FAILED_PRECONDITION"


class RequestTooLargeForDeviceError(GeneratorError):
    """The request's modeled activation peak (ditcore.sizing) plus `--memory-reserve-gb` exceeds the memory free on
    the model's device; refused at admission. The message names the canvas (height x width x frames, tokens), the
    modeled bytes and the free bytes; ErrorInfo metadata `height`, `width`, `num_frames`, `tokens`, `modeled_bytes`,
    `free_bytes`, `phase`."""

    reason = "REQUEST_TOO_LARGE_FOR_DEVICE"
    grpc_code = "RESOURCE_EXHAUSTED"


class CancelledError(GeneratorError):
    """The client cancelled the call (checked after every denoise step, between decode chunks and in the encoders'
    frame loops)."""

    reason = "CANCELLED"
    grpc_code = "CANCELLED"


class DeadlineExceededError(GeneratorError):
    """The call's deadline passed (checked after every denoise step, between decode chunks and in the encoders'
    frame loops)."""

    reason = "DEADLINE_EXCEEDED"
    grpc_code = "DEADLINE_EXCEEDED"


class ResultTooLargeError(GeneratorError):
    """A unary result (latents or media file) is above `--max-message-mb` less 4 KiB of framing: use GenerateStream.
    ErrorInfo metadata `result_bytes`, `max_message_bytes`."""

    reason = "RESULT_TOO_LARGE"
    grpc_code = "RESOURCE_EXHAUSTED"


class MediaEncodeError(GeneratorError):
    """Encoding the decoded frames and waveform into the requested file failed (e.g. no H.264 encoder in this
    PyAV/FFmpeg build): a server fault, not the request's."""

    reason = "MEDIA_ENCODE_FAILED"
    grpc_code = "INTERNAL"


class LeaseCheckError(GeneratorError):
    """A leased slot's table row is not READY with the lease's generation and key."""

    reason = "LEASE_CHECK_FAILED"
    grpc_code = "UNAVAILABLE"


class ReplicaUnavailableError(GeneratorError):
    """A rank of this replica is gone (its process died or the group broke): the request fails, the replica goes
    NOT_SERVING and restarts as a unit (generator_service.replica.link)."""

    reason = "REPLICA_RANK_LOST"
    grpc_code = "UNAVAILABLE"


class NodeWeightsDifferError(GeneratorError):
    """A replica across nodes: the nodes' sidecars read one weights path as different checkpoints (their copies of
    the files differ); the update (or the join) is refused on every node."""

    reason = "NODE_WEIGHTS_DIFFER"
    grpc_code = "FAILED_PRECONDITION"


class AdapterIdentityError(GeneratorError):
    """LoadAdapter's `identity` is not what the adapter's file reads now (it changed since it was listed): nothing is
    loaded. The message names both identities; ErrorInfo metadata `name`, `expected_identity`, `identity`."""

    reason = "ADAPTER_IDENTITY_MISMATCH"
    grpc_code = "FAILED_PRECONDITION"


class SidecarError(GeneratorError):
    """The sidecar refused a call; carries the sidecar's status code name, reason and metadata."""

    def __init__(self, code: str, reason: str, message: str, metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(f"plan cache: {message}", metadata)
        self.grpc_code = code
        self.reason = reason or "SIDECAR_ERROR"


class UpdateError(GeneratorError):
    """A weight update refused or failed; `grpc_code` and `reason` say which."""

    def __init__(self, code: str, reason: str, message: str, metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(message, metadata)
        self.grpc_code = code
        self.reason = reason


def tensor_updates_refused() -> UpdateError:
    """Cached mode cannot take pushed tensors: the sidecar rebuilds plans from checkpoint files."""
    return UpdateError(
        "FAILED_PRECONDITION",
        "TENSOR_UPDATE_REFUSED",
        "tensor-pushed updates are refused in cached mode: plans are rebuilt from checkpoint files and "
        "pushed tensors have none on disk; write a checkpoint under --weights-root and pass weights_path",
    )


class JobNotFoundError(GeneratorError):
    """No job has that id (or it was deleted)."""

    reason = "JOB_NOT_FOUND"
    grpc_code = "NOT_FOUND"


class JobStateError(GeneratorError):
    """The job is not in a state the call needs: content of a job that has not succeeded, cancel of a finished job.
    ErrorInfo metadata `job_id`, `state`."""

    reason = "JOB_STATE"
    grpc_code = "FAILED_PRECONDITION"


class ResultsFullError(GeneratorError):
    """The results directory holds `--results-max-gb` of content that is being read, so nothing can be removed
    for a new job's result; retry later (RetryInfo, QuotaFailure)."""

    reason = "RESULTS_FULL"
    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.quota_violation = ("--results-max-gb", message)


class OffsetError(GeneratorError):
    """GetJobContent's offset is past the content's end."""

    reason = "OFFSET_OUT_OF_RANGE"
    grpc_code = "OUT_OF_RANGE"


class IdempotencyConflictError(GeneratorError):
    """CreateJob's `idempotency_key` is held by a job created from a different request (or by a job being
    deleted). ErrorInfo metadata `idempotency_key`, `job_id` (the job holding it)."""

    reason = "IDEMPOTENCY_KEY_REUSED"
    grpc_code = "ALREADY_EXISTS"


class JobQueueFullError(GeneratorError):
    """`--max-queued-jobs` jobs are queued (across the replicas sharing the store); retry later. ErrorInfo metadata
    `queued`, `max_queued`; RetryInfo and QuotaFailure when the service sets them."""

    reason = "JOB_QUEUE_FULL"
    grpc_code = "RESOURCE_EXHAUSTED"
    retry_after_s: float | None = None
    """RetryInfo's delay (the service fills it in from the executor's drain rate)."""
    quota_violation: tuple[str, str] | None = None
    """QuotaFailure's (subject, description)."""


class JobStoreUnavailableError(GeneratorError):
    """The job store did not answer (SQLite locked past its busy timeout, PostgreSQL unreachable, a full disk):
    nothing was changed; retry after RetryInfo's delay. The database's own error is in the generator's log only."""

    reason = "JOB_STORE_UNAVAILABLE"
    grpc_code = "UNAVAILABLE"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class JobAttemptsExhaustedError(GeneratorError):
    """A job's runs ended `--job-max-attempts` times because the generator running it stopped (killed, out of
    memory, restarted): it is failed so the jobs behind it run. ErrorInfo metadata `job_id`, `attempts`."""

    reason = "ATTEMPTS_EXHAUSTED"
    grpc_code = "ABORTED"


class UnauthenticatedError(GeneratorError):
    """A Jobs RPC came without credentials while authentication is configured, or with a key no keys file names:
    send `authorization: Bearer <key>` (a --client-keys-file key, or the admin token) or a client certificate."""

    reason = "UNAUTHENTICATED"
    grpc_code = "UNAUTHENTICATED"
