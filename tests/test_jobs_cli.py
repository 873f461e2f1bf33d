"""`ditserve jobs ...` against a real in-process generator (tests/jobskit.py): create --wait --out writes the MP4
the job's record names, list / get / download / cancel / delete print JSON lines, bad ids exit 2, a failed call 1."""

from __future__ import annotations

import hashlib
from pathlib import Path

from clikit import CliRunner


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
