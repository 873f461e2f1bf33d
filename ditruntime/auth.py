"""Credentials and network exposure both services share, free of grpc (configs import it): PEM files read with
the flag that named them; the admin bearer token (`authorization: Bearer <token>`: from --admin-token,
$DITSERVE_ADMIN_TOKEN or --admin-token-file, at least 16 characters, never on a child's argv); which addresses and
peers are loopback; and the rule that an admin RPC never runs over a plaintext non-loopback connection. The
mutual-TLS credentials built from the PEM files are in `ditruntime.tls`."""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import unquote

from .errors import ServiceError

ADMIN_TOKEN_ENV = "DITSERVE_ADMIN_TOKEN"
"""The environment variable both services read their admin token from (`--admin-token` wins)."""
ADMIN_TOKEN_HELP = (
    f"admin bearer token (default: ${ADMIN_TOKEN_ENV}): the generator's UpdateWeights, a TCP sidecar's "
    "weight-update RPCs; unset = updates off"
)
"""One help text: `serve` declares the generator's --admin-token, the sidecar inherits the variable."""
ADMIN_TOKEN_FILE_HELP = (
    f"read the admin token from this file (stripped; not readable by other users); instead of --admin-token / "
    f"${ADMIN_TOKEN_ENV}"
)
"""One help text for the generator's, the sidecar's and `serve`'s --admin-token-file."""
MIN_ADMIN_TOKEN_CHARS = 16
"""The shortest admin token accepted at start (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)."""
LOOPBACK = "127.0.0.1"
"""Where a service's /metrics binds when its own address is a unix socket."""
METRICS_HOST_HELP = "host /metrics binds to (default: the host this service listens on; 127.0.0.1 for a unix socket)"
"""One help text for the generator's, the sidecar's and `serve`'s --metrics-host."""
REFLECTION_HELP = "do not serve gRPC server reflection (grpcurl then needs the .proto files)"
"""One help text for the generator's, the sidecar's and `serve`'s --no-reflection."""


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
    token = bearer_of(authorization)
    if token is None or not hmac.compare_digest(token.encode(), configured.encode()):
        raise BadTokenError(f"{what}: the admin token is wrong")


class PlaintextAdminError(ServiceError):
    """An admin RPC (UpdateWeights) came over a plaintext connection from a peer that is not loopback: its bearer
    token crossed the network in cleartext. Serve TLS (--tls-cert, --tls-key), or start with --allow-plaintext-admin
    to accept it anyway. FAILED_PRECONDITION, not PERMISSION_DENIED: the caller's token may well be right; what is
    missing is the transport the server must be configured with, and the same call succeeds once it is."""

    reason = "PLAINTEXT_ADMIN_REFUSED"
    grpc_code = "FAILED_PRECONDITION"


def read_token_file(path: Path, flag: str = "--admin-token-file") -> str:
    """The token in `path`, stripped. ValueError naming the flag when the file cannot be read, is empty, or is
    readable or writable by other users (mode o+r / o+w) or writable by its group: a secret's file is 0600 or 0640
    (0440 for a Kubernetes Secret volume with fsGroup)."""
    return _read_secret(path, flag)


CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}")
"""A client's name in a keys file: what its jobs' `owner` says."""


def read_client_keys(path: Path, flag: str = "--client-keys-file") -> dict[str, str]:
    """A keys file: one client per line, `NAME KEY` (blank lines and `#` comments skipped), each KEY at least
    MIN_ADMIN_TOKEN_CHARS printable ASCII characters, no KEY or NAME twice. Key -> name. ValueError naming the flag
    and the line (never a key); the file's mode is checked as a token file's."""
    keys: dict[str, str] = {}
    names: set[str] = set()
    for n, line in enumerate(_read_secret(path, flag).splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"{flag} {path} line {n}"
        if len(parts) != 2:
            raise ValueError(f"{where}: expected 'NAME KEY' (two fields), got {len(parts)} fields")
        name, key = parts
        if not CLIENT_NAME.fullmatch(name) or name in ("anonymous", "admin"):
            raise ValueError(
                f"{where}: NAME must be 1-128 of A-Z a-z 0-9 . _ @ : - (starting with a letter or digit), and not "
                f"'anonymous' or 'admin', got {name[:40]!r}"
            )
        check_admin_token(key, f"{where} (the key of {name})")
        if key in keys or name in names:
            raise ValueError(f"{where}: {'the key' if key in keys else 'the name ' + repr(name)} appears twice")
        keys[key] = name
        names.add(name)
    if not keys:
        raise ValueError(f"{flag} {path}: no 'NAME KEY' line")
    return keys


def bearer_of(authorization: str | None) -> str | None:
    """The token of an `authorization: Bearer <token>` value; None when there is none."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def match_key(keys: Mapping[str, str], token: str) -> str | None:
    """The name `token` belongs to in `keys` (key -> name), compared in constant time against every key."""
    found = None
    for key, name in keys.items():
        if hmac.compare_digest(token.encode(), key.encode()):
            found = name
    return found


def _read_secret(path: Path, flag: str) -> str:
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{flag} {path}: not a regular file")
        if mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP):
            raise ValueError(
                f"{flag} {path}: mode {stat.S_IMODE(mode):04o} lets other users read or change the token; "
                "allowed: no access for others and no group write (chmod 0600, or 0640)"
            )
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: not UTF-8 text") from None
    token = text.strip()
    if not token:
        raise ValueError(f"{flag} {path}: the file is empty")
    return token


def check_admin_token(token: str, source: str) -> None:
    """An admin token (empty: updates off) is at least MIN_ADMIN_TOKEN_CHARS printable ASCII characters without
    spaces (what `authorization: Bearer` metadata can carry). ValueError naming `source` (the flag it came from)
    and the rule; the token itself is never echoed."""
    if not token:
        return
    if len(token) < MIN_ADMIN_TOKEN_CHARS:
        raise ValueError(
            f"{source}: the admin token must be at least {MIN_ADMIN_TOKEN_CHARS} characters, got {len(token)} "
            "(make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    if not all("!" <= c <= "~" for c in token):
        raise ValueError(f"{source}: the admin token must be printable ASCII without spaces")


def resolve_admin_token(token: str, token_file: Path | None) -> str:
    """The admin token a service runs with: `token` (--admin-token, else $DITSERVE_ADMIN_TOKEN) or the contents of
    `token_file` (--admin-token-file), never both; checked by `check_admin_token`. ValueError naming the flags."""
    if token_file is None:
        check_admin_token(token, f"--admin-token (or ${ADMIN_TOKEN_ENV})")
        return token
    if token:
        raise ValueError(
            f"--admin-token-file and --admin-token (or ${ADMIN_TOKEN_ENV}) are both set: give the token one way"
        )
    from_file = read_token_file(token_file)
    check_admin_token(from_file, f"--admin-token-file {token_file}")
    return from_file


def listen_host(address: str) -> str:
    """The host part of a listen address: 'HOST:PORT' and '[V6]:PORT' give HOST / V6 ('' or '[::]': all
    interfaces, as '0.0.0.0' / '::'); a unix socket ('unix:PATH') gives LOOPBACK."""
    if address.startswith("unix"):
        return LOOPBACK
    host = address.rpartition(":")[0] if ":" in address else address
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "0.0.0.0"


def is_loopback_host(host: str) -> bool:
    """`host` (an IP literal or 'localhost') reaches only this machine. Wildcards ('0.0.0.0', '::') and other names
    are not loopback: a name may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def peer_is_local(peer: str) -> bool:
    """A gRPC `context.peer()` ('ipv4:127.0.0.1:5000', 'ipv6:[::1]:5000' or its escaped form
    'ipv6:%5B::1%5D:5000', 'unix:PATH') is a unix socket or a loopback address."""
    kind, _, rest = peer.partition(":")
    if kind in ("unix", "unix-abstract"):
        return True
    if kind not in ("ipv4", "ipv6"):
        return False
    return is_loopback_host(unquote(rest).rpartition(":")[0])


def check_admin_transport(peer: str, tls: bool, allow_plaintext: bool, method: str) -> None:
    """Refuse (PlaintextAdminError) admin RPC `method` from `peer` (`context.peer()`) when the listener is
    plaintext (`tls` False), the peer is not loopback or a unix socket, and `allow_plaintext`
    (--allow-plaintext-admin) is off. Call it before the bearer token is looked at."""
    if tls or allow_plaintext or peer_is_local(peer):
        return
    raise PlaintextAdminError(
        f"{method} refused: this connection from {peer} is plaintext, so the admin token would cross the network "
        "in cleartext; serve TLS (--tls-cert and --tls-key) and call over TLS, call from the server's own host "
        "(loopback), or start the server with --allow-plaintext-admin",
        {"peer": peer},
    )


def plaintext_admin_warning(listen: str, tls: bool, admin_token_set: bool, allow_plaintext: bool) -> str | None:
    """The start-time warning for an admin token served in plaintext beyond loopback (None when there is nothing to
    say). A warning, not a refusal: loopback callers of a wildcard listener (an exec into the container, a
    node-local admin) stay legitimate, and `check_admin_transport` refuses every other plaintext caller."""
    if not admin_token_set or tls or is_loopback_host(listen_host(listen)):
        return None
    if allow_plaintext:
        return (
            f"--allow-plaintext-admin: UpdateWeights is accepted over plaintext on --listen {listen}, so the admin "
            "token crosses the network in cleartext; serve TLS (--tls-cert, --tls-key) instead"
        )
    return (
        f"an admin token is set and --listen {listen} is not loopback, without TLS: UpdateWeights from non-loopback "
        "peers will be refused (FAILED_PRECONDITION, PLAINTEXT_ADMIN_REFUSED); serve TLS (--tls-cert, --tls-key), "
        "or pass --allow-plaintext-admin to accept the token in cleartext"
    )
