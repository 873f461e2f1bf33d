"""Quality levels listed and audited (issue 35): ListQualityLevels says what each level allows and what its audits
cover; `ditserve audit-quality` runs requests lossless and at a level on a served generator (the tiny preset: the
numbers mean nothing for quality, the mechanism is real), writes one record per request where the server reads
them, and a passing record lets an unaudited request through while a failing one does not; a line the level refuses
is reported and the others still run; `ditserve quality-levels` prints the table."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from clikit import run_cli_inprocess
from servicekit import TOKEN, Pair, error_info

from ditserve.client import GeneratorClient
from ditserve.quality_measures import FramesAndWav, compare

LEVELS = """
[levels.fast]
description = "FirstBlockCache at 0.3 (tests; loose thresholds)"
cache = { kind = "first_block", threshold = 0.3 }
tasks = ["t2va"]
steps = [12]
max_num_frames = 141
unaudited = "refuse"
audit = { min_psnr_db = 0.0, min_ssim = -1.0, min_audio_snr_db = -1000.0 }

[levels.harsh]
cache = { kind = "first_block", threshold = 0.3 }
steps = [12]
audit = { min_psnr_db = 1000.0, min_ssim = 2.0 }
"""
REQUEST = {"prompt": "a red fox", "num_inference_steps": 12, "seed": 7}


@pytest.fixture(scope="module")
def served(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pair, Path]]:
    root = tmp_path_factory.mktemp("audit")
    (root / "levels.toml").write_text(LEVELS)
    with Pair(tiny_ckpt, mode="resident", quality_levels=root / "levels.toml", quality_audit_dir=root / "audits",
              admin_token=TOKEN) as pair:  # fmt: skip
        yield pair.start(), root


def _jsonl(path: Path, *lines: dict[str, object]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _audit(pair: Pair, root: Path, level: str, requests: Path) -> tuple[int, list[dict[str, object]], str]:
    res = run_cli_inprocess(["audit-quality", "--target", pair.target, "--level", level, "--requests", requests,
                             "--audit-dir", root / "audits", "--out", root / f"{level}.report.json",
                             "--token", TOKEN])  # fmt: skip
    return res.code, res.json_lines(), res.err


def _refused(pair: Pair, fields: dict[str, object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        pair.generate({**REQUEST, **fields}, request_id="refused")
    return err.value


def test_list_quality_levels_says_what_each_level_allows(served: tuple[Pair, Path]) -> None:
    pair, root = served
    with GeneratorClient(pair.target) as client:
        resp = client.list_quality_levels()
    assert [lv.name for lv in resp.levels] == ["lossless", "fast", "harsh"]
    assert resp.world_size == 1 and resp.transformer_blocks > 0 and resp.source == str(root / "levels.toml")
    lossless, fast, harsh = resp.levels
    assert not lossless.HasField("cache") and not lossless.digest and not lossless.HasField("audits")
    assert fast.cache.kind == "first_block" and json.loads(fast.cache.params_json) == {"threshold": 0.3}
    assert list(fast.tasks) == ["t2va"] and list(fast.steps) == [12] and fast.max_num_frames == 141
    assert list(fast.world_sizes) == [1] and fast.adapters == "none" and fast.unaudited == "refuse"
    assert dict(fast.thresholds) == {"min_psnr_db": 0.0, "min_ssim": -1.0, "min_audio_snr_db": -1000.0}
    import hashlib

    assert fast.digest == hashlib.sha256(fast.definition_json.encode()).hexdigest() != harsh.digest
    assert harsh.tasks == lossless.tasks and harsh.audits.passed == 0 and not harsh.audits.HasField("last_audit_at")


def test_an_audit_that_passes_lets_the_level_serve_its_shapes(served: tuple[Pair, Path]) -> None:
    pair, root = served
    err = _refused(pair, {"quality": "fast"})
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(err)
    assert info is not None and info.reason == "QUALITY_NOT_AUDITED"
    requests = _jsonl(root / "fast.jsonl", {**REQUEST, "request_id": "a"}, {**REQUEST, "request_id": "b",
                                                                              "num_frames": 141})  # fmt: skip
    code, lines, stderr = _audit(pair, root, "fast", requests)
    assert code == 0, stderr
    *per_request, summary = lines
    assert summary["summary"] == {**summary["summary"], "requests": 2, "passed": 2, "failed": 0, "refused": 0}
    for line in per_request:
        m = line["measures"]
        assert line["passed"] and line["misses"] == [] and str(line["quality_warning"]).startswith("audit run: ")
        assert 0 < m["skipped_fraction"] <= 1 and m["latency_ratio"] > 0 and m["blocks_skipped"] > 0
        assert m["psnr_db"] > 0 and -1 <= m["ssim"] <= 1 and -1 <= m["audio_corr"] <= 1
    records = [json.loads(x) for x in (root / "audits" / "fast.jsonl").read_text().splitlines()]
    assert [r["shape"] for r in records] == [["t2va", 12, 32, 32, 124, 1], ["t2va", 12, 32, 32, 141, 1]]
    assert all(r["passed"] and r["level"] == "fast" and r["digest"] == per_request[0]["digest"] for r in records)
    assert set(records[0]["measures"]) >= {"psnr_db", "ssim", "audio_snr_db", "audio_corr", "latency_ratio",
                                           "skipped_fraction"}  # fmt: skip
    assert json.loads((root / "fast.report.json").read_text())["summary"]["passed"] == 2
    ok = pair.generate({**REQUEST, "quality": "fast", "num_frames": 141}, request_id="after")
    assert ok.quality == "fast" and not ok.quality_warning and sum(ok.blocks_skipped) > 0
    assert _refused(pair, {"quality": "fast", "seed": 9, "num_frames": 124 + 17 * 2}).code() == (
        grpc.StatusCode.INVALID_ARGUMENT  # 158 frames: beyond the level's bound, audited or not
    )
    with GeneratorClient(pair.target) as client:
        fast = client.list_quality_levels().levels[1]
    assert fast.audits.passed == 2 and fast.audits.failed == 0 and fast.audits.HasField("last_audit_at")
    assert [(s.num_frames, s.world_size) for s in fast.audits.covered] == [(124, 1), (141, 1)]


def test_a_failing_audit_leaves_the_level_refused_and_a_refused_line_does_not_stop_the_others(
    served: tuple[Pair, Path],
) -> None:
    pair, root = served
    requests = _jsonl(root / "harsh.jsonl", {**REQUEST, "request_id": "bad", "num_inference_steps": 8},
                      {**REQUEST, "request_id": "good"})  # fmt: skip
    code, lines, _ = _audit(pair, root, "harsh", requests)
    assert code == 1
    bad, good, summary = lines
    assert bad["passed"] is False and "measures" not in bad
    refused = str(bad["refused"])
    assert refused.startswith("INVALID_ARGUMENT: ") and "level harsh runs with num_inference_steps 12, not 8" in refused
    assert good["passed"] is False and any(m.startswith("ssim ") for m in good["misses"])
    assert summary["summary"]["failed"] == 1 and summary["summary"]["refused"] == 1
    (record,) = [json.loads(x) for x in (root / "audits" / "harsh.jsonl").read_text().splitlines()]
    assert record["passed"] is False and record["shape"] == ["t2va", 12, 32, 32, 124, 1]
    err = _refused(pair, {"quality": "harsh"})
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION  # a failing record covers nothing


def test_an_audit_run_needs_the_admin_token_and_is_never_a_job(served: tuple[Pair, Path]) -> None:
    """`quality_audit` runs a level where no audit covers it yet: only the operator may ask that (the admin token,
    as UpdateWeights); a job may not carry it."""
    from ditruntime.auth import bearer_metadata
    from ditserve.client import GeneratorClient
    from ditserve.jobs_client import JobsClient

    pair, _ = served
    audit = {**REQUEST, "quality": "fast", "quality_audit": True}
    with GeneratorClient(pair.target) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(audit, timeout=120)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            client.generate(audit, timeout=120, metadata=[("authorization", "Bearer " + "x" * 32)])
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with JobsClient(pair.target, metadata=bearer_metadata(TOKEN)) as jobs, pytest.raises(grpc.RpcError) as err:
        jobs.create({**audit, "request_id": "ja"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "quality_audit" in (err.value.details() or "")


def test_audit_usage_errors_exit_2(served: tuple[Pair, Path], tmp_path: Path) -> None:
    pair, _ = served
    requests = _jsonl(tmp_path / "r.jsonl", REQUEST)
    base = ["audit-quality", "--target", pair.target, "--requests", requests, "--audit-dir", tmp_path]
    res = run_cli_inprocess([*base, "--level", "turbo"])
    assert res.code == 2 and "unknown level 'turbo'; the server serves lossless, fast, harsh" in res.err
    assert run_cli_inprocess([*base, "--level", "lossless"]).code == 2
    res = run_cli_inprocess([*base[:4], tmp_path / "none.jsonl", "--audit-dir", tmp_path, "--level", "fast"])
    assert res.code == 2 and "no such file" in res.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]  # no record written


def test_identical_results_measure_infinite_psnr_and_ssim_one() -> None:
    rng = np.random.default_rng(0)
    a = FramesAndWav(rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8), rng.uniform(-1, 1, (2, 800)), 24000)
    same = compare(a, a)
    assert same == {"psnr_db": math.inf, "ssim": 1.0, "audio_snr_db": math.inf, "audio_corr": 1.0}
    from ditcore.quality import QualityLevel, verdict
    from ditcore.step_cache import StepCache

    assert verdict(QualityLevel("x", StepCache("first_block"), audit=(("min_psnr_db", 1e9),)), same) == (True, [])
    noisy = FramesAndWav(np.clip(a.frames.astype(int) + 3, 0, 255).astype(np.uint8), a.audio * 0.5, 24000)
    diff = compare(a, noisy)
    assert 30 < diff["psnr_db"] < 45 and 0.9 < diff["ssim"] < 1 and diff["audio_corr"] == pytest.approx(1.0)
    assert diff["audio_snr_db"] == pytest.approx(20 * math.log10(2), abs=1e-3)  # noise = half the signal


def test_the_quality_levels_table(served: tuple[Pair, Path]) -> None:
    pair, _ = served
    res = run_cli_inprocess(["quality-levels", "--target", pair.target])
    assert res.code == 0, res.err
    header, lossless, fast, harsh, footer = res.out.splitlines()
    assert harsh.startswith("harsh") and "min_ssim=2" in harsh
    assert header.split()[:3] == ["LEVEL", "CACHE", "ALLOWS"]
    assert lossless.startswith("lossless") and "any request" in lossless
    assert fast.startswith("fast") and 'first_block {"threshold": 0.3}' in fast and "tasks t2va; steps 12" in fast
    assert "frames<=141" in fast and "refuse" in fast and footer.startswith("on 1 rank(s); audits in ")
    res = run_cli_inprocess(["quality-levels", "--target", pair.target, "--json"])
    assert res.code == 0 and [lv["name"] for lv in json.loads(res.out)["levels"]] == ["lossless", "fast", "harsh"]
