"""`FacadeConfig`: every flag of `ditserve openai-api` but the generator's address, its TLS and the key (declared
once; the parser, the docs and the app read them from here), and the rules that check them."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from ditruntime.flags import check_bounds, flag

KIB, MIB = 2**10, 2**20
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
"""The Host names always served by default: this machine's own."""
_WILDCARDS = ("0.0.0.0", "::", "[::]", "")
_ORIGIN = re.compile(r"https?://[^/\s]+")


@dataclass(frozen=True)
class FacadeConfig:
    host: str = flag("127.0.0.1", "HTTP bind address (default %(default)s)")
    """Where the HTTP server listens; a loopback address unless a proxy or a key guards it."""
    port: int = flag(8000, "HTTP port (default %(default)s)", low=0, high=65535)
    """The HTTP port (0: any free port)."""
    max_body_bytes: int = flag(
        64 * MIB, "largest request body in MiB: a larger Content-Length is refused unread, a chunked body is cut at "
        "it (413; default %(default)s)", name="--max-body-mb", scale=MIB, flag_type=float, low=64 * KIB,
        high=1024 * MIB,
    )  # fmt: skip
    """Largest request body, in bytes. The default is the gRPC message limit of the facade's channel and of the
    generator (its --max-message-mb default): a CreateJob cannot be larger, and the largest the generator accepts
    at its defaults, two 20 MiB keyframes sent as base64 (53.4 MiB) and a 16 KiB prompt, fits."""
    allowed_hosts: str = flag(
        "", "comma-separated Host header values served, '*.example.com' patterns allowed, '*' any (default: "
        "localhost,127.0.0.1,[::1] and --host); others get 400",
    )  # fmt: skip
    """The Host names served (DNS rebinding: a page of another site resolving its name to this address must not
    reach the API). Empty: `LOOPBACK_HOSTS` and `host` (unless it is a wildcard address)."""
    cors_origins: str = flag(
        "", "comma-separated browser origins (https://app.example.com) allowed cross-origin calls (default: none, no "
        "CORS headers)",
    )  # fmt: skip
    """Origins a browser may call the API from; empty: no CORS headers at all, so browsers keep other sites out."""
    backend_timeout_s: float = flag(
        30.0, "deadline of each call to the generator, and the longest wait for each message of a /content stream, "
        "in seconds: then 504 (default %(default)s)", low=0.1, high=3600,
    )  # fmt: skip
    """Deadline of every unary Jobs call, and of each message of a content stream: a hung generator costs a request
    at most this long (504), and the HTTP worker thread is free again."""
    download_timeout_s: float = flag(
        600.0, "longest a /content download may take in all, in seconds (default %(default)s)", low=1, high=86_400
    )
    """Deadline of a whole GetJobContent stream: how long a slow HTTP client may hold a generator stream."""
    api_key: str | None = None
    """The one bearer key clients must send (--api-key-file or $DITSERVE_OPENAI_API_KEY); None: none asked."""

    def __post_init__(self) -> None:
        check_bounds(self)
        for pattern in self.host_patterns():
            if "*" in pattern[1:] or (pattern.startswith("*") and pattern != "*" and not pattern.startswith("*.")):
                raise ValueError(f"--allowed-hosts: {pattern!r} is not a host name, '*.example.com' or '*'")
        for origin in self.origins():
            if origin != "*" and _ORIGIN.fullmatch(origin) is None:
                raise ValueError(f"--cors-origins: {origin!r} is not an origin (http[s]://HOST[:PORT], or '*')")

    def host_patterns(self) -> tuple[str, ...]:
        """The Host names served: `allowed_hosts`, or the loopback names and the bound host."""
        if self.allowed_hosts.strip():
            return tuple(h.strip().lower() for h in self.allowed_hosts.split(",") if h.strip())
        bound = _as_host_header(self.host.strip().lower())
        return LOOPBACK_HOSTS if bound in (*_WILDCARDS, *LOOPBACK_HOSTS) else (*LOOPBACK_HOSTS, bound)

    def origins(self) -> tuple[str, ...]:
        return tuple(o.strip() for o in self.cors_origins.split(",") if o.strip())


def _as_host_header(host: str) -> str:
    """How a Host header names `host`: an IPv6 literal in brackets."""
    try:
        return f"[{host}]" if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address) else host
    except ValueError:
        return host
