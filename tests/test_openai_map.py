"""The /v1/videos mapping without a server: seconds -> frames, size, the create body and its keyframes (strict
JSON: finite numbers, integers that are integers), a job as OpenAI's Video (progress in every state, `seconds` as
asked, `expires_at`), a gRPC status (as the services send it) as OpenAI's error with a code."""

from __future__ import annotations

import base64

import grpc
import pytest

from ditcore import RequestError
from ditruntime.errors import ServiceError
from ditruntime.rpc_errors import to_status
from ditserve.jobs_client import StalledStreamError
from ditserve.openai.mapping import (
    ApiError,
    create_body,
    frames_for_seconds,
    from_rpc_error,
    parse_json_object,
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
    assert cancelled["ditserve_state"] == "cancelled"


def test_a_cancelled_or_failed_video_keeps_the_steps_it_finished() -> None:
    assert video_object(_job(pb.JOB_STATE_CANCELLED, 6, 99))["progress"] == 6
    assert video_object(_job(pb.JOB_STATE_FAILED, 50, 100))["progress"] == 49
    assert video_object(_job(pb.JOB_STATE_CANCELLED, 99, 99))["progress"] == 99  # 100 only when completed


def test_seconds_are_echoed_as_asked_and_the_real_length_is_duration_seconds() -> None:
    body = create_body({"prompt": "a fox", "seconds": "5"})
    video = video_object(_job(pb.JOB_STATE_QUEUED), body.model, body.seconds)
    assert (video["seconds"], video["duration_seconds"]) == ("5", 5.167)
    assert create_body({"prompt": "a fox", "seconds": 10}).seconds == "10"  # a JSON number, as its text
    assert create_body({"prompt": "a fox", "seconds": "5.2"}).seconds == "5.2"
    assert create_body({"prompt": "a fox"}).seconds is None
    assert video_object(_job(pb.JOB_STATE_RUNNING))["seconds"] == "5"  # retrieve: the whole seconds 124 frames are
    odd = _job(pb.JOB_STATE_RUNNING)
    odd.spec.num_frames = 158  # no whole second maps here (6 s: 141, 7 s: 175): its real length
    assert video_object(odd)["seconds"] == "6.58"


def test_expires_at_is_the_jobs_retention_deadline() -> None:
    job = _job(pb.JOB_STATE_SUCCEEDED, 4)
    assert video_object(job)["expires_at"] is None  # unset (queued, running, or an older generator)
    job.expires_at.FromSeconds(100 + 7 * 24 * 3600)
    assert video_object(job)["expires_at"] == 100 + 7 * 24 * 3600


@pytest.mark.parametrize(
    ("raw", "param"),
    [(b'{"prompt": "x", "seed": NaN}', "seed"), (b'{"prompt": "x", "flow_shift": Infinity}', "flow_shift"),
     (b'{"prompt": "x", "flow_shift": -Infinity}', "flow_shift"), (b'{"prompt": "x", "seconds": 1e999}', "seconds"),
     (b'{"prompt": "x", "input_reference": {"image_url": [1, NaN]}}', "input_reference")],
)  # fmt: skip
def test_a_number_that_is_not_finite_is_refused_naming_its_field(raw: bytes, param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_json_object(raw)
    assert (err.value.status, err.value.param) == (400, param) and "finite" in err.value.message


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"a fox"', b"{", b"\xff\xfe{}", b"[" * 100_000])
def test_a_body_that_is_no_json_object_is_refused(raw: bytes) -> None:
    with pytest.raises(ApiError) as err:
        parse_json_object(raw)
    assert (err.value.status, err.value.code) == (400, "invalid_json")


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"seed": 1.5}, "seed"), ({"seed": "1.5"}, "seed"), ({"seed": True}, "seed"), ({"seed": 7.0}, "seed"),
     ({"seed": -1}, "seed"), ({"seed": 2**63}, "seed"), ({"num_inference_steps": 2.5}, "num_inference_steps"),
     ({"num_inference_steps": 0}, "num_inference_steps"), ({"flow_shift": "nan"}, "flow_shift"),
     ({"flow_shift": "inf"}, "flow_shift"), ({"flow_shift": 10**400}, "flow_shift"), ({"flow_shift": True}, "flow_shift"),
     ({"idempotency_key": {"a": 1}}, "idempotency_key")],
)  # fmt: skip
def test_integers_are_integers_and_numbers_finite(fields: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as err:
        create_body({"prompt": "a fox", **fields})
    assert (err.value.status, err.value.param) == (400, param)
    assert param in err.value.message


def test_integer_and_number_fields_take_their_text_from_multipart() -> None:
    r = create_body({"prompt": "a fox", "seed": "9", "num_inference_steps": " 3", "flow_shift": "2.5"}).request
    assert (r.seed, r.num_inference_steps, r.flow_shift) == (9, 3, 2.5)


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
     ("FAILED_PRECONDITION", 409, "invalid_request_error"), ("PERMISSION_DENIED", 403, "permission_error"), ("UNAVAILABLE", 503, "server_error"),
     ("DEADLINE_EXCEEDED", 504, "server_error"), ("INTERNAL", 500, "server_error"), ("CANCELLED", 500, "server_error"),
     ("OUT_OF_RANGE", 400, "invalid_request_error")],
)  # fmt: skip
def test_grpc_status_becomes_the_http_status_and_openai_type(code: str, status: int, kind: str) -> None:
    e = from_rpc_error(_Failed(_service_error(code, f"SOME_{code}")))
    assert (e.status, e.kind, e.code, e.param) == (status, kind, f"some_{code.lower()}", None)
    assert e.body()["error"]["message"] == f"a {code} failure" and "Retry-After" not in e.headers


@pytest.mark.parametrize(
    ("code", "status", "expected"),
    [(grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_api_key"), (grpc.StatusCode.PERMISSION_DENIED, 403,
     "permission_denied"), (grpc.StatusCode.NOT_FOUND, 404, "not_found"), (grpc.StatusCode.INVALID_ARGUMENT, 400,
     "invalid_argument"), (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_exceeded"),
     (grpc.StatusCode.UNAVAILABLE, 503, "backend_unavailable"), (grpc.StatusCode.DEADLINE_EXCEEDED, 504,
     "backend_timeout"), (grpc.StatusCode.INTERNAL, 500, "backend_error"), (grpc.StatusCode.UNKNOWN, 500,
     "backend_error")],
)  # fmt: skip
def test_a_status_without_details_still_has_a_code(code: grpc.StatusCode, status: int, expected: str) -> None:
    e = from_rpc_error(_Bare(code, "failed to connect to all addresses; last error: ipv4:10.1.2.3:50051"))
    assert (e.status, e.code) == (status, expected)
    if status >= 500:  # the runtime's own text (addresses, internals) stays in the facade
        assert "10.1.2.3" not in e.message and "generator" in e.message
    assert ("Retry-After" in e.headers) == (status == 429)


def test_unauthenticated_is_invalid_api_key_whatever_the_reason() -> None:
    e = from_rpc_error(_Failed(_service_error("UNAUTHENTICATED", "KEY_UNKNOWN")))
    assert (e.status, e.kind, e.code, e.message) == (401, "authentication_error", "invalid_api_key",
                                                      "a UNAUTHENTICATED failure")  # fmt: skip


def test_a_stalled_stream_is_a_gateway_timeout() -> None:
    e = from_rpc_error(StalledStreamError("job_1", 0.5))
    assert (e.status, e.code, e.kind) == (504, "backend_timeout", "server_error")


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 409, 413, 415, 422, 429, 500, 503, 504, 418, 599])
def test_every_error_body_has_openais_four_keys_and_a_code(status: int) -> None:
    body = ApiError(status, "m").body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and isinstance(body["code"], str) and body["code"]


class _Bare(grpc.RpcError):
    """A failure with no rich status, as the gRPC runtime raises it (a refused connection, a deadline)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[()]:
        return ()


def test_a_bad_field_is_param_and_retry_info_is_retry_after() -> None:
    bad = from_rpc_error(_Failed(RequestError("height", "must be a multiple of 32, got 40")))
    assert (bad.status, bad.param, bad.code) == (400, "height", "invalid_request")
    full = JobQueueFullError("8 jobs are queued")
    full.retry_after_s = 2.5
    busy = from_rpc_error(_Failed(full))
    assert (busy.status, busy.kind, busy.code, busy.headers) == (429, "rate_limit_error", "job_queue_full",
                                                                  {"Retry-After": "3"})  # fmt: skip
