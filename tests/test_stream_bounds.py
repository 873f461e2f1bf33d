"""UploadReference and WatchJob under their own bounds, against real in-process generators (resident, the tiny preset):

- 40 idle uploads and 40 idle watches take at most --upload-watch-workers threads (the rest are refused
  RESOURCE_EXHAUSTED naming the flag) while Generate keeps working;
- an upload that sends nothing for --upload-stall-s ends DEADLINE_EXCEEDED naming the flag, its slot and bytes freed;
- a watch ends OK after --watch-max-s, its job still queued, and the client can watch again;
- the bytes of uploads still being received count against --max-upload-mb: the chunk that crosses it is refused
  while the others stay open, and the store's accounting returns to the stored bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from jobskit import jobs_server
from refmedia import image_bytes
from servicekit import REQ_FOX, error_info, gen_request, wait_for

from generator_service.serving.server import GeneratorServer
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

KIB = 1024
MAX_UPLOAD = 1024 * KIB
BUDGET = 8  # --upload-watch-workers' default


@pytest.fixture(scope="module")
def srv(svc_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeneratorServer]:
    """The default slots, 1 MiB of uploads, and idle uploads held for the whole test (long upload bounds)."""
    state = tmp_path_factory.mktemp("bounds")
    with jobs_server(svc_ckpt, state, max_upload_bytes=MAX_UPLOAD, upload_stall_s=600, upload_max_s=600) as server:
        yield server


@pytest.fixture(scope="module")
def quick(svc_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeneratorServer]:
    """Short upload-stall and watch bounds."""
    with jobs_server(
        svc_ckpt, tmp_path_factory.mktemp("quick"), upload_stall_s=0.5, upload_max_s=60, watch_max_s=1.0
    ) as server:
        yield server


@pytest.fixture
def jobs_stay_queued(srv: GeneratorServer, quick: GeneratorServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """These replicas claim no job (as when another replica holds them all): a watched job stays queued."""
    for server in (srv, quick):
        monkeypatch.setattr(server.jobs.store, "claim_next", lambda *a, **k: None)


def _channel(server: GeneratorServer) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{server.port}", options=[("grpc.use_local_subchannel_pool", 1)])


def _chunks(release: threading.Event, *sizes: int) -> Iterator[pb.UploadReferenceRequest]:
    """An upload that sends chunks of `sizes` bytes, then nothing until `release`."""
    for size in sizes:
        yield pb.UploadReferenceRequest(chunk=b"\0" * size)
    release.wait()


def _queued_job(channel: grpc.Channel, name: str) -> str:
    req = pb.CreateJobRequest(request=gen_request(REQ_FOX, name))
    return str(pb_grpc.JobsStub(channel).CreateJob(req, timeout=30).job.job_id)


def _readers() -> int:
    return sum(t.name == "upload-reader" for t in threading.enumerate())


def _settled(server: GeneratorServer) -> bool:
    """Every upload and watch is gone: slots, reserved bytes, send watches and reader threads."""
    busy = server.slots.upload_watch.busy
    return busy == 0 and server.uploads.receiving_bytes == 0 and server.watchdog.watched == 0 and _readers() == 0


def test_idle_uploads_and_watches_leave_generate_its_threads(srv: GeneratorServer, jobs_stay_queued: None) -> None:
    channels = [_channel(srv) for _ in range(10)]  # 8 calls each, within --max-streams-per-connection
    job_id = _queued_job(channels[0], "watched")
    release = threading.Event()
    calls: list[Any] = []
    for i in range(40):
        gen = pb_grpc.GeneratorStub(channels[i % 10])
        calls.append(gen.UploadReference.future(_chunks(release), timeout=300))
        jobs = pb_grpc.JobsStub(channels[(i + 5) % 10])
        calls.append(jobs.WatchJob(pb.WatchJobRequest(job_id=job_id), timeout=300))  # never read
    try:
        refused = wait_for(lambda: [c for c in calls if c.done()] if sum(c.done() for c in calls) >= 72 else None,
                           60, "all but --upload-watch-workers of the 80 calls to be refused")  # fmt: skip
        assert len(refused) == 80 - BUDGET and srv.slots.upload_watch.busy == BUDGET
        gen = pb_grpc.GeneratorStub(channels[0])
        for i in range(2):  # the 80 are still open: Generate has threads of its own
            assert gen.Generate(gen_request(REQ_FOX, f"while-held-{i}"), timeout=120).sha256
        assert gen.GetStatus(pb.GetStatusRequest(), timeout=10).queue_depth == 0
        for call in refused:
            assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, call.details()
            assert "--upload-watch-workers 8" in call.details()
            info = error_info(call)
            assert info is not None and info.reason == "UPLOAD_WATCH_BUSY"
    finally:
        for call in calls:
            call.cancel()
        release.set()
    wait_for(lambda: _settled(srv), 30, "the held uploads and watches to free their slots and readers")
    for channel in channels:
        channel.close()


def test_an_upload_that_stalls_ends_deadline_exceeded_naming_the_flag(quick: GeneratorServer) -> None:
    channel = _channel(quick)
    release = threading.Event()
    try:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.GeneratorStub(channel).UploadReference(_chunks(release, 64 * KIB), timeout=60)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "sent nothing for 0.5 s (--upload-stall-s)" in err.value.details()
        info = error_info(err.value)
        assert info is not None and info.reason == "RECEIVE_TIMEOUT" and info.metadata["bound"] == "stall"
        # the client still holds its side open: the server freed the slot, the 64 KiB and the reader anyway
        wait_for(lambda: _settled(quick), 30, "the stalled upload's slot, bytes and reader to be freed")
    finally:
        release.set()
        channel.close()


def test_a_watch_ends_ok_at_its_bound_and_can_watch_again(quick: GeneratorServer, jobs_stay_queued: None) -> None:
    channel = _channel(quick)
    jobs = pb_grpc.JobsStub(channel)
    job_id = _queued_job(channel, "rewatched")
    for _ in range(2):  # a client that wants more watches again
        seen = [r.job for r in jobs.WatchJob(pb.WatchJobRequest(job_id=job_id), timeout=60)]  # ends OK
        assert seen and seen[-1].state == pb.JOB_STATE_QUEUED  # not final: ended by --watch-max-s
    wait_for(lambda: _settled(quick), 30, "the watches' slots to be freed")
    jobs.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=30)
    channel.close()


def test_bytes_being_received_count_against_max_upload_mb(srv: GeneratorServer) -> None:
    channels = [_channel(srv) for _ in range(2)]
    gen = pb_grpc.GeneratorStub(channels[0])
    stored = gen.UploadReference(iter([pb.UploadReferenceRequest(chunk=image_bytes())]), timeout=30)
    assert srv.uploads.used_bytes == stored.size_bytes and srv.uploads.receiving_bytes == 0
    release = threading.Event()
    held: list[Any] = []
    try:
        held += [gen.UploadReference.future(_chunks(release, 256 * KIB), timeout=120) for _ in range(3)]
        wait_for(lambda: srv.uploads.receiving_bytes == 3 * 256 * KIB, 30, "three uploads' first chunks")
        # 768 KiB in flight + the stored image: the 4th's second 128 KiB chunk crosses 1 MiB, refused while it is open
        crossing = pb_grpc.GeneratorStub(channels[1]).UploadReference.future(
            _chunks(release, 128 * KIB, 128 * KIB), timeout=120
        )
        err = crossing.exception(timeout=30)
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "(--max-upload-mb)" in err.details() and "being received" in err.details()
        info = error_info(err)
        assert info is not None and info.reason == "UPLOAD_CAPACITY"
        assert not any(f.done() for f in held)  # the others are still being received
        assert srv.uploads.receiving_bytes == 3 * 256 * KIB  # the refused one's 128 KiB are freed
    finally:
        for f in held:
            f.cancel()
        release.set()
    wait_for(lambda: _settled(srv), 30, "the cancelled uploads' bytes to be freed")
    assert srv.uploads.used_bytes == stored.size_bytes  # the stored upload is untouched and still named
    assert srv.uploads.get(stored.upload_id, "upload_id").sha256 == stored.sha256
    again = gen.UploadReference(iter([pb.UploadReferenceRequest(chunk=image_bytes(seed=1))]), timeout=30)
    assert srv.uploads.used_bytes == stored.size_bytes + again.size_bytes
    for channel in channels:
        channel.close()
