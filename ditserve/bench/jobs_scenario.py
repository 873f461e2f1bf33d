"""Scenario 12: the cost of a job against a synchronous Generate of the same request (docs/performance.md).

A job is stored before CreateJob answers, claimed by the dispatcher, its progress and result written by the
recorder, its content stored as a file and then downloaded: the ratio is (CreateJob, WatchJob to its final state,
GetJobContent) over Generate's own round trip, medians of interleaved runs on one cached pair, plans warm."""

from __future__ import annotations

import statistics
import time
from typing import Any

import grpc

from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

from ..client_requests import request_to_proto
from .context import BenchContext
from .harness import Arm

JOB_OVERHEAD_TARGET = 1.25
"""Job / Generate at the quick preset's ~1 s requests; the fixed cost (a few store writes, one file) vanishes at the
released size's minutes."""


def _sync_s(gen: pb_grpc.GeneratorStub, req: pb.GenerateRequest) -> tuple[float, str]:
    t0 = time.perf_counter()
    resp = gen.Generate(req, timeout=1800)
    return time.perf_counter() - t0, resp.media.sha256


def _job_s(jobs: pb_grpc.JobsStub, req: pb.GenerateRequest) -> tuple[float, str]:
    t0 = time.perf_counter()
    job = jobs.CreateJob(pb.CreateJobRequest(request=req), timeout=60).job
    final = job
    while final.state not in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED):
        # a watch ends at the server's --watch-max-s: watch again
        final = [w.job for w in jobs.WatchJob(pb.WatchJobRequest(job_id=job.job_id), timeout=1800)][-1]
    size = sum(len(m.chunk.data) for m in jobs.GetJobContent(pb.GetJobContentRequest(job_id=job.job_id)))
    elapsed = time.perf_counter() - t0
    if final.state != pb.JOB_STATE_SUCCEEDED or size != final.result.content.total_bytes:
        raise RuntimeError(f"bench job {job.job_id} ended {pb.JobState.Name(final.state)}: {final.error.message}")
    return elapsed, final.result.content.sha256


def job_overhead(ctx: BenchContext) -> dict[str, Any]:
    req = request_to_proto({**ctx.request("A"), "output_type": "mp4"})
    with ctx.services(Arm("jobs", gpu_plans=2 * ctx.forwards + 8)) as svc, grpc.insecure_channel(svc.target) as ch:
        gen, jobs = pb_grpc.GeneratorStub(ch), pb_grpc.JobsStub(ch)
        _sync_s(gen, req)  # warm: plans built, the encoder's first call done
        sync, job, same = [], [], True
        for _ in range(max(3, ctx.repeats)):
            s, sha_sync = _sync_s(gen, req)
            j, sha_job = _job_s(jobs, req)
            sync.append(s)
            job.append(j)
            same = same and sha_sync == sha_job
    ratio = statistics.median(job) / statistics.median(sync)
    return {
        "ratio": round(ratio, 4), "target": f"job / Generate <= {JOB_OVERHEAD_TARGET}",
        "met": bool(ratio <= JOB_OVERHEAD_TARGET and same), "same_sha256": same,
        "generate_s": [round(x, 4) for x in sync], "job_s": [round(x, 4) for x in job],
    }  # fmt: skip
