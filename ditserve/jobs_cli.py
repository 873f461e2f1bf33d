"""`ditserve jobs create|get|list|watch|cancel|download|delete --target HOST:PORT`: the Jobs API from the command line.

    ditserve jobs create --target 127.0.0.1:50051 --prompt "a red fox" --output-type mp4 --wait --out fox.mp4
    ditserve jobs list --target 127.0.0.1:50051 --state succeeded
    ditserve jobs watch --target 127.0.0.1:50051 job_...      # a bar: queue position, steps, decoding, muxing, storing
    ditserve jobs download --target 127.0.0.1:50051 job_... --out fox.mp4   # resumes a partial file, checks sha256

Each command prints the job (or jobs) as JSON lines on stdout, the job's record as the server gives it. Exit codes:
0, 2 for INVALID_ARGUMENT (a bad flag or field), 1 for any other failure, a failed or cancelled job included
(`create --wait`, `watch`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator

import grpc
from google.protobuf.json_format import MessageToDict

from protos.ditserve.generator.v1 import generator_pb2 as pb

from .client_requests import request_to_proto
from .client_results import IntegrityError
from .errors import UsageError
from .jobs_client import JobsClient
from .progress import Progress, add_progress_flag, progress_enabled
from .remote import add_api_key_flag, add_client_flags, api_key_metadata, check_client_args, credentials_from_args
from .requests_io import add_request_flags, requests_with_unset

STATE_NAMES = ("queued", "running", "succeeded", "failed", "cancelled")
_FINAL = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)


def add_jobs_flags(jobs: argparse.ArgumentParser) -> None:
    """`ditserve jobs`' verbs and their flags."""
    verbs = jobs.add_subparsers(dest="jobs_command", required=True)
    create = verbs.add_parser("create", help="create a job from one request (the generate flags)")
    add_request_flags(create)
    create.add_argument("--idempotency-key", default="", help="the same key and request return the same job")
    create.add_argument("--expected-generation", type=int, default=None, help="refuse unless this generation runs")
    create.add_argument("--wait", action="store_true", help="watch it to its end (and download it with --out)")
    for name, text in (
        ("get", "print a job"), ("watch", "follow a job to its end with a progress bar"),
        ("cancel", "cancel a queued or running job"), ("delete", "delete a job and its content (cancel it first)"),
        ("download", "write a succeeded job's content to --out (resumes a partial file)"),
    ):  # fmt: skip
        verb = verbs.add_parser(name, help=text)
        verb.add_argument("job_id", help="job_ and 32 hex digits")
        if name == "download":
            verb.add_argument("--out", required=True, help="the file to write")
    ls = verbs.add_parser("list", help="list jobs, newest first")
    ls.add_argument("--state", action="append", choices=STATE_NAMES, default=[], help="only these states (repeat)")
    ls.add_argument("--limit", type=int, default=50, help="jobs to print at most (default %(default)s)")
    ls.add_argument("--oldest-first", action="store_true", help="oldest first")
    for name, verb in verbs.choices.items():
        verb.add_argument("--target", required=True, help="generator address HOST:PORT")
        add_client_flags(verb)
        add_api_key_flag(verb)
        if name in ("watch",):  # create has it from the request flags
            add_progress_flag(verb)
    jobs.set_defaults(func=cmd_jobs)


def job_json(job: pb.Job) -> str:
    return json.dumps(MessageToDict(job, preserving_proto_field_name=True), sort_keys=True)


def cmd_jobs(args: argparse.Namespace) -> int:
    check_client_args(args)
    with JobsClient(args.target, credentials=credentials_from_args(args), metadata=api_key_metadata(args)) as client:
        try:
            return _run(client, args)
        except grpc.RpcError as e:
            print(f"ditserve jobs {args.jobs_command}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
        except IntegrityError as e:
            print(f"ditserve jobs {args.jobs_command}: bad content: {e}", file=sys.stderr)
            return 1


def _run(client: JobsClient, args: argparse.Namespace) -> int:
    verb = args.jobs_command
    if verb == "create":
        requests = requests_with_unset(args)
        if len(requests) != 1:
            raise UsageError("jobs create takes one request (not --requests)")
        msg = request_to_proto(requests[0][0], args.expected_generation, requests[0][1])
        if not args.request_id:
            msg.request_id = ""  # the server names it
        job, _ = client.create(msg, args.idempotency_key)
        print(job_json(job), flush=True)
        if not args.wait:
            return 0
        code = _watch(client, job.job_id, args.progress)
        if code == 0 and args.out:
            _download(client, job.job_id, args.out)
        return code
    if verb == "list":
        for job in _listed(client, args):
            print(job_json(job))
        return 0
    if verb == "watch":
        return _watch(client, args.job_id, args.progress)
    if verb == "download":
        _download(client, args.job_id, args.out)
        return 0
    if verb == "delete":
        print(json.dumps({"job_id": args.job_id, "deleted": client.delete(args.job_id)}))
        return 0
    job = client.cancel(args.job_id) if verb == "cancel" else client.get(args.job_id)
    print(job_json(job))
    return 0


def _listed(client: JobsClient, args: argparse.Namespace) -> Iterator[pb.Job]:
    if not 1 <= args.limit <= 100_000:
        raise UsageError(f"--limit must be in [1, 100000], got {args.limit}")
    states = [pb.JobState.Value(f"JOB_STATE_{s.upper()}") for s in args.state]
    yield from itertools.islice(client.iter_all(states=states, oldest_first=args.oldest_first), args.limit)


def _watch(client: JobsClient, job_id: str, progress: str) -> int:
    """Follow the job; print its final record; 0 if it succeeded."""
    last: pb.Job | None = None
    with Progress(job_id, progress_enabled(progress)) as bar:
        for job in client.watch(job_id):
            last = job
            show_job(bar, job)
    if last is None:
        return 1
    print(job_json(last), flush=True)
    if last.state != pb.JOB_STATE_SUCCEEDED:
        print(f"ditserve jobs: {job_id} {pb.JobState.Name(last.state)}: {last.error.message}", file=sys.stderr)
        return 1
    return 0


def show_job(bar: Progress, job: pb.Job) -> None:
    """One watched record on the bar: the queue position while queued; once running, the steps its record names and
    its stage ("preparing", "denoising", then "decoding", "muxing", "storing" after the last step). A watch sees only
    the latest record, so the last step often arrives as the decoding record: the steps come from every record."""
    if job.state == pb.JOB_STATE_QUEUED:
        bar.stage(f"queued, position {job.queue_position}")
        return
    if job.progress.steps_total:
        bar.step(job.progress.steps_done, job.progress.steps_total)
    if job.state == pb.JOB_STATE_RUNNING and job.progress.stage != pb.JOB_STAGE_UNSPECIFIED:
        bar.stage(pb.JobStage.Name(job.progress.stage).removeprefix("JOB_STAGE_").lower())


def _download(client: JobsClient, job_id: str, out: str) -> None:
    path, sha = client.download(job_id, out)
    print(json.dumps({"job_id": job_id, "path": str(path), "sha256": sha}), flush=True)
