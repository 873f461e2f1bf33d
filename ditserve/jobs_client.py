"""A typed Python client of the Jobs API (`ditserve.generator.v1.Jobs`): create, look up, list, watch, cancel,
delete, and download a job's content (resumable, checked against its size and sha256). A per-request view
(`with_call_options`) gives every call one deadline and metadata (the HTTP facade's forwarded Authorization)."""

from __future__ import annotations

import copy
import hashlib
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from ditcore.request import GenerationRequest
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

from .client import open_channel
from .client_requests import request_to_proto
from .client_results import IntegrityError

_FINAL_STATES = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)


class JobsClient:
    def __init__(
        self, target: str, credentials: grpc.ChannelCredentials | None = None, timeout_s: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> None:  # fmt: skip
        self.channel = open_channel(target, credentials)
        self.stub = pb_grpc.JobsStub(self.channel)
        self.timeout_s = timeout_s
        """Every unary call's deadline in seconds; None: each method's own default."""
        self.metadata = tuple(metadata)
        """Sent with every call, e.g. (("authorization", "Bearer ..."),)."""

    def with_call_options(self, timeout_s: float | None = None, metadata: Sequence[tuple[str, str]] = ()) -> JobsClient:
        """A view of this client on the same channel whose every call has deadline `timeout_s` and `metadata` (one
        per HTTP request in the facade). Closing the view would close the shared channel: don't."""
        view = copy.copy(self)
        view.timeout_s, view.metadata = timeout_s, tuple(metadata)
        return view

    def _deadline(self, timeout: float | None, default: float) -> float:
        return timeout if timeout is not None else self.timeout_s if self.timeout_s is not None else default

    def __enter__(self) -> JobsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def create(
        self, request: GenerationRequest | Mapping[str, Any] | pb.GenerateRequest, idempotency_key: str = "",
        timeout: float | None = None,
    ) -> tuple[pb.Job, bool]:  # fmt: skip
        msg = request if isinstance(request, pb.GenerateRequest) else request_to_proto(request)
        resp = self.stub.CreateJob(pb.CreateJobRequest(request=msg, idempotency_key=idempotency_key),
                                   timeout=self._deadline(timeout, 60.0), metadata=self.metadata)  # fmt: skip
        return resp.job, resp.created

    def get(self, job_id: str, timeout: float | None = None) -> pb.Job:
        req = pb.GetJobRequest(job_id=job_id)
        return self.stub.GetJob(req, timeout=self._deadline(timeout, 30.0), metadata=self.metadata).job

    def list(
        self, states: Sequence[int] = (), page_size: int = 50, page_token: str = "", oldest_first: bool = False
    ) -> tuple[list[pb.Job], str]:
        req = pb.ListJobsRequest(page_size=page_size, page_token=page_token, oldest_first=oldest_first)
        req.states.extend(states)
        resp = self.stub.ListJobs(req, timeout=self._deadline(None, 30.0), metadata=self.metadata)
        return list(resp.jobs), resp.next_page_token

    def iter_all(self, states: Sequence[int] = (), oldest_first: bool = False) -> Iterator[pb.Job]:
        token = ""
        while True:
            jobs, token = self.list(states, 100, token, oldest_first)
            yield from jobs
            if not token:
                return

    def watch(self, job_id: str) -> Iterator[pb.Job]:
        """The job now and after every change, to its final state: a watch the server ends at its bound
        (--watch-max-s) with the job still live is opened again (the first record it sends repeats the last)."""
        last: pb.Job | None = None
        while True:
            for resp in self.stub.WatchJob(pb.WatchJobRequest(job_id=job_id), metadata=self.metadata):
                if last is None or resp.job != last:
                    yield resp.job
                last = resp.job
            if last is None or last.state in _FINAL_STATES:
                return

    def cancel(self, job_id: str) -> pb.Job:
        req = pb.CancelJobRequest(job_id=job_id)
        return self.stub.CancelJob(req, timeout=self._deadline(None, 30.0), metadata=self.metadata).job

    def delete(self, job_id: str) -> bool:
        req = pb.DeleteJobRequest(job_id=job_id)
        return self.stub.DeleteJob(req, timeout=self._deadline(None, 30.0), metadata=self.metadata).deleted

    def content_iter(
        self, job_id: str, offset: int = 0, *, timeout: float | None = None, idle_timeout_s: float | None = None
    ) -> tuple[pb.ContentHeader, ContentChunks]:
        """The content's header and its chunks. `timeout`: the whole stream's deadline; `idle_timeout_s`: the
        longest wait for each message, the header's included (StalledStreamError); None: no limit."""
        req = pb.GetJobContentRequest(job_id=job_id, offset=offset)
        chunks = ContentChunks(job_id, self.stub.GetJobContent(req, timeout=timeout, metadata=self.metadata),
                               idle_timeout_s)  # fmt: skip
        return chunks.start(), chunks

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


class StalledStreamError(grpc.RpcError):
    """A content stream sent no message within its idle timeout; the call was cancelled. Its code is
    DEADLINE_EXCEEDED, as the deadline of a unary call would say."""

    def __init__(self, job_id: str, idle_timeout_s: float) -> None:
        super().__init__(f"job {job_id}: no content message from the generator within {idle_timeout_s:g} s")

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return str(self)

    def trailing_metadata(self) -> None:
        return None


class ContentChunks(Iterator[bytes]):
    """One GetJobContent call: `start()` reads its header, then iteration yields the chunk bytes, each checked to
    start where the last ended and to stay within total_bytes. Each message is waited for at most `idle_timeout_s`
    (then the call is cancelled: StalledStreamError); `cancel()` ends the call from any thread (a no-op once it has
    ended), so the thread waiting for a message returns at once."""

    def __init__(self, job_id: str, stream: Any, idle_timeout_s: float | None) -> None:
        self.job_id, self._stream, self._idle_timeout_s = job_id, stream, idle_timeout_s
        self._stalled = False
        self._at = self._total = 0

    def cancel(self) -> None:
        self._stream.cancel()

    close = cancel

    def _stall(self) -> None:
        self._stalled = True
        self._stream.cancel()

    def _next_message(self) -> pb.GetJobContentResponse:
        timer = None
        if self._idle_timeout_s is not None:
            timer = threading.Timer(self._idle_timeout_s, self._stall)
            timer.daemon = True
            timer.start()
        try:
            message: pb.GetJobContentResponse = next(self._stream)
            return message
        except grpc.RpcError:
            if self._stalled:
                raise StalledStreamError(self.job_id, self._idle_timeout_s or 0) from None
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def start(self) -> pb.ContentHeader:
        try:
            first = self._next_message()
        except StopIteration:
            first = pb.GetJobContentResponse()
        if not first.HasField("header"):
            self.cancel()
            raise IntegrityError(f"job {self.job_id}: the content stream did not start with its header")
        self._at, self._total = first.header.offset, first.header.content.total_bytes
        return first.header

    def __next__(self) -> bytes:
        m = self._next_message()  # StopIteration at the stream's end
        at, total = self._at, self._total
        if not m.HasField("chunk") or m.chunk.offset != at or at + len(m.chunk.data) > total:
            self.cancel()
            raise IntegrityError(f"job {self.job_id}: a content message at offset {m.chunk.offset} "
                                 f"({len(m.chunk.data)} bytes), expected a chunk at {at} within {total} bytes")  # fmt: skip
        self._at += len(m.chunk.data)
        return m.chunk.data
