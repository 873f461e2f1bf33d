"""Quality levels on a served generator (ditcore.quality, --quality-levels / --quality-audit-dir): a request at a
level runs its step cache (the oracle's bits: diffusers with the same config through enable_cache), says what it
skipped per step and which level ran; a lossless request after it is lossless; every rule a level sets refuses the
request with INVALID_ARGUMENT naming `quality` and the rule; an unaudited request is refused (QUALITY_NOT_AUDITED)
or served with a warning, per the level's policy, and an audit record covering it lets it through; a job keeps
its level; a bad levels file refuses the start naming the file, the level and the key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from oracle import _pipeline, diffusers_request_latents, released_decode_dtype, stored_precision
from servicekit import Pair, error_info, ref_sha, request_keys

from ditcore import GenerationRequest, distinct_keys
from ditcore.generation import latents_sha256
from ditcore.quality import AuditRecord, QualityLevels
from ditcore.step_cache import StepCache, register_h3_blocks
from generator_service.config import GeneratorConfig
from protos.ditserve.generator.v1 import generator_pb2 as pb

LEVELS = """
[levels.fast]
description = "FirstBlockCache at 0.3 (tests)"
cache = { kind = "first_block", threshold = 0.3 }
tasks = ["t2va"]
steps = [12]
max_num_frames = 124
unaudited = "warn"

[levels.strict]
cache = { kind = "first_block", threshold = 0.3 }
steps = [12]
"""
REQUEST = {"prompt": "a red fox", "num_inference_steps": 12, "seed": 7}


@pytest.fixture(scope="module")
def served(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pair, Path]]:
    root = tmp_path_factory.mktemp("quality")
    (root / "levels.toml").write_text(LEVELS)
    (root / "audits").mkdir()
    with Pair(tiny_ckpt, mode="resident", quality_levels=root / "levels.toml",
              quality_audit_dir=root / "audits") as pair:  # fmt: skip
        yield pair.start(), root


def oracle_sha(repo: Path, cache: StepCache) -> str:
    precision = stored_precision(repo)
    pipe = _pipeline(str(repo), precision, False, released_decode_dtype(precision), "native")
    register_h3_blocks()
    pipe.transformer.enable_cache(cache.config())
    try:
        with pipe.transformer.cache_context("cond"):
            return latents_sha256(*diffusers_request_latents(repo, GenerationRequest(**REQUEST)))
    finally:
        pipe.transformer.disable_cache()


def test_a_level_runs_its_step_cache_and_lossless_stays_lossless(served: tuple[Pair, Path], tiny_ckpt: Path) -> None:
    pair, _ = served
    fast = pair.generate({**REQUEST, "quality": "fast"}, request_id="q1")
    assert fast.quality == "fast" and fast.sha256 == oracle_sha(
        tiny_ckpt, StepCache("first_block", (("threshold", 0.3),))
    )
    assert len(fast.blocks_skipped) == 11 and fast.blocks_skipped[0] == 0 and sum(fast.blocks_skipped) > 0
    assert "no passing audit covers t2va 12 steps" in fast.quality_warning  # its policy: warn
    lossless = pair.generate(REQUEST, request_id="q2")
    assert lossless.quality == "lossless" and not lossless.blocks_skipped and not lossless.quality_warning
    assert lossless.sha256 == ref_sha(tiny_ckpt, REQUEST) != fast.sha256
    assert pair.generate({**REQUEST, "quality": "lossless"}, request_id="q3").sha256 == lossless.sha256


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"quality": "turbo"}, "unknown level 'turbo'; this server serves lossless, fast, strict"),
        ({"quality": "fast", "num_inference_steps": 8}, "level fast runs with num_inference_steps 12, not 8"),
        ({"quality": "fast", "num_frames": 141}, "level fast runs with num_frames up to 124, not 141"),
        ({"quality": "Fast!"}, "must be a quality level's name"),
    ],
)
def test_a_rule_the_request_breaks_is_invalid_argument_naming_it(served: tuple[Pair, Path], fields: dict[str, object],
                                                                 message: str) -> None:  # fmt: skip
    pair, _ = served
    with pytest.raises(grpc.RpcError) as err:
        pair.generate({**REQUEST, **fields}, request_id="bad")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in (err.value.details() or "")


def test_an_unaudited_request_is_refused_until_an_audit_covers_it(served: tuple[Pair, Path], tiny_ckpt: Path) -> None:
    pair, root = served
    with pytest.raises(grpc.RpcError) as err:
        pair.generate({**REQUEST, "quality": "strict"}, request_id="s1")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(err.value)
    assert info is not None and info.reason == "QUALITY_NOT_AUDITED" and "ditserve audit-quality" in err.value.details()
    levels = QualityLevels.load(root / "levels.toml", root / "audits")
    strict = levels.levels["strict"]
    request = GenerationRequest(**REQUEST, quality="strict")
    failed = AuditRecord("strict", strict.digest, strict.shape(request, 1), {"psnr_db": 12.0}, passed=False)
    other = AuditRecord("strict", "0" * 64, strict.shape(request, 1), {}, passed=True)  # another definition's
    (root / "audits" / "strict.jsonl").write_text(json.dumps(failed.to_dict()) + "\n" + json.dumps(other.to_dict())
                                                   + "\n{torn")  # fmt: skip
    with pytest.raises(grpc.RpcError) as err:
        pair.generate({**REQUEST, "quality": "strict"}, request_id="s2")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # neither a failed audit nor another's covers it
    passed = AuditRecord("strict", strict.digest, strict.shape(request, 1), {"psnr_db": 40.0}, passed=True)
    with (root / "audits" / "strict.jsonl").open("a") as f:
        f.write("\n" + json.dumps(passed.to_dict()) + "\n")
    ok = pair.generate({**REQUEST, "quality": "strict"}, request_id="s3")
    assert ok.quality == "strict" and not ok.quality_warning and sum(ok.blocks_skipped) > 0


def test_a_job_keeps_its_level(served: tuple[Pair, Path]) -> None:
    from ditserve.jobs_client import JobsClient

    pair, _ = served
    with JobsClient(pair.target) as jobs:
        job, created = jobs.create({**REQUEST, "quality": "fast", "request_id": "jq"})
        assert created and job.spec.quality == "fast"
        done = next(j for j in jobs.watch(job.job_id) if j.state not in (pb.JOB_STATE_QUEUED, pb.JOB_STATE_RUNNING))
        assert done.state == pb.JOB_STATE_SUCCEEDED
        assert done.result.sha256 == pair.generate({**REQUEST, "quality": "fast"}, request_id="jd").sha256
        for fields, code in (({"quality": "fast", "num_inference_steps": 8}, grpc.StatusCode.INVALID_ARGUMENT),
                             ({"quality": "nope"}, grpc.StatusCode.INVALID_ARGUMENT)):  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                jobs.create({**REQUEST, **fields, "request_id": "jbad"})
            assert err.value.code() == code and "quality" in (err.value.details() or "")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[levels.fast]\ncache = { kind = 'teacache' }", "[levels.fast] cache: kind 'teacache' is not one of"),
        ("[levels.fast]\ncache = { kind = 'first_block' }\nsteps = [1]", "steps must be a list of integers >= 2"),
        ("[levels.lossless]\ncache = { kind = 'first_block' }", "not lossless"),
        ("[levels.fast]\ntasks = ['t2va']", "needs a cache"),
        ("[levels.fast]\ncache = { kind = 'first_block' }\nadapter = 'none'", "unknown key 'adapter'"),
        ("levels = 3", "holds [levels.NAME] tables only"),
        ("[levels.fast]\ncache = { kind = 'first_block' }\nworld_sizes = [1, 2]", "decides per rank"),
        (
            "[levels.fast]\ncache = { kind = 'mag', threshold = 0.1, num_inference_steps = 2, mag_ratios = [1.0, 1.0] }"
            "\nworld_sizes = [2]",
            "fails under context parallelism",
        ),
        ("[levels", "not a readable TOML file"),
    ],
)
def test_a_bad_levels_file_refuses_the_start(tmp_path: Path, tiny_ckpt: Path, text: str, message: str) -> None:
    path = tmp_path / "levels.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match="--quality-levels") as err:
        GeneratorConfig(checkpoint=tiny_ckpt, adaln_mode="resident", quality_levels=path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_the_cli_and_generate_local_run_a_level(served: tuple[Pair, Path], tiny_ckpt: Path) -> None:
    from clikit import run_cli_inprocess

    pair, root = served
    argv = ["--prompt", "a red fox", "--num-inference-steps", "12", "--seed", "7", "--quality", "fast"]
    res = run_cli_inprocess(["generate", "--target", pair.target, *argv])
    assert res.code == 0, res.err
    (line,) = res.json_lines()
    want = pair.generate({**REQUEST, "quality": "fast"}, request_id="cli").sha256
    assert line["sha256"] == want and line["quality"] == "fast" and len(line["blocks_skipped"]) == 11
    local = ["generate-local", "--checkpoint", tiny_ckpt, "--quality-levels", root / "levels.toml"]
    res = run_cli_inprocess([*local, *argv])
    assert res.code == 0, res.err
    assert res.json_lines()[0]["sha256"] == want
    res = run_cli_inprocess(["generate-local", "--checkpoint", tiny_ckpt, *argv])  # no levels file: unknown level
    assert res.code == 2 and "unknown level 'fast'; this server serves lossless" in res.err


def test_the_facade_takes_quality() -> None:
    from ditserve.openai.mapping import ApiError, create_body

    assert create_body({"prompt": "a fox", "quality": "fast"}).request.quality == "fast"
    assert create_body({"prompt": "a fox"}).request.quality == ""  # lossless
    with pytest.raises(ApiError, match="quality must be a quality level's name"):
        create_body({"prompt": "a fox", "quality": 3})


def test_a_cached_server_serves_a_level_on_its_plans_as_resident_does(served: tuple[Pair, Path],
                                                                      tiny_ckpt: Path) -> None:  # fmt: skip
    """The plan cache is untouched by a level: the same plan keys (a lossless request after it hits every plan), the
    same bits as the resident server, cold (rebuilt), warm (slot hits) and swapped in from the host tier: the slab
    holds one schedule's plans, so two schedules at the level alternating evict each other's plans to the host tier
    and each repeat reads them from there (no plan built)."""
    resident, root = served
    other = {**REQUEST, "flow_shift": 6.0}  # another schedule: only its first step's plan (sigma 1) is shared
    want = resident.generate({**REQUEST, "quality": "fast"}, request_id="r").sha256
    want_other = resident.generate({**other, "quality": "fast"}, request_id="r-other").sha256
    assert want_other != want
    keys, other_keys = (set(distinct_keys(request_keys(tiny_ckpt, r))) for r in (REQUEST, other))
    assert len(keys) == len(other_keys) == REQUEST["num_inference_steps"] - 1 and len(keys & other_keys) == 1
    with Pair(tiny_ckpt, mode="cached", quality_levels=root / "levels.toml", gpu_plans=len(keys)) as pair:
        pair.start()
        cold = pair.generate({**REQUEST, "quality": "fast"}, request_id="c1")
        assert cold.sha256 == want and cold.cache.built_plans == len(keys)
        lossless = pair.generate(REQUEST, request_id="c2")
        assert lossless.cache.built_plans == 0 and lossless.cache.gpu_hit_plans == cold.cache.built_plans
        assert lossless.sha256 == ref_sha(tiny_ckpt, REQUEST)
        warm = pair.generate({**REQUEST, "quality": "fast"}, request_id="c3")
        assert warm.sha256 == want and warm.cache.built_plans == 0
        first = pair.generate({**other, "quality": "fast"}, request_id="c4")  # evicts the first schedule's plans
        assert first.sha256 == want_other and first.cache.built_plans == len(other_keys - keys)
        for i, (request, sha, own) in enumerate([(REQUEST, want, keys), (other, want_other, other_keys)] * 2):
            got = pair.generate({**request, "quality": "fast"}, request_id=f"h{i}")
            c = got.cache
            assert (c.built_plans, c.gpu_hit_plans, c.host_hit_plans) == (0, 1, len(own) - 1), (i, c)
            assert got.sha256 == sha and got.quality == "fast" and sum(got.blocks_skipped) > 0, i
