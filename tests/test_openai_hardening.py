"""The /v1/videos facade against hostile clients and a misbehaving generator. A fake Jobs server runs in process (a
real grpc server that records each call's metadata, and can hang or fail any method); the facade runs under uvicorn
in a thread; raw sockets play the clients that misbehave below HTTP's politeness (a Content-Length never sent, a
chunked body without end). Each item of the hardening has its test: the body cap before reading, exact content
types, the Host allow-list and no CORS by default, deadlines (504) and a download cancelled with its client, strict
numbers, OpenAI's error shape with a code, the Authorization header forwarded, the README's polling."""

from __future__ import annotations

import argparse
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx2
import pytest
import uvicorn
from servicekit import REPO_ROOT, wait_for

from ditruntime.flags import from_args
from ditserve.errors import UsageError
from ditserve.jobs_client import JobsClient
from ditserve.openai.app import create_app
from ditserve.openai.cli import add_openai_api_flags, cmd_openai_api
from ditserve.openai.config import KIB, FacadeConfig
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

JOB_ID = "job_" + "a" * 32
CAP = 64 * KIB
CONTENT = b"\0" * (3 << 20)  # three 1 MiB chunks of a pretend MP4


@dataclass
class FakeJobs(pb_grpc.JobsServicer):
    """The Jobs API as a test drives it: records (method, authorization metadata); a method in `hang` waits until
    its caller goes away, one in `fail` aborts with that status; `trickle` makes GetJobContent send its header and
    one chunk, then wait for its caller to go away."""

    calls: list[tuple[str, str | None]] = field(default_factory=list)
    hang: set[str] = field(default_factory=set)
    fail: dict[str, grpc.StatusCode] = field(default_factory=dict)
    trickle: bool = False
    active: int = 0
    ended: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        self.calls.clear()
        self.hang.clear()
        self.fail.clear()
        self.trickle = False
        self.ended = threading.Event()  # a new one: an earlier test's call may still end (and set its own) later

    @contextmanager
    def call(self, method: str, context: grpc.ServicerContext) -> Iterator[None]:
        meta = dict(context.invocation_metadata())
        with self.lock:
            self.calls.append((method, meta.get("authorization")))  # type: ignore[arg-type]
            self.active += 1
        try:
            if method in self.fail:
                context.abort(self.fail[method], f"{method} failed on purpose")
            if method in self.hang:
                self._wait_gone(context)
            yield
        finally:
            with self.lock:
                self.active -= 1

    @staticmethod
    def _wait_gone(context: grpc.ServicerContext) -> None:
        while context.is_active():
            time.sleep(0.02)

    def _job(self) -> pb.Job:
        job = pb.Job(job_id=JOB_ID, state=pb.JOB_STATE_SUCCEEDED, spec=pb.JobSpec(prompt="p", num_frames=124,
                     height=32, width=64), progress=pb.JobProgress(steps_done=4, steps_total=4))  # fmt: skip
        job.created_at.FromSeconds(100)
        return job

    def CreateJob(self, request: pb.CreateJobRequest, context: grpc.ServicerContext) -> pb.CreateJobResponse:
        with self.call("CreateJob", context):
            job = self._job()
            job.state, job.spec.num_frames = pb.JOB_STATE_QUEUED, request.request.num_frames or 124
            return pb.CreateJobResponse(job=job, created=True)

    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.GetJobResponse:
        with self.call("GetJob", context):
            return pb.GetJobResponse(job=self._job())

    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext) -> pb.ListJobsResponse:
        with self.call("ListJobs", context):
            return pb.ListJobsResponse(jobs=[self._job()])

    def DeleteJob(self, request: pb.DeleteJobRequest, context: grpc.ServicerContext) -> pb.DeleteJobResponse:
        with self.call("DeleteJob", context):
            return pb.DeleteJobResponse(job_id=request.job_id, deleted=True)

    def GetJobContent(
        self, request: pb.GetJobContentRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GetJobContentResponse]:
        context.add_callback(self.ended.set)  # when this call ends, for whatever reason (this test's event)
        with self.call("GetJobContent", context):
            content = pb.JobContent(content_type="video/mp4", total_bytes=len(CONTENT), filename="v.mp4")
            yield pb.GetJobContentResponse(header=pb.ContentHeader(content=content))
            for at in range(0, len(CONTENT), 1 << 20):
                yield pb.GetJobContentResponse(chunk=pb.ContentChunk(offset=at, data=CONTENT[at : at + (1 << 20)]))
                if self.trickle:
                    self._wait_gone(context)
                    return


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeJobs, JobsClient]]:
    servicer = FakeJobs()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    pb_grpc.add_JobsServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with JobsClient(f"127.0.0.1:{port}") as jobs:
            yield servicer, jobs
    finally:
        server.stop(0)


@pytest.fixture
def jobs(fake: tuple[FakeJobs, JobsClient]) -> Iterator[FakeJobs]:
    fake[0].reset()
    yield fake[0]
    fake[0].reset()
    wait_for(lambda: fake[0].active == 0, 10, "the fake's calls to end")


@pytest.fixture
def serve(fake: tuple[FakeJobs, JobsClient]) -> Iterator[Callable[..., str]]:
    """serve(**FacadeConfig fields) -> "http://127.0.0.1:PORT": the facade over the fake, in a thread."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(**config: Any) -> str:
        app = create_app(fake[1], FacadeConfig(**config))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        wait_for(lambda: server.started, 30, "uvicorn to start")
        port = server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _raw(url: str, head: str, parts: Iterable[bytes] = (), timeout: float = 10) -> tuple[int, bytes, bytes]:
    """Send `head` (the request line and headers) and `parts` on a raw socket; (status, headers, body) of the
    answer."""
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=timeout) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
        for part in parts:
            try:
                sock.sendall(part)
            except OSError:  # the server answered and closed: what it does at the cap
                break
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"the connection closed without an answer: {data!r}"
            data += chunk
        top, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", top).group(1))  # type: ignore[union-attr]
        while len(body) < length:
            body += sock.recv(65536)
        return int(top.split()[1]), top.lower(), body


def _is_openai_error(response: httpx2.Response | bytes, status: int | None = None) -> dict[str, Any]:
    body = json.loads(response if isinstance(response, bytes) else response.content)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["code"], str) and error["code"]
    return dict(error)


# ----------------------------------------------------------------------------- 1. the body cap, before reading
def test_a_content_length_over_the_cap_is_refused_before_a_byte_is_read(serve: Callable[..., str],
                                                                        jobs: FakeJobs) -> None:  # fmt: skip
    url = serve(max_body_bytes=CAP)
    head = f"POST /v1/videos HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/json\nContent-Length: {300 << 20}\n"
    status, headers, body = _raw(url, head)  # the body is never sent: an answer proves nothing waited for it
    assert status == 413 and _is_openai_error(body)["code"] == "request_too_large"
    assert b"connection: close" in headers  # and the server reads none of it afterwards either
    assert "--max-body-mb" in _is_openai_error(body)["message"] and jobs.calls == []


def test_a_chunked_body_is_cut_at_the_cap(serve: Callable[..., str], jobs: FakeJobs) -> None:
    url = serve(max_body_bytes=CAP)
    piece = b'{"prompt": "' + b"x" * (16 * KIB)
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * 5  # 80 KiB, and never the last chunk: only the cap ends it
    head = "POST /v1/videos HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/json\nTransfer-Encoding: chunked\n"
    status, headers, body = _raw(url, head, chunks)
    assert status == 413 and _is_openai_error(body)["code"] == "request_too_large" and jobs.calls == []
    assert b"connection: close" in headers  # the rest is not read, not even to be thrown away
    under = json.dumps({"prompt": "x" * (CAP - 100)}).encode()  # within the cap, chunked too: served
    r = httpx2.post(f"{url}/v1/videos", content=iter([under[:1000], under[1000:]]),
                    headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 200, r.text
    assert [m for m, _ in jobs.calls] == ["CreateJob"]


def test_the_default_cap_is_the_grpc_message_limit() -> None:
    assert FacadeConfig().max_body_bytes == 64 << 20
    with pytest.raises(ValueError, match=r"--max-body-mb"):
        FacadeConfig(max_body_bytes=10)


# ----------------------------------------------------------------------------- 2. exact content types
@pytest.mark.parametrize(
    ("content_type", "status"),
    [("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("", 415), ("application/jsonx", 415),
     ("text/json", 415), ("application/json", 200), ("application/json; charset=utf-8", 200),
     ("Application/JSON", 200)],
)  # fmt: skip
def test_only_json_or_multipart_is_parsed(serve: Callable[..., str], jobs: FakeJobs, content_type: str,
                                          status: int) -> None:  # fmt: skip
    url = serve()  # no key: what a cross-site form or a CORS-simple text/plain post would reach
    headers = {"Content-Type": content_type} if content_type else {}
    r = httpx2.post(f"{url}/v1/videos", content=b'{"prompt": "a fox"}', headers=headers)
    assert r.status_code == status, r.text
    if status == 415:
        assert _is_openai_error(r)["code"] == "unsupported_media_type" and jobs.calls == []


def test_multipart_is_accepted_and_an_unknown_file_part_refused(serve: Callable[..., str], jobs: FakeJobs) -> None:
    url = serve()
    r = httpx2.post(f"{url}/v1/videos", data={"prompt": "a fox", "seed": "3"})  # multipart? no: urlencoded
    assert r.status_code == 415
    r = httpx2.post(f"{url}/v1/videos", data={"prompt": "a fox", "seed": "3"}, files={"last_frame": b""})
    assert r.status_code == 200, r.text
    r = httpx2.post(f"{url}/v1/videos", data={"prompt": "a fox"}, files={"mask": ("m.png", b"png")})
    error = _is_openai_error(r)
    assert r.status_code == 400 and error["param"] == "mask" and "input_reference" in error["message"]
    r = httpx2.post(f"{url}/v1/videos", files=[("prompt", (None, b"a")), ("prompt", (None, b"b"))])
    assert r.status_code == 400 and _is_openai_error(r)["param"] == "prompt"  # twice: which one?
    assert [m for m, _ in jobs.calls] == ["CreateJob"]


# ----------------------------------------------------------------------------- 3. Host allow-list, no CORS
def test_a_host_not_allowed_is_refused(serve: Callable[..., str], jobs: FakeJobs) -> None:
    url = serve()
    for host, status in (("evil.example", 400), ("evil.example:8000", 400), ("localhost:8000", 200),
                         ("127.0.0.1", 200), ("[::1]:8000", 200), ("LOCALHOST", 200)):  # fmt: skip
        r = httpx2.get(f"{url}/v1/videos", headers={"Host": host})
        assert r.status_code == status, (host, r.text)
    error = _is_openai_error(httpx2.get(f"{url}/v1/videos", headers={"Host": "evil.example"}))
    assert error["code"] == "invalid_host" and "--allowed-hosts" in error["message"]
    assert [m for m, _ in jobs.calls] == ["ListJobs"] * 4
    wide = serve(allowed_hosts="*.example.com, api.internal")
    for host, status in (("a.example.com", 200), ("example.org", 400), ("api.internal", 200), ("localhost", 400)):
        assert httpx2.get(f"{wide}/v1/videos", headers={"Host": host}).status_code == status, host
    assert httpx2.get(f"{serve(allowed_hosts='*')}/v1/videos", headers={"Host": "any.where"}).status_code == 200


def test_the_bound_host_is_allowed_and_bad_patterns_are_refused() -> None:
    assert FacadeConfig(host="10.0.0.5").host_patterns() == ("localhost", "127.0.0.1", "[::1]", "10.0.0.5")
    assert FacadeConfig(host="fd00::5").host_patterns()[-1] == "[fd00::5]"
    assert FacadeConfig(host="0.0.0.0").host_patterns() == ("localhost", "127.0.0.1", "[::1]")
    for bad in ("a.*.com", "*example.com"):
        with pytest.raises(ValueError, match="--allowed-hosts"):
            FacadeConfig(allowed_hosts=bad)
    with pytest.raises(ValueError, match="--cors-origins"):
        FacadeConfig(cors_origins="app.example.com")


def test_the_command_line_builds_the_config_and_names_a_bad_flag() -> None:
    parser = argparse.ArgumentParser()
    add_openai_api_flags(parser.add_subparsers().add_parser("openai-api"))
    args = parser.parse_args(["openai-api", "--target", "127.0.0.1:1", "--max-body-mb", "0.5", "--allowed-hosts",
                              "api.example.com", "--cors-origins", "https://app.example.com",
                              "--backend-timeout-s", "2", "--download-timeout-s", "60"])  # fmt: skip
    config = from_args(FacadeConfig, args)
    assert (config.max_body_bytes, config.host_patterns(), config.origins(), config.backend_timeout_s,
            config.download_timeout_s) == (1 << 19, ("api.example.com",), ("https://app.example.com",), 2.0, 60.0)  # fmt: skip
    bad = parser.parse_args(["openai-api", "--target", "127.0.0.1:1", "--allowed-hosts", "a.*.com"])
    with pytest.raises(UsageError, match="--allowed-hosts"):
        cmd_openai_api(bad)  # refused before anything starts


def test_no_cors_headers_unless_origins_are_listed(serve: Callable[..., str], jobs: FakeJobs) -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    closed = serve()
    r = httpx2.get(f"{closed}/v1/videos", headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and not any(k.startswith("access-control-") for k in r.headers)
    r = httpx2.options(f"{closed}/v1/videos", headers=preflight)
    assert "access-control-allow-origin" not in r.headers and _is_openai_error(r)["code"] == "method_not_allowed"
    opened = serve(cors_origins="https://app.example")
    r = httpx2.options(f"{opened}/v1/videos", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx2.get(f"{opened}/v1/videos", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx2.get(f"{opened}/v1/videos", headers={"Origin": "https://app.example"})
    assert r.headers["access-control-allow-origin"] == "https://app.example"


# ----------------------------------------------------------------------------- 4. deadlines, cancelled downloads
@pytest.mark.parametrize(
    ("method", "verb", "path"),
    [("GetJob", "GET", f"/v1/videos/{JOB_ID}"), ("ListJobs", "GET", "/v1/videos"),
     ("DeleteJob", "DELETE", f"/v1/videos/{JOB_ID}"), ("CreateJob", "POST", "/v1/videos"),
     ("GetJobContent", "GET", f"/v1/videos/{JOB_ID}/content")],
)  # fmt: skip
def test_a_hung_backend_is_a_504_within_the_deadline(serve: Callable[..., str], jobs: FakeJobs, method: str,
                                                     verb: str, path: str) -> None:  # fmt: skip
    deadline = 1.0
    url = serve(backend_timeout_s=deadline)
    jobs.hang.add(method)
    start = time.monotonic()
    r = httpx2.request(verb, f"{url}{path}", json={"prompt": "a fox"} if verb == "POST" else None, timeout=30)
    took = time.monotonic() - start
    assert r.status_code == 504 and _is_openai_error(r)["code"] == "backend_timeout", r.text
    assert took < 3 * deadline, f"{took:.2f} s for a {deadline} s deadline"


def test_hung_downloads_free_the_threadpool(serve: Callable[..., str], jobs: FakeJobs) -> None:
    """42 downloads against a hung generator (more than the 40 threads sync routes share) all end in 504, their
    gRPC calls end, and the facade answers again at once."""
    url = serve(backend_timeout_s=1.0)
    jobs.hang.add("GetJobContent")
    with futures.ThreadPoolExecutor(42) as pool:
        answers = list(pool.map(lambda _: httpx2.get(f"{url}/v1/videos/{JOB_ID}/content", timeout=60), range(42)))
    assert [r.status_code for r in answers] == [504] * 42
    wait_for(lambda: jobs.active == 0, 10, "the hung calls to be cancelled at the generator")
    jobs.hang.clear()
    assert httpx2.get(f"{url}/v1/videos/{JOB_ID}", timeout=10).status_code == 200  # a held pool: a timeout here


def test_a_download_cancels_its_grpc_call_when_the_client_goes_away(serve: Callable[..., str],
                                                                   jobs: FakeJobs) -> None:  # fmt: skip
    url = serve(backend_timeout_s=60)  # far beyond the wait below: only the disconnect can end the call
    jobs.trickle = True
    with httpx2.stream("GET", f"{url}/v1/videos/{JOB_ID}/content", timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-length"] == str(len(CONTENT))
        # Hold the iterator: a temporary one (next(r.iter_raw())) is finalized as soon as next() returns, and its
        # `finally` closes the response, so the client would be gone before the check below (a race it loses
        # under load).
        raw = r.iter_raw()
        got = 0
        while got < 1 << 20:  # all the fake sends before it waits: the client connected and reading
            got += len(next(raw))
        assert not jobs.ended.wait(0.5) and jobs.active == 1, "the call ended while its client was connected"
    assert jobs.ended.wait(10), "the GetJobContent call outlived its HTTP client"
    wait_for(lambda: jobs.active == 0, 10, "the stream's handler to return")


def test_a_download_whose_generator_stalls_ends_short_and_frees_its_call(serve: Callable[..., str],
                                                                         jobs: FakeJobs) -> None:  # fmt: skip
    url = serve(backend_timeout_s=1.0)
    jobs.trickle = True  # the header and one chunk, then nothing
    with httpx2.stream("GET", f"{url}/v1/videos/{JOB_ID}/content", timeout=30) as r:
        assert r.status_code == 200
        with pytest.raises(httpx2.HTTPError):  # fewer bytes than its Content-Length: the client knows
            b"".join(r.iter_raw())
    assert jobs.ended.wait(10), "the stalled GetJobContent call was never cancelled"


def test_a_whole_download_arrives(serve: Callable[..., str], jobs: FakeJobs) -> None:
    url = serve(backend_timeout_s=5)
    r = httpx2.get(f"{url}/v1/videos/{JOB_ID}/content", headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and r.content == CONTENT
    assert jobs.calls == [("GetJobContent", "Bearer k")]


# ----------------------------------------------------------------------------- 5. integers, finite numbers
@pytest.mark.parametrize(
    ("raw", "param"),
    [(b'{"prompt": "a fox", "seed": 1.5}', "seed"), (b'{"prompt": "a fox", "seed": Infinity}', "seed"),
     (b'{"prompt": "a fox", "flow_shift": NaN}', "flow_shift"), (b'{"prompt": "a fox", "seconds": 1e999}', "seconds"),
     (b'{"prompt": "a fox", "num_inference_steps": 3.0}', "num_inference_steps"),
     (b'{"prompt": "a fox", "seed": true}', "seed")],
)  # fmt: skip
def test_non_finite_numbers_and_float_integers_are_refused(serve: Callable[..., str], jobs: FakeJobs, raw: bytes,
                                                           param: str) -> None:  # fmt: skip
    r = httpx2.post(f"{serve()}/v1/videos", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and _is_openai_error(r)["param"] == param, r.text
    assert jobs.calls == []


# ----------------------------------------------------------------------------- 6. OpenAI's error shape everywhere
def test_the_servers_own_errors_have_openais_shape_and_a_code(serve: Callable[..., str], jobs: FakeJobs) -> None:
    url = serve(max_body_bytes=CAP)
    cases = [
        (httpx2.get(f"{url}/nothing"), 404, "not_found"),
        (httpx2.put(f"{url}/v1/videos"), 405, "method_not_allowed"),
        (httpx2.post(f"{url}/v1/videos", content=b"x" * (CAP + 1), headers={"Content-Type": "application/json"}),
         413, "request_too_large"),
        (httpx2.post(f"{url}/v1/videos", content=b"{}", headers={"Content-Type": "text/plain"}), 415,
         "unsupported_media_type"),
        (httpx2.get(f"{url}/v1/videos", params={"limit": "abc"}), 400, "invalid_value"),
        (httpx2.post(f"{url}/v1/videos", content=b"--x\r\n", headers={"Content-Type": "multipart/form-data"}), 400,
         "invalid_value"),
        (httpx2.post(f"{url}/v1/videos", json={"prompt": "a fox", "seconds": "4"}), 400, "invalid_value"),
    ]  # fmt: skip
    for r, status, code in cases:
        assert (r.status_code, _is_openai_error(r)["code"]) == (status, code), r.text
    assert httpx2.get(f"{url}/openapi.json").status_code == 404  # no schema served either


def test_an_unexpected_fault_is_a_500_that_leaks_nothing(serve: Callable[..., str], jobs: FakeJobs) -> None:
    r = httpx2.get(f"{serve()}/v1/videos/{JOB_ID}/content", params={"variant": "thumbnail"})  # not an MP4 inside
    error = _is_openai_error(r)
    assert r.status_code == 500 and (error["type"], error["code"]) == ("server_error", "internal_error")
    assert not re.search(r"/|Traceback|av\.|Error|\d+\.\d+\.\d+", error["message"]), error["message"]


# ----------------------------------------------------------------------------- 7. seconds as asked
def test_seconds_are_echoed_as_asked(serve: Callable[..., str], jobs: FakeJobs) -> None:
    r = httpx2.post(f"{serve()}/v1/videos", json={"prompt": "a fox", "seconds": "5"})
    assert (r.json()["seconds"], r.json()["duration_seconds"]) == ("5", 5.167)


# ----------------------------------------------------------------------------- 9. authentication pass-through
def test_the_authorization_header_is_forwarded_on_every_jobs_call(serve: Callable[..., str], jobs: FakeJobs) -> None:
    url = serve(backend_timeout_s=5)
    auth = {"Authorization": "Bearer sk-user-1"}
    httpx2.post(f"{url}/v1/videos", json={"prompt": "a fox"}, headers=auth).raise_for_status()
    httpx2.get(f"{url}/v1/videos/{JOB_ID}", headers=auth).raise_for_status()
    httpx2.get(f"{url}/v1/videos", headers=auth).raise_for_status()
    httpx2.get(f"{url}/v1/videos/{JOB_ID}/content", headers=auth).raise_for_status()
    httpx2.delete(f"{url}/v1/videos/{JOB_ID}", headers=auth).raise_for_status()
    assert jobs.calls == [(m, "Bearer sk-user-1") for m in ("CreateJob", "GetJob", "ListJobs", "GetJobContent",
                                                             "DeleteJob")]  # fmt: skip
    jobs.calls.clear()
    httpx2.get(f"{url}/v1/videos/{JOB_ID}").raise_for_status()  # none given: none sent
    assert jobs.calls == [("GetJob", None)]
    jobs.calls.clear()
    r = httpx2.get(f"{url}/v1/videos/{JOB_ID}", headers=[(b"Authorization", b"Bearer \x7f")])
    assert r.status_code == 401 and jobs.calls == []  # not something gRPC metadata can carry


def test_the_facades_own_key_is_checked_then_forwarded(serve: Callable[..., str], jobs: FakeJobs) -> None:
    url = serve(api_key="sk-facade")
    r = httpx2.get(f"{url}/v1/videos/{JOB_ID}", headers={"Authorization": "Bearer sk-other"})
    assert r.status_code == 401 and _is_openai_error(r)["code"] == "invalid_api_key" and jobs.calls == []
    httpx2.get(f"{url}/v1/videos/{JOB_ID}", headers={"Authorization": "Bearer sk-facade"}).raise_for_status()
    assert jobs.calls == [("GetJob", "Bearer sk-facade")]


@pytest.mark.parametrize(
    ("code", "status", "error_code"),
    [(grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_api_key"), (grpc.StatusCode.PERMISSION_DENIED, 403,
     "permission_denied"), (grpc.StatusCode.NOT_FOUND, 404, "not_found"), (grpc.StatusCode.RESOURCE_EXHAUSTED, 429,
     "rate_limit_exceeded"), (grpc.StatusCode.UNAVAILABLE, 503, "backend_unavailable"),
     (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "backend_timeout"), (grpc.StatusCode.INVALID_ARGUMENT, 400,
     "invalid_argument"), (grpc.StatusCode.INTERNAL, 500, "backend_error")],
)  # fmt: skip
def test_the_generators_status_becomes_the_http_status(serve: Callable[..., str], jobs: FakeJobs,
                                                       code: grpc.StatusCode, status: int, error_code: str) -> None:  # fmt: skip
    jobs.fail["GetJob"] = code
    r = httpx2.get(f"{serve()}/v1/videos/{JOB_ID}", headers={"Authorization": "Bearer sk-someone-else"})
    assert (r.status_code, _is_openai_error(r)["code"]) == (status, error_code), r.text
    assert ("retry-after" in r.headers) == (status == 429)


# ----------------------------------------------------------------------------- 10. the README polls politely
def test_the_readmes_openai_snippet_sleeps_between_polls() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    [snippet] = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "import openai" in b]
    compile(snippet, "README.md", "exec")
    loop = snippet[snippet.index("while ") :]
    assert re.search(r"time\.sleep\(\d", loop), snippet
    intro = readme[: readme.index(snippet)].removesuffix("```python\n").rstrip().rsplit("\n\n", 1)[-1]
    assert ".venv/bin/python" in intro, intro
