"""The Jobs API against a real in-process generator (resident, the tiny preset): truthful progress, idempotency,
content (latents and MP4) equal to synchronous Generate's, cancel, delete, paging, backpressure, retention and the
error codes. Restart and kill -9 are tests/test_jobs_e2e.py's (real processes)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import safetensors.torch
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from jobskit import QUICK, jobs_server, jobs_stub
from servicekit import error_info, wait_for

from generator_service.serving.server import GeneratorServer
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

LONG = {"prompt": "a slow fox", "num_inference_steps": 400}
"""A job that runs long enough to be caught running (cancelled before its end)."""


@pytest.fixture(scope="module")
def server(svc_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeneratorServer]:
    with jobs_server(svc_ckpt, tmp_path_factory.mktemp("jobs"), jobs={"max_queued_jobs": 3}) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server: GeneratorServer) -> Iterator[pb_grpc.JobsStub]:
    channel, stub = jobs_stub(f"127.0.0.1:{server.port}")
    with channel:
        yield stub


def _create(stub: pb_grpc.JobsStub, key: str = "", **fields: Any) -> pb.Job:
    return stub.CreateJob(pb.CreateJobRequest(request=pb.GenerateRequest(**fields), idempotency_key=key)).job


def _wait_final(stub: pb_grpc.JobsStub, job_id: str) -> tuple[pb.Job, list[pb.Job]]:
    seen = [w.job for w in stub.WatchJob(pb.WatchJobRequest(job_id=job_id), timeout=120)]
    return seen[-1], seen


def _content(stub: pb_grpc.JobsStub, job_id: str, offset: int = 0) -> tuple[pb.ContentHeader, bytes]:
    messages = list(stub.GetJobContent(pb.GetJobContentRequest(job_id=job_id, offset=offset), timeout=60))
    assert messages[0].HasField("header") and all(m.HasField("chunk") for m in messages[1:])
    offsets = [m.chunk.offset for m in messages[1:]]
    data = b"".join(m.chunk.data for m in messages[1:])
    assert offsets == sorted(offsets) and (not offsets or offsets[0] == offset)
    return messages[0].header, data


def _code(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def test_mp4_job_progress_is_truthful_and_its_content_is_generates(server: GeneratorServer, stub: Any) -> None:
    req = {**QUICK, "output_type": pb.OUTPUT_TYPE_MP4, "seed": 7}
    job = _create(stub, **req)
    assert job.state == pb.JOB_STATE_QUEUED and job.HasField("queue_position") and job.attempts == 0
    final, seen = _wait_final(stub, job.job_id)
    states = [w.state for w in seen]
    assert states[-1] == pb.JOB_STATE_SUCCEEDED and states.count(pb.JOB_STATE_SUCCEEDED) == 1
    # never running before queued, never queued after running; progress only moves forward
    first_running = states.index(pb.JOB_STATE_RUNNING)
    assert all(s == pb.JOB_STATE_QUEUED for s in states[:first_running])
    assert all(s != pb.JOB_STATE_QUEUED for s in states[first_running:])
    done = [w.progress.steps_done for w in seen]
    assert done == sorted(done) and done[-1] == final.progress.steps_total == QUICK["num_inference_steps"] - 1
    assert all(not w.HasField("queue_position") for w in seen[first_running:])
    stages = [w.progress.stage for w in seen if w.state == pb.JOB_STATE_RUNNING]
    assert stages == sorted(stages) and pb.JOB_STAGE_DECODING in stages and pb.JOB_STAGE_MUXING in stages
    assert final.attempts == 1 and final.started_at.ToNanoseconds() <= final.finished_at.ToNanoseconds()
    header, data = _content(stub, job.job_id)
    c = final.result.content
    assert header.content == c and c.content_type == "video/mp4" and c.available and len(data) == c.total_bytes
    assert hashlib.sha256(data).hexdigest() == c.sha256
    sync = pb_grpc.GeneratorStub(grpc.insecure_channel(f"127.0.0.1:{server.port}")).Generate(
        pb.GenerateRequest(**req), timeout=120
    )
    assert sync.media.sha256 == c.sha256 and sync.sha256 == final.result.sha256
    half = c.total_bytes // 2  # a resumed download
    header2, rest = _content(stub, job.job_id, offset=half)
    assert header2.offset == half and data[:half] + rest == data
    assert _content(stub, job.job_id, offset=c.total_bytes)[1] == b""
    err = _code(lambda: _content(stub, job.job_id, offset=c.total_bytes + 1))
    assert err.code() == grpc.StatusCode.OUT_OF_RANGE and "offset" in (err.details() or "")


def test_latents_job_content_is_a_safetensors_file_of_generates_latents(server: GeneratorServer, stub: Any) -> None:
    final, _ = _wait_final(stub, _create(stub, **QUICK, seed=3).job_id)
    header, data = _content(stub, final.job_id)
    assert header.content.content_type == "application/octet-stream"
    assert header.content.filename.endswith(".safetensors")
    tensors = safetensors.torch.load(data)
    sync = pb_grpc.GeneratorStub(grpc.insecure_channel(f"127.0.0.1:{server.port}")).Generate(
        pb.GenerateRequest(**QUICK, seed=3), timeout=120
    )
    assert sync.sha256 == final.result.sha256
    for t in sync.tensors:
        want = torch.frombuffer(bytearray(t.data), dtype=getattr(torch, t.dtype)).reshape(tuple(t.shape))
        assert torch.equal(tensors[t.name], want)


def test_idempotent_retry_returns_the_same_job_and_a_reused_key_is_refused(stub: Any) -> None:
    first = stub.CreateJob(pb.CreateJobRequest(request=pb.GenerateRequest(**QUICK, seed=11), idempotency_key="k-1"))
    again = stub.CreateJob(pb.CreateJobRequest(request=pb.GenerateRequest(**QUICK, seed=11), idempotency_key="k-1"))
    assert first.created and not again.created and again.job.job_id == first.job.job_id
    err = _code(lambda: _create(stub, "k-1", **QUICK, seed=12))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "idempotency_key" in (err.details() or "")
    info = error_info(err)
    assert info is not None and info.reason == "IDEMPOTENCY_KEY_REUSED"
    bad = _code(lambda: _create(stub, "\x01bad", **QUICK))
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "idempotency_key" in (bad.details() or "")
    _wait_final(stub, first.job.job_id)


def test_cancel_running_stops_within_a_step_and_the_next_job_runs(server: GeneratorServer, stub: Any) -> None:
    long = _create(stub, **LONG)
    after = _create(stub, **QUICK, seed=21)
    queued = _create(stub, **QUICK, seed=22)
    wait_for(lambda: stub.GetJob(pb.GetJobRequest(job_id=long.job_id)).job.progress.steps_done >= 2, 60, "steps")
    # a queued job is cancelled at once and never runs
    cancelled_queued = stub.CancelJob(pb.CancelJobRequest(job_id=queued.job_id)).job
    assert cancelled_queued.state == pb.JOB_STATE_CANCELLED and cancelled_queued.attempts == 0
    at_cancel = stub.GetJob(pb.GetJobRequest(job_id=long.job_id)).job.progress.steps_done
    answer = stub.CancelJob(pb.CancelJobRequest(job_id=long.job_id)).job
    assert answer.state in (pb.JOB_STATE_RUNNING, pb.JOB_STATE_CANCELLED)
    final, _ = _wait_final(stub, long.job_id)
    assert final.state == pb.JOB_STATE_CANCELLED and final.error.code == "CANCELLED"
    # CancelJob's answer is the job as it stood once the cancel was set: the step then in flight may finish, none after
    at_answer = answer.progress.steps_done
    assert at_cancel <= at_answer <= final.progress.steps_done <= at_answer + 1 < final.progress.steps_total
    assert not final.cancel_requested and not final.HasField("result")
    nxt, _ = _wait_final(stub, after.job_id)
    assert nxt.state == pb.JOB_STATE_SUCCEEDED
    assert stub.CancelJob(pb.CancelJobRequest(job_id=long.job_id)).job.state == pb.JOB_STATE_CANCELLED  # no-op
    err = _code(lambda: stub.CancelJob(pb.CancelJobRequest(job_id=nxt.job_id)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "succeeded" in (err.details() or "")
    err = _code(lambda: _content(stub, long.job_id))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_delete_of_a_running_job_cancels_it_and_the_record_goes_once_it_stopped(
    server: GeneratorServer, stub: Any
) -> None:
    long = _create(stub, **LONG, seed=31)
    wait_for(lambda: stub.GetJob(pb.GetJobRequest(job_id=long.job_id)).job.state == pb.JOB_STATE_RUNNING, 60, "run")
    stub.DeleteJob(pb.DeleteJobRequest(job_id=long.job_id))  # deleted: false while it stops (true if it already had)
    err = _code(lambda: stub.GetJob(pb.GetJobRequest(job_id=long.job_id)))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    wait_for(lambda: server.jobs.store.get_any(long.job_id) is None, 60, "the record to go once the job stopped")
    done, _ = _wait_final(stub, _create(stub, **QUICK, seed=32).job_id)
    assert done.state == pb.JOB_STATE_SUCCEEDED
    assert stub.DeleteJob(pb.DeleteJobRequest(job_id=done.job_id)).deleted
    assert _code(lambda: _content(stub, done.job_id)).code() == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: stub.DeleteJob(pb.DeleteJobRequest(job_id=done.job_id))).code() == grpc.StatusCode.NOT_FOUND


def test_list_pages_filters_and_refuses_a_foreign_token(stub: Any) -> None:
    ids = [_create(stub, **QUICK, seed=40 + i).job_id for i in range(3)]
    for job_id in ids:
        _wait_final(stub, job_id)
    pages, token = [], ""
    while True:
        resp = stub.ListJobs(pb.ListJobsRequest(page_size=2, page_token=token, states=[pb.JOB_STATE_SUCCEEDED]))
        pages.append([j.job_id for j in resp.jobs])
        assert all(j.state == pb.JOB_STATE_SUCCEEDED for j in resp.jobs) and len(resp.jobs) <= 2
        token = resp.next_page_token
        if not token:
            break
    listed = [i for p in pages for i in p]
    assert len(listed) == len(set(listed)) and listed[:3] == ids[::-1]  # newest first, no repeats
    oldest = stub.ListJobs(pb.ListJobsRequest(page_size=1000, oldest_first=True)).jobs
    assert [j.job_id for j in oldest if j.job_id in ids] == ids
    first = stub.ListJobs(pb.ListJobsRequest(page_size=1))
    err = _code(
        lambda: stub.ListJobs(pb.ListJobsRequest(page_size=1, page_token=first.next_page_token, oldest_first=True))
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in (err.details() or "")
    for bad, field in ((pb.ListJobsRequest(page_size=5000), "page_size"), (pb.ListJobsRequest(states=[0]), "states"),
                       (pb.ListJobsRequest(page_token="%%%"), "page_token")):  # fmt: skip
        err = _code(lambda bad=bad: stub.ListJobs(bad))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in (err.details() or "")


def test_bad_requests_are_refused_before_anything_is_stored(server: GeneratorServer, stub: Any) -> None:
    before = server.jobs.store.counts_by_state()
    err = _code(lambda: _create(stub, prompt="a fox", num_frames=125))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_frames" in (err.details() or "")
    err = _code(lambda: stub.CreateJob(pb.CreateJobRequest()))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "request" in (err.details() or "")
    calls = [
        lambda: stub.GetJob(pb.GetJobRequest(job_id="nope")),
        lambda: list(stub.WatchJob(pb.WatchJobRequest(job_id="nope"))),
        lambda: stub.CancelJob(pb.CancelJobRequest(job_id="nope")),
        lambda: stub.DeleteJob(pb.DeleteJobRequest(job_id="nope")),
        lambda: list(stub.GetJobContent(pb.GetJobContentRequest(job_id="nope"))),
    ]
    for i, call in enumerate(calls):
        err = _code(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "job_id" in (err.details() or ""), i
    err = _code(lambda: stub.GetJob(pb.GetJobRequest(job_id="job_" + "0" * 32)))
    assert err.code() == grpc.StatusCode.NOT_FOUND and error_info(err).reason == "JOB_NOT_FOUND"  # type: ignore[union-attr]
    assert server.jobs.store.counts_by_state() == before


def test_a_full_job_queue_is_refused_with_retry_info(server: GeneratorServer, stub: Any) -> None:
    long = _create(stub, **LONG, seed=51)
    wait_for(lambda: stub.GetJob(pb.GetJobRequest(job_id=long.job_id)).job.state == pb.JOB_STATE_RUNNING, 60, "run")
    waiting = [_create(stub, **QUICK, seed=52 + i) for i in range(3)]  # --max-queued-jobs 3
    err = _code(lambda: _create(stub, **QUICK, seed=60))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queued-jobs" in (err.details() or "")
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    retry, quota = error_details_pb2.RetryInfo(), error_details_pb2.QuotaFailure()
    assert any(d.Unpack(retry) for d in status.details) and retry.retry_delay.ToNanoseconds() >= 10**9
    assert any(d.Unpack(quota) for d in status.details) and quota.violations[0].subject == "--max-queued-jobs"
    positions = [stub.GetJob(pb.GetJobRequest(job_id=j.job_id)).job.queue_position for j in waiting]
    assert positions == [0, 1, 2]
    for j in (*waiting, long):
        stub.CancelJob(pb.CancelJobRequest(job_id=j.job_id))
    assert _wait_final(stub, long.job_id)[0].state == pb.JOB_STATE_CANCELLED


def test_retention_removes_old_jobs_and_oldest_content_but_never_content_being_read(
    svc_ckpt: Path, tmp_path: Path
) -> None:
    jobs = {"results_max_bytes": 300_000, "job_ttl_s": 3600.0}  # one tiny MP4 is ~195 kB
    with jobs_server(svc_ckpt, tmp_path / "state", jobs=jobs) as srv:
        channel, stub = jobs_stub(f"127.0.0.1:{srv.port}")
        a = _wait_final(stub, _create(stub, **QUICK, seed=71, output_type=pb.OUTPUT_TYPE_MP4).job_id)[0]
        b = _wait_final(stub, _create(stub, **QUICK, seed=72, output_type=pb.OUTPUT_TYPE_MP4).job_id)[0]
        with srv.jobs.content(a.job_id, 0) as (_, chunks):  # what GetJobContent holds while it streams A
            first = next(chunks)
            srv.jobs.retention()  # over the limit: the oldest content not being read goes, so B's, not A's
            assert stub.GetJob(pb.GetJobRequest(job_id=a.job_id)).job.result.content.available
            rest = first + b"".join(chunks)
        assert hashlib.sha256(rest).hexdigest() == a.result.content.sha256
        gone = stub.GetJob(pb.GetJobRequest(job_id=b.job_id)).job
        assert not gone.result.content.available and gone.state == pb.JOB_STATE_SUCCEEDED  # the record stays
        err = _code(lambda: _content(stub, b.job_id))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "retention" in (err.details() or "")
        c = _wait_final(stub, _create(stub, **QUICK, seed=73, output_type=pb.OUTPUT_TYPE_MP4).job_id)[0]
        srv.jobs.retention()  # A (oldest, no longer read) goes for C
        assert not stub.GetJob(pb.GetJobRequest(job_id=a.job_id)).job.result.content.available
        assert stub.GetJob(pb.GetJobRequest(job_id=c.job_id)).job.result.content.available
        srv.jobs._clock = lambda: time.time() + 7200  # two hours on: past --job-ttl 1 h
        srv.jobs.retention()
        for j in (a, b, c):
            assert _code(lambda j=j: stub.GetJob(pb.GetJobRequest(job_id=j.job_id))).code() == grpc.StatusCode.NOT_FOUND
        assert srv.jobs.results.total_bytes() == 0
        channel.close()


def test_jobs_metrics_count_states(server: GeneratorServer) -> None:
    from prometheus_client import generate_latest

    text = generate_latest(server.metrics.registry).decode()
    assert 'ditserve_generator_jobs{state="succeeded"}' in text
    assert "ditserve_generator_job_queue_wait_seconds_count" in text
    assert 'ditserve_generator_job_run_seconds_count{state="succeeded"}' in text


def test_an_embedded_store_is_one_generators_at_a_time(svc_ckpt: Path, tmp_path: Path) -> None:
    from ditruntime.paths import DirectoryFlagError

    with (
        jobs_server(svc_ckpt, tmp_path / "state"),
        pytest.raises(DirectoryFlagError, match=r"--state-dir .* is in use by pid \d+"),
        jobs_server(svc_ckpt, tmp_path / "state"),
    ):
        pass
    with jobs_server(svc_ckpt, tmp_path / "state") as again:  # released at stop
        assert again.jobs.store.counts_by_state()["queued"] == 0


def test_two_replicas_on_one_postgresql_store_never_run_a_job_twice(
    svc_ckpt: Path, tmp_path: Path, pg_url: str
) -> None:
    """Two generators share a real PostgreSQL store and one results directory: every job runs exactly once, on one
    of them, and either replica serves any job's record and content."""
    from pgkit import reset_database

    reset_database(pg_url)
    shared = {"job_store": pg_url, "results_dir": tmp_path / "results"}
    with (
        jobs_server(svc_ckpt, tmp_path / "a", jobs={**shared, "replica_id": "replica-a"}) as a,
        jobs_server(svc_ckpt, tmp_path / "b", jobs={**shared, "replica_id": "replica-b"}) as b,
    ):
        ca, sa_ = jobs_stub(f"127.0.0.1:{a.port}")
        cb, sb = jobs_stub(f"127.0.0.1:{b.port}")
        ids = [_create(sa_ if i % 2 else sb, **QUICK, seed=80 + i).job_id for i in range(6)]
        finals = [_wait_final(sb, job_id)[0] for job_id in ids]
        assert all(f.state == pb.JOB_STATE_SUCCEEDED and f.attempts == 1 for f in finals)
        assert {f.replica for f in finals} <= {"replica-a", "replica-b"}

        def runs() -> float:  # observed just after the record lands: a reader of the record may be first
            return sum(srv.metrics.registry.get_sample_value("ditserve_generator_job_run_seconds_count",
                                                             {"state": "succeeded"}) or 0 for srv in (a, b))  # fmt: skip

        wait_for(lambda: runs() >= len(ids), 30, "every run observed")
        assert runs() == len(ids)  # each job ran once, on one replica
        header, data = _content(sa_, finals[0].job_id)  # content of a job either replica ran, from replica A
        assert hashlib.sha256(data).hexdigest() == header.content.sha256 == finals[0].result.content.sha256
        ca.close()
        cb.close()
