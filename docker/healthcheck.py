"""Container health check over grpc.health.v1: exit 0 only if the server answers SERVING.

python docker/healthcheck.py [TARGET [SERVICE]] [--timeout-s S] [--alive]
                             [--tls-ca PEM [--tls-server-name NAME] [--tls-cert PEM --tls-key PEM]]

TARGET: 'host:port', 'unix:/path' or a socket path (default $DITSERVE_HEALTH_TARGET, else
127.0.0.1:50051). SERVICE: the health service name (default $DITSERVE_HEALTH_SERVICE, else ''
= the whole server). --alive: any answer counts (SERVING or NOT_SERVING), for liveness checks
that must not restart a process that is only waiting for its peer or updating weights.
TLS (a generator started with --tls-cert/--tls-key): --tls-ca is the PEM the server's certificate is verified
against (its CA, or the server's own certificate file: a probe inside the pod can trust exactly that), and
--tls-server-name the name in that certificate to expect (default: TARGET's host); --tls-cert/--tls-key present
a client certificate (a server with --tls-client-ca). Each defaults to $DITSERVE_HEALTH_TLS_CA,
$DITSERVE_HEALTH_TLS_SERVER_NAME, $DITSERVE_HEALTH_TLS_CERT, $DITSERVE_HEALTH_TLS_KEY, so a container's
environment can switch its HEALTHCHECK and probes to TLS without changing their command.
Exit codes: 0 healthy, 1 not serving / unreachable / unknown service, 2 bad usage.
Needs only grpcio and grpcio-health-checking, so it runs with the image's own interpreter.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"


def _target(address: str) -> str:
    return f"unix:{address}" if address.startswith("/") else address


def _env(name: str) -> str | None:
    return os.environ.get(name) or None  # set but empty: unset (compose's ${VAR:-})


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="healthcheck.py", description="grpc.health.v1 check (exit 0 if SERVING)")
    p.add_argument("target", nargs="?", default=os.environ.get("DITSERVE_HEALTH_TARGET", DEFAULT_TARGET))
    p.add_argument("service", nargs="?", default=os.environ.get("DITSERVE_HEALTH_SERVICE", ""))
    p.add_argument("--timeout-s", type=float, default=3.0, help="deadline of the Check call (default %(default)s)")
    p.add_argument("--alive", action="store_true", help="any answer counts, NOT_SERVING included")
    p.add_argument("--tls-ca", default=_env("DITSERVE_HEALTH_TLS_CA"), help="TLS: verify the server against this PEM")
    p.add_argument(
        "--tls-server-name", default=_env("DITSERVE_HEALTH_TLS_SERVER_NAME"), help="TLS: the certificate's name"
    )
    p.add_argument("--tls-cert", default=_env("DITSERVE_HEALTH_TLS_CERT"), help="TLS: client certificate PEM")
    p.add_argument("--tls-key", default=_env("DITSERVE_HEALTH_TLS_KEY"), help="TLS: client private key PEM")
    return p


def _channel(target: str, args: argparse.Namespace) -> grpc.Channel:
    """Plaintext, or TLS when --tls-ca is given (ValueError naming the flag for a file it cannot read)."""
    if args.tls_ca is None:
        if args.tls_server_name or args.tls_cert or args.tls_key:
            raise ValueError("--tls-server-name, --tls-cert and --tls-key need --tls-ca")
        return grpc.insecure_channel(target)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    files = {"--tls-ca": args.tls_ca, "--tls-cert": args.tls_cert, "--tls-key": args.tls_key}
    pem: dict[str, bytes | None] = {}
    for flag, path in files.items():
        try:
            pem[flag] = Path(path).read_bytes() if path else None
        except OSError as e:
            raise ValueError(f"{flag} {path}: cannot read: {e.strerror or e}") from None
    creds = grpc.ssl_channel_credentials(pem["--tls-ca"], pem["--tls-key"], pem["--tls-cert"])
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(target, creds, options=options)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.timeout_s > 0:
        print(f"healthcheck: --timeout-s must be > 0, got {args.timeout_s}", file=sys.stderr)
        return 2
    target = _target(args.target)
    label = f"{target} service {args.service or '(server)'}"
    try:
        opened = _channel(target, args)
    except ValueError as e:
        print(f"healthcheck: {e}", file=sys.stderr)
        return 2
    with opened as channel:
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
