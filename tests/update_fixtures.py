"""Fixtures and helpers for the weight-update tests (test_update_weights / _crash / _load).

- `weights`: a weights root holding checkpoints A (tiny, seed 0) and B (tiny, seed 1), two
  shards each. A and B are never modified; tests add their own directories beside them.
- `ref_sha(ckpt, req)`: sha256 of ditcore's resident generation (the reference), cached per
  checkpoint and request.
- `pairs`: starts in-process sidecar + generator pairs (real gRPC over a unix socket) and
  stops them at teardown.
- `cluster`: real `python -m plancache_service` / `python -m generator_service` processes
  for the crash tests; SIGTERM then SIGKILL at teardown, logs printed when a test failed.

Unix sockets live in short `/tmp` directories (AF_UNIX paths are limited to 107 bytes).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from service_fixtures import ServiceProcess as Proc
from service_fixtures import _print_uncaptured, free_port, health_status, resident_sha256, shm_files_of, status_details
from service_fixtures import short_tmpdir as _short_tmpdir
from service_fixtures import wait_for as _wait_for

from ditcore import GenerationRequest, get_preset, write_checkpoint
from protos.ditserve.generator.v1 import generator_pb2 as gen_pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as gen_grpc
from protos.ditserve.plancache.v1 import plancache_pb2 as cache_pb
from protos.ditserve.plancache.v1 import plancache_pb2_grpc as cache_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKEN = "update-test-token"
TINY = get_preset("tiny")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STATE_FILE = "plancache-state.json"

# Small requests (steps 4-8): t2v (plans of width 1) and t2va with its own audio shift (width 2).
REQ_T2V: dict[str, Any] = {
    "task": "t2v",
    "prompt": "a red fox",
    "steps": 6,
    "flow_shift": 5.0,
    "guidance_scale": 4.0,
    "seed": 7,
    "frames": 5,
    "height": 32,
    "width": 32,
}
REQ_T2VA: dict[str, Any] = {
    "task": "t2va",
    "prompt": "rain on a tin roof",
    "steps": 4,
    "flow_shift": 7.0,
    "audio_flow_shift": 3.0,
    "guidance_scale": 2.5,
    "seed": 11,
    "frames": 5,
    "height": 32,
    "width": 32,
    "audio_length": 8,
}
REQ_SHORT: dict[str, Any] = {
    "task": "t2v",
    "prompt": "snow",
    "steps": 5,
    "flow_shift": 3.0,
    "guidance_scale": 1.0,
    "seed": 3,
    "frames": 5,
    "height": 32,
    "width": 32,
}


def long_request(steps: int) -> dict[str, Any]:
    """A request that keeps the executor busy for a while (~30-40 ms per step on 2 CPUs)."""
    return {
        "task": "t2v",
        "prompt": "a long one",
        "steps": steps,
        "flow_shift": 6.0,
        "guidance_scale": 5.0,
        "seed": 5,
        "frames": 5,
        "height": 32,
        "width": 32,
    }


# ----------------------------------------------------------------------------- small helpers
def short_tmpdir(prefix: str = "dsu-") -> Path:
    return _short_tmpdir(prefix)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll until `predicate()` is truthy and return it; AssertionError on timeout."""
    return _wait_for(predicate, timeout, interval=interval, what=what)


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The google.rpc.ErrorInfo a ditserve status carries (None if it has none)."""
    return status_details(err)[0]


def read_state_file(state_dir: Path) -> dict[str, Any]:
    return json.loads((state_dir / STATE_FILE).read_text())


def gen_request(req: dict[str, Any], request_id: str = "upd", expected_generation: int | None = None) -> Any:
    from ditserve.client import request_to_proto

    return request_to_proto(GenerationRequest.from_dict({**req, "request_id": request_id}), expected_generation)


# ----------------------------------------------------------------------------- checkpoints and references
@dataclass(frozen=True)
class Weights:
    root: Path
    a: Path
    b: Path

    def ckpt_of(self, generation: int) -> Path:
        """The checkpoint a generation serves when updates alternate A, B, A, ... from generation 1 = A."""
        assert generation >= 1, generation
        return self.a if generation % 2 == 1 else self.b


def make_weights(parent: Path) -> Weights:
    root = parent / "weights"
    root.mkdir(parents=True, exist_ok=True)
    a = write_checkpoint(TINY, root / "A", seed=0, shards=2)
    b = write_checkpoint(TINY, root / "B", seed=1, shards=2)
    return Weights(root, a, b)


@pytest.fixture(scope="session", name="weights")
def weights_fixture(tmp_path_factory: pytest.TempPathFactory) -> Weights:
    """Weights root with A (seed 0) and B (seed 1). Never modify A or B; add new directories."""
    return make_weights(tmp_path_factory.mktemp("upd"))


_ref_lock = threading.Lock()
_ref_cache: dict[tuple[str, str], str] = {}


def ref_sha(ckpt: Path, req: dict[str, Any]) -> str:
    """Resident-mode sha256 of `req` on `ckpt`, computed in this process once per pair."""
    key = (str(ckpt), json.dumps(req, sort_keys=True))
    with _ref_lock:
        if key not in _ref_cache:
            _ref_cache[key] = resident_sha256(ckpt, {**req, "request_id": "ref"})
        return _ref_cache[key]


# ----------------------------------------------------------------------------- failure reporting


# ----------------------------------------------------------------------------- in-process servers
@dataclass
class Pair:
    """An in-process sidecar and generator (or a resident generator alone)."""

    generator: Any  # generator_service.server.GeneratorServer
    sidecar: Any | None  # plancache_service.server.SidecarServer
    socket_path: Path | None
    state_dir: Path | None
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.target)
        self.stub = gen_grpc.GeneratorStub(self.channel)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.generator.port}"

    @property
    def sidecar_target(self) -> str:
        return f"unix:{self.socket_path}"

    def status(self) -> gen_pb.GetStatusResponse:
        return self.stub.GetStatus(gen_pb.GetStatusRequest(), timeout=10)

    def state(self) -> cache_pb.GetStateResponse:
        with grpc.insecure_channel(self.sidecar_target) as ch:
            return cache_grpc.PlanCacheStub(ch).GetState(cache_pb.GetStateRequest(), timeout=10)

    def sidecar_health(self) -> int:
        return health_status(self.sidecar_target, timeout=2.0)

    def health(self) -> int:
        return health_status(self.target, timeout=2.0)

    def generate(
        self, req: dict[str, Any], request_id: str = "upd", expected_generation: int | None = None, timeout: float = 60
    ) -> gen_pb.GenerateResponse:
        return self.stub.Generate(gen_request(req, request_id, expected_generation), timeout=timeout)

    def update(
        self,
        path: str | Path,
        *,
        token: str | None = TOKEN,
        expected_generation: int | None = None,
        tensors: list[gen_pb.Tensor] | None = None,
        timeout: float = 120,
    ) -> gen_pb.UpdateWeightsResponse:
        req = gen_pb.UpdateWeightsRequest(weights_path=str(path), request_id="upd-test", tensors=tensors or [])
        if expected_generation is not None:
            req.expected_generation = expected_generation
        metadata = [("authorization", f"Bearer {token}")] if token is not None else None
        return self.stub.UpdateWeights(req, metadata=metadata, timeout=timeout)

    def close(self) -> None:
        try:
            self.channel.close()
            self.generator.stop(grace_s=1)
        finally:
            try:
                backend = self.generator.backend
                if getattr(backend, "cached", False):
                    backend.close()
            finally:
                if self.sidecar is not None:
                    self.sidecar.stop(grace_s=1)


class PairFactory:
    def __init__(self, weights: Weights) -> None:
        self.weights = weights
        self.pairs: list[Pair] = []
        self.dirs: list[Path] = []

    def cached(
        self,
        checkpoint: Path | None = None,
        *,
        drain_timeout_s: float = 60.0,
        gpu_plans: int = 64,
        admin_token: str = TOKEN,
        max_queue_depth: int = 16,
    ) -> Pair:
        from generator_service.app import build_server as build_generator
        from generator_service.config import GeneratorConfig
        from plancache_service.app import build_server as build_sidecar
        from plancache_service.config import CacheConfig, SidecarConfig

        work = short_tmpdir()
        self.dirs.append(work)
        sock, state_dir = work / "pc.sock", work / "state"
        cache = CacheConfig(gpu_plans=gpu_plans, plan_width=2, host_cache_bytes=20 * 1000**2)
        ckpt = checkpoint or self.weights.a
        sidecar = build_sidecar(SidecarConfig(ckpt, cache, f"unix:{sock}", heartbeat_s=0.5, state_dir=state_dir))
        sidecar.start()
        try:
            generator = build_generator(
                GeneratorConfig(
                    adaln_mode="cached",
                    sidecar=f"unix:{sock}",
                    listen="127.0.0.1:0",
                    admin_token=admin_token,
                    weights_root=self.weights.root,
                    drain_timeout_s=drain_timeout_s,
                    max_queue_depth=max_queue_depth,
                    reconnect_s=0.2,
                )
            )
        except BaseException:
            sidecar.stop(grace_s=1)
            raise
        generator.start()
        pair = Pair(generator, sidecar, sock, state_dir)
        self.pairs.append(pair)
        wait_for(lambda: pair.health() == SERVING, 60, "the generator to attach to its sidecar")
        return pair

    def resident(self, checkpoint: Path | None = None, *, admin_token: str = TOKEN) -> Pair:
        from generator_service.app import build_server as build_generator
        from generator_service.config import GeneratorConfig

        generator = build_generator(
            GeneratorConfig(
                adaln_mode="resident",
                checkpoint=checkpoint or self.weights.a,
                listen="127.0.0.1:0",
                admin_token=admin_token,
                weights_root=self.weights.root,
            )
        )
        generator.start()
        pair = Pair(generator, None, None, None)
        self.pairs.append(pair)
        wait_for(lambda: pair.health() == SERVING, 30, "the resident generator")
        return pair

    def close(self) -> None:
        for pair in reversed(self.pairs):
            with contextlib.suppress(Exception):
                pair.close()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(name="pairs")
def pairs_fixture(weights: Weights) -> Iterator[PairFactory]:
    factory = PairFactory(weights)
    try:
        yield factory
    finally:
        factory.close()


class Background:
    """Run a call in a thread; `result()` returns its value or re-raises its exception."""

    def __init__(self, fn: Callable[[], Any], name: str = "bg") -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self.started_at = time.monotonic()
        self.finished_at: float | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as e:
            self._error = e
        finally:
            self.finished_at = time.monotonic()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"background call {self._thread.name} did not finish within {timeout:.0f} s")

    def result(self, timeout: float = 120) -> Any:
        self.join(timeout)
        if self._error is not None:
            raise self._error
        return self._value

    def error(self, timeout: float = 120) -> BaseException | None:
        self.join(timeout)
        return self._error


def start_stream(pair: Pair, req: dict[str, Any], request_id: str) -> tuple[Background, threading.Event]:
    """GenerateStream in a thread; the event is set at its first `step` (the request is running)."""
    running = threading.Event()

    def run() -> gen_pb.GenerateResponse:
        header = None
        msg = gen_pb.GenerateStreamRequest(request=gen_request(req, request_id))
        for ev in pair.stub.GenerateStream(msg, timeout=300):
            kind = ev.WhichOneof("event")
            if kind == "step":
                running.set()
            elif kind == "result":
                header = ev.result
        assert header is not None, "the stream ended without a result"
        return header

    return Background(run, name=f"stream-{request_id}"), running


# ----------------------------------------------------------------------------- processes
class Cluster:
    """A sidecar process and a generator process over a unix socket, with a persisted state dir."""

    def __init__(self, weights: Weights, workdir: Path, drain_timeout_s: float = 30.0) -> None:
        self.weights = weights
        self.workdir = workdir
        self.sock = workdir / "pc.sock"
        self.state_dir = workdir / "state"
        self.port = free_port()
        self.leaked_shm: set[str] = set()
        py = sys.executable
        self.sidecar = Proc("sidecar", [
            py, "-m", "plancache_service", "--checkpoint", str(weights.a), "--socket", str(self.sock),
            "--state-dir", str(self.state_dir), "--gpu-plans", "64", "--host-cache-gb", "0.02",
            "--heartbeat-s", "0.5",
        ], workdir / "sidecar.log")  # fmt: skip
        self.generator = Proc("generator", [
            py, "-m", "generator_service", "--sidecar", f"unix:{self.sock}", "--listen", f"127.0.0.1:{self.port}",
            "--weights-root", str(weights.root), "--admin-token", TOKEN, "--drain-timeout-s", str(drain_timeout_s),
        ], workdir / "generator.log")  # fmt: skip
        self._channel: grpc.Channel | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def sidecar_target(self) -> str:
        return f"unix:{self.sock}"

    # ---------------------------------------------------------------- lifecycle
    def start_sidecar(self, fault: str | None = None, timeout: float = 90) -> None:
        self.sidecar.start(fault)
        self._wait_serving(self.sidecar, self.sidecar_target, timeout)
        self.leaked_shm |= shm_files_of(self.sidecar.pid)

    def start_generator(self, fault: str | None = None, timeout: float = 90) -> None:
        self.generator.start(fault)
        self.wait_generator_serving(timeout)

    def wait_generator_serving(self, timeout: float = 90) -> None:
        self._wait_serving(self.generator, self.target, timeout)

    def _wait_serving(self, proc: Proc, target: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not proc.running():
                raise AssertionError(f"{proc.name} exited with {proc.proc and proc.proc.returncode}\n{self.logs()}")
            with contextlib.suppress(grpc.RpcError):
                if health_status(target, timeout=1) == SERVING:
                    return
            time.sleep(0.1)
        raise AssertionError(f"{target} not SERVING within {timeout:.0f} s\n{self.logs()}")

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self.generator.stop()
        self.sidecar.stop()
        for f in self.leaked_shm:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f)

    def logs(self) -> str:
        return "\n".join(
            f"----- {p.name} ({p.log_path}) -----\n{p.log()[-30000:]}" for p in (self.sidecar, self.generator)
        )

    # ---------------------------------------------------------------- calls
    @property
    def stub(self) -> gen_grpc.GeneratorStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.target)
        return gen_grpc.GeneratorStub(self._channel)

    def status(self) -> gen_pb.GetStatusResponse:
        return self.stub.GetStatus(gen_pb.GetStatusRequest(), timeout=10)

    def state(self) -> cache_pb.GetStateResponse:
        with grpc.insecure_channel(self.sidecar_target) as ch:
            return cache_grpc.PlanCacheStub(ch).GetState(cache_pb.GetStateRequest(), timeout=10)

    def generate(self, req: dict[str, Any], request_id: str = "crash", timeout: float = 60) -> gen_pb.GenerateResponse:
        return self.stub.Generate(gen_request(req, request_id), timeout=timeout)

    def update(self, path: Path, timeout: float = 120) -> gen_pb.UpdateWeightsResponse:
        req = gen_pb.UpdateWeightsRequest(weights_path=str(path), request_id="crash-upd")
        return self.stub.UpdateWeights(req, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=timeout)


@pytest.fixture(name="cluster")
def cluster_fixture(request: pytest.FixtureRequest, weights: Weights) -> Iterator[Cluster]:
    workdir = short_tmpdir()
    c = Cluster(weights, workdir)
    failed_before = request.session.testsfailed
    try:
        yield c
    finally:
        try:
            c.close()
        finally:
            if request.session.testsfailed > failed_before:
                _print_uncaptured(request, f"\n===== service logs ({request.node.nodeid}) =====\n{c.logs()}\n")
            shutil.rmtree(workdir, ignore_errors=True)
