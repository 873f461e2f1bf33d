"""A typed Python client of the Jobs API (`ditserve.generator.v1.Jobs`): create, look up, list, watch, cancel,
delete, and download a job's content (resumable, checked against its size and sha256)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from ditcore import GenerationRequest
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

from .client import open_channel
from .client_requests import request_to_proto
from .client_results import IntegrityError


class JobsClient:
    def __init__(self, target: str, credentials: grpc.ChannelCredentials | None = None) -> None:
        self.channel = open_channel(target, credentials)
        self.stub = pb_grpc.JobsStub(self.channel)

    def __enter__(self) -> JobsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def create(
        self, request: GenerationRequest | Mapping[str, Any] | pb.GenerateRequest, idempotency_key: str = "",
        timeout: float = 60.0,
    ) -> tuple[pb.Job, bool]:  # fmt: skip
        msg = request if isinstance(request, pb.GenerateRequest) else request_to_proto(request)
        resp = self.stub.CreateJob(pb.CreateJobRequest(request=msg, idempotency_key=idempotency_key), timeout=timeout)
        return resp.job, resp.created

    def get(self, job_id: str, timeout: float = 30.0) -> pb.Job:
        return self.stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=timeout).job

    def list(
        self, states: Sequence[int] = (), page_size: int = 50, page_token: str = "", oldest_first: bool = False
    ) -> tuple[list[pb.Job], str]:
        req = pb.ListJobsRequest(page_size=page_size, page_token=page_token, oldest_first=oldest_first)
        req.states.extend(states)
        resp = self.stub.ListJobs(req, timeout=30.0)
        return list(resp.jobs), resp.next_page_token

    def iter_all(self, states: Sequence[int] = (), oldest_first: bool = False) -> Iterator[pb.Job]:
        token = ""
        while True:
            jobs, token = self.list(states, 100, token, oldest_first)
            yield from jobs
            if not token:
                return

    def watch(self, job_id: str) -> Iterator[pb.Job]:
        for resp in self.stub.WatchJob(pb.WatchJobRequest(job_id=job_id)):
            yield resp.job

    def cancel(self, job_id: str) -> pb.Job:
        return self.stub.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=30.0).job

    def delete(self, job_id: str) -> bool:
        return self.stub.DeleteJob(pb.DeleteJobRequest(job_id=job_id), timeout=30.0).deleted

    def content_iter(self, job_id: str, offset: int = 0) -> tuple[pb.ContentHeader, Iterator[bytes]]:
        stream = self.stub.GetJobContent(pb.GetJobContentRequest(job_id=job_id, offset=offset))
        first = next(stream)
        if not first.HasField("header"):
            stream.cancel()
            raise IntegrityError(f"job {job_id}: the content stream did not start with its header")
        return first.header, _chunks(job_id, stream, first.header)

    def download(self, job_id: str, dest: str | os.PathLike[str], resume: bool = True) -> tuple[Path, str]:
        """Write the content to `dest` (through `dest`.part, which a later call resumes from: from the part's size,
        or from where the server starts; a part longer than the content starts over); check its size and sha256
        against the header (IntegrityError, the part removed), then rename it into place."""
        dest = Path(dest)
        part = dest.with_name(dest.name + ".part")
        offset = part.stat().st_size if resume and part.exists() else 0
        try:
            header, chunks = self.content_iter(job_id, offset)
        except grpc.RpcError as e:
            if offset and e.code() == grpc.StatusCode.OUT_OF_RANGE:  # a stale partial file longer than the content
                return self.download(job_id, dest, resume=False)
            raise
        content = header.content
        if header.offset > offset:
            raise IntegrityError(f"job {job_id}: asked for the content from byte {offset}, got {header.offset}")
        with part.open("r+b" if header.offset else "wb") as f:  # from where the server starts (0: it ignored offset)
            f.truncate(header.offset)
            f.seek(header.offset)
            for data in chunks:
                f.write(data)
        digest = hashlib.sha256()
        with part.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        size = part.stat().st_size
        if size != content.total_bytes or digest.hexdigest() != content.sha256:
            part.unlink()
            raise IntegrityError(
                f"job {job_id}: received {size} bytes with sha256 {digest.hexdigest()}, expected "
                f"{content.total_bytes} bytes with sha256 {content.sha256}"
            )
        part.replace(dest)
        return dest, content.sha256


def _chunks(job_id: str, stream: Any, header: pb.ContentHeader) -> Iterator[bytes]:
    """The stream's chunk bytes, each checked to start where the last ended and to stay within total_bytes; the
    call is cancelled when the consumer stops early."""
    at, total = header.offset, header.content.total_bytes
    try:
        for m in stream:
            if not m.HasField("chunk") or m.chunk.offset != at or at + len(m.chunk.data) > total:
                raise IntegrityError(f"job {job_id}: a content message at offset {m.chunk.offset} "
                                     f"({len(m.chunk.data)} bytes), expected a chunk at {at} within {total} bytes")  # fmt: skip
            at += len(m.chunk.data)
            yield m.chunk.data
    finally:
        stream.cancel()  # a no-op once the stream has ended
