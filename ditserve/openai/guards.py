"""The facade's ASGI guards, which answer before any route reads a byte of the body: the Host allow-list (Starlette's
TrustedHostMiddleware), the bearer key, and the body cap (a larger Content-Length refused unread, a chunked body cut
where it passes the cap). Each refusal is OpenAI's error body."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .mapping import ApiError


async def refuse(e: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(e.body(), status_code=e.status, headers=e.headers)(scope, receive, send)


class HostGuard:
    """Only requests whose Host header matches `allowed_hosts` (TrustedHostMiddleware's rules: exact names,
    `*.example.com`, `*`); others get 400 `invalid_host`."""

    def __init__(self, app: ASGIApp, allowed_hosts: Sequence[str]) -> None:
        self.app, self.allowed_hosts = app, list(allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or "*" in self.allowed_hosts:
            await self.app(scope, receive, send)
            return
        passed = False

        async def through(scope: Scope, receive: Receive, send: Send) -> None:
            nonlocal passed
            passed = True
            await self.app(scope, receive, send)

        async def send_if_passed(message: Message) -> None:  # drops TrustedHostMiddleware's plain-text refusal
            if passed:
                await send(message)

        await TrustedHostMiddleware(through, self.allowed_hosts, www_redirect=False)(scope, receive, send_if_passed)
        if not passed:
            host = Headers(scope=scope).get("host", "")
            await refuse(ApiError(400, f"Host {host[:100]!r} is not served here; allowed: "
                                  f"{', '.join(self.allowed_hosts)} (--allowed-hosts)", None, "invalid_host"),
                         scope, receive, send)  # fmt: skip


class KeyGuard:
    """With a key, every request must carry `Authorization: Bearer <key>` (401 `invalid_api_key`, compared in
    constant time); without one, any passes."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is not None and scope["type"] == "http":
            given = Headers(scope=scope).get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(given, self.expected):
                e = ApiError(401, "invalid or missing API key (Authorization: Bearer ...)", None, "invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
                await refuse(e, scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Request bodies of at most `max_bytes`: a larger Content-Length is refused (413) before a byte is read; a
    body without one (chunked) is counted as it arrives, and the read that passes the cap raises ApiError(413)
    instead of returning, so nothing past it is read or kept."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def too_large(self, what: str) -> ApiError:
        """The 413; `Connection: close` makes the server close the connection after it, so the rest of the body is
        never read (not even to be thrown away)."""
        return ApiError(413, f"the request body ({what}) is larger than the {self.max_bytes} bytes served "
                        "(--max-body-mb)", None, "request_too_large", headers={"Connection": "close"})  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None:
            if not (length.isascii() and length.strip().isdigit()):
                await refuse(ApiError(400, f"Content-Length must be a byte count, got {length[:40]!r}"), scope,
                             receive, send)  # fmt: skip
                return
            if int(length) > self.max_bytes:
                await refuse(self.too_large(f"Content-Length {int(length)}"), scope, receive, send)
                return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self.too_large(f"more than {self.max_bytes} bytes sent")
            return message

        await self.app(scope, counted, send)
