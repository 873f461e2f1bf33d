"""Jobs outlive their clients and a `kill -9` of the generator (real processes, the real grpcurl and the real
`openai` package through the /v1/videos facade): a running job runs again after the restart and its content has
the sha256 a synchronous Generate of the same request gives; queued jobs keep their order."""

from __future__ import annotations

import base64
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
from servicekit import ProcessGroup, free_port, wait_for
from test_e2e_grpcurl import run_grpcurl

from ditserve.supervise import wait_http

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]
LONG = {"prompt": "a red fox", "output_type": "OUTPUT_TYPE_MP4", "num_inference_steps": 300, "seed": 3}
"""Long enough (a few seconds here) to be caught running, then killed."""


def _call(target: str, method: str, data: dict[str, Any], *opts: str) -> dict[str, Any]:
    r = run_grpcurl(["-plaintext", *opts, "-d", json.dumps(data), target, method], timeout=120)
    assert r.code == 0, r.text
    return json.loads(r.out)


def _job(target: str, job_id: str) -> dict[str, Any]:
    return _call(target, "ditserve.generator.v1.Jobs/GetJob", {"job_id": job_id})["job"]


def _content_sha(target: str, job_id: str) -> tuple[str, str]:
    """(the header's sha256, the sha256 of the chunks grpcurl printed)."""
    r = run_grpcurl(["-plaintext", "-d", json.dumps({"job_id": job_id}), target,
                     "ditserve.generator.v1.Jobs/GetJobContent"], timeout=120)  # fmt: skip
    assert r.code == 0, r.text
    decoder, text, i, header, digest = json.JSONDecoder(), r.out, 0, None, hashlib.sha256()
    while (i := len(text) - len(text[i:].lstrip())) < len(text):
        msg, i = decoder.raw_decode(text, i)
        if "header" in msg:
            header = msg["header"]
        else:
            digest.update(base64.b64decode(msg["chunk"].get("data", "")))
    assert header is not None
    return header["content"]["sha256"], digest.hexdigest()


def test_jobs_survive_kill9_of_the_generator(procs: ProcessGroup, svc_ckpt: Path, tmp_path: Path) -> None:
    target = f"127.0.0.1:{free_port()}"
    gen_argv = [sys.executable, "-m", "generator_service", "--adaln-mode", "resident", "--checkpoint", svc_ckpt,
                "--listen", target, "--state-dir", tmp_path / "state", "--replica-id", "e2e"]  # fmt: skip
    gen = procs.start("generator", gen_argv)
    procs.wait_healthy(target, gen)
    http = free_port()
    facade = procs.start("openai-api", [sys.executable, "-m", "ditserve", "openai-api", "--target", target,
                                        "--port", http])  # fmt: skip
    wait_http(f"http://127.0.0.1:{http}/v1/videos", 60, facade.proc)
    created = _call(target, "ditserve.generator.v1.Jobs/CreateJob", {"request": LONG, "idempotency_key": "long"})
    running = created["job"]["job_id"]  # grpcurl has exited: the client is gone
    queued = _call(target, "ditserve.generator.v1.Jobs/CreateJob", {"request": {**LONG, "seed": 4,
                   "num_inference_steps": 3}})["job"]["job_id"]  # fmt: skip
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", max_retries=0)
    video = client.videos.create(prompt="a blue fox", extra_body={"num_inference_steps": 3, "seed": 5})
    wait_for(lambda: int(_job(target, running)["progress"].get("steps_done", 0)) >= 1, 120, "the job to run")
    gen.kill9()
    gen.start()
    procs.wait_healthy(target, gen)
    wait_for(lambda: _job(target, queued)["state"] == "JOB_STATE_SUCCEEDED", 300, "the queued job after the restart")
    first, second = _job(target, running), _job(target, queued)
    assert first["state"] == "JOB_STATE_SUCCEEDED" and first["attempts"] == 2  # ran again after the kill
    assert second["attempts"] == 1 and second["started_at"] >= first["started_at"]  # the order kept
    header_sha, streamed_sha = _content_sha(target, running)
    assert header_sha == streamed_sha == first["result"]["content"]["sha256"]
    sync = _call(target, "ditserve.generator.v1.Generator/Generate", LONG, "-max-msg-sz", str(64 << 20))
    assert sync["media"]["sha256"] == header_sha and sync["sha256"] == first["result"]["sha256"]
    again = _call(target, "ditserve.generator.v1.Jobs/CreateJob", {"request": LONG, "idempotency_key": "long"})
    assert again["job"]["job_id"] == running and not again.get("created", False)  # the idempotent retry
    done = wait_for(lambda: (v := client.videos.retrieve(video.id)).status == "completed" and v, 120, "the video")
    data = client.videos.download_content(video.id).read()
    assert hashlib.sha256(data).hexdigest() == (done.model_extra or {})["sha256"]
