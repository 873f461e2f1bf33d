"""Mutual-TLS gRPC credentials from PEM files (a bad file is refused naming its flag)."""

from __future__ import annotations

from pathlib import Path

import grpc

from .auth import read_pem


def mutual_tls_server_credentials(
    cert: Path, key: Path, client_ca: Path, flags: str = "--tls"
) -> grpc.ServerCredentials:
    """TLS with `cert`/`key`; every client must present a certificate `client_ca` signed."""
    return grpc.ssl_server_credentials(
        [(read_pem(key, f"{flags}-key"), read_pem(cert, f"{flags}-cert"))],
        root_certificates=read_pem(client_ca, f"{flags}-client-ca"),
        require_client_auth=True,
    )


def mutual_tls_channel_credentials(ca: Path, cert: Path, key: Path, flags: str) -> grpc.ChannelCredentials:
    """A client that verifies the server against `ca` and presents `cert`/`key`."""
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, f"{flags}-ca"),
        private_key=read_pem(key, f"{flags}-key"),
        certificate_chain=read_pem(cert, f"{flags}-cert"),
    )
