"""Cached generation through the embedded plan cache is bit-identical to resident generation.

MiniMax-H3 t2va through diffusers' own denoise loop (ditcore.generation.generate): a cached H3Model reading its
modulation rows from the cache's slots produces exactly the latents of the resident model, whichever way a request's
plans arrive (cold rebuild, slot hit, host swap-in), in the released mixed precision and in float32; a failed
rebuild in between disturbs nothing; and `ditserve generate-local --adaln-mode cached` does the same end to end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ditcore import GenerationRequest, H3Model, generate, load_model
from ditcore.plans import is_plan_tensor
from ditcore.rebuild import PlanBuilder
from ditserve.cli import main as cli_main
from plancache_service.embedded import EmbeddedPlanProvider
from plancache_service.errors import RebuildError
from plancache_service.rebuild import RebuildSource

from plancache_helpers import CPU, check_invariants, expect, group_of, make_cache, pages_needed  # isort: skip

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = "a red fox runs through a snowy forest at dawn"


@pytest.fixture(scope="module", params=["mixed", "float32"])
def repo(request: pytest.FixtureRequest) -> Path:
    """tiny_ckpt (released mixed precision) or tiny_ckpt_f32."""
    name = "tiny_ckpt" if request.param == "mixed" else "tiny_ckpt_f32"
    path: Path = request.getfixturevalue(name)
    return path


@pytest.fixture(scope="module")
def models(repo: Path) -> dict[str, H3Model]:
    return {mode: load_model(repo, mode) for mode in ("resident", "cached")}


@pytest.fixture(scope="module")
def repo_source(repo: Path) -> RebuildSource:
    return RebuildSource(repo, CPU)


A, B = "a", "b"


@pytest.fixture(scope="module")
def reqs() -> dict[str, GenerationRequest]:
    """Two 6-step requests whose schedules share only their first plan (t = 0)."""
    return {A: request(5.0), B: request(7.0, seed=1)}


@pytest.fixture(scope="module")
def want(models: dict[str, H3Model], reqs: dict[str, GenerationRequest]) -> dict[str, Any]:
    """The resident model's results: the reference every cached generation must equal."""
    return {name: generate(models["resident"], req) for name, req in reqs.items()}


def request(shift: float, steps: int = 6, seed: int = 0, request_id: str = "") -> GenerationRequest:
    """A t2va request with `steps` transformer forwards (video shift `shift`, audio shift 3.0)."""
    return GenerationRequest(
        request_id=request_id or f"shift{shift:g}-steps{steps}-seed{seed}",
        prompt=PROMPT,
        num_inference_steps=steps + 1,
        flow_shift=shift,
        audio_flow_shift=3.0,
        seed=seed,
    )


def assert_same_output(got: Any, want: Any) -> None:
    assert torch.equal(got.video, want.video)
    assert torch.equal(got.audio, want.audio)
    assert got.sha256 == want.sha256


def test_cached_equals_resident_for_cold_build_slot_hit_and_host_swap_in(
    models: dict[str, H3Model],
    repo_source: RebuildSource,
    reqs: dict[str, GenerationRequest],
    want: dict[str, Any],
    tmp_path: Path,
) -> None:
    resident, cached = models["resident"], models["cached"]
    assert cached.precision == resident.precision == repo_source.info.precision
    ka, kb = cached.plan_keys(reqs[A]), cached.plan_keys(reqs[B])
    assert ka == resident.plan_keys(reqs[A]) and len(ka) == 6
    assert len(set(ka)) == len(set(kb)) == 6 and len(set(ka) | set(kb)) == 11
    assert not torch.equal(want[A].video, want[B].video)

    # 6 slots hold one schedule; the host tier holds both
    cache = make_cache(repo_source, gpu_plans=6, host_pages=pages_needed(set(ka) | set(kb)), shm_dir=tmp_path)
    try:
        assert cache.slab.dtype == repo_source.info.projection_dtype
        provider = EmbeddedPlanProvider(cache)
        sources = []
        for name in (A, A, B, A):
            got = generate(cached, reqs[name], provider)
            assert_same_output(got, want[name])
            assert cache.leases() == []  # generate released its lease
            assert got.cache is not None
            sources.append((got.cache.built_plans, got.cache.gpu_hit_plans, got.cache.host_hit_plans))
        assert sources == [
            (6, 0, 0),  # cold
            (0, 6, 0),  # slot hit
            (5, 1, 0),  # B evicts A from the slab (t = 0 is shared)
            (0, 1, 5),  # A swapped in from the host tier
        ]
        expect(cache, resident=set(ka), host_groups=[group_of(kb), group_of(ka)], built_plans=11, rebuild_passes=2)
    finally:
        cache.close()


def test_failed_rebuild_does_not_disturb_later_cached_generation(
    models: dict[str, H3Model],
    repo_source: RebuildSource,
    reqs: dict[str, GenerationRequest],
    want: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cached = models["cached"]
    a, b, want_a, want_b = reqs[A], reqs[B], want[A], want[B]
    cache = make_cache(repo_source, gpu_plans=11, shm_dir=tmp_path)
    try:
        provider = EmbeddedPlanProvider(cache)
        assert_same_output(generate(cached, a, provider), want_a)

        with monkeypatch.context() as m:
            real = PlanBuilder._read

            def broken(self: PlanBuilder, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
                if is_plan_tensor(name):
                    raise OSError(5, "injected I/O error", name)
                return real(self, name, rows)

            m.setattr(PlanBuilder, "_read", broken)
            with pytest.raises(RebuildError, match="injected I/O error"):
                generate(cached, b, provider)
        expect(cache, resident=set(cached.plan_keys(a)), leases=0, failed_prepares=1)

        got = generate(cached, a, provider)  # slot hits on the plans built before the failure
        assert got.cache is not None and got.cache.gpu_hit_plans == 6
        assert_same_output(got, want_a)
        got = generate(cached, b, provider)  # the failed request, retried
        assert got.cache is not None and got.cache.built_plans == 5
        assert_same_output(got, want_b)
        check_invariants(cache)
    finally:
        cache.close()


# ============================================================================ CLI
STEPS = 6  # forwards per request: 6 distinct plans, the first (t = 0) shared by both shifts


def _alternating() -> list[GenerationRequest]:
    return [request(5.0 if i % 2 == 0 else 7.0, steps=STEPS, request_id=f"r{i}") for i in range(4)]


def _write_requests(path: Path, reqs: list[GenerationRequest]) -> Path:
    path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in reqs))
    return path


def _cli_args(ckpt: Path, requests_file: Path, *extra: str) -> list[str]:
    base = ["generate-local", "--checkpoint", str(ckpt), "--adaln-mode", "cached", "--requests", str(requests_file)]
    return [*base, *extra]


def _run_subprocess(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "ditserve", *argv],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=300,
        check=False,
    )


def _cache_counts(stdout: str) -> list[tuple[int, int, int]]:
    caches = [json.loads(line)["cache"] for line in stdout.splitlines() if line.strip()]
    return [(c["built_plans"], c["gpu_hit_plans"], c["host_hit_plans"]) for c in caches]


@pytest.mark.processes
def test_cli_generate_local_cached_alternating_schedules_hit_the_slab(tiny_ckpt: Path, tmp_path: Path) -> None:
    reqs = _alternating()
    file = _write_requests(tmp_path / "reqs.jsonl", reqs)
    proc = _run_subprocess(_cli_args(tiny_ckpt, file, "--gpu-plans", "12", "--host-cache-gb", "0"))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [line["request_id"] for line in lines] == ["r0", "r1", "r2", "r3"]
    assert _cache_counts(proc.stdout) == [(6, 0, 0), (5, 1, 0), (0, 6, 0), (0, 6, 0)]
    assert all(line["adaln_mode"] == "cached" for line in lines)
    resident = load_model(tiny_ckpt, "resident")
    want = [generate(resident, req).sha256 for req in reqs[:2]]  # r2, r3 repeat r0, r1 (same schedule and seed)
    assert [line["sha256"] for line in lines] == want * 2


def test_cli_generate_local_small_slab_swaps_in_from_host(tiny_ckpt: Path, tmp_path: Path, capsys: Any) -> None:
    file = _write_requests(tmp_path / "reqs.jsonl", _alternating())
    code = cli_main(_cli_args(tiny_ckpt, file, "--gpu-plans", "6", "--host-cache-gb", "0.01"))
    out = capsys.readouterr().out
    assert code == 0
    assert _cache_counts(out) == [(6, 0, 0), (5, 1, 0), (0, 1, 5), (0, 1, 5)]
    caches = [json.loads(line)["cache"] for line in out.splitlines() if line.strip()]
    assert all(c["swap_in_s"] > 0 for c in caches[2:])


def test_cli_too_small_gpu_plans_exits_2_naming_the_flag(tiny_ckpt: Path, tmp_path: Path, capsys: Any) -> None:
    file = _write_requests(tmp_path / "reqs.jsonl", [request(5.0, steps=6)])
    code = cli_main(_cli_args(tiny_ckpt, file, "--gpu-plans", "4", "--host-cache-gb", "0"))
    captured = capsys.readouterr()
    assert code == 2
    assert "--gpu-plans" in captured.err and "at most 4" in captured.err
    assert captured.out == ""


def test_ref2va_cached_equals_resident_for_cold_build_slot_hit_and_host_swap_in(
    models: dict[str, H3Model], repo_source: RebuildSource, tmp_path: Path
) -> None:
    """The same for ref2va on the transformer_ref partition (an image and a WAV: plans up to 4 wide, of the "ref"
    partition), the decoded frames and waveform included; the t2va plans of the same shift stay apart."""
    from refmedia import image_bytes, wav_bytes

    from ditcore.references import Reference

    refs = (Reference(image_bytes(48, 32, seed=4)), Reference(wav_bytes(1.0, 32000, seed=5)))
    ra = dataclasses.replace(request(5.0), request_id="ref-a", task="ref2va", references=refs,
                             output_type="frames_and_wav")  # fmt: skip
    rb = dataclasses.replace(request(7.0, seed=1), request_id="ref-b", task="ref2va", references=refs)
    resident, cached = models["resident"], models["cached"]
    want = {"a": generate(resident, ra), "b": generate(resident, rb)}
    ka, kb = cached.plan_keys(ra), cached.plan_keys(rb)
    assert {k.partition for k in (*ka, *kb)} == {"ref"} and max(k.width for k in ka) == 4
    assert len(set(ka)) == len(set(kb)) == 6 and len(set(ka) | set(kb)) == 11
    cache = make_cache(repo_source, gpu_plans=6, plan_width=4, host_pages=pages_needed(set(ka) | set(kb)),
                       shm_dir=tmp_path)  # fmt: skip
    try:
        provider = EmbeddedPlanProvider(cache)
        sources = []
        for name, req in (("a", ra), ("a", ra), ("b", rb), ("a", ra)):
            got = generate(cached, req, provider)
            assert_same_output(got, want[name])
            if req.decodes:
                assert got.media is not None and want[name].media is not None
                assert np.array_equal(got.media.frames, want[name].media.frames)
                assert np.array_equal(got.media.audio, want[name].media.audio)
            assert got.cache is not None
            sources.append((got.cache.built_plans, got.cache.gpu_hit_plans, got.cache.host_hit_plans))
        assert sources == [(6, 0, 0), (0, 6, 0), (5, 1, 0), (0, 1, 5)]  # cold, slot hit, evicted, host swap-in
        assert cached.plan_keys(dataclasses.replace(ra, task="t2va", references=())) != ka
    finally:
        cache.close()
