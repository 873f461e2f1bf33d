"""Cached generation through the embedded plan cache is bit-identical to resident generation.

Covers every way a request's plans can arrive (cold rebuild, slot hit, host swap-in), a failed
rebuild in between, and `ditserve generate-local --adaln-mode cached` end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ditcore import DiT, GenerationRequest, generate, latents_sha256, load_model, write_checkpoint
from ditcore.checkpoint import CheckpointReader
from ditserve.cli import main as cli_main
from plancache_service.embedded import EmbeddedPlanProvider
from plancache_service.errors import RebuildError
from plancache_service.rebuild import RebuildSource

from plancache_helpers import (  # isort: skip
    CPU,
    TINY,
    check_invariants,
    expect,
    group_of,
    make_cache,
    pages_needed,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(TINY, tmp_path_factory.mktemp("pc_embedded") / "ckpt", seed=0, shards=2)


@pytest.fixture(scope="module")
def resident(ckpt: Path) -> DiT:
    return load_model(ckpt, "resident")


@pytest.fixture(scope="module")
def cached(ckpt: Path) -> DiT:
    return load_model(ckpt, "cached")


@pytest.fixture(scope="module")
def source(ckpt: Path) -> RebuildSource:
    return RebuildSource(ckpt, CPU)


def request(task: str, shift: float, steps: int = 8, seed: int = 0) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"{task}-{shift}-{steps}-{seed}",
        task=task,
        steps=steps,
        flow_shift=shift,
        audio_flow_shift=3.0 if task == "t2va" else None,
        seed=seed,
        audio_length=8,
    )


def assert_same_output(got: Any, want: Any) -> None:
    assert torch.equal(got.video, want.video)
    if want.audio is None:
        assert got.audio is None
    else:
        assert got.audio is not None and torch.equal(got.audio, want.audio)
    assert got.sha256 == want.sha256


@pytest.mark.parametrize("task", ["t2v", "t2va"])
def test_cached_equals_resident_for_cold_build_slot_hit_and_host_swap_in(
    task: str, resident: DiT, cached: DiT, source: RebuildSource, tmp_path: Path
) -> None:
    a, b = request(task, 5.0), request(task, 7.0, seed=1)
    ka, kb = a.schedule_spec().plan_keys(), b.schedule_spec().plan_keys()
    assert len(set(ka)) == len(set(kb)) == 8 and len(set(ka) | set(kb)) == 15
    want = {a.request_id: generate(resident, a), b.request_id: generate(resident, b)}
    assert not torch.equal(want[a.request_id].video, want[b.request_id].video)

    # 8 slots hold one schedule; the host tier holds both
    cache = make_cache(source, gpu_plans=8, host_pages=pages_needed(set(ka) | set(kb)), shm_dir=tmp_path)
    try:
        provider = EmbeddedPlanProvider(cache)
        sources = []
        for req in (a, a, b, a):
            got = generate(cached, req, provider)
            assert_same_output(got, want[req.request_id])
            assert cache.leases() == []  # generate released its lease
            sources.append({k: getattr(got.cache, k) for k in ("built_plans", "gpu_hit_plans", "host_hit_plans")})
        assert sources == [
            {"built_plans": 8, "gpu_hit_plans": 0, "host_hit_plans": 0},  # cold
            {"built_plans": 0, "gpu_hit_plans": 8, "host_hit_plans": 0},  # slot hit
            {"built_plans": 7, "gpu_hit_plans": 1, "host_hit_plans": 0},  # B evicts A from the slab
            {"built_plans": 0, "gpu_hit_plans": 1, "host_hit_plans": 7},  # A swapped in from host
        ]
        expect(cache, resident=set(ka), host_groups=[group_of(kb), group_of(ka)], built_plans=15, rebuild_passes=2)
    finally:
        cache.close()


def test_failed_rebuild_does_not_disturb_later_cached_generation(
    resident: DiT, cached: DiT, source: RebuildSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = request("t2va", 5.0), request("t2va", 7.0, seed=1)
    want_a, want_b = generate(resident, a), generate(resident, b)
    cache = make_cache(source, gpu_plans=15, shm_dir=tmp_path)
    try:
        provider = EmbeddedPlanProvider(cache)
        assert_same_output(generate(cached, a, provider), want_a)

        with monkeypatch.context() as m:

            def broken(self: CheckpointReader, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
                raise OSError(5, "injected I/O error", prefix)

            m.setattr(CheckpointReader, "adaln_layer", broken)
            with pytest.raises(RebuildError, match="injected I/O error"):
                generate(cached, b, provider)
        expect(cache, resident=set(a.schedule_spec().plan_keys()), leases=0, failed_prepares=1)

        got = generate(cached, a, provider)  # slot hits on the plans built before the failure
        assert got.cache is not None and got.cache.gpu_hit_plans == 8
        assert_same_output(got, want_a)
        got = generate(cached, b, provider)  # the failed request, retried
        assert got.cache is not None and got.cache.built_plans == 7
        assert_same_output(got, want_b)
        check_invariants(cache)
    finally:
        cache.close()


# ============================================================================ CLI
def _write_requests(path: Path, reqs: list[GenerationRequest]) -> Path:
    fields = ("request_id", "task", "steps", "flow_shift", "audio_flow_shift", "seed", "audio_length")
    path.write_text("".join(json.dumps({f: getattr(r, f) for f in fields}) + "\n" for r in reqs))
    return path


def _alternating() -> list[GenerationRequest]:
    reqs = []
    for i in range(4):
        shift = 5.0 if i % 2 == 0 else 7.0
        r = request("t2va", shift, steps=50)
        reqs.append(GenerationRequest.from_dict({"request_id": f"r{i}"}, r))
    return reqs


def _cli_args(ckpt: Path, requests_file: Path, *extra: str) -> list[str]:
    return [
        "generate-local",
        "--checkpoint",
        str(ckpt),
        "--adaln-mode",
        "cached",
        "--requests",
        str(requests_file),
        *extra,
    ]


def _run_subprocess(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "ditserve", *argv],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=120,
        check=False,
    )


def test_cli_generate_local_cached_alternating_schedules_hit_the_slab(
    ckpt: Path, resident: DiT, tmp_path: Path
) -> None:
    reqs = _alternating()
    file = _write_requests(tmp_path / "reqs.jsonl", reqs)
    proc = _run_subprocess(_cli_args(ckpt, file, "--gpu-plans", "100", "--host-cache-gb", "0"))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [line["request_id"] for line in lines] == ["r0", "r1", "r2", "r3"]
    got = [(c["built_plans"], c["gpu_hit_plans"], c["host_hit_plans"]) for c in (line["cache"] for line in lines)]
    assert got == [(50, 0, 0), (49, 1, 0), (0, 50, 0), (0, 50, 0)]
    for line, req in zip(lines, reqs, strict=True):
        want = generate(resident, req)
        assert line["sha256"] == latents_sha256(want.video, want.audio)
        assert line["adaln_mode"] == "cached"


def test_cli_generate_local_small_slab_swaps_in_from_host(ckpt: Path, tmp_path: Path, capsys: Any) -> None:
    file = _write_requests(tmp_path / "reqs.jsonl", _alternating())
    code = cli_main(_cli_args(ckpt, file, "--gpu-plans", "50", "--host-cache-gb", "0.01"))
    out = capsys.readouterr().out
    assert code == 0
    caches = [json.loads(line)["cache"] for line in out.splitlines() if line.strip()]
    got = [(c["built_plans"], c["gpu_hit_plans"], c["host_hit_plans"]) for c in caches]
    assert got == [(50, 0, 0), (49, 1, 0), (0, 1, 49), (0, 1, 49)]
    assert all(c["swap_in_s"] > 0 for c in caches[2:])


def test_cli_too_small_gpu_plans_exits_2_naming_the_flag(ckpt: Path, tmp_path: Path, capsys: Any) -> None:
    file = _write_requests(tmp_path / "reqs.jsonl", [request("t2v", 5.0, steps=8)])
    code = cli_main(_cli_args(ckpt, file, "--gpu-plans", "4", "--host-cache-gb", "0"))
    captured = capsys.readouterr()
    assert code == 2
    assert "--gpu-plans" in captured.err and "at most 4" in captured.err
    assert captured.out == ""
