"""The Jobs gRPC adapter: proto <-> the jobs core (generator_service.jobs.service), every call as its authenticated
caller (generator_service.serving.auth: another owner's job is NOT_FOUND), every error through the one mapping
(ditruntime.rpc_errors). CreateJob looks an idempotency key up before any admission step, comparing the request's
meaning (generator_service.serving.convert.request_meaning), and stores the request slim (its large parts apart). WatchJob and GetJobContent are streams: they take a request-handler slot (as
GenerateStream does) and GetJobContent's sends are watched for stalled readers (generator_service.serving.streams)."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import grpc
from google.protobuf import timestamp_pb2

from ditcore import GenerationRequest, RequestError
from ditruntime.rpc_errors import abort, classify
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

from ..errors import HandlersBusyError, UnauthenticatedError
from ..jobs.schema import STATES, Job
from ..jobs.service import JobService, new_job_id
from ..jobs.types import JobView, NewJob
from .auth import JobsAuth
from .convert import join_parts, request_from_proto, request_meaning, resolve_request, split_parts
from .streams import HandlerSlots, SendWatchdog
from .uploads import UploadStore

if TYPE_CHECKING:
    from ditcore.adapters import AdapterRegistry

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Jobs"].full_name
_STATES = {name: pb.JobState.Value(f"JOB_STATE_{name.upper()}") for name in STATES}
_STATE_NAMES = {v: k for k, v in _STATES.items()}
_STAGES = {s: pb.JobStage.Value(f"JOB_STAGE_{s.upper()}")
           for s in ("queued", "preparing", "denoising", "decoding", "muxing", "storing", "done")}  # fmt: skip
_TASKS = {"t2va": pb.TASK_T2VA, "fl2va": pb.TASK_FL2VA}
_OUTPUTS = {
    "latents": pb.OUTPUT_TYPE_LATENTS,
    "mp4": pb.OUTPUT_TYPE_MP4,
    "frames_and_wav": pb.OUTPUT_TYPE_FRAMES_AND_WAV,
}
_JOB_ID = re.compile(r"job_[0-9a-f]{32}")
_KEY = re.compile(r"[\x20-\x7e]{1,256}")
DEFAULT_PAGE, MAX_PAGE = 50, 1000


def decode_request(data: bytes, parts: Mapping[str, bytes]) -> tuple[GenerationRequest, int | None]:
    """A stored GenerateRequest's bytes and parts, parsed as Generate parses it (the jobs core's Decoder)."""
    return request_from_proto(join_parts(data, parts))


def classify_error(error: BaseException) -> tuple[str, str, str]:
    """(status code name, reason, message): how the job would have ended a Generate call (the core's Classifier)."""
    code, reason, message = classify(error)
    return code.name, reason, message


def _check_id(job_id: str) -> str:
    if not _JOB_ID.fullmatch(job_id):
        raise RequestError("job_id", f"must be 'job_' and 32 lowercase hex digits, got {job_id[:80]!r}")
    return job_id


def _ts(epoch: float | None) -> timestamp_pb2.Timestamp | None:
    if epoch is None:
        return None
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(epoch * 1e9))
    return ts


def _spec(spec: dict[str, object]) -> pb.JobSpec:
    out = pb.JobSpec(
        request_id=str(spec["request_id"]), task=_TASKS.get(str(spec["task"]), pb.TASK_UNSPECIFIED),
        prompt=str(spec["prompt"]), num_inference_steps=int(spec["num_inference_steps"]),  # type: ignore[call-overload]
        flow_shift=float(spec["flow_shift"]), audio_flow_shift=float(spec["audio_flow_shift"]),  # type: ignore[arg-type]
        seed=int(spec["seed"]), num_frames=int(spec["num_frames"]),  # type: ignore[call-overload]
        height=int(spec["height"]), width=int(spec["width"]),  # type: ignore[call-overload]
        output_type=_OUTPUTS.get(str(spec["output_type"]), pb.OUTPUT_TYPE_UNSPECIFIED),
        has_first_frame=spec.get("first_frame") is not None, has_last_frame=spec.get("last_frame") is not None,
        quality=str(spec.get("quality") or ""),
    )  # fmt: skip
    if spec.get("expected_generation") is not None:
        out.expected_generation = int(spec["expected_generation"])  # type: ignore[call-overload]
    for use in spec.get("adapters") or ():  # type: ignore[attr-defined]
        out.adapters.append(pb.AdapterUse(name=str(use["name"]), scale=float(use["scale"])))
    return out


def job_to_proto(view: JobView) -> pb.Job:
    r = view.record
    job = pb.Job(
        job_id=r.job_id, state=_STATES[view.state], spec=_spec(r.spec), idempotency_key=r.idempotency_key or "",
        progress=pb.JobProgress(stage=_STAGES.get(view.stage, pb.JOB_STAGE_UNSPECIFIED), steps_done=view.steps_done,
                                steps_total=view.steps_total),
        attempts=r.attempts, cancel_requested=r.cancel_requested and not view.terminal, replica=r.replica or "",
        owner=r.owner,
    )  # fmt: skip
    for name, when in (("created_at", r.created_at), ("started_at", r.started_at), ("finished_at", r.finished_at),
                       ("expires_at", view.expires_at)):  # fmt: skip
        ts = _ts(when)
        if ts is not None:
            getattr(job, name).CopyFrom(ts)
    if view.queue_position is not None:
        job.queue_position = view.queue_position
    if r.error_code and view.state in ("failed", "cancelled"):
        job.error.CopyFrom(pb.JobError(code=r.error_code, reason=r.error_reason or "", message=r.error_message or ""))
    if view.state == "succeeded" and r.result is not None:
        job.result.CopyFrom(_result(view))
    return job


def _result(view: JobView) -> pb.JobResult:
    res = view.record.result or {}
    timings = dict(res.get("timings_ms") or {})
    cache = res.get("cache")
    return pb.JobResult(
        sha256=str(res.get("sha256", "")), generation=int(res.get("generation", 0)),
        output_type=_OUTPUTS.get(str(res.get("output_type")), pb.OUTPUT_TYPE_UNSPECIFIED),
        content=_content(view),
        timings=pb.StageTimings(**timings, attention_backend=str(res.get("attention_backend", ""))),
        cache=pb.CacheReport(**cache) if isinstance(cache, dict) else pb.CacheReport(),
    )  # fmt: skip


def _content(view: JobView) -> pb.JobContent:
    r = view.record
    return pb.JobContent(
        content_type=r.content_type or "", total_bytes=int(r.content_bytes or 0), sha256=r.content_sha256 or "",
        filename=r.content_filename or "", available=bool(r.content_available),
    )  # fmt: skip


def _page_token(after: int, states: list[str], oldest_first: bool) -> str:
    raw = f"{after}|{','.join(states)}|{int(oldest_first)}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _after(token: str, states: list[str], oldest_first: bool) -> int | None:
    if not token:
        return None
    try:
        after, names, order = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode().split("|")
        seq = int(after)
    except ValueError as e:
        raise RequestError("page_token", "is not a next_page_token this server gave") from e
    if names != ",".join(states) or order != str(int(oldest_first)):
        raise RequestError("page_token", "was given for other states or another order: repeat them unchanged")
    return seq


class JobsServicer(pb_grpc.JobsServicer):
    def __init__(
        self,
        jobs: JobService,
        slots: HandlerSlots,
        watchdog: SendWatchdog,
        chunk_bytes: int,
        uploads: UploadStore | None = None,
        auth: JobsAuth | None = None,
        adapters: AdapterRegistry | None = None,
    ) -> None:
        self.auth = auth or JobsAuth({})
        self.adapters = adapters
        """--adapter-dir's registry: a request's unset fields take its adapters' contract defaults before its meaning
        is computed and it is stored (convert.resolve_request, as Generate runs it)."""
        self.uploads = uploads
        """UploadReference's store: a job's references named by upload_id are resolved into the stored request."""
        self.jobs = jobs
        self.slots = slots
        self.watchdog = watchdog
        self.chunk_bytes = chunk_bytes

    def CreateJob(self, request: pb.CreateJobRequest, context: grpc.ServicerContext) -> pb.CreateJobResponse:
        try:
            caller = self.auth.caller(context)
            key = request.idempotency_key
            if key and not _KEY.fullmatch(key):
                raise RequestError("idempotency_key", "must be 1 to 256 printable ASCII characters")
            if not request.HasField("request"):
                raise RequestError("request", "is required: the Generate request the job runs")
            msg = request.request
            if msg.quality_audit:
                raise RequestError("request.quality_audit", "audit runs go through Generate or GenerateStream with the "
                                   "admin token (ditserve audit-quality), never as jobs")  # fmt: skip
            if key:  # a retry gets its job back before any admission step (its upload may have expired since)
                found = self.jobs.find_retry(caller.name, key, lambda job: self._retry_meaning(msg, job))
                if found is not None:
                    return pb.CreateJobResponse(job=job_to_proto(found), created=False)
            # the job keeps the bytes, not the upload, and the values its adapters' contracts default
            stored = resolve_request(msg, self.uploads, self.adapters)
            if stored is msg:  # it named no upload: a copy of our own to change
                stored = pb.GenerateRequest()
                stored.CopyFrom(msg)
            job_id = new_job_id()
            stored.request_id = msg.request_id or job_id  # the proto's promise; a restart runs it under the same id
            parsed, expected = request_from_proto(stored)
            uploads = {r.upload_id: self._upload_digest(r.upload_id) for r in msg.references
                       if r.WhichOneof("source") == "upload_id"}  # fmt: skip
            slim, parts = split_parts(stored)  # its parts taken out of our copy
            del stored
            new = NewJob(job_id, parsed, expected, slim, parts, {u: d for u, d in uploads.items() if d is not None})
            view, created = self.jobs.create(new, key or None, caller.name)
        except Exception as e:  # every error mapped; an unexpected one is INTERNAL, its text only in the log
            abort(context, e)
        return pb.CreateJobResponse(job=job_to_proto(view), created=created)

    def _retry_meaning(self, msg: pb.GenerateRequest, job: Job) -> str:
        """The retried request's meaning, its uploads read from the upload store, else from what `job` recorded."""
        known = {uid: (str(d[0]), int(d[1])) for uid, d in (job.spec.get("upload_ids") or {}).items()}
        return request_meaning(msg, lambda uid: self._upload_digest(uid) or known.get(uid), self.adapters)

    def _upload_digest(self, upload_id: str) -> tuple[str, int] | None:
        """(sha256, bytes) of a stored upload; None when unknown or expired."""
        if self.uploads is None:
            return None
        try:
            up = self.uploads.get(upload_id, "references")
        except RequestError:
            return None
        return up.sha256, len(up.reference.data)

    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.GetJobResponse:
        try:
            sees = self.auth.caller(context).sees
            return pb.GetJobResponse(job=job_to_proto(self.jobs.get(_check_id(request.job_id), sees)))
        except Exception as e:  # every error mapped; an unexpected one is INTERNAL, its text only in the log
            abort(context, e)

    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext) -> pb.ListJobsResponse:
        try:
            sees = self.auth.caller(context).sees
            if request.page_size > MAX_PAGE:
                raise RequestError(
                    "page_size", f"must be in [1, {MAX_PAGE}] (0: {DEFAULT_PAGE}), got {request.page_size}"
                )
            states = []
            for s in request.states:
                if s not in _STATE_NAMES:
                    allowed = ", ".join(pb.JobState.Name(v) for v in _STATE_NAMES)
                    raise RequestError("states", f"unknown job state {s}; allowed: {allowed}")
                states.append(_STATE_NAMES[s])
            after = _after(request.page_token, states, request.oldest_first)
            limit = request.page_size or DEFAULT_PAGE
            views, last = self.jobs.list(states, limit, after, request.oldest_first, sees)
        except Exception as e:  # every error mapped; an unexpected one is INTERNAL, its text only in the log
            abort(context, e)
        token = _page_token(last, states, request.oldest_first) if last is not None else ""
        return pb.ListJobsResponse(jobs=[job_to_proto(v) for v in views], next_page_token=token)

    def WatchJob(self, request: pb.WatchJobRequest, context: grpc.ServicerContext) -> Iterator[pb.WatchJobResponse]:
        pool = self.slots.upload_watch  # its own slots: idle watches never take Generate's threads
        try:
            sees = self.auth.caller(context).sees
            pool.acquire()
        except (HandlersBusyError, UnauthenticatedError) as e:
            abort(context, e)
        sends = self.watchdog.watch(request.job_id[:64] or "(no job_id)", context.cancel)  # a reader that stalls
        try:
            alive = pool.watch_alive(context.is_active)  # False after --watch-max-s: the watch ends OK
            for view in self.jobs.watch(_check_id(request.job_id), alive, sees):
                sends.sending()
                yield pb.WatchJobResponse(job=job_to_proto(view))
                sends.sent()
        except Exception as e:  # every error mapped; an unexpected one is INTERNAL, its text only in the log
            abort(context, e)
        finally:
            sends.close()
            pool.release()

    def CancelJob(self, request: pb.CancelJobRequest, context: grpc.ServicerContext) -> pb.CancelJobResponse:
        try:
            sees = self.auth.caller(context).sees
            return pb.CancelJobResponse(job=job_to_proto(self.jobs.cancel(_check_id(request.job_id), sees)))
        except Exception as e:  # every error mapped; an unexpected one is INTERNAL, its text only in the log
            abort(context, e)

    def DeleteJob(self, request: pb.DeleteJobRequest, context: grpc.ServicerContext) -> pb.DeleteJobResponse:
        try:
            sees = self.auth.caller(context).sees
            job_id = _check_id(request.job_id)
            return pb.DeleteJobResponse(job_id=job_id, deleted=self.jobs.delete(job_id, sees))
        except Exception as e:  # every error mapped; an unexpected one is INTERNAL, its text only in the log
            abort(context, e)

    def GetJobContent(
        self, request: pb.GetJobContentRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GetJobContentResponse]:
        try:
            sees = self.auth.caller(context).sees
            self.slots.acquire()
        except (HandlersBusyError, UnauthenticatedError) as e:
            abort(context, e)
        watch = self.watchdog.watch(request.job_id[:64] or "(no job_id)", context.cancel)
        try:
            with self.jobs.content(_check_id(request.job_id), request.offset, sees) as (ref, chunks):
                header = pb.ContentHeader(content=pb.JobContent(
                    content_type=ref.content_type, total_bytes=ref.size, sha256=ref.sha256, filename=ref.filename,
                    available=True,
                ), offset=request.offset)  # fmt: skip
                watch.start_transfer()
                for message in self._content(header, chunks):
                    watch.sending()
                    yield message
                    watch.sent()
        except Exception as e:  # every error mapped; an unexpected one is INTERNAL, its text only in the log
            abort(context, e)
        finally:
            watch.close()
            self.slots.release()

    def _content(self, header: pb.ContentHeader, chunks: Iterator[bytes]) -> Iterator[pb.GetJobContentResponse]:
        yield pb.GetJobContentResponse(header=header)
        offset = header.offset
        for data in chunks:
            for i in range(0, len(data), self.chunk_bytes):
                piece = data[i : i + self.chunk_bytes]
                yield pb.GetJobContentResponse(chunk=pb.ContentChunk(offset=offset, data=piece))
                offset += len(piece)
