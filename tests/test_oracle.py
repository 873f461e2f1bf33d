"""The oracle through the command line: the final video and audio latents `ditserve generate-local` writes, resident
and cached (cold build, slab hit, host swap-in), in float32 and in the released mixed precision, are torch.equal to
diffusers' own MiniMax-H3 loop run directly on the same repository (tests/oracle.py). `sha256` is the digest of the
raw little-endian bytes of those video latents, then audio latents."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from clikit import CliRunner
from oracle import diffusers_request_latents
from safetensors.torch import load_file

# Two requests with different plan groups; the slab holds one group only, so the third request (FOX again) finds
# its plans evicted from the slab and swaps them in from the host tier.
FOX: dict[str, Any] = {"request_id": "fox-cold", "prompt": "a red fox in the snow", "num_inference_steps": 5,
                       "seed": 4, "num_frames": 124, "height": 32, "width": 32}  # fmt: skip
RAIN: dict[str, Any] = {"request_id": "rain", "prompt": "rain on a tin roof", "num_inference_steps": 6, "seed": 9,
                        "num_frames": 141, "height": 64, "width": 32, "flow_shift": 7.0, "audio_flow_shift": 2.0}  # fmt: skip
RUN = [FOX, {**FOX, "request_id": "fox-slot"}, RAIN, {**FOX, "request_id": "fox-host"}]


def latents_digest(video: torch.Tensor, audio: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in (video, audio):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module", params=["float32", "mixed"])
def oracle_repo(request: pytest.FixtureRequest, tiny_ckpt: Path, tiny_ckpt_f32: Path) -> Path:
    return tiny_ckpt_f32 if request.param == "float32" else tiny_ckpt


@pytest.fixture(scope="module")
def expected(oracle_repo: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {name: diffusers_request_latents(oracle_repo, req) for name, req in (("fox", FOX), ("rain", RAIN))}


def run_local(run_cli: CliRunner, repo: Path, tmp_path: Path, mode: str, extra: list[str]) -> list[dict[str, Any]]:
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(r) + "\n" for r in RUN))
    out = tmp_path / mode
    res = run_cli(["generate-local", "--checkpoint", repo, "--adaln-mode", mode, "--requests", requests,
                   "--out", out, *extra])  # fmt: skip
    assert res.code == 0, res.err
    lines = res.json_lines()
    assert [line["request_id"] for line in lines] == [r["request_id"] for r in RUN]
    return lines


def check_against_diffusers(lines: list[dict[str, Any]], out: Path, expected: dict[str, Any]) -> None:
    for line in lines:
        saved = load_file(out / f"{line['request_id']}.safetensors")
        ref_video, ref_audio = expected["rain" if line["request_id"] == "rain" else "fox"]
        assert torch.equal(saved["video"], ref_video), line["request_id"]
        assert torch.equal(saved["audio"], ref_audio), line["request_id"]
        assert line["sha256"] == latents_digest(ref_video, ref_audio)


def test_generate_local_resident_equals_diffusers(
    run_cli: CliRunner, oracle_repo: Path, expected: dict[str, Any], tmp_path: Path
) -> None:
    lines = run_local(run_cli, oracle_repo, tmp_path, "resident", [])
    check_against_diffusers(lines, tmp_path / "resident", expected)


def test_generate_local_cached_equals_diffusers_cold_slot_and_host(
    run_cli: CliRunner, oracle_repo: Path, expected: dict[str, Any], tmp_path: Path
) -> None:
    # 5 slots. FOX's group is 4 plans; RAIN's is 5, sharing FOX's first (both start at t = 0), so RAIN evicts FOX's
    # other three; the host tier keeps both groups, so FOX's third run swaps them in.
    lines = run_local(run_cli, oracle_repo, tmp_path, "cached", ["--gpu-plans", "5", "--plan-width", "2"])
    check_against_diffusers(lines, tmp_path / "cached", expected)
    cache = {line["request_id"]: line["cache"] for line in lines}
    assert cache["fox-cold"]["built_plans"] == 4 and cache["fox-cold"]["gpu_hit_plans"] == 0
    assert cache["fox-slot"]["gpu_hit_plans"] == 4 and cache["fox-slot"]["built_plans"] == 0
    assert (cache["rain"]["built_plans"], cache["rain"]["gpu_hit_plans"]) == (4, 1)
    fox_host = cache["fox-host"]
    assert (fox_host["host_hit_plans"], fox_host["gpu_hit_plans"], fox_host["built_plans"]) == (3, 1, 0)


def test_ditserve_generate_through_the_service_pair_equals_diffusers(
    run_cli: CliRunner, pairs: Any, weights: Any, tmp_path: Path
) -> None:
    """`ditserve generate` (GenerateStream through a cached sidecar + generator pair) writes diffusers' latents."""
    pair = pairs(weights.a)
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(r) + "\n" for r in RUN[:3]))
    res = run_cli(["generate", "--target", pair.target, "--requests", requests, "--out", tmp_path / "out"])
    assert res.code == 0, res.err
    lines = res.json_lines()
    assert [line["request_id"] for line in lines] == ["fox-cold", "fox-slot", "rain"]
    expected = {name: diffusers_request_latents(weights.a, req) for name, req in (("fox", FOX), ("rain", RAIN))}
    check_against_diffusers(lines, tmp_path / "out", expected)
    assert lines[1]["cache"]["gpu_hit_plans"] == 4 and lines[1]["cache"]["built_plans"] == 0
