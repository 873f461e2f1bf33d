"""The one error -> gRPC status mapping, used by both services' adapters.

Domain errors never import grpc: ditcore's are mapped here by class; the services' carry a
`grpc_code` attribute (a `grpc.StatusCode` member name) and a stable `reason`. Every error
leaves with google.rpc details: ErrorInfo (reason, domain, metadata) and, for request
fields, BadRequest field violations; a refusal to retry later, RetryInfo (`retry_after_s`) and QuotaFailure
(`quota_violation`: subject, description). INTERNAL errors never carry stack traces.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from ditcore import CheckpointError, CheckpointNotFoundError, PresetError, RequestError
from ditcore.adapter_contract import AdapterError, AdapterNotFoundError
from ditcore.pipeline import PartitionNotLoadedError
from ditcore.quality import QualityNotAuditedError

log = logging.getLogger(__name__)

DOMAIN = "ditserve"

# (class, status, reason) for errors defined in ditcore; first match wins.
_CORE_TABLE: list[tuple[type[BaseException], grpc.StatusCode, str]] = [
    (RequestError, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST"),
    (CheckpointNotFoundError, grpc.StatusCode.NOT_FOUND, "CHECKPOINT_NOT_FOUND"),
    (CheckpointError, grpc.StatusCode.FAILED_PRECONDITION, "CHECKPOINT_INVALID"),
    (PresetError, grpc.StatusCode.INVALID_ARGUMENT, "PRESET_INVALID"),
    (PartitionNotLoadedError, grpc.StatusCode.FAILED_PRECONDITION, "PARTITION_NOT_SERVED"),
    (AdapterNotFoundError, grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND"),
    (AdapterError, grpc.StatusCode.FAILED_PRECONDITION, "ADAPTER_REFUSED"),
    (QualityNotAuditedError, grpc.StatusCode.FAILED_PRECONDITION, "QUALITY_NOT_AUDITED"),
]


def classify(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(status code, ErrorInfo reason, message) of any exception."""
    for cls, code, reason in _CORE_TABLE:
        if isinstance(exc, cls):
            return code, reason, str(exc)
    name = getattr(exc, "grpc_code", None)
    if isinstance(name, str) and name in grpc.StatusCode.__members__:
        return grpc.StatusCode[name], str(getattr(exc, "reason", name)), str(exc)
    log.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, "INTERNAL", f"internal error ({type(exc).__name__})"


def to_status(exc: BaseException, metadata: dict[str, str] | None = None) -> grpc.Status:
    code, reason, message = classify(exc)
    meta = {k: str(v) for k, v in (getattr(exc, "metadata", None) or {}).items()}
    meta.update(metadata or {})
    details = [_pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=meta))]
    field = getattr(exc, "field", None)
    if isinstance(field, str):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=field, description=getattr(exc, "description", message)
        )
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    retry = getattr(exc, "retry_after_s", None)
    if isinstance(retry, int | float):
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(retry * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    quota = getattr(exc, "quota_violation", None)
    if isinstance(quota, tuple):
        violation_q = error_details_pb2.QuotaFailure.Violation(subject=quota[0], description=quota[1])
        details.append(_pack(error_details_pb2.QuotaFailure(violations=[violation_q])))
    status = status_pb2.Status(code=_code_number(code), message=message, details=details)
    return rpc_status.to_status(status)


def abort(context: grpc.ServicerContext, exc: BaseException) -> NoReturn:
    """Abort the RPC with the mapped status and details."""
    context.abort_with_status(to_status(exc))
    raise AssertionError("unreachable")  # abort_with_status raises


def error_info(err: grpc.RpcError) -> tuple[str, dict[str, str]]:
    """(reason, metadata) of the ErrorInfo a ditserve status carries; ("", {}) if none."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    if status is None:
        return "", {}
    for d in status.details:
        info = error_details_pb2.ErrorInfo()
        if d.Unpack(info):
            return info.reason, dict(info.metadata)
    return "", {}


def _pack(msg: Any) -> any_pb2.Any:
    a = any_pb2.Any()
    a.Pack(msg)
    return a


def _code_number(code: grpc.StatusCode) -> int:
    return int(getattr(code_pb2, code.name))
