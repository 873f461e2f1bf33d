"""The Jobs API's owners and idempotency, against a real in-process generator (resident, tiny preset): with keys and
an admin token configured, a caller without them is UNAUTHENTICATED, a client sees, cancels, deletes and downloads
only its own jobs (another's are NOT_FOUND, exactly as unknown ones), the admin sees all, idempotency keys are per
client and compared by the request's meaning, and a retry finds its job before any admission step."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from clikit import CliRunner
from jobskit import QUICK, jobs_server, jobs_stub, write_keys
from refmedia import image_bytes
from servicekit import wait_for

from ditcore import GenerationRequest
from ditruntime.auth import PlaintextAdminError
from ditserve.client_requests import request_to_proto
from ditserve.remote import api_key_metadata
from generator_service.serving.auth import JobsAuth
from generator_service.serving.server import GeneratorServer
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

ALICE, BOB, ADMIN = "alice-key-0123456789abcdef", "bob-key-0123456789abcdefgh", "admin-token-0123456789abcdef"
LONG = {"prompt": "a slow fox", "num_inference_steps": 400}
UPLOAD_TTL_S = 3.0


@pytest.fixture(scope="module")
def server(svc_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeneratorServer]:
    root = tmp_path_factory.mktemp("auth")
    keys = write_keys(root / "keys", {"alice": ALICE, "bob": BOB})
    with jobs_server(
        svc_ckpt, root / "state", client_keys_file=keys, admin_token=ADMIN, upload_ttl_s=UPLOAD_TTL_S
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server: GeneratorServer) -> Iterator[pb_grpc.JobsStub]:
    channel, stub = jobs_stub(f"127.0.0.1:{server.port}")
    with channel:
        yield stub


def as_(key: str | None) -> dict[str, Any]:
    return {"metadata": (("authorization", f"Bearer {key}"),)} if key else {}


def code_of(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def create(stub: pb_grpc.JobsStub, key: str | None, idem: str = "", **fields: Any) -> pb.CreateJobResponse:
    req = pb.CreateJobRequest(request=pb.GenerateRequest(**fields), idempotency_key=idem)
    return stub.CreateJob(req, **as_(key))


def test_no_or_unknown_credentials_are_unauthenticated(stub: pb_grpc.JobsStub) -> None:
    calls = {
        "CreateJob": lambda md: create(stub, md, **QUICK),
        "ListJobs": lambda md: stub.ListJobs(pb.ListJobsRequest(), **as_(md)),
        "GetJob": lambda md: stub.GetJob(pb.GetJobRequest(job_id="job_" + "0" * 32), **as_(md)),
        "CancelJob": lambda md: stub.CancelJob(pb.CancelJobRequest(job_id="job_" + "0" * 32), **as_(md)),
        "DeleteJob": lambda md: stub.DeleteJob(pb.DeleteJobRequest(job_id="job_" + "0" * 32), **as_(md)),
        "WatchJob": lambda md: list(stub.WatchJob(pb.WatchJobRequest(job_id="job_" + "0" * 32), **as_(md))),
        "GetJobContent": lambda md: list(
            stub.GetJobContent(pb.GetJobContentRequest(job_id="job_" + "0" * 32), **as_(md))
        ),
    }
    for name, call in calls.items():
        for md in (None, "not-a-key-of-this-server-at-all"):
            err = code_of(lambda call=call, md=md: call(md))  # type: ignore[misc]
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (name, md, err.details())
            assert "authorization" in (err.details() or "") and "not-a-key" not in (err.details() or "")


def test_a_client_sees_only_its_own_jobs_and_the_admin_sees_all(server: GeneratorServer, stub: Any) -> None:
    mine = create(stub, ALICE, **QUICK, seed=11, output_type=pb.OUTPUT_TYPE_LATENTS).job
    assert mine.owner == "alice"
    wait_for(lambda: stub.GetJob(pb.GetJobRequest(job_id=mine.job_id), **as_(ALICE)).job.state
             == pb.JOB_STATE_SUCCEEDED, 120, "alice's job")  # fmt: skip
    not_found = [
        lambda: stub.GetJob(pb.GetJobRequest(job_id=mine.job_id), **as_(BOB)),
        lambda: list(stub.WatchJob(pb.WatchJobRequest(job_id=mine.job_id), **as_(BOB))),
        lambda: list(stub.GetJobContent(pb.GetJobContentRequest(job_id=mine.job_id), **as_(BOB))),
        lambda: stub.CancelJob(pb.CancelJobRequest(job_id=mine.job_id), **as_(BOB)),
        lambda: stub.DeleteJob(pb.DeleteJobRequest(job_id=mine.job_id), **as_(BOB)),
    ]
    for call in not_found:
        err = code_of(call)
        assert err.code() == grpc.StatusCode.NOT_FOUND and "unknown, or deleted" in (err.details() or "")
    assert mine.job_id not in {j.job_id for j in stub.ListJobs(pb.ListJobsRequest(), **as_(BOB)).jobs}
    assert mine.job_id in {j.job_id for j in stub.ListJobs(pb.ListJobsRequest(), **as_(ALICE)).jobs}
    assert mine.job_id in {j.job_id for j in stub.ListJobs(pb.ListJobsRequest(), **as_(ADMIN)).jobs}
    data = b"".join(m.chunk.data for m in stub.GetJobContent(pb.GetJobContentRequest(job_id=mine.job_id),
                                                             **as_(ALICE)))  # fmt: skip
    assert len(data) == mine.result.content.total_bytes or len(data) > 0
    assert server.jobs.store.get(mine.job_id) is not None  # bob's delete changed nothing
    assert stub.DeleteJob(pb.DeleteJobRequest(job_id=mine.job_id), **as_(ADMIN)).deleted  # the admin may


def test_idempotency_keys_are_per_client(stub: pb_grpc.JobsStub) -> None:
    a = create(stub, ALICE, "shared-key", **QUICK, seed=21)
    b = create(stub, BOB, "shared-key", **QUICK, seed=22)  # another request under the same key: bob's own
    assert a.created and b.created and a.job.job_id != b.job.job_id
    again = create(stub, ALICE, "shared-key", **QUICK, seed=21)
    assert not again.created and again.job.job_id == a.job.job_id
    err = code_of(lambda: create(stub, ALICE, "shared-key", **QUICK, seed=99))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS and b.job.job_id not in (err.details() or "")


def test_a_request_means_the_same_with_defaults_left_unset_or_filled_in(stub: pb_grpc.JobsStub) -> None:
    """grpcurl leaves fields unset; `ditserve jobs create` fills every one in: one meaning, one job."""
    sparse = create(stub, ALICE, "meaning-key", prompt="a red fox", num_inference_steps=3)
    full = pb.CreateJobRequest(request=request_to_proto(GenerationRequest(prompt="a red fox", num_inference_steps=3,
                                                                          request_id="")), idempotency_key="meaning-key")  # fmt: skip
    assert full.request.HasField("seed") and full.request.HasField("height")
    again = stub.CreateJob(full, **as_(ALICE))
    assert sparse.created and not again.created and again.job.job_id == sparse.job.job_id


def test_an_empty_request_id_runs_as_the_job_id(stub: pb_grpc.JobsStub) -> None:
    job = create(stub, ALICE, **QUICK, seed=31).job
    assert job.spec.request_id == job.job_id


def test_a_retry_finds_its_job_after_its_upload_expired(server: GeneratorServer, stub: Any) -> None:
    gen = pb_grpc.GeneratorStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    png = image_bytes(64, 64, seed=3)
    up = gen.UploadReference(iter([pb.UploadReferenceRequest(chunk=png, kind=pb.REFERENCE_KIND_IMAGE)]))
    ref = pb.Reference(upload_id=up.upload_id, kind=pb.REFERENCE_KIND_IMAGE)
    fields = {**QUICK, "seed": 41, "references": [ref]}
    first = create(stub, ALICE, "upload-key", **fields)
    assert first.created

    def expired() -> bool:  # a new job naming it is refused once it expired ...
        try:
            create(stub, ALICE, "", **fields)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "upload_id" in (e.details() or "")
            return True
        return False

    wait_for(expired, UPLOAD_TTL_S * 10, "the upload to expire")
    retry = create(stub, ALICE, "upload-key", **fields)  # ... the retry gets its job back
    assert not retry.created and retry.job.job_id == first.job.job_id
    inline = pb.Reference(data=png, kind=pb.REFERENCE_KIND_IMAGE)  # the same file sent inline means the same
    same = create(stub, ALICE, "upload-key", **{**fields, "references": [inline]})
    assert not same.created and same.job.job_id == first.job.job_id


def test_cancel_and_delete_of_a_queued_job_end_it_at_once(stub: pb_grpc.JobsStub) -> None:
    long = create(stub, BOB, **LONG, seed=51).job
    queued = [create(stub, BOB, **QUICK, seed=52 + i).job for i in range(2)]
    cancelled = stub.CancelJob(pb.CancelJobRequest(job_id=queued[0].job_id), **as_(BOB)).job
    assert cancelled.state == pb.JOB_STATE_CANCELLED and not cancelled.cancel_requested
    assert stub.DeleteJob(pb.DeleteJobRequest(job_id=queued[1].job_id), **as_(BOB)).deleted
    err = code_of(lambda: stub.GetJob(pb.GetJobRequest(job_id=queued[1].job_id), **as_(BOB)))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    stub.CancelJob(pb.CancelJobRequest(job_id=long.job_id), **as_(BOB))


def test_the_jobs_cli_sends_its_key(
    server: GeneratorServer, run_cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("DITSERVE_API_KEY", "DITSERVE_ADMIN_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    t = f"--target=127.0.0.1:{server.port}"
    refused = run_cli(["jobs", "list", t])
    assert refused.code == 1 and "UNAUTHENTICATED" in refused.err
    key_file = tmp_path / "bob.key"
    key_file.write_text(BOB + "\n")
    os.chmod(key_file, 0o600)
    made = run_cli(["jobs", "create", t, "--prompt", "a red fox", "--num-inference-steps", "3", "--api-key-file",
                    key_file])  # fmt: skip
    assert made.code == 0, made.err
    job = made.json_lines()[0]
    assert job["owner"] == "bob"
    monkeypatch.setenv("DITSERVE_API_KEY", ALICE)  # alice does not see it
    assert job["job_id"] not in [j["job_id"] for j in run_cli(["jobs", "list", t]).json_lines()]
    monkeypatch.delenv("DITSERVE_API_KEY")
    monkeypatch.setenv("DITSERVE_ADMIN_TOKEN", ADMIN)  # the admin does
    assert job["job_id"] in [j["job_id"] for j in run_cli(["jobs", "list", t, "--limit", "100"]).json_lines()]
    os.chmod(key_file, 0o644)
    loose = run_cli(["jobs", "list", t, "--api-key-file", key_file])
    assert loose.code == 2 and "--api-key-file" in loose.err


class _Context:
    """What JobsAuth reads of a call: its metadata, its peer and its TLS identity."""

    def __init__(self, peer: str, token: str | None) -> None:
        self._peer, self._token = peer, token

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self._token}"),) if self._token else ()

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}


def test_the_admin_token_never_crosses_a_network_in_cleartext() -> None:
    plain = JobsAuth({ALICE: "alice"}, ADMIN)
    assert plain.caller(_Context("ipv4:127.0.0.1:5000", ADMIN)).admin  # type: ignore[arg-type]
    with pytest.raises(PlaintextAdminError):
        plain.caller(_Context("ipv4:10.0.0.5:5000", ADMIN))  # type: ignore[arg-type]
    assert plain.caller(_Context("ipv4:10.0.0.5:5000", ALICE)).name == "alice"  # a client key: its own jobs only
    tls = JobsAuth({}, ADMIN, tls=True)
    assert tls.caller(_Context("ipv4:10.0.0.5:5000", ADMIN)).admin  # type: ignore[arg-type]


def test_the_cli_sends_the_admin_token_only_over_tls_or_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DITSERVE_API_KEY", raising=False)
    monkeypatch.setenv("DITSERVE_ADMIN_TOKEN", ADMIN)

    def sent(target: str, tls_ca: str | None = None) -> tuple[tuple[str, str], ...]:
        return api_key_metadata(argparse.Namespace(target=target, tls_ca=tls_ca, tls_cert=None, api_key_file=None))

    assert sent("127.0.0.1:50051") == (("authorization", f"Bearer {ADMIN}"),)
    assert sent("gpu-7.example.com:50051") == ()  # the server says UNAUTHENTICATED: nothing crossed in cleartext
    assert sent("gpu-7.example.com:50051", tls_ca="/ca.pem") == (("authorization", f"Bearer {ADMIN}"),)
