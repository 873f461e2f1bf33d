"""`ditserve serve` as one node of a replica across nodes (--nnodes, --node-rank, --rdzv-endpoint): the generator's
torchrun argv (static rendezvous, no --standalone, even with one rank per node), the refusals naming the flag and
its range, and node K > 0's generator, which has no public port: it is up once its agent runs (no gRPC health
check), and it stops through the agent's process group."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ditruntime.flags import LaunchOptions, from_args
from ditserve import cli as ditserve_cli
from ditserve import supervise
from ditserve.errors import UsageError
from ditserve.launcher import (
    REPLICA_MAX_RESTARTS,
    agent_group,
    banner,
    build_children,
    child_configs,
    prepare,
    wait_running,
)
from ditserve.supervise import Child, replica_leader
from generator_service import cli as generator_cli
from generator_service.config import GeneratorConfig
from plancache_service.config import SidecarConfig

ENDPOINT = "10.0.0.1:29500"
TWO_NODES = ("--nnodes", "2", "--rdzv-endpoint", ENDPOINT)


def _serve_args(*argv: str) -> argparse.Namespace:
    [sub] = [a for a in ditserve_cli._parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser: argparse.ArgumentParser = sub.choices["serve"]
    return parser.parse_args(list(argv))


def _children(tmp_path: Path, *argv: str) -> tuple[argparse.Namespace, GeneratorConfig, dict[str, Child]]:
    ckpt = tmp_path / "ck"
    args = _serve_args("--run-dir", str(tmp_path), "--checkpoint", str(ckpt), "--device", "cpu", *argv)
    gen, side = child_configs(args, tmp_path, ckpt)
    children = build_children(args, from_args(LaunchOptions, args, exclude=("threads",)), gen, side)
    return args, gen, {c.name: c for c in children}


def _torchrun(nnodes: int, rank: int, nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={rank}",
            "--rdzv-backend=static", f"--rdzv-endpoint={ENDPOINT}", f"--nproc-per-node={nproc}",
            f"--max-restarts={REPLICA_MAX_RESTARTS}", "-m", "generator_service"]  # fmt: skip


def _parses_back(child: Child, launcher_len: int, gen: GeneratorConfig) -> None:
    """The generator's flags after the launcher are its config, as on one node."""
    gen_args = generator_cli.build_parser().parse_args(child.argv[launcher_len:])
    assert generator_cli.config_from_args(gen_args) == gen


# ----------------------------------------------------------------------------- the argv
def test_node_0_runs_torchrun_with_a_static_rendezvous_and_serves_the_port(tmp_path: Path) -> None:
    args, gen, children = _children(tmp_path, *TWO_NODES, "--node-rank", "0", "--nproc", "2", "--port", "50061")
    generator = children["generator"]
    launcher = _torchrun(2, 0, 2)
    assert generator.argv[: len(launcher)] == launcher
    assert "--standalone" not in generator.argv and "--nnodes=1" not in generator.argv
    _parses_back(generator, len(launcher), gen)
    assert generator.ready is None and generator.health_target == "127.0.0.1:50061"  # gRPC health on --port
    assert generator.leader is replica_leader  # stopped through rank 0, here
    assert "--devices=cpu,cpu" in children["plancache sidecar"].argv  # one slab per local rank
    text = banner(args, gen, tmp_path / "ck", tmp_path)
    assert "generator on 127.0.0.1:50061" in text and "grpcurl" in text
    assert "node 0 of 2" in text and ENDPOINT in text


def test_node_1_runs_torchrun_without_a_public_server(tmp_path: Path) -> None:
    args, gen, children = _children(tmp_path, *TWO_NODES, "--node-rank", "1", "--nproc", "2")
    generator = children["generator"]
    launcher = _torchrun(2, 1, 2)
    assert generator.argv[: len(launcher)] == launcher
    assert "--standalone" not in generator.argv
    _parses_back(generator, len(launcher), gen)
    assert generator.ready is wait_running  # no gRPC health on --port: nothing serves it on this node
    assert generator.leader is agent_group
    assert "--devices=cpu,cpu" in children["plancache sidecar"].argv
    text = banner(args, gen, tmp_path / "ck", tmp_path)
    assert "node 1 of 2" in text and ENDPOINT in text and "rank 0" in text
    assert gen.sidecar == f"unix:{tmp_path / 'plancache.sock'}" and gen.sidecar in text
    assert "grpcurl" not in text


def test_one_rank_per_node_still_runs_torchrun(tmp_path: Path) -> None:
    for rank in (0, 1):
        _, gen, children = _children(tmp_path, "--nnodes", "3", "--rdzv-endpoint", ENDPOINT, "--node-rank", str(rank))
        launcher = _torchrun(3, rank, 1)
        assert children["generator"].argv[: len(launcher)] == launcher
        sidecar = children["plancache sidecar"]
        assert not any(a.startswith("--devices") for a in sidecar.argv)  # one slab, on --device
        assert isinstance(sidecar.config, SidecarConfig)
        assert (sidecar.config.cache.device, sidecar.config.cache.devices) == (gen.device, "")


def test_resident_node_1_banner_names_no_sidecar(tmp_path: Path) -> None:
    args, gen, children = _children(tmp_path, *TWO_NODES, "--node-rank", "1", "--adaln-mode", "resident")
    assert list(children) == ["generator"] and gen.sidecar == ""
    assert "no sidecar" in banner(args, gen, tmp_path / "ck", tmp_path)


def test_one_node_is_unchanged(tmp_path: Path) -> None:
    _, _, children = _children(tmp_path, "--nproc", "2")
    assert children["generator"].argv[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                              "--nnodes=1"]  # fmt: skip
    assert children["generator"].leader is replica_leader and children["generator"].ready is None
    _, _, children = _children(tmp_path)
    assert children["generator"].argv[:3] == [sys.executable, "-m", "generator_service"]
    assert children["generator"].leader is None and children["generator"].ready is None


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--nnodes", "0"), r"--nnodes must be at least 1, got 0"),
        ((*TWO_NODES, "--node-rank", "2"), r"--node-rank must be in \[0, 2\) for --nnodes 2, got 2"),
        ((*TWO_NODES, "--node-rank", "-1"), r"--node-rank must be in \[0, 2\) for --nnodes 2, got -1"),
        (("--node-rank", "1"), r"--node-rank must be in \[0, 1\) for --nnodes 1, got 1"),
        (("--nnodes", "2"), r"--rdzv-endpoint HOST:PORT is required with --nnodes 2"),
        (("--rdzv-endpoint", ENDPOINT), r"--rdzv-endpoint is for a replica across nodes .* with --nnodes 1"),
        (("--nnodes", "2", "--rdzv-endpoint", "10.0.0.1"), r"--rdzv-endpoint must be HOST:PORT with PORT in \[1,"),
        (("--nnodes", "2", "--rdzv-endpoint", "h:0"), r"--rdzv-endpoint must be HOST:PORT with PORT in \[1,"),
        ((*TWO_NODES, "--node-rank", "1", "--openai-port", "8080"), r"--openai-port .*--node-rank 1"),
    ],
)
def test_bad_node_flags_are_refused_naming_the_flag(tmp_path: Path, argv: tuple[str, ...], message: str) -> None:
    args = _serve_args("--run-dir", str(tmp_path / "run"), "--checkpoint", str(tmp_path / "ck"), *argv)
    with pytest.raises(ValueError, match=message):
        child_configs(args, tmp_path, tmp_path / "ck")
    with pytest.raises(UsageError, match=message):  # `serve` exits 2 before it writes or starts anything
        prepare(args)


def test_node_0_may_serve_the_openai_facade(tmp_path: Path) -> None:
    _, _, children = _children(tmp_path, *TWO_NODES, "--openai-port", "8080")
    assert "openai-api" in children


# ----------------------------------------------------------------------------- node K > 0's generator, started
@pytest.mark.processes
def test_node_1_generator_is_up_without_a_grpc_health_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for torchrun's agent (it sleeps) is up after about a second though nothing serves --port, and
    stopping it signals its process group."""

    def no_health(*args: object, **kwargs: object) -> None:
        pytest.fail("node 1's generator was health-checked over gRPC")

    monkeypatch.setattr(supervise, "wait_healthy", no_health)
    _, _, children = _children(tmp_path, *TWO_NODES, "--node-rank", "1", "--port", "1")
    generator = children["generator"]
    generator.argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    started = time.monotonic()
    generator.start(timeout_s=30)
    try:
        assert 0.9 <= time.monotonic() - started < 10
        assert generator.proc is not None and generator.proc.poll() is None
    finally:
        generator.stop(grace_s=10)
    assert generator.proc.returncode == -signal.SIGTERM

    generator.argv = [sys.executable, "-c", "raise SystemExit(3)"]  # an agent that exits at once did not start
    with pytest.raises(RuntimeError, match=r"generator failed to start \(process exited with code 3"):
        generator.start(timeout_s=30)


@pytest.mark.processes
def test_serve_help_lists_the_node_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ditserve", "serve", "--help"], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    for flag in ("--nnodes", "--node-rank", "--rdzv-endpoint"):
        assert flag in out, flag
