"""Credentials both services share, free of grpc (configs import it): PEM files read with the
flag that named them, and the admin bearer token (`authorization: Bearer <token>`). The mutual-TLS
credentials built from those files are in `ditruntime.tls`."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from pathlib import Path

from .errors import ServiceError

ADMIN_TOKEN_ENV = "DITSERVE_ADMIN_TOKEN"
"""The environment variable both services read their admin token from (`--admin-token` wins)."""
ADMIN_TOKEN_HELP = (
    f"admin bearer token (default: ${ADMIN_TOKEN_ENV}): the generator's UpdateWeights, a TCP sidecar's "
    "weight-update RPCs; unset = updates off"
)
"""One help text: `serve` declares the generator's --admin-token, the sidecar inherits the variable."""


class MissingTokenError(ServiceError):
    """An admin RPC (UpdateWeights; a TCP sidecar's weight-update RPCs) came without `authorization: Bearer <token>`."""

    reason = "MISSING_TOKEN"
    grpc_code = "UNAUTHENTICATED"


class BadTokenError(ServiceError):
    """An admin RPC's bearer token is not the configured `--admin-token`."""

    reason = "BAD_TOKEN"
    grpc_code = "PERMISSION_DENIED"


class UpdatesDisabledError(ServiceError):
    """Weight updates are off: no `--admin-token` (nor $DITSERVE_ADMIN_TOKEN) was configured."""

    reason = "UPDATES_DISABLED"
    grpc_code = "PERMISSION_DENIED"


def read_pem(path: Path, flag: str) -> bytes:
    """The bytes of a PEM file; ValueError naming the flag when it cannot be read or is not PEM."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file")
    return data


def check_tls_flags(
    flags: Mapping[str, Path | None], required: bool, needed_by: str, stray: str, hint: str = ""
) -> None:
    """Mutual TLS takes every one of `flags` (flag name -> value) where `required` (`needed_by` says why; `hint`
    ends the message), and none of them elsewhere (`stray` says where they apply). ValueError naming the flags."""
    names = list(flags)
    if required:
        missing = [name for name, value in flags.items() if value is None]
        if missing:
            raise ValueError(
                f"{needed_by} needs mutual TLS: {', '.join(names[:-1])} and {names[-1]} are required "
                f"({', '.join(missing)} missing){hint}"
            )
    elif given := [name for name, value in flags.items() if value is not None]:
        raise ValueError(f"{', '.join(given)}: {stray}")


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents `token`."""
    return (("authorization", f"Bearer {token}"),)


def check_bearer(configured: str, authorization: str | None, what: str) -> None:
    """`authorization: Bearer <token>` against the configured token (compared in constant time).
    No token configured: PERMISSION_DENIED (UPDATES_DISABLED); none sent: UNAUTHENTICATED
    (MISSING_TOKEN); a wrong one: PERMISSION_DENIED (BAD_TOKEN)."""
    if not configured:
        raise UpdatesDisabledError(f"{what} is disabled: start with --admin-token (or {ADMIN_TOKEN_ENV})")
    if not authorization:
        raise MissingTokenError(f"{what} needs metadata 'authorization: Bearer <admin token>'")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), configured.encode()):
        raise BadTokenError(f"{what}: the admin token is wrong")
