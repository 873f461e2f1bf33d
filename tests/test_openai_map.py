"""The /v1/videos mapping without a server: seconds -> frames, size, the create body, a job as OpenAI's Video, a
gRPC status as OpenAI's error."""

from __future__ import annotations

import pytest

from ditserve.openai_map import ApiError, create_body, frames_for_seconds, parse_size, video_object
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
