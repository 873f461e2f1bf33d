"""Container health check over grpc.health.v1: exit 0 only if the server answers SERVING.

python docker/healthcheck.py [TARGET [SERVICE]] [--timeout-s S] [--alive]

TARGET: 'host:port', 'unix:/path' or a socket path (default $DITSERVE_HEALTH_TARGET, else
127.0.0.1:50051). SERVICE: the health service name (default $DITSERVE_HEALTH_SERVICE, else ''
= the whole server). --alive: any answer counts (SERVING or NOT_SERVING), for liveness checks
that must not restart a process that is only waiting for its peer or updating weights.
Exit codes: 0 healthy, 1 not serving / unreachable / unknown service, 2 bad usage.
Needs only grpcio and grpcio-health-checking, so it runs with the image's own interpreter.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"


def _target(address: str) -> str:
    return f"unix:{address}" if address.startswith("/") else address


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="healthcheck.py", description="grpc.health.v1 check (exit 0 if SERVING)")
    p.add_argument("target", nargs="?", default=os.environ.get("DITSERVE_HEALTH_TARGET", DEFAULT_TARGET))
    p.add_argument("service", nargs="?", default=os.environ.get("DITSERVE_HEALTH_SERVICE", ""))
    p.add_argument("--timeout-s", type=float, default=3.0, help="deadline of the Check call (default %(default)s)")
    p.add_argument("--alive", action="store_true", help="any answer counts, NOT_SERVING included")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.timeout_s > 0:
        print(f"healthcheck: --timeout-s must be > 0, got {args.timeout_s}", file=sys.stderr)
        return 2
    target = _target(args.target)
    label = f"{target} service {args.service or '(server)'}"
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s)
        except grpc.RpcError as e:
            print(f"{label}: {e.code().name}: {e.details()}", file=sys.stderr)  # NOT_FOUND = unknown service
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{label}: {status}")
    ok = reply.status == health_pb2.HealthCheckResponse.SERVING or (
        args.alive and reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
