"""A replica across two "nodes" on loopback, as a user starts one: `ditserve serve --nnodes 2 --node-rank K
--rdzv-endpoint ...` twice, each with its own run dir and its own plan-cache sidecar (one slab each), one CPU rank per
node under torchrun's static rendezvous, gloo. Rank 0 (node 0) is the one client of both sidecars.

- Node 1's sidecar starts on other weights than node 0's: the replica commits node 0's there before it serves.

- Outputs equal diffusers' own context-parallel run with the same degrees (Ulysses 2 across the nodes: the ring,
  the default across nodes on CUDA, has no log-sum-exp backend on the CPU), t2va with even and uneven rows, fl2va,
  ref2va (tests/parallel/rankwork.py `oracle_digests`).
- UpdateWeights commits on both sidecars (each one's GetState: the new weights, one generation on), and the next
  request equals the oracle of the new weights.
- kill -9 of node 1's rank: the replica restarts as a unit (both nodes' ranks are new processes), and serves the
  committed weights' bits again; every answer meanwhile is the oracle's or UNAVAILABLE, never mixed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from distkit import run_ranks
from rankwork import oracle_digests_of
from refmedia import image_bytes
from servicekit import TOKEN, Weights, free_port, is_serving, short_tmpdir, sidecar_state, wait_for

from ditcore.references import Reference
from ditserve.client import GeneratorClient
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.processes, pytest.mark.timeout(900)]

CANVAS: dict[str, Any] = {"num_inference_steps": 2, "seed": 5, "height": 32, "width": 32, "num_frames": 124}
FIRST, LAST = image_bytes(64, 64, seed=11), image_bytes(64, 64, seed=12)
BATCH: list[dict[str, Any]] = [
    {**CANVAS, "request_id": "fox", "prompt": "a red fox"},
    {**CANVAS, "request_id": "fox-jumps", "prompt": "a red fox jumps over the lazy dog"},
    {**CANVAS, "request_id": "fl2va", "prompt": "a red fox", "task": "fl2va", "first_frame": FIRST, "last_frame": LAST},
    {**CANVAS, "request_id": "ref2va", "prompt": "a red fox", "task": "ref2va",
     "references": (Reference(image_bytes(80, 48, seed=1)),)},
]  # fmt: skip


@dataclass
class Node:
    proc: subprocess.Popen[bytes]
    run_dir: Path

    @property
    def sidecar(self) -> str:
        return f"unix:{self.run_dir / 'plancache.sock'}"

    def rank_pids(self) -> list[int]:
        """The pids of this node's generator ranks (not torchrun's agent)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmd = (entry / "cmdline").read_bytes()
                if (
                    b"-m\0generator_service" in cmd
                    and b"torch.distributed.run" not in cmd
                    and (f"--sidecar={self.sidecar}".encode() in cmd)
                ):
                    pids.append(int(entry.name))
        return pids


@dataclass
class TwoNodes:
    target: str
    nodes: list[Node]


def start_node(rank: int, checkpoint: Path, weights: Weights, rdzv: str, port: int) -> Node:
    run_dir = short_tmpdir(f"dsnode{rank}-")
    argv = [sys.executable, "-m", "ditserve", "serve", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint",
            rdzv, "--nproc", "1", "--device", "cpu", "--checkpoint", str(checkpoint), "--weights-root",
            str(weights.root), "--run-dir", str(run_dir), "--port", str(port), "--no-metrics", "--gpu-plans", "512"]  # fmt: skip
    env = {**os.environ, "DITSERVE_ADMIN_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    log = (run_dir / "serve.out").open("wb")
    return Node(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), run_dir)


@pytest.fixture(scope="module")
def two_nodes(weights: Weights) -> Iterator[TwoNodes]:
    rdzv, port = f"127.0.0.1:{free_port()}", free_port()
    # node 1's sidecar starts on other weights (B): the replica brings it to node 0's (A) before it serves
    nodes = [start_node(1, weights.b, weights, rdzv, free_port()), start_node(0, weights.a, weights, rdzv, port)]
    nodes.reverse()
    target = f"127.0.0.1:{port}"
    try:
        wait_for(lambda: is_serving(target), 300, "the two-node replica serving")
        yield TwoNodes(target, nodes)
    finally:
        for node in nodes:  # node 0 first: its rank 0 stops every rank, then node 1's serve has nothing to wait for
            node.proc.send_signal(signal.SIGTERM)
            try:
                node.proc.wait(60)
            except subprocess.TimeoutExpired:
                node.proc.kill()


@pytest.fixture(scope="module")
def oracle(weights: Weights, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """weights name -> request id -> sha256 of diffusers' own 2-rank Ulysses run (A: the batch; B: "a red fox"), in
    one process group."""
    runs = [(weights.a, BATCH, "a.json"), (weights.b, BATCH[:1], "b.json")]
    out = run_ranks(oracle_digests_of, 2, (runs, 2), tmp_path_factory.mktemp("oracle"))
    return {name: {rid: o["sha256"] for rid, o in json.loads((out / f"{name}.json").read_text()).items()}
            for name in ("a", "b")}  # fmt: skip


def generate(target: str, request: dict[str, Any]) -> tuple[int, str]:
    with GeneratorClient(target) as client:
        result = client.generate(request, timeout=300)
    return result.generation, result.sha256


def test_two_nodes_serve_the_oracle_of_every_task(
    two_nodes: TwoNodes, weights: Weights, oracle: dict[str, dict[str, str]]
) -> None:
    with GeneratorClient(two_nodes.target) as client:
        status = client.status()
    assert status.replica.ranks == 2 and status.replica.ulysses_degree == 2 and status.replica.ring_degree == 1
    assert status.replica.nodes == 2 and [r.node for r in status.replica.rank_placements] == [0, 1]
    assert status.sidecar_target == ",".join(n.sidecar for n in two_nodes.nodes)  # rank 0: a client of both
    states = [sidecar_state(n.sidecar) for n in two_nodes.nodes]
    assert [(s.weights_path, s.generation) for s in states] == [(str(weights.a), 1), (str(weights.a), 2)]
    sidecars = [(n.node, n.target, n.attached, n.generation, n.fingerprint) for n in status.replica.node_sidecars]
    assert sidecars == [(i, node.sidecar, True, state.generation, status.fingerprint)
                        for i, (node, state) in enumerate(zip(two_nodes.nodes, states, strict=True))]  # fmt: skip
    for request in BATCH:
        generation, sha = generate(two_nodes.target, request)
        assert (generation, sha) == (1, oracle["a"][request["request_id"]]), request["request_id"]
    for node in two_nodes.nodes:  # each node's sidecar built and leased its own plans
        assert sidecar_state(node.sidecar).stats.prepares > 0


def test_an_update_commits_on_both_sidecars(
    two_nodes: TwoNodes, weights: Weights, oracle: dict[str, dict[str, str]]
) -> None:
    before = [sidecar_state(n.sidecar) for n in two_nodes.nodes]
    with grpc.insecure_channel(two_nodes.target) as ch:
        resp = pb_grpc.GeneratorStub(ch).UpdateWeights(
            pb.UpdateWeightsRequest(weights_path=str(weights.b), request_id="upd"),
            metadata=[("authorization", f"Bearer {TOKEN}")], timeout=300,
        )  # fmt: skip
    assert resp.generation == before[0].generation + 1
    after = [sidecar_state(n.sidecar) for n in two_nodes.nodes]
    for old, new in zip(before, after, strict=True):
        assert new.generation == old.generation + 1 and new.weights_path == str(weights.b), new
        assert new.fingerprint == resp.fingerprint and not new.pending_weights_path
    assert generate(two_nodes.target, BATCH[0]) == (resp.generation, oracle["b"]["fox"])


def test_kill_a_rank_on_node_1_restarts_the_replica_and_nothing_mixes(
    two_nodes: TwoNodes, oracle: dict[str, dict[str, str]]
) -> None:
    before = [sidecar_state(node.sidecar) for node in two_nodes.nodes]
    generation = before[0].generation  # node 0's is the replica's (each sidecar counts its own)
    expected = oracle["b"]["fox"] if generation == 2 else oracle["a"]["fox"]
    old = {pid for node in two_nodes.nodes for pid in node.rank_pids()}
    victim = two_nodes.nodes[1].rank_pids()
    assert len(old) == 2 and len(victim) == 1, (old, victim)
    os.kill(victim[0], signal.SIGKILL)
    answers = []
    with contextlib.suppress(grpc.RpcError):  # the first request after the kill may find the rank gone
        answers.append(generate(two_nodes.target, BATCH[0]))

    def restarted() -> bool:
        pids = [set(node.rank_pids()) for node in two_nodes.nodes]
        return all(len(p) == 1 for p in pids) and not (pids[0] | pids[1]) & old and is_serving(two_nodes.target)

    wait_for(restarted, 240, "both nodes' ranks restarted as a unit")
    answers.append(generate(two_nodes.target, BATCH[0]))
    assert all(answer == (generation, expected) for answer in answers), answers
    after = [sidecar_state(node.sidecar) for node in two_nodes.nodes]
    assert [(s.generation, s.fingerprint) for s in after] == [(s.generation, s.fingerprint) for s in before]
