"""The jobs core when its store or its claims misbehave, against a real in-process generator (resident, tiny
preset): a final write the store refuses for a while still lands (the job never stays "running"), and a claim that
lapsed while its own replica ran the job is renewed, not taken over by that replica (which would fail its own
running job as "already live")."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from jobskit import QUICK, jobs_server, jobs_stub
from servicekit import wait_for

from generator_service.errors import JobStoreUnavailableError
from generator_service.jobs import dispatch
from generator_service.jobs.results import ResultStore
from generator_service.jobs.retention import Retention, RetentionPolicy
from generator_service.jobs.store import JobStore
from protos.ditserve.generator.v1 import generator_pb2 as pb


def _final(stub: Any, job_id: str) -> pb.Job:
    return [w.job for w in stub.WatchJob(pb.WatchJobRequest(job_id=job_id), timeout=120)][-1]


def test_a_final_write_the_store_refuses_for_a_while_still_lands(
    svc_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusals = {"left": 3, "seen": 0}
    real_finish = JobStore.finish

    def flaky_finish(self: JobStore, *a: Any, **kw: Any) -> Any:
        if refusals["left"] > 0:
            refusals["left"] -= 1
            refusals["seen"] += 1
            raise JobStoreUnavailableError("the job store is unavailable (database is locked); retry shortly", 1.0)
        return real_finish(self, *a, **kw)

    monkeypatch.setattr(JobStore, "finish", flaky_finish)
    real_sleep = time.sleep
    monkeypatch.setattr(dispatch.time, "sleep", lambda s: real_sleep(min(s, 0.05)))  # the backoff, shortened
    with jobs_server(svc_ckpt, tmp_path / "state") as srv:
        channel, stub = jobs_stub(f"127.0.0.1:{srv.port}")
        with channel:
            job = stub.CreateJob(pb.CreateJobRequest(request=pb.GenerateRequest(**QUICK, seed=5))).job
            final = _final(stub, job.job_id)
            assert refusals["seen"] == 3
            assert final.state == pb.JOB_STATE_SUCCEEDED and final.result.content.available
            data = b"".join(m.chunk.data for m in stub.GetJobContent(pb.GetJobContentRequest(job_id=job.job_id)))
            assert len(data) == final.result.content.total_bytes


def test_a_lapsed_claim_is_renewed_not_taken_over_by_its_own_replica(
    svc_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica's claim (1 s) lapses while it runs the job (a renewal that came too late: a long retention pass,
    a clock step); the dispatcher's next claim must not take its own running job back (before the fix it did, and
    recorded it FAILED "already live" while it ran on)."""
    lapse = threading.Event()
    real_renew, real_sleep = JobStore.renew_claims, time.sleep

    def late_renew(self: JobStore, replica: str, lease_s: float, now: float) -> list[str]:
        if lapse.is_set():
            lapse.clear()
            real_sleep(2.5)  # no renewal this time, and longer than --job-claim-s: the claim lapses
            return []
        return real_renew(self, replica, lease_s, now)

    monkeypatch.setattr(JobStore, "renew_claims", late_renew)
    with jobs_server(svc_ckpt, tmp_path / "state", jobs={"job_claim_s": 1.0}) as srv:
        channel, stub = jobs_stub(f"127.0.0.1:{srv.port}")
        with channel:
            job = stub.CreateJob(pb.CreateJobRequest(request=pb.GenerateRequest(
                prompt="a slow fox", num_inference_steps=400, seed=6))).job  # fmt: skip
            wait_for(lambda: stub.GetJob(pb.GetJobRequest(job_id=job.job_id)).job.state == pb.JOB_STATE_RUNNING, 60,
                     "the job to run")  # fmt: skip
            lapse.set()
            wait_for(lambda: not lapse.is_set(), 30, "the late renewal")
            final = _final(stub, job.job_id)
            assert final.state == pb.JOB_STATE_SUCCEEDED, final.error
            assert final.attempts == 1 and final.replica == "test-replica"


def test_orphaned_result_files_never_make_results_full_and_go_after_the_grace(tmp_path: Path) -> None:
    """A result file no record names (a crash between writing and recording it) counted toward --results-max-gb:
    with an empty store CreateJob answered RESULTS_FULL forever. Now only named content counts, and the orphan goes
    once older than the grace period."""
    store = JobStore.open(f"sqlite:///{tmp_path / 'jobs.db'}")
    results = ResultStore(tmp_path / "results")
    orphan = results.put_bytes(b"x" * 1000, "video/mp4", "orphan.mp4")
    retention = Retention(store, results, RetentionPolicy(ttl_s=3600, max_bytes=100, orphan_grace_s=60), time.time,
                          lambda: None)  # fmt: skip
    retention.check_room(lambda: 1.0)  # no ResultsFullError: nothing a record names is stored
    retention.run()
    assert results.total_bytes() == 1000  # younger than the grace: it may be a result being recorded
    old = time.time() - 120
    os.utime(results.path(orphan.sha256), (old, old))
    retention.run()
    assert results.total_bytes() == 0
    store.close()
