"""The service tests' kit: one sidecar + generator pair (`Pair`, in this process or as processes),
one process group, request data, resident references, gRPC helpers, and media helpers (keyframe
PNGs, an MP4 prober). The fixtures built on them (svc_ckpt, weights, procs, pairs, proc_pair) are
registered in tests/conftest.py.

Unix sockets live under short /tmp/dsv-* directories (AF_UNIX paths are limited to 107 bytes;
pytest's tmp_path is often longer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from fractions import Fraction
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from ditcore import GenerationRequest, GenerationResult, PlanKey, distinct_keys, generate, load_model
from ditcore.schedule import ScheduleKeys
from ditcore.shards import INDEX_FILE, SINGLE_FILE
from ditruntime.flags import to_argv
from ditserve.client import request_to_proto
from ditserve.supervise import die_with_parent, terminate
from generator_service.app import build_server as build_generator
from generator_service.config import GeneratorConfig
from plancache_service.app import build_server as build_sidecar
from plancache_service.config import CacheConfig, SidecarConfig
from protos.ditserve.generator.v1 import generator_pb2 as gen_pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as gen_grpc
from protos.ditserve.plancache.v1 import plancache_pb2 as cache_pb
from protos.ditserve.plancache.v1 import plancache_pb2_grpc as cache_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
GENERATOR_SERVICE = "ditserve.generator.v1.Generator"
PLANCACHE_SERVICE = "ditserve.plancache.v1.PlanCache"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SHM_PREFIX = "ditserve-"
STATE_FILE = "plancache-state.json"
TOKEN = "update-test-token"

# Small t2va requests on the tiny preset: H3's default shifts, and other shifts on a wider canvas. Unequal video and
# audio shifts give plans of width 2 (the first step's, at t = 0 for both, has width 1).
FOX_REQUEST: dict[str, Any] = {
    "request_id": "it-fox", "task": "t2va", "prompt": "a red fox", "num_inference_steps": 6, "flow_shift": 12.0,
    "audio_flow_shift": 3.0, "seed": 7, "num_frames": 124, "height": 32, "width": 32,
}  # fmt: skip
RAIN_REQUEST: dict[str, Any] = {
    "request_id": "it-rain", "task": "t2va", "prompt": "rain on a tin roof", "num_inference_steps": 8,
    "flow_shift": 7.0, "audio_flow_shift": 2.0, "seed": 11, "num_frames": 141, "height": 32, "width": 64,
}  # fmt: skip
# The update tests' requests (4-6 grid points; each call names its request_id), distinct outputs per checkpoint.
REQ_FOX: dict[str, Any] = {k: v for k, v in FOX_REQUEST.items() if k != "request_id"}
REQ_RAIN: dict[str, Any] = {**{k: v for k, v in RAIN_REQUEST.items() if k != "request_id"}, "num_inference_steps": 5}
REQ_SHORT: dict[str, Any] = {**REQ_FOX, "prompt": "snow", "num_inference_steps": 5, "flow_shift": 3.0, "seed": 3}


def long_request(steps: int) -> dict[str, Any]:
    """A request that keeps the executor busy for a while (`steps` forwards on a 128 x 128 canvas)."""
    return {**REQ_FOX, "prompt": "a long one", "num_inference_steps": steps + 1, "height": 128, "width": 128, "seed": 5}


def narrow_request(steps: int, **overrides: Any) -> dict[str, Any]:
    """`steps` forwards on the smallest canvas with equal video and audio shifts: every plan has width 1 and every
    step its own plan (fits slots of width 1; `steps` + 1 grid points)."""
    return {**REQ_FOX, "prompt": "narrow", "num_inference_steps": steps + 1, "flow_shift": 3.0,
            "audio_flow_shift": 3.0, **overrides}  # fmt: skip


# ----------------------------------------------------------------------------- small helpers
def short_tmpdir(prefix: str = "dsv-") -> Path:
    """A fresh directory under /tmp with a short path (for unix sockets)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def free_port() -> int:
    """A TCP port that was free a moment ago (bind port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float, what: str = "condition", interval: float = 0.05) -> Any:
    """Poll `predicate` until it returns a truthy value; return it. Raise AssertionError on timeout."""
    end = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (grpc.RpcError, OSError) as e:
            last_exc = e
        if time.monotonic() >= end:
            raise AssertionError(f"timed out after {timeout:.1f} s waiting for {what} (last error: {last_exc!r})")
        time.sleep(interval)


def status_details(err: grpc.RpcError) -> tuple[error_details_pb2.ErrorInfo | None, list[tuple[str, str]]]:
    """(ErrorInfo, [(field, description)] of BadRequest) decoded from a ditserve error."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    info: error_details_pb2.ErrorInfo | None = None
    violations: list[tuple[str, str]] = []
    for d in status.details if status is not None else ():
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            d.Unpack(info)
        elif d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            br = error_details_pb2.BadRequest()
            d.Unpack(br)
            violations += [(v.field, v.description) for v in br.field_violations]
    return info, violations


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The google.rpc.ErrorInfo a ditserve status carries (None if it has none)."""
    return status_details(err)[0]


def health_status(target: str, service: str = "", timeout: float = 5) -> int:
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


def is_serving(target: str) -> bool:
    """The generator at `target` answers its health check SERVING now (False while it cannot be reached)."""
    with contextlib.suppress(grpc.RpcError):
        return health_status(target, timeout=2) == health_pb2.HealthCheckResponse.SERVING
    return False


def sidecar_state(target: str, timeout: float = 10) -> cache_pb.GetStateResponse:
    """GetState of the sidecar at `target` ('unix:/path' or a socket path)."""
    target = target if target.startswith("unix:") else f"unix:{target}"
    with grpc.insecure_channel(target) as ch:
        return cache_grpc.PlanCacheStub(ch).GetState(cache_pb.GetStateRequest(), timeout=timeout)


def read_state_file(state_dir: Path) -> dict[str, Any]:
    return json.loads((state_dir / STATE_FILE).read_text())


def gen_request(req: dict[str, Any], request_id: str = "upd", expected_generation: int | None = None) -> Any:
    return request_to_proto(GenerationRequest.from_dict({**req, "request_id": request_id}), expected_generation)


def background(fn: Callable[[], Any], name: str = "bg") -> Future[Any]:
    """Run `fn` in a daemon thread: `result(timeout)` returns its value or re-raises, `exception(timeout)`."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


# ----------------------------------------------------------------------------- checkpoints and references
@dataclasses.dataclass(frozen=True)
class Weights:
    """A weights root holding checkpoints A (tiny, seed 0) and B (tiny, seed 1)."""

    root: Path
    a: Path
    b: Path

    def ckpt_of(self, generation: int) -> Path:
        """The checkpoint a generation serves when updates alternate A, B, A, ... from generation 1 = A."""
        assert generation >= 1, generation
        return self.a if generation % 2 == 1 else self.b


@functools.lru_cache(maxsize=4)
def _resident_model(checkpoint: str) -> Any:
    return load_model(checkpoint, "resident")


@functools.lru_cache(maxsize=8)
def _schedule(checkpoint: str) -> ScheduleKeys:
    return ScheduleKeys(checkpoint)


def request_keys(checkpoint: Path, request: dict[str, Any]) -> list[PlanKey]:
    """The plan key of every step of `request` on `checkpoint` (its schedulers alone; what the generator leases)."""
    return _schedule(str(checkpoint)).keys(GenerationRequest.from_dict({"request_id": "keys", **request}))


def distinct_plans(checkpoint: Path, request: dict[str, Any]) -> int:
    """How many distinct plans (slots) `request` needs: what its cache report adds up to."""
    return len(distinct_keys(request_keys(checkpoint, request)))


def transformer_shards(checkpoint: Path) -> list[str]:
    """The transformer's shard files, relative to the repository, in index order."""
    if not (checkpoint / "transformer" / INDEX_FILE).is_file():
        return [f"transformer/{SINGLE_FILE}"]
    index = json.loads((checkpoint / "transformer" / INDEX_FILE).read_text())
    return [f"transformer/{f}" for f in sorted(set(index["weight_map"].values()))]


def resident_result(checkpoint: Path, request: dict[str, Any]) -> GenerationResult:
    """ditcore's resident-mode result of `request` (the reference), in this process."""
    return generate(_resident_model(str(checkpoint)), GenerationRequest.from_dict({"request_id": "ref", **request}))


@functools.cache
def _ref_sha(checkpoint: str, request_json: str) -> str:
    return resident_result(Path(checkpoint), json.loads(request_json)).sha256


def ref_sha(checkpoint: Path, request: dict[str, Any]) -> str:
    """sha256 of the resident reference of `request` on `checkpoint`, computed once per pair."""
    return _ref_sha(str(checkpoint), json.dumps(request, sort_keys=True))


def updatable(weights: Weights, **options: Any) -> dict[str, Any]:
    """Pair options of the update tests: A and B under the weights root, the test token, a state dir."""
    return {"weights_root": weights.root, "admin_token": TOKEN, "state_dir": "state", "max_queue_depth": 16, **options}


# ----------------------------------------------------------------------------- processes
def service_env(fault: str | None = None) -> dict[str, str]:
    """The services' environment: unbuffered, repo importable, DITSERVE_FAULT only if given."""
    env = dict(os.environ)
    env.pop("DITSERVE_FAULT", None)
    if fault:
        env["DITSERVE_FAULT"] = fault
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def shm_files_of(pid: int) -> set[str]:
    """The /dev/shm/ditserve-* files process `pid` has mapped (its slab and slot table)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    out = set()
    for line in maps.splitlines():
        fields = line.split(None, 5)  # address perms offset dev inode [path]
        if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith(SHM_PREFIX):
            out.add(fields[5].strip())
    return out


@dataclasses.dataclass
class ServiceProcess:
    """One service subprocess with its log file; it can be started again (a restart)."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self, fault: str | None = None) -> ServiceProcess:
        """Start (again); `fault` sets DITSERVE_FAULT for this start only."""
        self.starts += 1
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n=== start #{self.starts} (DITSERVE_FAULT={fault!r}): {' '.join(self.argv)}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(
                self.argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=service_env(fault), cwd=REPO_ROOT, preexec_fn=die_with_parent,
            )  # fmt: skip
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.wait_exit(10)

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM, wait, then SIGKILL. Returns the exit code."""
        return terminate(self.proc, grace_s) if self.proc is not None else None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_log(self, pattern: str, timeout: float, since: int = 0) -> None:
        """Wait until the log (from byte `since`) matches `pattern`."""
        rx = re.compile(pattern)
        wait_for(lambda: rx.search(self.log()[since:]), timeout, f"{self.name}'s log to match {pattern!r}")


class ProcessGroup:
    """Service processes; `close()` closes its pairs, stops every process (SIGTERM, then SIGKILL)
    and removes what they leaked (grandchildren in `extra_pids`, shm files in `leaked_files`)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[ServiceProcess] = []
        self.pairs: list[Pair] = []
        self.extra_pids: set[int] = set()  # e.g. grandchildren of `ditserve serve`
        self.leaked_files: set[str] = set()  # shm files of sidecars (a SIGKILLed one cannot unlink them)

    def add(self, name: str, argv: Sequence[Any]) -> ServiceProcess:
        """A process, not started yet; its log is <workdir>/<name>-<n>.log."""
        sp = ServiceProcess(name, [str(a) for a in argv], self.workdir / f"{name}-{len(self.procs)}.log")
        self.procs.append(sp)
        return sp

    def start(self, name: str, argv: Sequence[Any]) -> ServiceProcess:
        return self.add(name, argv).start()

    def pair(self, checkpoint: Path, **options: Any) -> Pair:
        """A sidecar and a generator as processes of this group (not started; see `Pair`)."""
        self.pairs.append(Pair(checkpoint, group=self, **options))
        return self.pairs[-1]

    def logs(self) -> str:
        return "\n".join(f"----- {sp.name} ({sp.log_path}) -----\n{sp.log()[-30000:]}" for sp in self.procs)

    def wait_healthy(self, target: str, proc: ServiceProcess, timeout: float = 90, service: str = "") -> None:
        """Poll grpc.health.v1 until SERVING; fail with the logs if the process dies or time runs out."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not proc.running():
                raise AssertionError(f"{proc.name} exited ({proc.proc and proc.proc.returncode})\n{self.logs()}")
            with contextlib.suppress(grpc.RpcError):
                if health_status(target, service, timeout=1) == SERVING:
                    return
            time.sleep(0.1)
        raise AssertionError(f"{target} not SERVING within {timeout:.0f} s\n{self.logs()}")

    def close(self) -> None:
        try:
            for pair in reversed(self.pairs):
                pair.close()
        finally:
            for sp in reversed(self.procs):
                sp.stop()
            for pid in self.extra_pids:
                if pid_alive(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            for f in self.leaked_files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f)


@contextlib.contextmanager
def process_group(request: pytest.FixtureRequest) -> Iterator[ProcessGroup]:
    """A group closed on exit; the logs are printed (past pytest's capture) if a test failed meanwhile."""
    group = ProcessGroup(short_tmpdir())
    failed_before = request.session.testsfailed
    try:
        yield group
    finally:
        try:
            group.close()
        finally:
            if request.session.testsfailed > failed_before:
                capman = request.config.pluginmanager.getplugin("capturemanager")
                with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
                    sys.stderr.write(f"\n===== service logs ({request.node.nodeid}) =====\n{group.logs()}\n")
                    sys.stderr.flush()
            shutil.rmtree(group.workdir, ignore_errors=True)


# ----------------------------------------------------------------------------- the pair
class Pair:
    """A plan-cache sidecar and a generator over a unix socket (`mode="resident"`: the generator
    alone), as real gRPC servers in this process or, with a process `group`, as `python -m
    plancache_service` / `python -m generator_service` processes started from the same configs.

    `sidecar` / `generator` are the SidecarServer / GeneratorServer here (None until started),
    or the ServiceProcess of each side (start with a fault, kill9, log, restart). A relative
    `state_dir` lies in the pair's own work dir. Use as a context manager, or close().
    """

    def __init__(
        self,
        checkpoint: Path,
        *,
        group: ProcessGroup | None = None,
        mode: str = "cached",
        state_dir: Path | str | None = None,
        weights_root: Path | None = None,
        admin_token: str = "",
        gpu_plans: int = 64,
        plan_width: int = 2,
        host_cache_bytes: int = 20 * 1000**2,
        sidecar_device: str = "cpu",
        max_queue_depth: int = 8,
        chunk_bytes: int = 1024 * 1024,
        drain_timeout_s: float = 60.0,
        heartbeat_s: float = 0.5,
        sidecar_metrics_port: int | None = None,
        plan_dir: Path | None = None,
        **generator_options: Any,
    ) -> None:
        self.checkpoint, self.group, self.mode, self.workdir = checkpoint, group, mode, short_tmpdir()
        self.socket_path = self.workdir / "pc.sock"
        self.state_dir = self.workdir / state_dir if state_dir is not None else None
        self.port = free_port() if group is not None else 0  # in this process: known once started
        cache = CacheConfig(
            gpu_plans=gpu_plans, plan_width=plan_width, host_cache_bytes=host_cache_bytes, device=sidecar_device,
            plan_dir=plan_dir,
        )  # fmt: skip
        self.sidecar_config = SidecarConfig(
            checkpoint, cache, self.sidecar_target,
            heartbeat_s=heartbeat_s, state_dir=self.state_dir, metrics_port=sidecar_metrics_port,
            adapter_dir=generator_options.get("adapter_dir"),  # the sidecar builds the adapters' plans
        )  # fmt: skip
        self.generator_config = GeneratorConfig(
            adaln_mode=mode, checkpoint=checkpoint if mode == "resident" else None,
            sidecar=self.sidecar_target if mode == "cached" else "", listen=f"127.0.0.1:{self.port}",
            max_queue_depth=max_queue_depth, chunk_bytes=chunk_bytes, reconnect_s=0.2,
            admin_token=admin_token, weights_root=weights_root, drain_timeout_s=drain_timeout_s,
            **generator_options,  # e.g. metrics_port, operator limits, TLS
        )  # fmt: skip
        self.sidecar: Any = None
        self.generator: Any = None
        if group is not None:
            self.sidecar, self.generator = self._processes(group)
        self._channel: grpc.Channel | None = None

    def _processes(self, group: ProcessGroup) -> tuple[ServiceProcess | None, ServiceProcess]:
        """Both sides as processes of `group`, their flags rendered from the configs. reconnect_s
        has no flag: the generator process keeps its default."""
        py = [sys.executable, "-m"]
        sidecar = None
        if self.mode == "cached":
            flags = to_argv(self.sidecar_config, exclude=("address",))
            sidecar = group.add("sidecar", [*py, "plancache_service", *flags, f"--socket={self.socket_path}"])
        flags = to_argv(self.generator_config, exclude=("reconnect_s",))
        return sidecar, group.add("generator", [*py, "generator_service", *flags])

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def sidecar_target(self) -> str:
        return f"unix:{self.socket_path}"

    # ---------------------------------------------------------------- lifecycle
    def start(self, sidecar_fault: str | None = None, generator_fault: str | None = None) -> Pair:
        """Start both sides (the generator attaches by itself), then wait until both are SERVING."""
        if self.mode == "cached":
            self.start_sidecar(sidecar_fault, wait=False)
        self.start_generator(generator_fault, wait=False)
        if self.mode == "cached":
            self.wait_sidecar()
        self.wait_generator()
        return self

    def start_sidecar(self, fault: str | None = None, wait: bool = True) -> None:
        """Start (or restart) the sidecar; `fault` (processes only) sets DITSERVE_FAULT for this start."""
        if self.group is not None:
            self.sidecar.start(fault)
        else:
            assert fault is None, "fault hooks need processes (Pair(group=...))"
            self.sidecar = build_sidecar(self.sidecar_config)
            self.sidecar.start()
        if wait:
            self.wait_sidecar()

    def start_generator(self, fault: str | None = None, wait: bool = True) -> None:
        """Start (or restart) the generator on the same port; `fault` as for the sidecar."""
        if self.group is not None:
            self.generator.start(fault)
        else:
            assert fault is None, "fault hooks need processes (Pair(group=...))"
            listen = f"127.0.0.1:{self.port}"  # port 0 on the first start
            self.generator = build_generator(dataclasses.replace(self.generator_config, listen=listen))
            self.generator.start()
            self.port = self.generator.port
        if wait:
            self.wait_generator()

    def wait_sidecar(self, timeout: float = 90) -> None:
        self._wait_serving(self.sidecar, self.sidecar_target, timeout)
        if self.group is not None:
            self.group.leaked_files |= shm_files_of(self.sidecar.pid)

    def wait_generator(self, timeout: float = 90) -> None:
        self._wait_serving(self.generator, self.target, timeout)

    def _wait_serving(self, side: Any, target: str, timeout: float) -> None:
        if self.group is not None:
            self.group.wait_healthy(target, side, timeout)
        elif side is self.generator:  # its own serving state: health over gRPC may need TLS
            wait_for(lambda: side.state.serving, timeout, f"{target} to be SERVING")
        else:
            wait_for(lambda: health_status(target, timeout=1) == SERVING, timeout, f"{target} to be SERVING")

    def close(self) -> None:
        """Stop the generator, then the sidecar; remove the work dir (socket, state dir)."""
        grace_s = 1 if self.group is None else 15
        try:
            if self._channel is not None:
                self._channel.close()
            if self.generator is not None:
                self.generator.stop(grace_s=grace_s)
        finally:
            try:
                if self.sidecar is not None:
                    self.sidecar.stop(grace_s=grace_s)
            finally:
                shutil.rmtree(self.workdir, ignore_errors=True)

    # ---------------------------------------------------------------- calls
    def channel(self) -> grpc.Channel:
        """A new channel to the generator (close it)."""
        return grpc.insecure_channel(self.target)

    def sidecar_channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.sidecar_target)

    @property
    def stub(self) -> gen_grpc.GeneratorStub:
        """A Generator stub on the pair's own channel (closed with the pair)."""
        if self._channel is None:
            self._channel = self.channel()
        return gen_grpc.GeneratorStub(self._channel)

    def status(self) -> gen_pb.GetStatusResponse:
        return self.stub.GetStatus(gen_pb.GetStatusRequest(), timeout=10)

    def state(self) -> cache_pb.GetStateResponse:
        return sidecar_state(self.sidecar_target)

    def health(self) -> int:
        return health_status(self.target, timeout=2.0)

    def sidecar_health(self) -> int:
        return health_status(self.sidecar_target, timeout=2.0)

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
        """UpdateWeights with `Bearer token` (None: no authorization metadata)."""
        req = gen_pb.UpdateWeightsRequest(weights_path=str(path), request_id="upd-test", tensors=tensors or [])
        if expected_generation is not None:
            req.expected_generation = expected_generation
        metadata = [("authorization", f"Bearer {token}")] if token is not None else None
        return self.stub.UpdateWeights(req, metadata=metadata, timeout=timeout)


# ----------------------------------------------------------------------------- media
def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """An RGB PNG of `width` x `height` (a smooth gradient with a seeded tint): a keyframe."""
    from PIL import Image

    tint = np.random.default_rng(seed).integers(0, 256, 3)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], axis=-1)
    buf = io.BytesIO()
    Image.fromarray(((pixels + tint) % 256).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that is only a signature, an IHDR claiming `width` x `height` (8-bit RGB) and IEND: what a
    decompression bomb's header looks like, without its pixels."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def audio_sampling_rate(checkpoint: Path) -> int:
    """The audio VAE's sampling rate, from the repository's own config (what the waveform is sampled at)."""
    return int(json.loads((checkpoint / "audio_vae" / "config.json").read_text())["sampling_rate"])


@dataclasses.dataclass(frozen=True)
class Mp4Info:
    """What PyAV finds in an MP4: stream counts, codecs, geometry, rates, decoded frame count, duration."""

    video_streams: int
    audio_streams: int
    video_codec: str
    fps: Fraction
    frames: int  # decoded, not the header's count
    width: int
    height: int
    pix_fmt: str
    audio_codec: str
    channels: int
    sample_rate: int
    duration_s: float


def probe_mp4(data: bytes) -> Mp4Info:
    """Open `data` with PyAV (in memory) and decode every video frame."""
    import av

    with av.open(io.BytesIO(data)) as c:
        assert c.format.name.startswith("mov,mp4"), c.format.name
        video, audio = c.streams.video, c.streams.audio
        assert video and audio, (len(video), len(audio))
        v, a = video[0].codec_context, audio[0].codec_context
        info = {
            "video_streams": len(video), "audio_streams": len(audio), "video_codec": v.name,
            "fps": Fraction(video[0].average_rate), "width": v.width, "height": v.height, "pix_fmt": v.pix_fmt,
            "audio_codec": a.name, "channels": a.layout.nb_channels, "sample_rate": a.sample_rate,
            "duration_s": c.duration / av.time_base,
        }  # fmt: skip
        frames = sum(1 for _ in c.decode(video=0))
    return Mp4Info(frames=frames, **info)


StartPair = Callable[..., Pair]
"""The `pairs` fixture: `pairs(checkpoint, **options)` starts an in-process pair (closed at teardown)."""
