"""Jobs survive restarts in cached mode, the default (issue 32, finding 1): one `ditserve serve` (sidecar and
generator as processes, its job store in --state-dir) whose supervisor restarts what a test kills.

- kill -9 of the generator while a job runs and five wait: every job succeeds once the generator is back;
- kill -9 of the sidecar while a job runs: its run ends UNAVAILABLE and the job waits for the sidecar, then succeeds;
- a job whose runs two generator deaths end (--job-max-attempts 2) fails ATTEMPTS_EXHAUSTED; the job behind it runs;
- SIGTERM of `serve` with jobs queued, then a start on the same run dir: every job succeeds (the queued ones run
  after the start; the running one is finished by the stop, which waits for it).

Every job's content is a safetensors file of the latents a synchronous Generate of its request gives.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import safetensors.torch
from servicekit import ProcessGroup, ServiceProcess, free_port, pid_alive, process_group, shm_files_of, wait_for

from ditcore.generation import latents_sha256
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.processes, pytest.mark.timeout(240)]

MAX_ATTEMPTS = 2
"""serve's --job-max-attempts: the second generator death that ends a job's run fails it."""
LONG = {"prompt": "a red fox", "num_inference_steps": 21, "height": 256, "width": 256}
"""20 forwards of ~0.1 s each on 256 x 256 (a few seconds on 2 cores): caught running, then killed."""
QUICK = {"prompt": "a red fox", "num_inference_steps": 3}
"""Two forwards on the default 32 x 32 canvas (~0.1 s)."""
FINAL = {pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED}
GENERATOR, SIDECAR = "generator_service", "plancache_service"
Stubs = tuple[pb_grpc.JobsStub, pb_grpc.GeneratorStub]


@dataclass
class Serve:
    """`ditserve serve` as a process of `group`; its children's logs are in `run_dir`."""

    group: ProcessGroup
    proc: ServiceProcess
    run_dir: Path
    target: str

    def child(self, module: str) -> int | None:
        """The pid of serve's live child running `python -m module` (None while there is none)."""
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                for pid in map(int, (task / "children").read_text().split()):
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if module.encode() in cmd and pid_alive(pid):
                        self.group.extra_pids.add(pid)
                        return pid
        return None

    def serving(self, timeout: float = 120) -> None:
        """Both children up: the sidecar SERVING, then the generator (attached to it)."""
        self.group.wait_healthy(f"unix:{self.run_dir / 'plancache.sock'}", self.proc, timeout)
        self.group.wait_healthy(self.target, self.proc, timeout)
        sidecar = wait_for(lambda: self.child(SIDECAR), 10, "the sidecar child")
        self.group.leaked_files |= shm_files_of(sidecar)  # what a kill -9 of it leaves, removed at teardown

    def kill9(self, module: str) -> None:
        """SIGKILL serve's `module` child; return once the supervisor's new one serves."""
        old = self.child(module)
        assert old is not None, f"serve runs no {module}\n{self.logs()}"
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: self.child(module) not in (None, old), 30, f"serve to restart {module}")
        self.serving()

    def logs(self) -> str:
        return "\n".join(f"----- {p.name} -----\n{p.read_text(errors='replace')[-20000:]}"
                         for p in sorted(self.run_dir.glob("*.log")))  # fmt: skip


@pytest.fixture(scope="module")
def serve(request: pytest.FixtureRequest, svc_ckpt: Path) -> Iterator[Serve]:
    """One `ditserve serve` for the module (a start costs seconds of imports); each test leaves it serving."""
    with process_group(request) as group:
        run_dir, port = group.workdir / "run", free_port()
        proc = group.start("serve", [
            sys.executable, "-m", "ditserve", "serve", "--run-dir", run_dir, "--state-dir", run_dir / "state",
            "--port", port, "--checkpoint", svc_ckpt, "--no-metrics", "--gpu-plans", "32", "--host-cache-gb", "0.01",
            "--replica-id", "e2e", "--job-max-attempts", MAX_ATTEMPTS,
        ])  # fmt: skip
        s = Serve(group, proc, run_dir, f"127.0.0.1:{port}")
        s.serving()
        yield s


@pytest.fixture
def stubs(serve: Serve, request: pytest.FixtureRequest) -> Iterator[Stubs]:
    """Jobs and Generator stubs on one channel that reconnects quickly after a restart; the children's logs are
    printed if the test failed."""
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.initial_reconnect_backoff_ms", 100),
               ("grpc.max_reconnect_backoff_ms", 500)]  # fmt: skip
    failed_before = request.session.testsfailed
    with grpc.insecure_channel(serve.target, options=options) as channel:
        yield pb_grpc.JobsStub(channel), pb_grpc.GeneratorStub(channel)
    if request.session.testsfailed > failed_before:
        sys.stderr.write(f"\n===== serve's children ({request.node.nodeid}) =====\n{serve.logs()}\n")


def _create(jobs: pb_grpc.JobsStub, request: dict[str, Any]) -> str:
    return str(jobs.CreateJob(pb.CreateJobRequest(request=pb.GenerateRequest(**request)), timeout=30).job.job_id)


def _running(jobs: pb_grpc.JobsStub, job_id: str, attempt: int) -> pb.Job:
    """Wait until the job's `attempt`-th run (recorded in the store: `attempts`) has finished a forward."""

    def check() -> pb.Job | None:
        job = jobs.GetJob(pb.GetJobRequest(job_id=job_id), timeout=5).job
        assert job.state not in FINAL, (pb.JobState.Name(job.state), job.error)
        ok = job.state == pb.JOB_STATE_RUNNING and job.attempts == attempt and job.progress.steps_done >= 1
        return job if ok else None

    return wait_for(check, 120, f"run {attempt} of {job_id}")


def _final(jobs: pb_grpc.JobsStub, ids: list[str], timeout: float = 180) -> list[pb.Job]:
    """Every job's record once all are final (the generator may be restarting meanwhile)."""

    def check() -> list[pb.Job] | None:
        got = [jobs.GetJob(pb.GetJobRequest(job_id=i), timeout=5).job for i in ids]
        return got if all(j.state in FINAL for j in got) else None

    return wait_for(check, timeout, "every job to end", interval=0.2)


def _outcomes(done: list[pb.Job]) -> list[tuple[str, str, str]]:
    return [(pb.JobState.Name(j.state), j.error.reason, j.error.message) for j in done]


def _assert_generates(stubs: Stubs, job: pb.Job, req: dict[str, Any]) -> None:
    """The job's content is the safetensors file of the latents a synchronous Generate of `req` gives now."""
    jobs, gen = stubs
    messages = list(jobs.GetJobContent(pb.GetJobContentRequest(job_id=job.job_id), timeout=60))
    header, data = messages[0].header, b"".join(m.chunk.data for m in messages[1:])
    assert hashlib.sha256(data).hexdigest() == header.content.sha256 == job.result.content.sha256
    tensors = safetensors.torch.load(data)
    sync = gen.Generate(pb.GenerateRequest(**req), timeout=120)
    assert latents_sha256(tensors["video"], tensors["audio"]) == sync.sha256 == job.result.sha256, job.job_id


def test_jobs_survive_kill9_of_the_generator(serve: Serve, stubs: Stubs) -> None:
    jobs, _ = stubs
    reqs = [{**LONG, "seed": 101}] + [{**QUICK, "seed": 102 + i} for i in range(5)]
    ids = [_create(jobs, r) for r in reqs]
    _running(jobs, ids[0], attempt=1)
    serve.kill9(GENERATOR)
    done = _final(jobs, ids)
    assert all(j.state == pb.JOB_STATE_SUCCEEDED for j in done), _outcomes(done)
    assert [j.attempts for j in done] == [2, 1, 1, 1, 1, 1]  # the killed one ran again, the queued ones once
    for job, req in zip(done, reqs, strict=True):
        _assert_generates(stubs, job, req)


def test_jobs_survive_kill9_of_the_sidecar(serve: Serve, stubs: Stubs) -> None:
    jobs, _ = stubs
    reqs = [{**LONG, "seed": 201}] + [{**QUICK, "seed": 202 + i} for i in range(3)]
    ids = [_create(jobs, r) for r in reqs]
    _running(jobs, ids[0], attempt=1)
    serve.kill9(SIDECAR)
    done = _final(jobs, ids)
    assert all(j.state == pb.JOB_STATE_SUCCEEDED and not j.error.reason for j in done), _outcomes(done)
    assert done[0].attempts == 2  # its run ended with the sidecar; the job waited for it and ran again
    for job, req in zip(done, reqs, strict=True):
        _assert_generates(stubs, job, req)


def test_a_crash_looping_job_fails_attempts_exhausted_and_the_next_runs(serve: Serve, stubs: Stubs) -> None:
    jobs, _ = stubs
    reqs = [{**LONG, "seed": 401}, {**QUICK, "seed": 402}]
    crashing, behind = [_create(jobs, r) for r in reqs]
    for attempt in range(1, MAX_ATTEMPTS + 1):
        _running(jobs, crashing, attempt)
        serve.kill9(GENERATOR)
    failed, succeeded = _final(jobs, [crashing, behind])
    assert failed.state == pb.JOB_STATE_FAILED, _outcomes([failed])
    assert (failed.error.code, failed.error.reason, failed.attempts) == ("ABORTED", "ATTEMPTS_EXHAUSTED", 2)
    assert succeeded.state == pb.JOB_STATE_SUCCEEDED and succeeded.attempts == 1, _outcomes([succeeded])
    _assert_generates(stubs, succeeded, reqs[1])


def test_jobs_survive_a_sigterm_stop_and_start_of_serve(serve: Serve, stubs: Stubs) -> None:
    jobs, _ = stubs
    reqs = [{**LONG, "seed": 301}] + [{**QUICK, "seed": 302 + i} for i in range(4)]
    ids = [_create(jobs, r) for r in reqs]
    _running(jobs, ids[0], attempt=1)
    children = {serve.child(GENERATOR), serve.child(SIDECAR)}
    serve.proc.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert serve.proc.wait_exit(60) == 0, serve.logs()
    assert not any(pid_alive(p) for p in children if p is not None)
    restarted = time.time()
    serve.proc.start()  # the same run dir and --state-dir
    serve.serving()
    done = _final(jobs, ids)
    assert all(j.state == pb.JOB_STATE_SUCCEEDED for j in done), _outcomes(done)
    assert all(j.started_at.ToNanoseconds() >= restarted * 1e9 for j in done[1:])  # queued at the stop: ran after
    for job, req in zip(done, reqs, strict=True):
        _assert_generates(stubs, job, req)
