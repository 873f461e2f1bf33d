"""The sidecar authenticates its peer (issue 12, item 2).

Unix socket (the default, no configuration): the peer's SO_PEERCRED uid must be the sidecar's;
a call that reaches the gRPC server some other way is refused; the session's peer pid is known.
TCP (`--listen`): only with mutual TLS (refused at start otherwise, naming the flags); a client
without a certificate the client CA signed is refused; the weight-update RPCs also need the
admin token, and a refused one changes nothing. A generator with client certificates and the
token works end to end over TCP. Certificates are made here with the `openssl` CLI.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from servicekit import (
    REQ_SHORT,
    SERVING,
    TOKEN,
    Pair,
    Weights,
    error_info,
    gen_request,
    ref_sha,
    short_tmpdir,
    wait_for,
)

from ditruntime.peercred import PeerCred, PeerRefusedError, check_peer, peer_cred
from generator_service import cli as generator_cli
from generator_service.app import build_server as build_generator
from generator_service.config import GeneratorConfig
from generator_service.serving.server import GeneratorServer
from plancache_service import cli as plancache_cli
from plancache_service.app import build_server as build_sidecar
from plancache_service.config import CacheConfig, SidecarConfig
from plancache_service.server import SidecarServer
from protos.ditserve.generator.v1 import generator_pb2 as gen_pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as gen_grpc
from protos.ditserve.plancache.v1 import plancache_pb2 as pb
from protos.ditserve.plancache.v1 import plancache_pb2_grpc as pb_grpc

pytestmark = pytest.mark.processes  # openssl makes the certificates

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
SMALL_CACHE = CacheConfig(gpu_plans=16, host_cache_bytes=0)
FRESH = [("grpc.use_local_subchannel_pool", 1)]
"""Channel option: its own connection (grpc otherwise shares one between channels to one target)."""


# ----------------------------------------------------------------------------- certificates
@dataclasses.dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    """A client certificate signed by another CA."""
    rogue_key: Path


def _openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True)


def _make_ca(d: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip


def _make_leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI")
    d = tmp_path_factory.mktemp("pki")
    _make_ca(d, "ca")
    _make_ca(d, "rogue-ca")
    _make_leaf(d, "sidecar", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _make_leaf(d, "generator", "ca", "extendedKeyUsage=clientAuth\n")
    _make_leaf(d, "rogue", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    return Pki(
        d / "ca.pem", d / "sidecar.pem", d / "sidecar.key", d / "generator.pem", d / "generator.key",
        d / "rogue.pem", d / "rogue.key",
    )  # fmt: skip


def _tls(pki: Pki, admin_token: str = TOKEN) -> dict[str, object]:
    return {
        "tls_cert": pki.server_cert, "tls_key": pki.server_key, "tls_client_ca": pki.ca, "admin_token": admin_token,
    }  # fmt: skip


def _channel(port: int, pki: Pki, cert: Path | None = None, key: Path | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )
    return grpc.secure_channel(f"127.0.0.1:{port}", creds, options=FRESH)


def _started(cfg: SidecarConfig) -> SidecarServer:
    server = build_sidecar(cfg)
    server.start()
    return server


@pytest.fixture
def tcp_sidecar(weights: Weights, pki: Pki) -> Iterator[SidecarServer]:
    """A sidecar serving A over TCP with mutual TLS and the admin token."""
    server = _started(SidecarConfig(weights.a, SMALL_CACHE, "127.0.0.1:0", heartbeat_s=0.5, **_tls(pki)))  # type: ignore[arg-type]
    yield server
    server.stop(grace_s=1)


@pytest.fixture
def unix_sidecar(svc_ckpt: Path) -> Iterator[SidecarServer]:
    """A sidecar on its unix socket, configured with nothing but the socket."""
    d = short_tmpdir()
    server = _started(SidecarConfig(svc_ckpt, SMALL_CACHE, f"unix:{d / 'pc.sock'}"))
    yield server
    server.stop(grace_s=1)
    shutil.rmtree(d, ignore_errors=True)


def _code(call: object) -> tuple[grpc.StatusCode, str]:
    """(status code, ErrorInfo reason) of a call expected to fail."""
    with pytest.raises(grpc.RpcError) as exc:
        call()  # type: ignore[operator]
    err = exc.value
    info = error_info(err)  # type: ignore[arg-type]
    return err.code(), info.reason if info is not None else ""  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- TCP
@needs_openssl
def test_tcp_client_without_a_certificate_is_refused(tcp_sidecar: SidecarServer, pki: Pki) -> None:
    port = tcp_sidecar.port
    refused = [
        grpc.insecure_channel(f"127.0.0.1:{port}", options=FRESH),  # no TLS at all
        _channel(port, pki),  # TLS, no client certificate
        _channel(port, pki, pki.rogue_cert, pki.rogue_key),  # a certificate another CA signed
    ]
    for ch in refused:
        with ch:
            code, _ = _code(lambda ch=ch: pb_grpc.PlanCacheStub(ch).GetState(pb.GetStateRequest(), timeout=5))
            assert code == grpc.StatusCode.UNAVAILABLE
            attach = pb_grpc.PlanCacheStub(ch).Attach(pb.AttachRequest(client_name="intruder"), timeout=5)
            assert _code(lambda attach=attach: next(attach))[0] == grpc.StatusCode.UNAVAILABLE
    assert tcp_sidecar.sidecar.state().session is None  # nobody attached
    with _channel(port, pki, pki.client_cert, pki.client_key) as ch:
        assert pb_grpc.PlanCacheStub(ch).GetState(pb.GetStateRequest(), timeout=5).generation == 1


@needs_openssl
def test_weight_updates_over_tcp_need_the_admin_token(tcp_sidecar: SidecarServer, pki: Pki, weights: Weights) -> None:
    with _channel(tcp_sidecar.port, pki, pki.client_cert, pki.client_key) as ch:
        stub = pb_grpc.PlanCacheStub(ch)
        before = stub.GetState(pb.GetStateRequest(), timeout=5)
        assert before.generation == 1 and Path(before.weights_path) == weights.a
        prepare = pb.PrepareWeightUpdateRequest(from_generation=1, weights_path=str(weights.b))
        commit = pb.CommitWeightUpdateRequest(from_generation=1, weights_path=str(weights.b))
        abort = pb.AbortWeightUpdateRequest(weights_path=str(weights.b))
        none: tuple[tuple[str, str], ...] = ()
        wrong = (("authorization", "Bearer not-the-token"),)
        basic = (("authorization", f"Basic {TOKEN}"),)
        for metadata, expected in [
            (none, (grpc.StatusCode.UNAUTHENTICATED, "MISSING_TOKEN")),
            (wrong, (grpc.StatusCode.PERMISSION_DENIED, "BAD_TOKEN")),
            (basic, (grpc.StatusCode.PERMISSION_DENIED, "BAD_TOKEN")),
        ]:
            for method, req in [
                (stub.PrepareWeightUpdate, prepare),
                (stub.CommitWeightUpdate, commit),
                (stub.AbortWeightUpdate, abort),
            ]:
                got = _code(lambda m=method, r=req, md=metadata: m(r, metadata=md, timeout=30))
                assert got == expected, (method, metadata)
            after = stub.GetState(pb.GetStateRequest(), timeout=5)
            assert (after.generation, after.weights_path, after.pending_weights_path) == (
                before.generation, before.weights_path, "",
            )  # fmt: skip
            assert after.fingerprint == before.fingerprint
        # the token is the only thing missing: with it, the same calls go through
        good = (("authorization", f"Bearer {TOKEN}"),)
        stub.PrepareWeightUpdate(prepare, metadata=good, timeout=60)
        assert stub.CommitWeightUpdate(commit, metadata=good, timeout=60).generation == 2


@needs_openssl
def test_tcp_sidecar_without_a_token_refuses_every_update(svc_ckpt: Path, pki: Pki) -> None:
    server = _started(SidecarConfig(svc_ckpt, SMALL_CACHE, "127.0.0.1:0", **_tls(pki, admin_token="")))  # type: ignore[arg-type]
    try:
        with _channel(server.port, pki, pki.client_cert, pki.client_key) as ch:
            stub = pb_grpc.PlanCacheStub(ch)
            req = pb.PrepareWeightUpdateRequest(from_generation=1, weights_path=str(svc_ckpt))
            got = _code(lambda: stub.PrepareWeightUpdate(req, metadata=(("authorization", "Bearer x"),), timeout=30))
            assert got == (grpc.StatusCode.PERMISSION_DENIED, "UPDATES_DISABLED")
            assert stub.GetState(pb.GetStateRequest(), timeout=5).generation == 1
    finally:
        server.stop(grace_s=1)


def test_listen_without_tls_flags_refuses_to_start(svc_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert plancache_cli.main(["--checkpoint", str(svc_ckpt), "--listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert "--listen 127.0.0.1:0 (TCP) needs mutual TLS" in err
    for name in ("--tls-cert", "--tls-key", "--tls-client-ca"):
        assert name in err
    # one of three is not enough; the message names what is missing
    argv = ["--checkpoint", str(svc_ckpt), "--listen", "127.0.0.1:0", "--tls-cert", "c.pem"]
    assert plancache_cli.main(argv) == 2
    assert "--tls-key, --tls-client-ca missing" in capsys.readouterr().err
    # TLS flags on the unix socket are a mistake, not silently ignored
    with pytest.raises(ValueError, match="--tls-cert: TLS applies only with --listen"):
        SidecarConfig(svc_ckpt, SMALL_CACHE, "unix:/tmp/x.sock", tls_cert=Path("c.pem"))


def test_unreadable_tls_file_is_refused_naming_its_flag(
    svc_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "not-pem").write_text("hello")
    argv = ["--checkpoint", str(svc_ckpt), "--listen", "127.0.0.1:0", "--tls-cert", str(tmp_path / "missing.pem")]
    argv += ["--tls-key", str(tmp_path / "not-pem"), "--tls-client-ca", str(tmp_path / "not-pem")]
    assert plancache_cli.main(argv) == 2
    assert "--tls-key " in capsys.readouterr().err  # the key is read first: not a PEM file


def test_generator_with_a_tcp_sidecar_needs_client_tls(capsys: pytest.CaptureFixture[str]) -> None:
    assert generator_cli.main(["--sidecar", "127.0.0.1:50052"]) == 2
    err = capsys.readouterr().err
    for name in ("--sidecar-tls-ca", "--sidecar-tls-cert", "--sidecar-tls-key"):
        assert name in err
    # with a unix --sidecar they are rank 0's for the other nodes' TCP sidecars (a replica across nodes): all three
    with pytest.raises(ValueError, match=r"a TCP sidecar of another node needs mutual TLS.*--sidecar-tls-cert"):
        GeneratorConfig(sidecar="unix:/tmp/x.sock", sidecar_tls_ca=Path("ca.pem"))
    with pytest.raises(ValueError, match=r"--sidecar-tls-ca: apply only in cached mode"):
        GeneratorConfig(adaln_mode="resident", checkpoint=Path("/c"), sidecar_tls_ca=Path("ca.pem"))


@needs_openssl
def test_generator_over_tcp_with_client_certificates_and_token(
    tcp_sidecar: SidecarServer, pki: Pki, weights: Weights
) -> None:
    cfg = GeneratorConfig(
        sidecar=f"127.0.0.1:{tcp_sidecar.port}", listen="127.0.0.1:0", reconnect_s=0.2,
        sidecar_tls_ca=pki.ca, sidecar_tls_cert=pki.client_cert, sidecar_tls_key=pki.client_key,
        admin_token=TOKEN, weights_root=weights.root,
    )  # fmt: skip
    gen: GeneratorServer = build_generator(cfg)
    gen.start()
    try:
        wait_for(lambda: gen.state.serving, 60, "the generator to attach over TCP")
        assert tcp_sidecar.sidecar.state().session is not None
        assert tcp_sidecar.servicer.session_peers == {}  # no kernel credentials over TCP
        with grpc.insecure_channel(f"127.0.0.1:{gen.port}") as ch:
            stub = gen_grpc.GeneratorStub(ch)
            res = stub.Generate(gen_request(REQ_SHORT, "tcp-a"), timeout=120)
            assert (res.generation, res.sha256) == (1, ref_sha(weights.a, REQ_SHORT))
            assert res.cache.built_plans > 0  # plans came from the sidecar
            # the generator presents the admin token to the sidecar's weight-update RPCs
            up = stub.UpdateWeights(
                gen_pb.UpdateWeightsRequest(weights_path="B", request_id="tcp-upd"),
                metadata=(("authorization", f"Bearer {TOKEN}"),),
                timeout=120,
            )
            assert up.generation == 2
            assert tcp_sidecar.sidecar.state().generation == 2
    finally:
        gen.stop(grace_s=1)


# ----------------------------------------------------------------------------- unix socket
def test_unix_socket_needs_no_configuration_and_knows_the_peer(svc_ckpt: Path) -> None:
    with Pair(svc_ckpt) as pair:  # no TLS, no token: the default
        pair.start()
        assert pair.sidecar_health() == SERVING
        res = pair.generate(REQ_SHORT, "unix-1")
        assert res.sha256 == ref_sha(svc_ckpt, REQ_SHORT)
        session = pair.sidecar.sidecar.state().session
        assert session is not None
        peer = pair.sidecar.session_peer(session.session_id)
        assert peer == PeerCred(os.getpid(), os.getuid(), os.getgid())  # the generator runs in this process
        assert pair.sidecar.relay.refused == 0


def test_peer_of_another_uid_is_refused(unix_sidecar: SidecarServer, monkeypatch: pytest.MonkeyPatch) -> None:
    relay = unix_sidecar.relay
    assert relay is not None
    target = unix_sidecar.address
    with grpc.insecure_channel(target) as ch:
        assert pb_grpc.PlanCacheStub(ch).GetState(pb.GetStateRequest(), timeout=5).generation == 1
    # tests run as root: pretend the connecting process runs as another user
    real = peer_cred
    monkeypatch.setattr("ditruntime.peercred.peer_cred", lambda s: dataclasses.replace(real(s), uid=os.getuid() + 1000))
    with grpc.insecure_channel(target, options=FRESH) as ch:  # a new connection, not a shared one
        code, _ = _code(lambda: pb_grpc.PlanCacheStub(ch).GetState(pb.GetStateRequest(), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE
        attach = pb_grpc.PlanCacheStub(ch).Attach(pb.AttachRequest(client_name="other-user"), timeout=5)
        assert _code(lambda: next(attach))[0] == grpc.StatusCode.UNAVAILABLE
    assert relay.refused >= 1
    assert unix_sidecar.sidecar.state().session is None
    monkeypatch.undo()
    with grpc.insecure_channel(target, options=FRESH) as ch:  # the same user still gets in
        assert pb_grpc.PlanCacheStub(ch).GetState(pb.GetStateRequest(), timeout=5).generation == 1


def test_check_peer_compares_uids() -> None:
    check_peer(PeerCred(pid=10, uid=1000, gid=1000), 1000)
    with pytest.raises(PeerRefusedError, match="peer pid 10 runs as uid 1001; only uid 1000"):
        check_peer(PeerCred(pid=10, uid=1001, gid=1000), 1000)


def test_call_that_bypasses_the_checked_socket_is_refused(unix_sidecar: SidecarServer) -> None:
    relay = unix_sidecar.relay
    assert relay is not None
    assert oct(relay.backend.parent.stat().st_mode & 0o777) == "0o700"  # the private socket's directory
    with grpc.insecure_channel(relay.backend_address, options=FRESH) as ch:
        stub = pb_grpc.PlanCacheStub(ch)
        assert _code(lambda: stub.GetState(pb.GetStateRequest(), timeout=5)) == (
            grpc.StatusCode.PERMISSION_DENIED, "PEER_REFUSED",
        )  # fmt: skip
        req = pb.PrepareWeightUpdateRequest(from_generation=1, weights_path="/tmp")
        assert _code(lambda: stub.PrepareWeightUpdate(req, timeout=5))[0] == grpc.StatusCode.PERMISSION_DENIED


def test_relay_adds_little_latency(unix_sidecar: SidecarServer) -> None:
    """GetState through the relay: a generous bound (shared CI CPUs); the median is printed."""
    with grpc.insecure_channel(unix_sidecar.address) as ch:
        stub = pb_grpc.PlanCacheStub(ch)
        stub.GetState(pb.GetStateRequest(), timeout=5)
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            stub.GetState(pb.GetStateRequest(), timeout=5)
            times.append(time.perf_counter() - t0)
    median = sorted(times)[len(times) // 2]
    print(f"GetState through the relay: median {median * 1e3:.3f} ms")
    assert median < 0.05


def test_private_socket_dir_is_ours_and_removed_at_stop(svc_ckpt: Path) -> None:
    d = short_tmpdir()
    try:
        server = _started(SidecarConfig(svc_ckpt, SMALL_CACHE, f"unix:{d / 'pc.sock'}"))
        relay = server.relay
        assert relay is not None and relay.backend.parent == d / ".pc.sock.d"
        server.stop(grace_s=1)
        assert sorted(p.name for p in d.iterdir()) == []  # public socket, private dir: gone
        if os.getuid() == 0:  # a private dir another user planted is refused, not used
            (d / ".pc.sock.d").mkdir(mode=0o700)
            os.chown(d / ".pc.sock.d", 12345, 12345)
            with pytest.raises(OSError, match="not a directory of this user's"):
                build_sidecar(SidecarConfig(svc_ckpt, SMALL_CACHE, f"unix:{d / 'pc.sock'}"))
    finally:
        shutil.rmtree(d, ignore_errors=True)
