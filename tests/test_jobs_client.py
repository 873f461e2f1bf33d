"""ditserve.jobs_client against a real in-process gRPC Jobs server that ends its watches early, as the generator does
at --watch-max-s: `watch` opens the watch again until the job is final, and never repeats a record."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc

from ditserve.jobs_client import JobsClient
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

JOB = "job_" + "1" * 32


class BoundedWatches(pb_grpc.JobsServicer):
    """Each watch sends the job's record now, then its next one, and ends (a bound reached), until it is final."""

    def __init__(self) -> None:
        self.records = [
            pb.Job(job_id=JOB, state=pb.JOB_STATE_QUEUED),
            pb.Job(job_id=JOB, state=pb.JOB_STATE_RUNNING, progress=pb.JobProgress(steps_done=1, steps_total=3)),
            pb.Job(job_id=JOB, state=pb.JOB_STATE_RUNNING, progress=pb.JobProgress(steps_done=3, steps_total=3)),
            pb.Job(job_id=JOB, state=pb.JOB_STATE_SUCCEEDED),
        ]
        self.at = 0
        self.watches = 0

    def WatchJob(self, request: pb.WatchJobRequest, context: grpc.ServicerContext) -> Iterator[pb.WatchJobResponse]:
        self.watches += 1
        yield pb.WatchJobResponse(job=self.records[self.at])  # the record now (a repeat of the last one seen)
        if self.at + 1 < len(self.records):
            self.at += 1
            yield pb.WatchJobResponse(job=self.records[self.at])


def test_watch_opens_again_until_the_job_is_final() -> None:
    servicer = BoundedWatches()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_JobsServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with JobsClient(f"127.0.0.1:{port}") as client:
            seen = list(client.watch(JOB))
        assert seen == servicer.records  # each once, in order, to the final one
        assert servicer.watches == 3
    finally:
        server.stop(None)
