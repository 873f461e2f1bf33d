"""`ditserve jobs ...` against a real in-process generator (tests/jobskit.py): create --wait --out writes the MP4
the job's record names, list / get / download / cancel / delete print JSON lines, bad ids exit 2, a failed call 1;
the watch bar through a job's records."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from clikit import CliRunner

from ditserve.jobs_cli import show_job
from ditserve.progress import Progress
from protos.ditserve.generator.v1 import generator_pb2 as pb


def test_create_wait_download_list_get_delete(jobs_target: str, run_cli: CliRunner, tmp_path: Path) -> None:
    t = f"--target={jobs_target}"
    out = tmp_path / "fox.mp4"
    res = run_cli(["jobs", "create", t, "--prompt", "a red fox", "--num-inference-steps", "3", "--output-type",
                   "mp4", "--idempotency-key", "cli-1", "--wait", "--out", out, "--progress", "off"])  # fmt: skip
    assert res.code == 0, res.err
    created, final, written = res.json_lines()
    assert created["state"] == "JOB_STATE_QUEUED" and final["state"] == "JOB_STATE_SUCCEEDED"
    job_id = created["job_id"]
    assert final["job_id"] == written["job_id"] == job_id and final["spec"]["request_id"] != "req-0"
    sha = final["result"]["content"]["sha256"]
    assert hashlib.sha256(out.read_bytes()).hexdigest() == sha == written["sha256"]
    again = run_cli(["jobs", "create", t, "--prompt", "a red fox", "--num-inference-steps", "3", "--output-type",
                     "mp4", "--idempotency-key", "cli-1"])  # fmt: skip
    assert again.code == 0 and again.json_lines()[0]["job_id"] == job_id  # the idempotent retry
    listed = run_cli(["jobs", "list", t, "--state", "succeeded", "--limit", "5"])
    assert listed.code == 0 and job_id in [j["job_id"] for j in listed.json_lines()]
    part = tmp_path / "again.mp4.part"
    part.write_bytes(out.read_bytes()[:1000])  # an interrupted download resumes
    dl = run_cli(["jobs", "download", t, job_id, "--out", tmp_path / "again.mp4"])
    assert dl.code == 0 and (tmp_path / "again.mp4").read_bytes() == out.read_bytes() and not part.exists()
    assert run_cli(["jobs", "get", t, job_id]).json_lines()[0]["state"] == "JOB_STATE_SUCCEEDED"
    refused = run_cli(["jobs", "cancel", t, job_id])
    assert refused.code == 1 and "FAILED_PRECONDITION" in refused.err
    assert run_cli(["jobs", "delete", t, job_id]).json_lines() == [{"job_id": job_id, "deleted": True}]
    gone = run_cli(["jobs", "get", t, job_id])
    assert gone.code == 1 and "NOT_FOUND" in gone.err


def test_bad_input_exits_2_naming_the_field(jobs_target: str, run_cli: CliRunner) -> None:
    t = f"--target={jobs_target}"
    bad = run_cli(["jobs", "get", t, "nope"])
    assert bad.code == 2 and "job_id" in bad.err
    frames = run_cli(["jobs", "create", t, "--prompt", "a fox", "--num-frames", "125"])
    assert frames.code == 2 and "num_frames" in frames.err
    limit = run_cli(["jobs", "list", t, "--limit", "0"])
    assert limit.code == 2 and "--limit" in limit.err


def _running(stage: pb.JobStage, done: int, total: int = 49) -> pb.Job:
    return pb.Job(state=pb.JOB_STATE_RUNNING, progress=pb.JobProgress(stage=stage, steps_done=done, steps_total=total))


def test_watch_bar_names_each_stage_after_the_last_step(capsys: pytest.CaptureFixture[str]) -> None:
    """A watch sees only the latest record, so the last step arrives as the decoding record (as a real job's watch
    does): the bar is full from then on and names decoding, muxing and storing."""
    records = [
        pb.Job(state=pb.JOB_STATE_QUEUED, queue_position=2),
        _running(pb.JOB_STAGE_PREPARING, 0),
        _running(pb.JOB_STAGE_DENOISING, 48),
        _running(pb.JOB_STAGE_DECODING, 49),
        _running(pb.JOB_STAGE_MUXING, 49),
        _running(pb.JOB_STAGE_STORING, 49),
    ]
    seen = []
    with Progress("job_x", enabled=True) as bar:
        for job in records:
            show_job(bar, job)
            seen.append((bar.bar.desc, bar.bar.n, bar.bar.total))
    assert seen == [
        ("job_x queued, position 2", 0, None),
        ("job_x preparing", 0, 49),
        ("job_x denoising", 48, 49),
        ("job_x decoding", 49, 49),
        ("job_x muxing", 49, 49),
        ("job_x storing", 49, 49),
    ]
    drawn = capsys.readouterr().err
    assert "job_x decoding: 100%" in drawn and "job_x storing: 100%" in drawn


def test_status_prints_getstatus_as_json(jobs_target: str, run_cli: CliRunner) -> None:
    res = run_cli(["status", f"--target={jobs_target}"])
    assert res.code == 0, res.err
    [status] = res.json_lines()
    assert status["serving"] is True and status["adaln_mode"] == "ADALN_MODE_RESIDENT"
    down = run_cli(["status", "--target=127.0.0.1:1", "--timeout-s", "2"])
    assert down.code == 1 and "ditserve status: failed: UNAVAILABLE" in down.err
