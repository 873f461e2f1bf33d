"""The /v1/videos facade over a generator with per-client keys, driven by the real `openai` package: the facade
forwards each client's own key, so a client sees only its own videos (another's is 404, exactly as an unknown id),
and a client without a key is 401."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from jobskit import facade, jobs_server, write_keys

from ditserve.jobs_client import JobsClient
from ditserve.openai.config import FacadeConfig

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
ALICE, BOB = "alice-facade-key-0123456789", "bob-facade-key-0123456789ab"


@pytest.fixture(scope="module")
def base_url(svc_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("owners")
    keys = write_keys(root / "keys", {"alice": ALICE, "bob": BOB})
    with (
        jobs_server(svc_ckpt, root / "state", client_keys_file=keys) as srv,
        JobsClient(f"127.0.0.1:{srv.port}") as jobs,
        facade(jobs, FacadeConfig()) as url,  # no key of its own: each client's is the generator's to check
    ):
        yield url


def client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)


@pytest.fixture(autouse=True)
def _no_uname(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openai._base_client, "get_platform", lambda: "Linux")  # no `uname -p` process


def test_a_client_sees_only_its_own_videos(base_url: str) -> None:
    alice, bob = client(base_url, ALICE), client(base_url, BOB)
    video = alice.videos.create(prompt="a red fox", seconds="5", size="64x32",
                                extra_body={"num_inference_steps": 3, "seed": 9})  # fmt: skip
    assert alice.videos.retrieve(video.id).id == video.id
    with pytest.raises(openai.NotFoundError):
        bob.videos.retrieve(video.id)
    with pytest.raises(openai.NotFoundError):
        bob.videos.delete(video.id)
    with pytest.raises(openai.NotFoundError):
        bob.videos.download_content(video.id)
    assert video.id not in {v.id for v in bob.videos.list()}
    assert video.id in {v.id for v in alice.videos.list()}
    assert alice.videos.retrieve(video.id).id == video.id  # bob's delete changed nothing


def test_no_or_an_unknown_key_is_401(base_url: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as no_key:
        urllib.request.urlopen(f"{base_url}/videos", timeout=30)
    assert no_key.value.code == 401
    body = json.loads(no_key.value.read())
    assert body["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError) as err:
        client(base_url, "sk-not-a-key-of-this-server-at-all").videos.list()
    assert err.value.status_code == 401 and "sk-not-a-key" not in str(err.value)
