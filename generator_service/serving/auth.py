"""Who calls the Jobs API: the caller a gRPC context authenticates as (`JobsAuth.caller`), and so whose jobs it
may see. Authentication is on whenever any credential is configured (--client-keys-file, --admin-token,
--tls-client-ca): a call then needs `authorization: Bearer <key>` (a keys-file key: that client; the admin token:
the admin, who sees every job) or a verified client certificate (`tls:<common name>`); else UNAUTHENTICATED. Off,
every caller is `anonymous`. Keys are compared in constant time; no key is ever logged or echoed."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from ditruntime.auth import bearer_of, check_admin_transport, match_key

from ..errors import UnauthenticatedError
from ..jobs.schema import ANONYMOUS

ADMIN = "admin"
"""The admin token's caller name (the owner of the jobs an admin creates)."""


@dataclass(frozen=True)
class Caller:
    """An authenticated caller."""

    name: str
    """What its jobs' `owner` says."""
    admin: bool = False
    """Sees (cancels, deletes) every job."""

    @property
    def sees(self) -> str | None:
        """The owner whose jobs it sees; None: every owner's."""
        return None if self.admin else self.name


class JobsAuth:
    """The Jobs API's authentication: client keys (key -> name), the admin token, client certificates."""

    def __init__(
        self, keys: Mapping[str, str], admin_token: str = "", client_certs: bool = False, tls: bool = False,
        allow_plaintext_admin: bool = False,
    ) -> None:  # fmt: skip
        self._keys, self._admin, self._certs = dict(keys), admin_token, client_certs
        self._tls, self._allow_plaintext_admin = tls, allow_plaintext_admin
        """The admin token crosses no network in cleartext here either (ditruntime.auth.check_admin_transport)."""

    @property
    def enabled(self) -> bool:
        return bool(self._keys or self._admin or self._certs)

    def caller(self, context: grpc.ServicerContext) -> Caller:
        """Who `context`'s call comes from; UnauthenticatedError when authentication is on and it proves nobody."""
        if not self.enabled:
            return Caller(ANONYMOUS)
        token = bearer_of(dict(context.invocation_metadata()).get("authorization"))
        if token is not None:
            if self._admin and hmac.compare_digest(token.encode(), self._admin.encode()):
                check_admin_transport(context.peer(), self._tls, self._allow_plaintext_admin, "the Jobs API as admin")
                return Caller(ADMIN, admin=True)
            name = match_key(self._keys, token)
            if name is None:
                raise UnauthenticatedError("authorization: the bearer key is not one this server knows")
            return Caller(name)
        common_name = _certificate_name(context) if self._certs else None
        if common_name:
            return Caller(f"tls:{common_name}")
        raise UnauthenticatedError(
            "authorization: the Jobs API needs 'authorization: Bearer <key>' metadata (a --client-keys-file key or "
            "the admin token)" + (" or a client certificate" if self._certs else "")
        )


def _certificate_name(context: grpc.ServicerContext) -> str | None:
    """The common name of the verified client certificate of the call (mutual TLS), if any."""
    names = (context.auth_context() or {}).get("x509_common_name") or []
    return names[0].decode("utf-8", "replace") if names else None
