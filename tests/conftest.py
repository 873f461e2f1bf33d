"""Shared fixtures: tiny checkpoints (session-scoped, never mutated), CLI runners (tests/clikit.py),
and the service tests' pairs and processes (built by tests/servicekit.py)."""

from __future__ import annotations

import os

# grpc's fork handlers can deadlock a process that forks (subprocess.Popen) while its own
# channels are busy (grpc/grpc#37259); the tests start service processes from threads that
# also hold channels. Must be set before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# One torch thread per process: scripts/test.sh runs two workers on two cores, and each starts services of its own;
# more threads than cores only spin. Set before torch is imported, so every process a test starts inherits the same
# count (CPU bits of some reductions depend on it: a service's output is compared with this process's reference).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import processguard
import pytest
import torch
from clikit import CliRunner, run_cli_inprocess, run_cli_subprocess
from jobskit import jobs_server
from pgkit import pg_url  # noqa: F401  (the session's PostgreSQL server, for the job store's tests)
from servicekit import Pair, ProcessGroup, StartPair, Weights, process_group, updatable, wait_for
from slowfirst import SLOW_FIRST

from ditcore import write_repository

PROCESS_FIXTURES = frozenset({"procs", "proc_pair", "run_cli_proc", "pg_url"})
"""Fixtures that start OS processes: a test using one is marked `processes` (the quick tier leaves it out)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped (and reported as skipped) on machines without CUDA. End-to-end tests and tests
    using a process-starting fixture are marked `processes`."""
    skip = (
        None
        if torch.cuda.is_available()
        else pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    )
    for item in items:
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)
        if "e2e" in item.keywords or PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.processes)
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(SLOW_FIRST)))  # stable: modules stay whole


def _guarded(item: pytest.Item) -> contextlib.AbstractContextManager[None]:
    return processguard.running(item.nodeid, item.get_closest_marker("processes") is not None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> object:
    """While `item`'s fixtures are set up and while it runs, a process it starts must be declared: a test that is not
    marked `processes` and starts one fails, naming the command (tests/processguard.py), so `--quick` really is the
    tier that starts none. Teardown is not checked: a session fixture stops the server it started (PostgreSQL) after
    whichever test its worker ran last."""
    with _guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    with _guarded(item):
        return (yield)


@pytest.fixture(autouse=True)
def _root_logging_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A service's main() run in this process points the root logger at the test's captured stderr; each test gets
    the root logger's handlers and level back, so no later log record is written to a closed stream."""
    import logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)


# ----------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny MiniMax-H3 repository (released mixed precision), seed 0, 2 transformer shards. Read-only: copy it
    (copy_ckpt) before mutating."""
    return write_repository(tmp_path_factory.mktemp("tiny_ckpt") / "ckpt", "tiny", seed=0, dtype="mixed", shards=2)


@pytest.fixture(scope="session")
def tiny_ckpt_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same config, precision and sharding as `tiny_ckpt`, different weights (seed 1)."""
    return write_repository(tmp_path_factory.mktemp("tiny_ckpt_b") / "ckpt", "tiny", seed=1, dtype="mixed", shards=2)


@pytest.fixture(scope="session")
def tiny_ckpt_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset in float32 throughout, seed 0 (read-only)."""
    return write_repository(tmp_path_factory.mktemp("tiny_f32") / "ckpt", "tiny", seed=0, dtype="float32", shards=2)


# ----------------------------------------------------------------------------- CLI runners
@pytest.fixture
def run_cli() -> CliRunner:
    return run_cli_inprocess


@pytest.fixture
def run_cli_proc() -> CliRunner:
    return run_cli_subprocess


# ----------------------------------------------------------------------------- services
@pytest.fixture(scope="session")
def svc_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset (mixed precision), seed 0, one transformer shard, for the service tests (read-only)."""
    return write_repository(
        tmp_path_factory.mktemp("svc_ckpt") / "tiny-ckpt-0", "tiny", seed=0, dtype="mixed", shards=1
    )


@pytest.fixture(scope="session")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Weights:
    """A weights root with A (seed 0) and B (seed 1), two shards each. Never modify A or B; add directories."""
    root = tmp_path_factory.mktemp("upd") / "weights"
    a = write_repository(root / "A", "tiny", seed=0, dtype="mixed", shards=2)
    b = write_repository(root / "B", "tiny", seed=1, dtype="mixed", shards=2)
    return Weights(root, a, b)


@pytest.fixture
def procs(request: pytest.FixtureRequest) -> Iterator[ProcessGroup]:
    """This test's service processes: stopped at teardown, their logs printed if the test failed."""
    with process_group(request) as group:
        yield group


@pytest.fixture
def pairs(weights: Weights) -> Iterator[StartPair]:
    """`pairs(checkpoint, **options)`: a started in-process pair that accepts updates to A and B
    (servicekit.updatable); every pair is closed at teardown."""
    with contextlib.ExitStack() as stack:
        yield lambda checkpoint, **options: stack.enter_context(
            Pair(checkpoint, **updatable(weights, **options))
        ).start()


@pytest.fixture
def proc_pair(procs: ProcessGroup, weights: Weights) -> Pair:
    """A sidecar and a generator as processes (not started) serving A, set up for updates (drain 30 s)."""
    return procs.pair(weights.a, **updatable(weights, drain_timeout_s=30.0))


@pytest.fixture(scope="module")
def jobs_target(svc_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """ "127.0.0.1:PORT" of a real in-process generator (resident, the tiny preset) serving Generator and Jobs, its
    jobs in a fresh state directory (one per test module)."""
    with jobs_server(svc_ckpt, tmp_path_factory.mktemp("jobs-state")) as srv:
        yield f"127.0.0.1:{srv.port}"


@pytest.fixture(scope="module")
def resident_backend(svc_ckpt: Path) -> Iterator[Any]:
    """A started resident backend on the CPU over `svc_ckpt` (one per test module): for executor-level tests."""
    from generator_service.backends.resident import ResidentBackend

    b = ResidentBackend(svc_ckpt, torch.device("cpu"))
    b.start()
    wait_for(lambda: b.status().serving, 120, "the model to load")
    yield b
    b.close()
