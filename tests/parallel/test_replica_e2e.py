"""`ditserve serve --nproc 2 --device cpu` as a user runs it: one sidecar with a slab per rank, two generator ranks
under torchrun's elastic agent, gloo on this host.

- `ditserve generate` through it returns the sha256 of diffusers' own context-parallel loop
  (`enable_parallelism(ContextParallelConfig(ulysses_degree=2))`) on the same repository and request; a ref2va
  request (a video with its soundtrack, the reference travelling to every rank) returns that of
  diffusers' context-parallel ref2va workflow on `transformer_ref`.
- (Rows that do not divide by the ranks: tests/parallel/test_replica_any_prompt.py.)
- A weight update under load never mixes generations across ranks: every result is exactly A's or B's
  context-parallel latents, as its generation says.
- kill -9 of rank 1 mid-request fails that request UNAVAILABLE; the replica restarts as a unit and serves the same
  bits again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from distkit import run_ranks
from rankwork import diffusers_only, diffusers_with_adapters, diffusers_with_step_cache
from refmedia import video_bytes
from safetensors.torch import load_file
from servicekit import TOKEN, Weights, free_port, is_serving, short_tmpdir, wait_for

from ditcore.adapter_files import write_adapter
from ditcore.references import Reference
from ditserve.client import GeneratorClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# 32 x 32 x 124: 37 video + 414 audio rows; this prompt is 7 text rows: 458, even
REQUEST: dict[str, Any] = {"prompt": "a red fox jumps", "num_inference_steps": 4, "seed": 3, "height": 32,
                           "width": 32, "num_frames": 124}  # fmt: skip
LONG = {**REQUEST, "num_inference_steps": 400}
# a 30-frame clip with its soundtrack
REF2VA: dict[str, Any] = {
    **REQUEST,
    "num_inference_steps": 3,
    "task": "ref2va",
    "references": (Reference(video_bytes(frames=30, fps=30, audio_rate=32000, seed=3)),),
}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in ("video", "audio"):
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def expected(weights: Weights, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """sha256 of diffusers' own 2-rank Ulysses latents of REQUEST on A and on B."""
    out = run_ranks(diffusers_only, 2, ([weights.a, weights.b], REQUEST, 2), tmp_path_factory.mktemp("cp-ref"))
    return {name: digest(load_file(out / f"repo{i}.safetensors")) for i, name in enumerate("ab")}


@pytest.fixture(scope="module")
def expected_ref2va(weights: Weights, tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """generation -> sha256 of diffusers' own 2-rank Ulysses ref2va latents of REF2VA on A (1) and B (2), its
    transformer_ref parallelised."""
    out = run_ranks(diffusers_only, 2, ([weights.a, weights.b], REF2VA, 2), tmp_path_factory.mktemp("cp-ref2va"))
    return {g: digest(load_file(out / f"repo{g - 1}.safetensors")) for g in (1, 2)}


class Replica:
    def __init__(self, proc: subprocess.Popen[bytes], target: str, run_dir: Path) -> None:
        self.proc, self.target, self.run_dir = proc, target, run_dir

    def ranks(self) -> dict[int, int]:
        """RANK -> pid of the generator ranks now running."""
        out = subprocess.run(["pgrep", "-f", f"generator_service .*--listen=127.0.0.1:{self.target.split(':')[1]}"],
                             capture_output=True, text=True).stdout.split()  # fmt: skip
        found = {}
        for pid in map(int, out):
            with contextlib.suppress(OSError):
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
                if rank is not None and b"-m\0generator_service" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found[rank] = pid
        return found

    def log(self) -> str:
        return (self.run_dir / "generator.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def adapter_dir(weights: Weights, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trunk-only adapter (served on the base plans) and a modulation one (on plans built with it)."""
    root = tmp_path_factory.mktemp("replica-adapters")
    write_adapter(root / "trunk.safetensors", weights.a, "trunk", "diffusers", rank=2, alpha=None, seed=5)
    write_adapter(root / "mod.safetensors", weights.a, "modulation", "diffusers", rank=2, alpha=None, seed=6)
    return root


TAYLORSEER = {"kind": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 1}
LEVELS = """
[levels.steady]
cache = { kind = "taylorseer", cache_interval = 2, disable_cache_before_step = 1 }
world_sizes = [2]
unaudited = "warn"
"""


@pytest.fixture(scope="module")
def replica(weights: Weights, adapter_dir: Path) -> Iterator[Replica]:
    run_dir = short_tmpdir("dsrep-")
    levels = run_dir / "levels.toml"
    levels.write_text(LEVELS)
    port = free_port()
    env = {**os.environ, "DITSERVE_ADMIN_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "ditserve", "serve", "--nproc", "2", "--device", "cpu", "--checkpoint",
            str(weights.a), "--weights-root", str(weights.root), "--run-dir", str(run_dir), "--port", str(port),
            "--no-metrics", "--gpu-plans", "512", "--adapter-dir", str(adapter_dir), "--quality-levels",
            str(levels)]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{port}"
    try:
        wait_for(lambda: is_serving(target), 240, "the 2-rank replica serving")
        yield Replica(proc, target, run_dir)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ditserve", *args], capture_output=True, text=True, timeout=300)


def test_generate_through_two_ranks_returns_diffusers_context_parallel_sha(
    replica: Replica, expected: dict[str, str], tmp_path: Path
) -> None:
    assert sorted(replica.ranks()) == [0, 1]
    res = run_cli("generate", "--target", replica.target, "--prompt", REQUEST["prompt"], "--num-inference-steps",
                  "4", "--seed", "3", "--out", str(tmp_path))  # fmt: skip
    assert res.returncode == 0, res.stderr
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert line["sha256"] == expected["a"]
    assert line["cache"]["built_plans"] > 0 or line["cache"]["gpu_hit_plans"] > 0


def test_adapters_on_two_ranks_are_diffusers_context_parallel_with_them(
    replica: Replica, weights: Weights, adapter_dir: Path, tmp_path: Path
) -> None:
    """Every rank loads the adapters (its own --adapter-dir, the same identities as rank 0's): a trunk adapter on the
    base plans, a modulation one on plans the sidecar builds with it (every rank reads the same slots)."""
    sets = [[(adapter_dir / "trunk.safetensors", 0.8)], [(adapter_dir / "mod.safetensors", 1.0)]]
    out = run_ranks(diffusers_with_adapters, 2, (weights.a, REQUEST, 2, sets), tmp_path)
    expected = [digest(load_file(out / f"adapters{i}.safetensors")) for i in range(len(sets))]
    with GeneratorClient(replica.target) as client:
        for i, uses in enumerate(([{"name": "trunk", "scale": 0.8}], [{"name": "mod"}])):
            result = client.generate({**REQUEST, "request_id": f"lora{i}", "adapters": uses}, timeout=240)
            assert result.sha256 == expected[i], uses
        assert client.generate({**REQUEST, "request_id": "base"}, timeout=240).generation == 1


def test_a_quality_level_on_two_ranks_is_diffusers_context_parallel_with_its_step_cache(
    replica: Replica, weights: Weights, tmp_path: Path
) -> None:
    """Every rank installs the level's hooks (rank 0 hands its step cache on): TaylorSeer, whose decisions every rank
    makes alike (by step), equals diffusers' 2-rank loop with the same config; lossless after it is lossless. The other
    kinds are refused on a replica when the levels file is read (FirstBlockCache decides per rank; diffusers' MagCache
    fails under context parallelism): tests/core/test_core_quality_rules.py."""
    request = {**REQUEST, "num_inference_steps": 6}
    out = run_ranks(diffusers_with_step_cache, 2, (weights.a, request, 2, TAYLORSEER), tmp_path)
    with GeneratorClient(replica.target) as client:
        result = client.generate({**request, "request_id": "steady", "quality": "steady"}, timeout=240)
        assert result.quality == "steady" and sum(result.blocks_skipped) > 0
        assert result.sha256 == digest(load_file(out / "step_cache.safetensors"))
        plain = client.generate({**request, "request_id": "plain"}, timeout=240)
        assert plain.quality == "lossless" and plain.sha256 != result.sha256 and not plain.blocks_skipped


def test_ref2va_through_two_ranks_returns_diffusers_context_parallel_sha(
    replica: Replica, expected_ref2va: dict[int, str]
) -> None:
    with GeneratorClient(replica.target) as client:
        result = client.generate({**REF2VA, "request_id": "ref2va"}, timeout=240)
    assert result.sha256 == expected_ref2va[result.generation]
    assert result.cache.built_plans > 0  # the ref partition's plans: none shared with the t2va request before it


def test_update_under_load_never_mixes_generations_across_ranks(
    replica: Replica, weights: Weights, expected: dict[str, str]
) -> None:
    results: list[tuple[int, str]] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def load() -> None:
        with GeneratorClient(replica.target) as client:
            i = 0
            while not stop.is_set():
                try:
                    r = client.generate({**REQUEST, "request_id": f"load-{i}"}, timeout=120)
                    results.append((r.generation, r.sha256))
                except grpc.RpcError as e:  # an admission during the swap may be refused; never a wrong result
                    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED):
                        errors.append(e)
                i += 1

    worker = threading.Thread(target=load)
    worker.start()
    try:
        wait_for(lambda: len(results) >= 2, 120, "requests before the update")
        with grpc.insecure_channel(replica.target) as ch:
            from protos.ditserve.generator.v1 import generator_pb2 as pb
            from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

            resp = pb_grpc.GeneratorStub(ch).UpdateWeights(
                pb.UpdateWeightsRequest(weights_path=str(weights.b), request_id="upd"),
                metadata=[("authorization", f"Bearer {TOKEN}")], timeout=300,
            )  # fmt: skip
        assert resp.generation == 2
        count = len(results)
        wait_for(lambda: len(results) >= count + 2, 120, "requests after the update")
    finally:
        stop.set()
        worker.join(180)
    assert not errors, errors
    by_generation = {1: expected["a"], 2: expected["b"]}
    assert {g for g, _ in results} == {1, 2}
    for generation, sha in results:
        assert sha == by_generation[generation], f"generation {generation} returned {sha[:12]}"


def test_kill_rank_1_mid_request_fails_it_unavailable_and_the_replica_restarts(
    replica: Replica, expected: dict[str, str]
) -> None:
    ranks = replica.ranks()
    outcome: dict[str, Any] = {}

    def long_request() -> None:
        with GeneratorClient(replica.target) as client:
            try:
                outcome["result"] = client.generate({**LONG, "request_id": "long"}, timeout=120,
                                                    progress=lambda kind, p: outcome.setdefault(kind, p))  # fmt: skip
            except grpc.RpcError as e:
                outcome["code"] = e.code()

    worker = threading.Thread(target=long_request)
    worker.start()
    wait_for(lambda: "step" in outcome or "code" in outcome, 60, "the long request denoising")
    assert "code" not in outcome, outcome
    os.kill(ranks[1], signal.SIGKILL)
    worker.join(120)
    assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE, outcome
    # restarted as a unit: new processes for both ranks, serving the weights the sidecar serves (B)
    wait_for(lambda: is_serving(replica.target) and set(replica.ranks()) == {0, 1}
             and not set(replica.ranks().values()) & set(ranks.values()), 180, "the replica restarted")  # fmt: skip
    with GeneratorClient(replica.target) as client:
        result = client.generate({**REQUEST, "request_id": "after"}, timeout=120)
    assert result.sha256 == (expected["b"] if result.generation == 2 else expected["a"])
    assert "replica rank lost" in replica.log()


def test_get_status_reports_every_rank_and_its_components(replica: Replica) -> None:
    with GeneratorClient(replica.target) as client:
        status = client.status()
    assert status.replica.ranks == 2 and status.replica.ulysses_degree == 2 and status.replica.ring_degree == 1
    ranks = {r.rank: r for r in status.replica.rank_placements}
    assert sorted(ranks) == [0, 1] and all(r.device == "cpu" for r in ranks.values())
    parts = {r: {c.name: c for c in ranks[r].components} for r in ranks}
    assert set(parts[0]) == set(parts[1]) == {"transformer", "transformer_ref", "text_encoder", "vae", "audio_vae"}
    assert parts[0]["text_encoder"].bytes > 0 and parts[0]["text_encoder"].placement == "device"
    assert parts[1]["text_encoder"].bytes == 0 and parts[1]["text_encoder"].placement == "rank0"
    assert parts[0]["transformer"].bytes == parts[1]["transformer"].bytes > 0  # each rank: the whole transformer
