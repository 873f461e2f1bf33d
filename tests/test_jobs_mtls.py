"""The Jobs API's owners under mutual TLS: with --tls-client-ca and no keys, a client is its certificate's common name
(`tls:<CN>`), sees only its own jobs, and a bearer key it does not have is UNAUTHENTICATED. Certificates are made
here with the `openssl` CLI."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from jobskit import QUICK, jobs_server

from generator_service.serving.server import GeneratorServer
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.processes  # openssl makes the certificates


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _key_and_csr(d: Path, name: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=ca", "-addext",
             "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)  # fmt: skip
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
                      ("alice-svc", "extendedKeyUsage=clientAuth\n"), ("bob-svc", "extendedKeyUsage=clientAuth\n")):  # fmt: skip
        (d / f"{name}.ext").write_text(ext)
        _key_and_csr(d, name)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return d


@pytest.fixture(scope="module")
def server(svc_ckpt: Path, pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeneratorServer]:
    tls = {"tls_cert": pki / "server.pem", "tls_key": pki / "server.key", "tls_client_ca": pki / "ca.pem"}
    with jobs_server(svc_ckpt, tmp_path_factory.mktemp("mtls") / "state", **tls) as srv:
        yield srv


def _stub(server: GeneratorServer, pki: Path, who: str) -> pb_grpc.JobsStub:
    creds = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes(), (pki / f"{who}.key").read_bytes(),
                                         (pki / f"{who}.pem").read_bytes())  # fmt: skip
    channel = grpc.secure_channel(f"127.0.0.1:{server.port}", creds, options=[("grpc.use_local_subchannel_pool", 1)])
    return pb_grpc.JobsStub(channel)


def test_a_client_certificate_is_its_owner(server: GeneratorServer, pki: Path) -> None:
    alice, bob = _stub(server, pki, "alice-svc"), _stub(server, pki, "bob-svc")
    job = alice.CreateJob(pb.CreateJobRequest(request=pb.GenerateRequest(**QUICK, seed=61))).job
    assert job.owner == "tls:alice-svc"
    assert alice.GetJob(pb.GetJobRequest(job_id=job.job_id)).job.job_id == job.job_id
    with pytest.raises(grpc.RpcError) as err:
        bob.GetJob(pb.GetJobRequest(job_id=job.job_id))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert job.job_id not in {j.job_id for j in bob.ListJobs(pb.ListJobsRequest()).jobs}
    with pytest.raises(grpc.RpcError) as err:  # a bearer key wins over the certificate: an unknown one is refused
        alice.GetJob(pb.GetJobRequest(job_id=job.job_id), metadata=(("authorization", "Bearer nobody-has-this-1"),))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
