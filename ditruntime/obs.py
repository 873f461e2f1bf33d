"""Observability shared by both services: Prometheus RPC metrics, the /metrics HTTP server,
and structured (JSON) logging.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

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
        code = context.code()
        if code is None:
            code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
        self.requests.labels(method, code.name).inc()
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


class MetricsServer:
    """/metrics over HTTP for one registry (off when port is None)."""

    def __init__(self, registry: CollectorRegistry, port: int | None, addr: str = "0.0.0.0") -> None:
        self.port = port
        self._server: Any = None
        if port is not None:
            try:
                self._server, _ = start_http_server(port, addr=addr, registry=registry)
                self.port = self._server.server_port
                logging.getLogger(__name__).info("metrics on http://%s:%d/metrics", addr, self.port)
            except OSError as e:  # a busy port must not take the service down
                logging.getLogger(__name__).error("metrics disabled: cannot listen on %s:%d (%s)", addr, port, e)
                self.port = None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
