"""Observability shared by both services: Prometheus RPC metrics, the /metrics HTTP server,
and structured (JSON) logging.

The /metrics server is prometheus_client's WSGI app behind a bounded server: one thread waits on the listening
socket and the idle connections together (an idle connection holds no thread), a connection that sends a request
goes to one of `workers` handler threads, and every connection is closed `timeout_s` after it was accepted, in
whatever state it is (idle, half a request, a response the client does not read). Beyond `max_connections` open
connections the oldest idle one is closed for the new one; with every connection busy, the new one is closed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import selectors
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app

from .auth import LOOPBACK

_STD_ATTRS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update({k: v for k, v in vars(record).items() if k not in _STD_ATTRS and not k.startswith("_")})
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(level: str, fmt: str = "text") -> None:
    """Configure the root logger: `fmt` "text" (human) or "json" (one object per line)."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    elif fmt == "text":
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        raise ValueError(f"--log-format must be text or json, got {fmt!r}")
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def final_code(context: grpc.ServicerContext, failed: bool) -> grpc.StatusCode:
    """The status an RPC ended with: the one its handler set (abort, set_code); else, for an RPC that is no longer
    active (the client cancelled or went away, or its deadline passed: grpc then closes a stream's iterator
    mid-yield), CANCELLED or DEADLINE_EXCEEDED; else UNKNOWN if the handler raised, OK if it returned."""
    code = context.code()
    if code is not None:
        return code
    if not context.is_active():
        remaining = context.time_remaining()
        return (
            grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else grpc.StatusCode.CANCELLED
        )
    return grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK


class RpcMetrics(grpc.ServerInterceptor):
    """Counts every RPC by method and status code (unary and streaming) and times it."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.requests = Counter(
            f"{prefix}_rpc_requests", "RPCs by method and status code", ["method", "code"], registry=registry
        )
        self.seconds = Histogram(
            f"{prefix}_rpc_seconds", "RPC wall time by method", ["method"], registry=registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300),
        )  # fmt: skip

    def _done(self, method: str, context: grpc.ServicerContext, t0: float, failed: bool) -> None:
        self.requests.labels(method, final_code(context, failed).name).inc()
        self.seconds.labels(method).observe(time.perf_counter() - t0)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                t0, failed = time.perf_counter(), True
                try:
                    resp = inner(request, context)
                    failed = False
                    return resp
                finally:
                    self._done(method, context, t0, failed)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner_s = handler.unary_stream

            def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                t0, failed = time.perf_counter(), True
                try:
                    yield from inner_s(request, context)
                    failed = False
                finally:
                    self._done(method, context, t0, failed)

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        return handler


class _QuietHandler(WSGIRequestHandler):
    """wsgiref's handler (one request per connection, then close), without a log line per request."""

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing."""


class _Listener(WSGIServer):
    """wsgiref's server for its socket, environ and request handling; `MetricsServer` runs the accept loop."""

    request_queue_size = 64  # the listen backlog: connections past it wait in the kernel

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily) -> None:
        self.address_family = family
        super().__init__(address, _QuietHandler)

    def server_bind(self) -> None:
        """Bind without HTTPServer's reverse DNS lookup of the host (socket.getfqdn can block)."""
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)
        self.setup_environ()


def _shutdown(conn: socket.socket) -> None:
    """End both directions: a thread blocked reading or writing `conn` returns at once."""
    with contextlib.suppress(OSError):  # already closed, or reset by the peer
        conn.shutdown(socket.SHUT_RDWR)


class MetricsServer:
    """/metrics over HTTP for one registry (off when port is None), bound to `host` (module docstring: bounded
    threads, per-connection deadline). A port that cannot be bound is logged and leaves metrics off."""

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int | None,
        host: str = LOOPBACK,
        *,
        timeout_s: float = 10.0,
        workers: int = 2,
        max_connections: int = 64,
    ) -> None:
        self.port = port
        self.host = host
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._listener: _Listener | None = None
        self._lock = threading.Lock()
        self._idle: dict[socket.socket, float] = {}  # accepted, waiting for a first byte -> deadline (oldest first)
        self._busy: dict[socket.socket, float] = {}  # handed to a worker (queued or running) -> deadline
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        if port is None:
            return
        log = logging.getLogger(__name__)
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            self._listener = _Listener((str(sockaddr[0]), int(sockaddr[1])), family)
        except OSError as e:  # a busy port must not take the service down
            log.error("metrics disabled: cannot listen on %s (%s)", self.url(port), e)
            self.port = None
            return
        self._listener.set_app(make_wsgi_app(registry))
        self._listener.socket.setblocking(False)
        self.port = self._listener.server_port
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="metrics")
        self._thread = threading.Thread(target=self._serve, name="metrics-accept", daemon=True)
        self._thread.start()
        log.info("metrics on %s", self.url(self.port))

    def url(self, port: int | None = None) -> str:
        """http://HOST:PORT/metrics (an IPv6 host in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port if port is None else port}/metrics"

    def _serve(self) -> None:
        assert self._listener is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener.socket, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.2):
                    if key.fileobj is self._listener.socket:
                        self._accept(sel)
                    else:  # a first byte (or EOF): to a worker
                        conn: socket.socket = key.fileobj  # type: ignore[assignment]
                        sel.unregister(conn)
                        self._dispatch(conn)
                self._expire(sel)
            for conn in list(self._idle):
                self._close(conn)

    def _accept(self, sel: selectors.BaseSelector) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.socket.accept()
        except OSError:  # gone before we took it, or no fd left
            return
        with self._lock:
            full = len(self._idle) + len(self._busy) >= self.max_connections
        if full and self._idle:  # the oldest idle connection makes room
            oldest = next(iter(self._idle))
            sel.unregister(oldest)
            self._close(oldest)
        elif full:  # every connection is being served: this one waits for nothing
            conn.close()
            return
        conn.setblocking(True)
        with self._lock:
            self._idle[conn] = time.monotonic() + self.timeout_s
        sel.register(conn, selectors.EVENT_READ)

    def _dispatch(self, conn: socket.socket) -> None:
        assert self._pool is not None
        with self._lock:
            self._busy[conn] = self._idle.pop(conn)
        try:
            self._pool.submit(self._handle, conn)
        except RuntimeError:  # shutting down
            self._finish(conn)

    def _handle(self, conn: socket.socket) -> None:
        """One request on a worker; the accept loop shuts the socket down at its deadline, which ends any read
        or write this is blocked in."""
        assert self._listener is not None
        with self._lock:
            left = self._busy.get(conn, 0.0) - time.monotonic()
        try:
            if left > 0:
                conn.settimeout(left)
                self._listener.finish_request(conn, conn.getpeername())
        except Exception as e:  # a timeout, a reset, a client that went away: its connection ends, nothing else
            logging.getLogger(__name__).debug("metrics connection ended: %s", e)
        finally:
            self._finish(conn)

    def _finish(self, conn: socket.socket) -> None:
        with self._lock:
            self._busy.pop(conn, None)
        self._close(conn)

    def _close(self, conn: socket.socket) -> None:
        with self._lock:
            self._idle.pop(conn, None)
        _shutdown(conn)
        conn.close()

    def _expire(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        with self._lock:
            idle = [c for c, deadline in self._idle.items() if deadline <= now]
            busy = [c for c, deadline in self._busy.items() if deadline <= now]
        for conn in idle:
            sel.unregister(conn)
            self._close(conn)
        for conn in busy:  # its worker is blocked on it: the shutdown ends the read or write
            _shutdown(conn)

    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet closed (idle, queued or being answered)."""
        with self._lock:
            return len(self._idle) + len(self._busy)

    def close(self) -> None:
        if self._listener is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            busy = list(self._busy)
        for conn in busy:
            _shutdown(conn)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            left = list(self._busy)
        for conn in left:  # queued ones whose futures were cancelled
            self._finish(conn)
        self._listener.server_close()
        self._listener = None
