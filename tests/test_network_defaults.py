"""Safe network defaults (issue 19, item 5): /metrics binds where its service listens (127.0.0.1 by default) with
bounded threads and a per-connection deadline; UpdateWeights over a plaintext non-loopback connection is refused;
reflection can be turned off; the admin token is at least 16 characters, may come from a file, and never reaches
a child's argv."""

from __future__ import annotations

import argparse
import os
import socket
import stat
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter
from servicekit import wait_for

from ditruntime.auth import (
    ADMIN_TOKEN_ENV,
    PlaintextAdminError,
    check_admin_transport,
    listen_host,
    peer_is_local,
    plaintext_admin_warning,
    read_token_file,
)
from ditruntime.flags import LaunchOptions, from_args
from ditruntime.obs import MetricsServer
from ditserve import cli as ditserve_cli
from ditserve.launcher import build_children, child_configs, warnings
from ditserve.supervise import Child
from generator_service import cli as generator_cli
from generator_service.config import GeneratorConfig
from plancache_service import cli as plancache_cli
from plancache_service.config import CacheConfig, SidecarConfig
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

TOKEN = "n3tw0rk-defaults-token"  # 22 characters


@pytest.fixture(autouse=True)
def _no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)


@pytest.fixture
def registry() -> CollectorRegistry:
    r = CollectorRegistry()
    Counter("probe_total", "a counter the scrape must show", registry=r).inc()
    return r


@pytest.fixture
def metrics(registry: CollectorRegistry) -> Iterator[MetricsServer]:
    server = MetricsServer(registry, 0, timeout_s=1.0)
    try:
        yield server
    finally:
        server.close()


def _scrape(server: MetricsServer) -> str:
    with urllib.request.urlopen(server.url(), timeout=10) as resp:
        body: str = resp.read().decode()
        return body


# ----------------------------------------------------------------------------- /metrics
def test_metrics_bind_loopback_by_default(metrics: MetricsServer) -> None:
    assert metrics.host == "127.0.0.1"
    assert metrics.url() == f"http://127.0.0.1:{metrics.port}/metrics"
    assert "probe_total 1.0" in _scrape(metrics)
    assert GeneratorConfig(sidecar="unix:/s").metrics_bind_host == "127.0.0.1"
    assert GeneratorConfig(sidecar="unix:/s", listen="0.0.0.0:50051").metrics_bind_host == "0.0.0.0"
    assert GeneratorConfig(sidecar="unix:/s", listen="[::1]:1", metrics_host="10.0.0.5").metrics_bind_host == (
        "10.0.0.5"
    )
    side = SidecarConfig(Path("ck"), CacheConfig(), "unix:/run/x/p.sock")
    assert side.metrics_bind_host == "127.0.0.1"  # a unix-socket sidecar: loopback, not every interface
    assert listen_host("[::1]:50051") == "::1" and listen_host(":50051") == "0.0.0.0"


def test_idle_connections_hold_no_threads_and_a_scrape_still_answers(registry: CollectorRegistry) -> None:
    server = MetricsServer(registry, 0, timeout_s=30.0)
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(200)]
    try:
        wait_for(lambda: server.open_connections == server.max_connections, 10, "the oldest to close")  # the rest
        assert threading.active_count() - before < 10, threading.active_count() - before
        t0 = time.monotonic()
        assert "probe_total 1.0" in _scrape(server)  # behind 200 idle connections
        assert time.monotonic() - t0 < 5
        assert threading.active_count() - before < 10
    finally:
        for s in idle:
            s.close()
        server.close()


@pytest.mark.parametrize("sent", [b"", b"GET /metrics HTTP/1.1\r\nHost: x\r\n"])  # idle; half a request
def test_a_stalled_connection_is_closed_after_the_timeout(metrics: MetricsServer, sent: bytes) -> None:
    with socket.create_connection(("127.0.0.1", metrics.port)) as s:
        s.sendall(sent)
        s.settimeout(10)
        t0 = time.monotonic()
        assert s.recv(100) == b""  # closed by the server (a timeout here raises instead)
        assert time.monotonic() - t0 < 8
    wait_for(lambda: metrics.open_connections == 0, 10, "every connection to close")
    assert "probe_total 1.0" in _scrape(metrics)


def test_a_busy_port_leaves_metrics_off(registry: CollectorRegistry, metrics: MetricsServer) -> None:
    taken = MetricsServer(registry, metrics.port)
    assert taken.port is None
    taken.close()


# ----------------------------------------------------------------------------- UpdateWeights transport
@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv4:127.1.2.3:5000", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:%5B::1%5D:5000", True),  # how grpc writes it
        ("ipv6:%5B::ffff:127.0.0.1%5D:5000", True),
        ("unix:", True),
        ("unix:/run/ditserve/x.sock", True),
        ("ipv4:10.0.0.7:5000", False),
        ("ipv4:0.0.0.0:5000", False),
        ("ipv6:%5B2001:db8::1%5D:5000", False),
        ("ipv6:%5B::ffff:10.0.0.7%5D:5000", False),
        ("dns:localhost:5000", False),
        ("", False),
    ],
)
def test_peer_is_local(peer: str, local: bool) -> None:
    assert peer_is_local(peer) is local


def test_plaintext_admin_is_refused_from_a_remote_peer_only() -> None:
    remote = "ipv4:10.0.0.7:41234"
    with pytest.raises(PlaintextAdminError) as e:
        check_admin_transport(remote, tls=False, allow_plaintext=False, method="UpdateWeights")
    err = e.value
    assert (err.grpc_code, err.reason, err.metadata["peer"]) == (
        "FAILED_PRECONDITION",
        "PLAINTEXT_ADMIN_REFUSED",
        remote,
    )
    for flag in ("--tls-cert", "--tls-key", "--allow-plaintext-admin"):
        assert flag in str(err)
    check_admin_transport(remote, tls=True, allow_plaintext=False, method="UpdateWeights")
    check_admin_transport(remote, tls=False, allow_plaintext=True, method="UpdateWeights")
    check_admin_transport("ipv4:127.0.0.1:1", tls=False, allow_plaintext=False, method="UpdateWeights")
    check_admin_transport("unix:", tls=False, allow_plaintext=False, method="UpdateWeights")


def test_real_grpc_peers_of_loopback_clients_are_local(tmp_path: Path) -> None:
    """The strings grpc's context.peer() really gives (IPv6 escaped as %5B...%5D) are recognized."""
    peers: list[str] = []

    class Recording(health.HealthServicer):
        def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> object:
            peers.append(context.peer())
            return super().Check(request, context)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(Recording(), server)
    port = server.add_insecure_port("localhost:0")  # 127.0.0.1 and, where there is IPv6, [::1]
    sock = tmp_path / "h.sock"
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    try:
        targets = [f"127.0.0.1:{port}", f"unix:{sock}"]
        if socket.has_ipv6 and _ipv6_loopback():
            targets.append(f"[::1]:{port}")
        for target in targets:
            with grpc.insecure_channel(target) as ch:
                try:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                except grpc.RpcError as e:  # [::1] not bound by "localhost" on this host
                    assert target.startswith("[::1]"), e
    finally:
        server.stop(None)
    assert len(peers) >= 2 and all(peer_is_local(p) for p in peers), peers


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_start_warns_about_an_admin_token_in_plaintext_beyond_loopback() -> None:
    assert plaintext_admin_warning("127.0.0.1:50051", False, True, False) is None
    assert plaintext_admin_warning("unix:/s", False, True, False) is None
    assert plaintext_admin_warning("0.0.0.0:50051", True, True, False) is None
    assert plaintext_admin_warning("0.0.0.0:50051", False, False, False) is None  # no token: updates off
    refused = plaintext_admin_warning("0.0.0.0:50051", False, True, False)
    assert refused and "PLAINTEXT_ADMIN_REFUSED" in refused and "--allow-plaintext-admin" in refused
    allowed = plaintext_admin_warning("[::]:50051", False, True, True)
    assert allowed and "cleartext" in allowed and "--tls-cert" in allowed


# ----------------------------------------------------------------------------- config flags
def test_reflection_and_plaintext_admin_flags_parse(tmp_path: Path) -> None:
    gen = generator_cli.config_from_args(generator_cli.build_parser().parse_args([]))
    assert gen.reflection is True and gen.allow_plaintext_admin is False and gen.metrics_host == ""
    flags = ["--no-reflection", "--allow-plaintext-admin", "--metrics-host", "0.0.0.0"]
    gen = generator_cli.config_from_args(generator_cli.build_parser().parse_args(flags))
    assert (gen.reflection, gen.allow_plaintext_admin, gen.metrics_bind_host) == (False, True, "0.0.0.0")

    def sidecar(*flags: str) -> SidecarConfig:
        argv = ["--checkpoint", "/ck", "--socket", str(tmp_path / "run" / "p.sock"), *flags]
        return plancache_cli.config_from_args(plancache_cli.build_parser().parse_args(argv))

    assert (sidecar().reflection, sidecar().metrics_host) == (True, "")
    side = sidecar("--no-reflection", "--metrics-host", "::")
    assert (side.reflection, side.metrics_bind_host) == (False, "::")


# ----------------------------------------------------------------------------- the admin token
@pytest.mark.parametrize("short", ["Zq9", "Q" * 15])
def test_a_short_admin_token_is_refused_naming_the_flag_and_the_rule(
    short: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"--admin-token .*at least 16 characters, got \d+") as e:
        GeneratorConfig(sidecar="unix:/s", admin_token=short)
    assert short not in str(e.value)  # the token itself is not echoed
    monkeypatch.setenv(ADMIN_TOKEN_ENV, short)
    with pytest.raises(ValueError, match=r"DITSERVE_ADMIN_TOKEN.*at least 16"):
        generator_cli.config_from_args(generator_cli.build_parser().parse_args([]))
    with pytest.raises(ValueError, match="at least 16"):
        SidecarConfig(Path("ck"), CacheConfig(), "unix:/s", admin_token=short)
    path = tmp_path / "token"
    path.write_text(short + "\n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match=r"--admin-token-file .*at least 16"):
        GeneratorConfig(sidecar="unix:/s", admin_token_file=path)
    with pytest.raises(ValueError, match="printable ASCII"):
        GeneratorConfig(sidecar="unix:/s", admin_token="sixteen chars!! with spaces")
    assert GeneratorConfig(sidecar="unix:/s", admin_token="a" * 16).admin_secret == "a" * 16


def _token_file(tmp_path: Path, mode: int = 0o600, text: str = f"  {TOKEN}\n") -> Path:
    path = tmp_path / "admin-token"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_admin_token_file_is_read_stripped_and_must_be_private(tmp_path: Path) -> None:
    path = _token_file(tmp_path)
    args = generator_cli.build_parser().parse_args(["--admin-token-file", str(path)])
    gen = generator_cli.config_from_args(args)
    assert gen.admin_secret == TOKEN and gen.admin_token == ""
    side = plancache_cli.build_parser().parse_args(["--checkpoint", "/ck", "--admin-token-file", str(path)])
    assert plancache_cli.config_from_args(side).admin_secret == TOKEN
    assert read_token_file(_token_file(tmp_path, 0o640)) == TOKEN  # a group may read (a Secret with fsGroup)
    for mode in (0o644, 0o604, 0o660, 0o602):
        with pytest.raises(ValueError, match=rf"--admin-token-file .*mode {mode:04o}.*chmod 0600"):
            read_token_file(_token_file(tmp_path, mode))
    with pytest.raises(ValueError, match="the file is empty"):
        read_token_file(_token_file(tmp_path, text="\n"))
    with pytest.raises(ValueError, match="cannot read"):
        read_token_file(tmp_path / "none")
    with pytest.raises(ValueError, match="not a regular file"):
        read_token_file(tmp_path)
    with pytest.raises(ValueError, match="both set"):
        GeneratorConfig(sidecar="unix:/s", admin_token=TOKEN, admin_token_file=_token_file(tmp_path))


def _serve_args(*argv: str) -> argparse.Namespace:
    [sub] = [a for a in ditserve_cli._parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser: argparse.ArgumentParser = sub.choices["serve"]
    return parser.parse_args(list(argv))


def _children(tmp_path: Path, *argv: str, checkpoint: Path | None = None) -> tuple[GeneratorConfig, list[Child]]:
    ckpt = checkpoint or tmp_path / "ck"
    args = _serve_args("--run-dir", str(tmp_path), "--checkpoint", str(ckpt), *argv)
    gen, side = child_configs(args, tmp_path, ckpt)
    return gen, build_children(args, from_args(LaunchOptions, args, exclude=("threads",)), gen, side)


def _config(child: Child) -> GeneratorConfig | SidecarConfig:
    assert child.config is not None
    return child.config


def test_serve_gives_the_generator_its_token_by_environment_never_argv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen, children = _children(tmp_path, "--admin-token", TOKEN)
    [side, generator] = children
    assert gen.admin_secret == TOKEN
    for child in children:
        assert not any(TOKEN in a for a in child.argv), child.argv
        assert not any(a.startswith("--admin-token") for a in child.argv)
    assert generator.env[ADMIN_TOKEN_ENV] == TOKEN
    assert side.env is not None and generator.env is not None
    assert ADMIN_TOKEN_ENV not in side.env  # the unix-socket sidecar needs none
    child_args = generator_cli.build_parser().parse_args(generator.argv[3:])
    monkeypatch.setenv(ADMIN_TOKEN_ENV, TOKEN)  # what the child's environment holds
    assert generator_cli.config_from_args(child_args) == gen
    # from serve's environment: the same, and the sidecar still gets none
    monkeypatch.setenv(ADMIN_TOKEN_ENV, TOKEN)
    _, [side, generator] = _children(tmp_path)
    assert side.env is not None and generator.env is not None
    assert generator.env[ADMIN_TOKEN_ENV] == TOKEN and ADMIN_TOKEN_ENV not in side.env
    assert not any(TOKEN in a for c in (side, generator) for a in c.argv)


def test_serve_passes_a_token_file_by_path(tmp_path: Path) -> None:
    path = _token_file(tmp_path)
    gen, [side, generator] = _children(tmp_path, "--admin-token-file", str(path))
    assert f"--admin-token-file={path}" in generator.argv
    assert side.env is not None and generator.env is not None
    assert ADMIN_TOKEN_ENV not in generator.env and ADMIN_TOKEN_ENV not in side.env
    assert not any(TOKEN in a for a in generator.argv)
    child_args = generator_cli.build_parser().parse_args(generator.argv[3:])
    assert generator_cli.config_from_args(child_args).admin_secret == TOKEN == gen.admin_secret


def test_serve_metrics_and_reflection_follow_serve_flags(tmp_path: Path) -> None:
    gen, [side, _] = _children(tmp_path)
    assert gen.metrics_bind_host == _config(side).metrics_bind_host == "127.0.0.1"
    gen, [side, _] = _children(tmp_path, "--host", "0.0.0.0", "--no-reflection")
    assert gen.metrics_bind_host == _config(side).metrics_bind_host == "0.0.0.0"
    assert gen.reflection is False and _config(side).reflection is False
    gen, [side, _] = _children(tmp_path, "--host", "0.0.0.0", "--metrics-host", "127.0.0.1")
    assert _config(side).metrics_bind_host == "127.0.0.1"


def test_serve_warns_about_argv_tokens_and_plaintext_admin(tmp_path: Path) -> None:
    args = _serve_args("--host", "0.0.0.0", "--admin-token", TOKEN)
    gen, _ = child_configs(args, tmp_path, tmp_path / "ck")
    [argv_warning, plaintext] = warnings(args, gen)
    assert "ps" in argv_warning and "--admin-token-file" in argv_warning
    assert "PLAINTEXT_ADMIN_REFUSED" in plaintext
    args = _serve_args("--admin-token-file", str(_token_file(tmp_path)))
    assert warnings(args, child_configs(args, tmp_path, tmp_path / "ck")[0]) == []  # loopback, no argv token


@pytest.mark.e2e
def test_the_generator_process_gets_the_token_off_its_command_line(tmp_path: Path, tiny_ckpt: Path) -> None:
    """A real generator child (resident mode) started as serve starts it: its /proc cmdline has no token, its
    environment (private to its uid) has it, and UpdateWeights with that token passes authorization."""
    port = _free_port()
    argv = ("--adaln-mode", "resident", "--port", str(port), "--no-metrics", "--admin-token", TOKEN)
    _, [generator] = _children(tmp_path, *argv, checkpoint=tiny_ckpt)
    generator.start(timeout_s=180)
    try:
        assert generator.proc is not None
        cmdline = Path(f"/proc/{generator.proc.pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in cmdline and b"generator_service" in cmdline
        environ = Path(f"/proc/{generator.proc.pid}/environ")
        assert stat.S_IMODE(environ.stat().st_mode) & 0o044 == 0
        assert f"{ADMIN_TOKEN_ENV}={TOKEN}".encode() in environ.read_bytes().split(b"\0")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.GeneratorStub(ch)
            for token in (TOKEN, "x" * 20):
                with pytest.raises(grpc.RpcError) as e:
                    stub.UpdateWeights(
                        pb.UpdateWeightsRequest(weights_path="/nowhere"),
                        metadata=(("authorization", f"Bearer {token}"),), timeout=30,
                    )  # fmt: skip
                wrong = "token is wrong" in e.value.details()
                assert wrong == (token != TOKEN), e.value.details()  # the right one gets past the token check
    finally:
        generator.stop()
    assert TOKEN not in (tmp_path / "generator.log").read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_process_environment_is_private() -> None:
    """What keeps a token in the environment private: /proc/PID/environ is readable by its uid only."""
    mode = stat.S_IMODE(os.stat(f"/proc/{os.getpid()}/environ").st_mode)
    assert mode & 0o044 == 0, oct(mode)


def test_serve_passes_the_facades_host_allow_list_and_cors_origins(tmp_path: Path) -> None:
    """`serve --host 0.0.0.0 --openai-port` must be reachable by the names clients use: the facade refuses other
    Host headers (DNS rebinding), so serve passes --openai-allowed-hosts (and --openai-cors-origins) through."""
    _, children = _children(tmp_path, "--host", "0.0.0.0", "--openai-port", "8000",
                            "--openai-allowed-hosts", "gpu-7.example.com", "--openai-cors-origins",
                            "https://app.example.com")  # fmt: skip
    [facade] = [c for c in children if c.name == "openai-api"]
    argv = facade.argv
    assert argv[argv.index("--allowed-hosts") + 1] == "gpu-7.example.com"
    assert argv[argv.index("--cors-origins") + 1] == "https://app.example.com"
    _, plain = _children(tmp_path / "plain", "--openai-port", "8000")
    [facade] = [c for c in plain if c.name == "openai-api"]
    assert "--allowed-hosts" not in facade.argv and "--cors-origins" not in facade.argv  # the facade's defaults
