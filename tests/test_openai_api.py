"""The OpenAI-compatible /v1/videos facade, driven by the real `openai` package as a user would, over a real
generator's Jobs API (tests/jobskit.py): create, poll retrieve, download the MP4 (checked with PyAV) and its
thumbnail, list with paging, delete; an input_reference (file or image_url) as the first frame; bad input as
OpenAI's errors naming the field; the bearer key; the jobs client's download over a stale partial file."""

from __future__ import annotations

import base64
import hashlib
import io
from collections.abc import Iterator
from pathlib import Path

import av
import httpx2
import openai
import pytest
from jobskit import facade
from PIL import Image
from servicekit import wait_for

from ditserve.jobs_client import JobsClient
from ditserve.openai.config import FacadeConfig
from protos.ditserve.generator.v1 import generator_pb2 as pb

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the client's notice of OpenAI's
# own service; this facade is not it
KEY = "sk-test-0123456789abcdef"
QUICK = {"num_inference_steps": 3, "seed": 5}


@pytest.fixture(scope="module")
def base_url(jobs_target: str) -> Iterator[str]:
    with JobsClient(jobs_target) as jobs, facade(jobs, FacadeConfig(api_key=KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with pytest.MonkeyPatch.context() as mp:
        # its X-Stainless-OS header: platform.platform() runs `uname -p`, a process this quick-tier module must not start
        mp.setattr(openai._base_client, "get_platform", lambda: "Linux")
        yield openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0)


def _done(client: openai.OpenAI, video_id: str) -> openai.types.Video:
    seen: list[int] = []

    def finished() -> openai.types.Video | None:
        v = client.videos.retrieve(video_id)
        seen.append(v.progress)
        return v if v.status in ("completed", "failed") else None

    video = wait_for(finished, 120, "the video", interval=0.1)
    assert seen == sorted(seen) and all(p < 100 for p in seen[:-1])  # progress never goes back, 100 only at the end
    return video


def test_create_poll_download_list_delete(client: openai.OpenAI, tmp_path: object) -> None:
    video = client.videos.create(prompt="a red fox", model="minimax-h3", seconds="5", size="64x32",
                                 extra_body=QUICK)  # fmt: skip
    assert video.status == "queued" and video.id.startswith("job_") and video.size == "64x32"
    assert video.seconds == "5" and (video.model_extra or {})["duration_seconds"] == 5.167  # as asked; the real length
    done = _done(client, video.id)
    assert done.status == "completed" and done.progress == 100 and done.completed_at is not None
    data = client.videos.download_content(video.id).read()
    extra = done.model_extra or {}
    assert hashlib.sha256(data).hexdigest() == extra["sha256"]
    with av.open(io.BytesIO(data)) as mp4:
        kinds = {s.type for s in mp4.streams}
        frames = sum(1 for _ in mp4.decode(video=0))
    assert kinds == {"video", "audio"} and frames == 124
    thumb = client.videos.download_content(video.id, variant="thumbnail").read()
    assert Image.open(io.BytesIO(thumb)).size == (64, 32)
    second = client.videos.create(prompt="a blue fox", extra_body=QUICK)
    _done(client, second.id)
    page = client.videos.list(limit=1, order="desc")
    assert [v.id for v in page.data] == [second.id] and page.has_more
    after = client.videos.list(limit=1, after=second.id, order="desc")
    assert [v.id for v in after.data] == [video.id]
    deleted = client.videos.delete(video.id)
    assert deleted.deleted and deleted.id == video.id
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def test_bad_input_is_openais_error_naming_the_field(client: openai.OpenAI, base_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(prompt="a fox", seconds="30")
    assert err.value.body["param"] == "seconds" and "5, 15" in err.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(prompt="a fox", size="big")
    assert err.value.body["param"] == "size"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:  # the server's own rule: a height not a multiple of 32
        client.videos.create(prompt="a fox", size="64x40", extra_body=QUICK)
    assert err.value.body["param"] == "height"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.videos.retrieve("nope")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).videos.list()
    auth = {"Authorization": f"Bearer {KEY}"}
    for limit in (0, "abc"):  # out of range, and not a number (FastAPI's own check, in OpenAI's shape too)
        raw = httpx2.get(f"{base_url}/videos", params={"limit": limit}, headers=auth)
        assert raw.status_code == 400 and raw.json()["error"]["param"] == "limit"
    with pytest.raises(openai.BadRequestError) as err:  # a typo is refused, not ignored
        client.videos.create(prompt="a fox", extra_body={"secconds": "30"})
    assert err.value.body["param"] == "secconds"  # type: ignore[index]
    raw = httpx2.post(f"{base_url}/videos", json={"prompt": "a fox", "input_reference": {"file_id": "f"}}, headers=auth)
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "input_reference"  # no file ids here
    raw = httpx2.get(f"{base_url}/nothing", headers=auth)
    assert raw.status_code == 404 and set(raw.json()["error"]) == {"message", "type", "param", "code"}


def test_an_input_reference_is_the_first_frame(client: openai.OpenAI, base_url: str, jobs_target: str) -> None:
    png = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 80, 20)).save(png, format="PNG")
    video = client.videos.create(prompt="the fox turns", input_reference=("fox.png", png.getvalue(), "image/png"),
                                 extra_body=QUICK)  # fmt: skip
    # OpenAI's image reference object, in a JSON body (the openai package sends only files in input_reference)
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    raw = httpx2.post(f"{base_url}/videos", json={"prompt": "the fox turns", "input_reference": {"image_url": url},
                      **QUICK}, headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert raw.status_code == 200, raw.text
    with JobsClient(jobs_target) as jobs:
        for video_id in (video.id, raw.json()["id"]):
            spec = jobs.get(video_id).spec
            assert (spec.task, spec.has_first_frame, spec.has_last_frame) == (pb.TASK_FL2VA, True, False)
    assert client.videos.delete(raw.json()["id"]).deleted
    done = _done(client, video.id)
    assert done.status == "completed", done.error


def test_a_download_starts_over_when_the_partial_file_is_stale(client: openai.OpenAI, jobs_target: str,
                                                                tmp_path: Path) -> None:  # fmt: skip
    video = client.videos.create(prompt="a green fox", extra_body=QUICK)
    sha = (_done(client, video.id).model_extra or {})["sha256"]
    dest = tmp_path / "fox.mp4"
    with JobsClient(jobs_target) as jobs:
        dest.with_name("fox.mp4.part").write_bytes(b"\0" * (64 << 20))  # longer than the content: OUT_OF_RANGE
        assert jobs.download(video.id, dest) == (dest, sha)
        data = dest.read_bytes()
        dest.with_name("fox.mp4.part").write_bytes(data[:1000])  # a true prefix resumes
        dest.unlink()
        assert jobs.download(video.id, dest) == (dest, sha) and dest.read_bytes() == data
        assert not dest.with_name("fox.mp4.part").exists()
