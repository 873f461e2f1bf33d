"""`ditserve serve` as one node of a replica across nodes (--nnodes, --node-rank, --rdzv-endpoint): the generator's
torchrun argv (static rendezvous, no --standalone, even with one rank per node), the refusals naming the flag and
its range, and node K > 0's generator, which has no public port: it is up once its agent runs (no gRPC health
check), and it stops through the agent's process group. With --sidecar-listen (nodes on different hosts): the
sidecar on TCP with mutual TLS and the generator's admin token (in its environment, never on an argv), the
generator's --sidecar the address rank 0 reaches it at, the refusals naming the flags, and a real start over TCP +
mutual TLS."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from servicekit import TOKEN, ProcessGroup, free_port, health_status, service_env, short_tmpdir, wait_for

from ditruntime.auth import ADMIN_TOKEN_ENV
from ditruntime.flags import LaunchOptions, from_args
from ditruntime.tls import mutual_tls_channel_credentials
from ditserve import cli as ditserve_cli
from ditserve import supervise
from ditserve.errors import UsageError
from ditserve.launcher import (
    REPLICA_MAX_RESTARTS,
    agent_group,
    banner,
    build_children,
    child_configs,
    prepare,
    wait_running,
    warnings,
)
from ditserve.supervise import Child, replica_leader
from generator_service import cli as generator_cli
from generator_service.config import GeneratorConfig
from plancache_service import cli as plancache_cli
from plancache_service.config import SidecarConfig

ENDPOINT = "10.0.0.1:29500"
TWO_NODES = ("--nnodes", "2", "--rdzv-endpoint", ENDPOINT)


def _serve_args(*argv: str) -> argparse.Namespace:
    [sub] = [a for a in ditserve_cli._parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser: argparse.ArgumentParser = sub.choices["serve"]
    return parser.parse_args(list(argv))


def _children(tmp_path: Path, *argv: str) -> tuple[argparse.Namespace, GeneratorConfig, dict[str, Child]]:
    ckpt = tmp_path / "ck"
    args = _serve_args("--run-dir", str(tmp_path), "--checkpoint", str(ckpt), "--device", "cpu", *argv)
    gen, side = child_configs(args, tmp_path, ckpt)
    children = build_children(args, from_args(LaunchOptions, args, exclude=("threads",)), gen, side)
    return args, gen, {c.name: c for c in children}


def _torchrun(nnodes: int, rank: int, nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={rank}",
            "--rdzv-backend=static", f"--rdzv-endpoint={ENDPOINT}", f"--nproc-per-node={nproc}",
            f"--max-restarts={REPLICA_MAX_RESTARTS}", "-m", "generator_service"]  # fmt: skip


def _parses_back(child: Child, launcher_len: int, gen: GeneratorConfig) -> None:
    """The generator's flags after the launcher are its config, as on one node."""
    gen_args = generator_cli.build_parser().parse_args(child.argv[launcher_len:])
    assert generator_cli.config_from_args(gen_args) == gen


# ----------------------------------------------------------------------------- the argv
def test_node_0_runs_torchrun_with_a_static_rendezvous_and_serves_the_port(tmp_path: Path) -> None:
    args, gen, children = _children(tmp_path, *TWO_NODES, "--node-rank", "0", "--nproc", "2", "--port", "50061")
    generator = children["generator"]
    launcher = _torchrun(2, 0, 2)
    assert generator.argv[: len(launcher)] == launcher
    assert "--standalone" not in generator.argv and "--nnodes=1" not in generator.argv
    _parses_back(generator, len(launcher), gen)
    assert generator.ready is None and generator.health_target == "127.0.0.1:50061"  # gRPC health on --port
    assert generator.leader is replica_leader  # stopped through rank 0, here
    assert "--devices=cpu,cpu" in children["plancache sidecar"].argv  # one slab per local rank
    text = banner(args, gen, tmp_path / "ck", tmp_path)
    assert "generator on 127.0.0.1:50061" in text and "grpcurl" in text
    assert "node 0 of 2" in text and ENDPOINT in text


def test_node_1_runs_torchrun_without_a_public_server(tmp_path: Path) -> None:
    args, gen, children = _children(tmp_path, *TWO_NODES, "--node-rank", "1", "--nproc", "2")
    generator = children["generator"]
    launcher = _torchrun(2, 1, 2)
    assert generator.argv[: len(launcher)] == launcher
    assert "--standalone" not in generator.argv
    _parses_back(generator, len(launcher), gen)
    assert generator.ready is wait_running  # no gRPC health on --port: nothing serves it on this node
    assert generator.leader is agent_group
    assert "--devices=cpu,cpu" in children["plancache sidecar"].argv
    text = banner(args, gen, tmp_path / "ck", tmp_path)
    assert "node 1 of 2" in text and ENDPOINT in text and "rank 0" in text
    assert gen.sidecar == f"unix:{tmp_path / 'plancache.sock'}" and gen.sidecar in text
    assert "grpcurl" not in text


def test_one_rank_per_node_still_runs_torchrun(tmp_path: Path) -> None:
    for rank in (0, 1):
        _, gen, children = _children(tmp_path, "--nnodes", "3", "--rdzv-endpoint", ENDPOINT, "--node-rank", str(rank))
        launcher = _torchrun(3, rank, 1)
        assert children["generator"].argv[: len(launcher)] == launcher
        sidecar = children["plancache sidecar"]
        assert not any(a.startswith("--devices") for a in sidecar.argv)  # one slab, on --device
        assert isinstance(sidecar.config, SidecarConfig)
        assert (sidecar.config.cache.device, sidecar.config.cache.devices) == (gen.device, "")


def test_resident_node_1_banner_names_no_sidecar(tmp_path: Path) -> None:
    args, gen, children = _children(tmp_path, *TWO_NODES, "--node-rank", "1", "--adaln-mode", "resident")
    assert list(children) == ["generator"] and gen.sidecar == ""
    assert "no sidecar" in banner(args, gen, tmp_path / "ck", tmp_path)


def test_one_node_is_unchanged(tmp_path: Path) -> None:
    _, _, children = _children(tmp_path, "--nproc", "2")
    assert children["generator"].argv[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                              "--nnodes=1"]  # fmt: skip
    assert children["generator"].leader is replica_leader and children["generator"].ready is None
    _, _, children = _children(tmp_path)
    assert children["generator"].argv[:3] == [sys.executable, "-m", "generator_service"]
    assert children["generator"].leader is None and children["generator"].ready is None


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--nnodes", "0"), r"--nnodes must be at least 1, got 0"),
        ((*TWO_NODES, "--node-rank", "2"), r"--node-rank must be in \[0, 2\) for --nnodes 2, got 2"),
        ((*TWO_NODES, "--node-rank", "-1"), r"--node-rank must be in \[0, 2\) for --nnodes 2, got -1"),
        (("--node-rank", "1"), r"--node-rank must be in \[0, 1\) for --nnodes 1, got 1"),
        (("--nnodes", "2"), r"--rdzv-endpoint HOST:PORT is required with --nnodes 2"),
        (("--rdzv-endpoint", ENDPOINT), r"--rdzv-endpoint is for a replica across nodes .* with --nnodes 1"),
        (("--nnodes", "2", "--rdzv-endpoint", "10.0.0.1"), r"--rdzv-endpoint must be HOST:PORT with PORT in \[1,"),
        (("--nnodes", "2", "--rdzv-endpoint", "h:0"), r"--rdzv-endpoint must be HOST:PORT with PORT in \[1,"),
        ((*TWO_NODES, "--node-rank", "1", "--openai-port", "8080"), r"--openai-port .*--node-rank 1"),
    ],
)
def test_bad_node_flags_are_refused_naming_the_flag(tmp_path: Path, argv: tuple[str, ...], message: str) -> None:
    args = _serve_args("--run-dir", str(tmp_path / "run"), "--checkpoint", str(tmp_path / "ck"), *argv)
    with pytest.raises(ValueError, match=message):
        child_configs(args, tmp_path, tmp_path / "ck")
    with pytest.raises(UsageError, match=message):  # `serve` exits 2 before it writes or starts anything
        prepare(args)


def test_node_0_may_serve_the_openai_facade(tmp_path: Path) -> None:
    _, _, children = _children(tmp_path, *TWO_NODES, "--openai-port", "8080")
    assert "openai-api" in children


# ----------------------------------------------------------------------------- node K > 0's generator, started
@pytest.mark.processes
def test_node_1_generator_is_up_without_a_grpc_health_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for torchrun's agent (it sleeps) is up after about a second though nothing serves --port, and
    stopping it signals its process group."""

    def no_health(*args: object, **kwargs: object) -> None:
        pytest.fail("node 1's generator was health-checked over gRPC")

    monkeypatch.setattr(supervise, "wait_healthy", no_health)
    _, _, children = _children(tmp_path, *TWO_NODES, "--node-rank", "1", "--port", "1")
    generator = children["generator"]
    generator.argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    started = time.monotonic()
    generator.start(timeout_s=30)
    try:
        assert 0.9 <= time.monotonic() - started < 10
        assert generator.proc is not None and generator.proc.poll() is None
    finally:
        generator.stop(grace_s=10)
    assert generator.proc.returncode == -signal.SIGTERM

    generator.argv = [sys.executable, "-c", "raise SystemExit(3)"]  # an agent that exits at once did not start
    with pytest.raises(RuntimeError, match=r"generator failed to start \(process exited with code 3"):
        generator.start(timeout_s=30)


@pytest.mark.processes
def test_serve_help_lists_the_node_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ditserve", "serve", "--help"], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    for flag in ("--nnodes", "--node-rank", "--rdzv-endpoint"):
        assert flag in out, flag


# ----------------------------------------------------------------------------- a TCP sidecar (--sidecar-listen)
SIDECAR_AT = "127.0.0.1:50052"


def _pems(d: Path) -> tuple[str, ...]:
    """--sidecar-tls-ca/-cert/-key naming placeholder PEM files (the argv tests connect nowhere)."""
    flags: list[str] = []
    for name in ("ca", "cert", "key"):
        path = d / f"{name}.pem"
        path.write_text(f"-----BEGIN {name.upper()}-----\n-----END {name.upper()}-----\n")
        flags += [f"--sidecar-tls-{name}", str(path)]
    return tuple(flags)


def _no_token_on_argv(children: dict[str, Child]) -> None:
    for child in children.values():
        assert not any(TOKEN in a for a in child.argv), child.name


def test_sidecar_listen_puts_the_sidecar_on_tcp_with_mutual_tls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1 of 2: the sidecar listens on --sidecar-listen with --tls-cert/--tls-key/--tls-client-ca (the one pair,
    the CA), and gets the generator's token in its environment; the generator names --sidecar-advertise and presents
    the same pair. Both argvs parse back to their configs (in the children's environment)."""
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    pems = _pems(tmp_path)
    ca, cert, key = pems[1], pems[3], pems[5]
    advertise = "node1.example:50052"
    args, gen, children = _children(tmp_path, *TWO_NODES, "--node-rank", "1", "--sidecar-listen", "0.0.0.0:50052",
                                    "--sidecar-advertise", advertise, *pems, "--admin-token", TOKEN)  # fmt: skip
    sidecar, generator = children["plancache sidecar"], children["generator"]
    assert "--listen=0.0.0.0:50052" in sidecar.argv
    assert not any(a.startswith("--socket") for a in sidecar.argv)
    for flag, value in (("--tls-cert", cert), ("--tls-key", key), ("--tls-client-ca", ca)):
        assert f"{flag}={value}" in sidecar.argv, flag
    assert isinstance(sidecar.config, SidecarConfig) and sidecar.config.tcp
    assert (sidecar.config.tls_cert, sidecar.config.tls_key, sidecar.config.tls_client_ca) == tuple(
        map(Path, (cert, key, ca))
    )
    assert sidecar.health_target == advertise and sidecar.credentials is not None  # mutual TLS, as rank 0 reaches it
    assert gen.sidecar == advertise and f"--sidecar={advertise}" in generator.argv
    assert (gen.sidecar_tls_ca, gen.sidecar_tls_cert, gen.sidecar_tls_key) == tuple(map(Path, (ca, cert, key)))
    for flag in ("--sidecar-tls-ca", "--sidecar-tls-cert", "--sidecar-tls-key"):
        assert any(a.startswith(flag) for a in generator.argv), flag
    assert sidecar.env is not None and sidecar.env[ADMIN_TOKEN_ENV] == TOKEN  # the generator's token, same way
    assert generator.env is not None and generator.env[ADMIN_TOKEN_ENV] == TOKEN
    _no_token_on_argv(children)

    monkeypatch.setenv(ADMIN_TOKEN_ENV, TOKEN)  # as each child starts: the token in its environment
    side_args = plancache_cli.build_parser().parse_args(sidecar.argv[3:])
    assert plancache_cli.config_from_args(side_args) == sidecar.config
    _parses_back(generator, len(_torchrun(2, 1, 1)), gen)
    text = banner(args, gen, tmp_path / "ck", tmp_path)
    assert "TCP 0.0.0.0:50052 (mutual TLS)" in text and advertise in text


def test_sidecar_advertise_defaults_to_sidecar_listen(tmp_path: Path) -> None:
    _, gen, children = _children(tmp_path, *TWO_NODES, "--sidecar-listen", SIDECAR_AT, *_pems(tmp_path))
    assert gen.sidecar == SIDECAR_AT and children["plancache sidecar"].health_target == SIDECAR_AT
    assert f"--sidecar={SIDECAR_AT}" in children["generator"].argv


def test_tcp_sidecar_gets_the_admin_token_file_by_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    _, _, children = _children(tmp_path, "--sidecar-listen", SIDECAR_AT, *_pems(tmp_path),
                               "--admin-token-file", str(token_file))  # fmt: skip
    for child in children.values():
        argv = " ".join(child.argv)
        assert "--admin-token-file" in argv and str(token_file) in argv, child.name
        assert child.env is not None and ADMIN_TOKEN_ENV not in child.env, child.name
    _no_token_on_argv(children)


def test_unix_sidecar_still_gets_no_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    _, _, children = _children(tmp_path, "--admin-token", TOKEN)
    sidecar = children["plancache sidecar"]
    assert sidecar.env is not None and ADMIN_TOKEN_ENV not in sidecar.env
    assert any(a.startswith("--socket=") for a in sidecar.argv) and sidecar.credentials is None
    assert not any(a.startswith(("--tls", "--admin-token")) for a in sidecar.argv)
    _no_token_on_argv(children)


def test_node_0_presents_the_tls_pair_to_other_nodes_without_a_tcp_sidecar_of_its_own(tmp_path: Path) -> None:
    _, gen, children = _children(tmp_path, *TWO_NODES, *_pems(tmp_path))
    assert gen.sidecar.startswith("unix:") and gen.sidecar_tls_ca is not None
    assert any(a.startswith("--sidecar-tls-ca") for a in children["generator"].argv)
    sidecar = children["plancache sidecar"]
    assert any(a.startswith("--socket=") for a in sidecar.argv) and not any(a.startswith("--tls") for a in sidecar.argv)


def test_tcp_sidecar_without_an_admin_token_is_warned_about(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It starts (SidecarConfig allows it: its weight updates are refused), and serve says so before any start."""
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    args, gen, _ = _children(tmp_path, "--sidecar-listen", SIDECAR_AT, *_pems(tmp_path))
    [warning] = [w for w in warnings(args, gen) if "--sidecar-listen" in w]
    assert "refuses weight updates" in warning and ADMIN_TOKEN_ENV in warning
    args, gen, _ = _children(tmp_path, "--sidecar-listen", SIDECAR_AT, *_pems(tmp_path), "--admin-token", TOKEN)
    assert not [w for w in warnings(args, gen) if "--sidecar-listen" in w]


TLS = ("--sidecar-tls-ca", "/nonexistent/ca.pem", "--sidecar-tls-cert", "/nonexistent/c.pem",
       "--sidecar-tls-key", "/nonexistent/k.pem")  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--sidecar-listen", SIDECAR_AT), r"--sidecar-listen 127.0.0.1:50052 \(TCP\) needs mutual TLS: "
         r"--sidecar-tls-ca, --sidecar-tls-cert and --sidecar-tls-key are required \(--sidecar-tls-ca, "
         r"--sidecar-tls-cert, --sidecar-tls-key missing\)"),
        (("--sidecar-listen", SIDECAR_AT, *TLS[:2]), r"\(--sidecar-tls-cert, --sidecar-tls-key missing\)"),
        (("--sidecar-listen", "0.0.0.0:50052", *TLS), r"--sidecar-listen 0.0.0.0:50052 binds every interface: give "
         r"--sidecar-advertise HOST:PORT"),
        (("--sidecar-listen", "[::]:50052", *TLS), r"binds every interface: give --sidecar-advertise"),
        (("--sidecar-listen", "0.0.0.0:50052", "--sidecar-advertise", "0.0.0.0:50052", *TLS),
         r"--sidecar-advertise must be an address rank 0 can reach"),
        (("--sidecar-listen", SIDECAR_AT, "--sidecar-advertise", "node1", *TLS),
         r"--sidecar-advertise must be HOST:PORT"),
        (("--sidecar-listen", "127.0.0.1", *TLS), r"--sidecar-listen must be HOST:PORT with PORT in \[1, 65535\]"),
        (("--sidecar-advertise", SIDECAR_AT), r"--sidecar-advertise 127.0.0.1:50052 .* needs --sidecar-listen"),
        (("--sidecar-listen", SIDECAR_AT, *TLS, "--adaln-mode", "resident"), r"--sidecar-listen .*resident mode"),
        ((*TWO_NODES, "--node-rank", "1", *TLS[:2]), r"--sidecar-tls-ca: apply to TCP sidecars: this node's "
         r"\(--sidecar-listen HOST:PORT\)"),
        (TLS, r"--sidecar-tls-ca, --sidecar-tls-cert, --sidecar-tls-key: apply to TCP sidecars"),
        ((*TWO_NODES, *TLS[:2]), r"a TCP sidecar of another node needs mutual TLS"),  # node 0: all three
    ],
)  # fmt: skip
def test_bad_sidecar_listen_flags_are_refused_naming_the_flags(
    tmp_path: Path, argv: tuple[str, ...], message: str
) -> None:
    args = _serve_args("--run-dir", str(tmp_path / "run"), "--checkpoint", str(tmp_path / "ck"), *argv)
    with pytest.raises(ValueError, match=message):
        child_configs(args, tmp_path, tmp_path / "ck")
    with pytest.raises(UsageError, match=message):
        prepare(args)


def test_an_unreadable_sidecar_tls_file_is_refused_before_any_start(tmp_path: Path) -> None:
    args = _serve_args("--run-dir", str(tmp_path / "run"), "--checkpoint", str(tmp_path / "ck"),
                       "--sidecar-listen", SIDECAR_AT, *TLS)  # fmt: skip
    with pytest.raises(UsageError, match=r"--sidecar-tls-\w+ /nonexistent/\w+\.pem: cannot read"):
        prepare(args)


# ----------------------------------------------------------------------------- a real start over TCP + mutual TLS
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _one_pair(d: Path) -> tuple[Path, Path, Path]:
    """A CA, and one certificate it signed for 127.0.0.1 / localhost, valid for server and client auth."""
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=ca", "-addext",
             "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)  # fmt: skip
    (d / "node.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "node.key",
             "-out", "node.csr", "-subj", "/CN=node", cwd=d)  # fmt: skip
    _openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
             "node.pem", "-days", "2", "-extfile", "node.ext", cwd=d)  # fmt: skip
    return d / "ca.pem", d / "node.pem", d / "node.key"


def _children_of(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += map(int, (task / "children").read_text().split())
    return out


def _mtls_serving(target: str, ca: Path, cert: Path, key: Path) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    creds = mutual_tls_channel_credentials(ca, cert, key, "--sidecar-tls")
    with grpc.secure_channel(target, creds) as ch, contextlib.suppress(grpc.RpcError):
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        return bool(status == health_pb2.HealthCheckResponse.SERVING)
    return False


@pytest.mark.processes
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_serve_with_a_tcp_sidecar_serves_and_generates(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --sidecar-listen 127.0.0.1:P` with one pair: the sidecar is SERVING over mutual TLS (serve's own check
    passed), the generator attached to it over TCP, `ditserve generate` works, and the token is in the sidecar's
    environment, not its argv; SIGTERM stops it cleanly."""
    workdir = short_tmpdir()
    group = ProcessGroup(workdir)
    try:
        ca, cert, key = _one_pair(workdir)
        monkeypatch.setenv(ADMIN_TOKEN_ENV, TOKEN)
        side_at, port = f"127.0.0.1:{free_port()}", free_port()
        serve = group.start("serve", [
            sys.executable, "-m", "ditserve", "serve", "--run-dir", str(workdir / "run"), "--checkpoint",
            str(tiny_ckpt), "--device", "cpu", "--no-metrics", "--port", str(port), "--gpu-plans", "16",
            "--host-cache-gb", "0.01", "--sidecar-listen", side_at, "--sidecar-tls-ca", str(ca),
            "--sidecar-tls-cert", str(cert), "--sidecar-tls-key", str(key),
        ])  # fmt: skip
        target = f"127.0.0.1:{port}"
        group.wait_healthy(target, serve, timeout=240)
        assert _mtls_serving(side_at, ca, cert, key)
        assert serve.proc is not None
        [sidecar] = [
            p for p in _children_of(serve.proc.pid) if b"plancache_service" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        assert TOKEN.encode() not in Path(f"/proc/{sidecar}/cmdline").read_bytes()
        assert f"{ADMIN_TOKEN_ENV}={TOKEN}".encode() in Path(f"/proc/{sidecar}/environ").read_bytes().split(b"\0")
        assert f"--listen={side_at}".encode() in Path(f"/proc/{sidecar}/cmdline").read_bytes().split(b"\0")

        res = subprocess.run(
            [sys.executable, "-m", "ditserve", "generate", "--target", target, "--prompt", "a red fox",
             "--num-inference-steps", "2", "--height", "32", "--width", "32", "--num-frames", "124",
             "--out", str(workdir / "fox.safetensors"), "--progress", "off"],
            capture_output=True, text=True, timeout=300, env=service_env(),
        )  # fmt: skip
        assert res.returncode == 0, res.stderr + group.logs()
        assert json.loads(res.stdout.strip().splitlines()[-1])["sha256"]
        assert health_status(target) is not None

        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(60) == 0, group.logs()
        assert "ditserve stopped" in serve.log()
        wait_for(lambda: not _mtls_serving(side_at, ca, cert, key), 10, "the sidecar to stop")
    finally:
        group.close()
        shutil.rmtree(workdir, ignore_errors=True)
