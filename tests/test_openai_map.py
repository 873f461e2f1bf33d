"""The /v1/videos mapping without a server: seconds -> frames, size, the create body and its keyframes, a job as
OpenAI's Video, a gRPC status (as the services send it) as OpenAI's error."""

from __future__ import annotations

import base64

import grpc
import pytest

from ditcore import RequestError
from ditruntime.errors import ServiceError
from ditruntime.rpc_errors import to_status
from ditserve.openai.mapping import (
    ApiError,
    create_body,
    frames_for_seconds,
    from_rpc_error,
    parse_size,
    reference_image,
    video_object,
)
from generator_service.errors import JobQueueFullError
from protos.ditserve.generator.v1 import generator_pb2 as pb


@pytest.mark.parametrize(("seconds", "frames"), [("5", 124), (5.2, 124), ("10", 243), (15, 345), ("12", 294)])
def test_seconds_become_the_nearest_valid_frame_count(seconds: object, frames: int) -> None:
    assert frames_for_seconds(seconds) == frames and (frames - 5) % 17 == 0


@pytest.mark.parametrize("seconds", ["4", "16", "nan", "five", None, "inf"])
def test_seconds_outside_5_to_15_are_refused_naming_the_field(seconds: object) -> None:
    with pytest.raises(ApiError) as err:
        frames_for_seconds(seconds)
    assert err.value.status == 400 and err.value.param == "seconds"


def test_size_is_width_by_height() -> None:
    assert parse_size("1344x768") == (768, 1344)
    for bad in ("1344", "x768", "1344x768x2", "-32x32", ""):
        with pytest.raises(ApiError) as err:
            parse_size(bad)
        assert err.value.param == "size"


def test_create_body_maps_openais_fields_and_h3s_extras() -> None:
    body = create_body({"prompt": "a fox", "seconds": "10", "size": "64x32", "seed": "7", "flow_shift": 5,
                        "idempotency_key": "k"}, first_frame=b"png")  # fmt: skip
    r = body.request
    assert (r.num_frames, r.height, r.width, r.seed, r.flow_shift) == (243, 32, 64, 7, 5.0)
    assert r.output_type == pb.OUTPUT_TYPE_MP4 and r.first_frame == b"png" and body.idempotency_key == "k"
    assert not create_body({"prompt": "a fox"}).request.HasField("num_frames")  # unset: H3's default
    for fields, param in (({}, "prompt"), ({"prompt": "x", "model": "sora-2"}, "model"),
                          ({"prompt": "x", "seed": "many"}, "seed"), ({"prompt": "x", "output_type": "latents"},
                                                                      "output_type")):  # fmt: skip
        with pytest.raises(ApiError) as err:
            create_body(fields)
        assert err.value.param == param and err.value.status == 400


def _job(state: int, done: int = 0, total: int = 4) -> pb.Job:
    job = pb.Job(job_id="job_" + "a" * 32, state=state, spec=pb.JobSpec(prompt="p", num_frames=124, height=32,
                 width=64), progress=pb.JobProgress(steps_done=done, steps_total=total))  # fmt: skip
    job.created_at.FromSeconds(100)
    return job


def test_progress_is_what_finished_and_100_only_when_completed() -> None:
    assert video_object(_job(pb.JOB_STATE_QUEUED))["progress"] == 0
    assert video_object(_job(pb.JOB_STATE_RUNNING, 2))["progress"] == 49
    assert video_object(_job(pb.JOB_STATE_RUNNING, 4))["progress"] == 99  # decoding, muxing: not done yet
    done = video_object(_job(pb.JOB_STATE_SUCCEEDED, 4))
    assert done["progress"] == 100 and done["status"] == "completed" and done["size"] == "64x32"
    cancelled = video_object(_job(pb.JOB_STATE_CANCELLED))
    assert cancelled["status"] == "failed" and cancelled["error"]["code"] == "cancelled"
    assert cancelled["ditserve_state"] == "cancelled" and cancelled["seconds"] == "5.17"


def test_a_keyframe_as_text_is_base64_a_data_url_or_an_image_url_object() -> None:
    png = b"\x89PNG\r\n\x1a\n"
    b64 = base64.b64encode(png).decode()
    for value in (b64, f"data:image/png;base64,{b64}", {"image_url": f"data:image/png;base64,{b64}"}):
        assert reference_image(value, "input_reference") == png
    for bad in ({"file_id": "file_1"}, "https://example.com/fox.png", "data:text/plain;base64,eA==", "not base64!",
                {"image_url": 3}):  # fmt: skip
        with pytest.raises(ApiError) as err:
            reference_image(bad, "last_frame")
        assert err.value.status == 400 and err.value.param == "last_frame"


def test_an_unknown_create_field_is_refused_naming_it_not_ignored() -> None:
    with pytest.raises(ApiError) as err:
        create_body({"prompt": "a fox", "secconds": "30"})
    assert (err.value.status, err.value.param, err.value.code) == (400, "secconds", "unknown_parameter")


class _Failed(grpc.RpcError):
    """What a failed call raises, built from the status the services send (ditruntime.rpc_errors.to_status)."""

    def __init__(self, exc: BaseException) -> None:
        self.status = to_status(exc)

    def code(self) -> grpc.StatusCode:
        return self.status.code

    def details(self) -> str:
        return self.status.details

    def trailing_metadata(self) -> object:
        return self.status.trailing_metadata


def _service_error(code: str, reason: str) -> ServiceError:
    err = ServiceError(f"a {code} failure")
    err.grpc_code, err.reason = code, reason
    return err


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [("NOT_FOUND", 404, "invalid_request_error"), ("ALREADY_EXISTS", 409, "invalid_request_error"),
     ("FAILED_PRECONDITION", 409, "invalid_request_error"), ("UNAUTHENTICATED", 401, "authentication_error"),
     ("PERMISSION_DENIED", 403, "permission_error"), ("UNAVAILABLE", 503, "server_error"),
     ("DEADLINE_EXCEEDED", 504, "server_error"), ("INTERNAL", 500, "server_error"), ("CANCELLED", 500, "server_error"),
     ("OUT_OF_RANGE", 400, "invalid_request_error")],
)  # fmt: skip
def test_grpc_status_becomes_the_http_status_and_openai_type(code: str, status: int, kind: str) -> None:
    e = from_rpc_error(_Failed(_service_error(code, f"SOME_{code}")))
    assert (e.status, e.kind, e.code, e.param) == (status, kind, f"some_{code.lower()}", None)
    assert e.body()["error"]["message"] == f"a {code} failure" and "Retry-After" not in e.headers


def test_a_bad_field_is_param_and_retry_info_is_retry_after() -> None:
    bad = from_rpc_error(_Failed(RequestError("height", "must be a multiple of 32, got 40")))
    assert (bad.status, bad.param, bad.code) == (400, "height", "invalid_request")
    full = JobQueueFullError("8 jobs are queued")
    full.retry_after_s = 2.5
    busy = from_rpc_error(_Failed(full))
    assert (busy.status, busy.kind, busy.code, busy.headers) == (429, "rate_limit_error", "job_queue_full",
                                                                  {"Retry-After": "3"})  # fmt: skip
