"""Fixtures and helpers for the service tests (integration, e2e with grpcurl, faults).

Imported by tests/test_services_integration.py, tests/test_e2e_grpcurl.py and
tests/test_e2e_faults.py. Fixtures are registered under their `name=` (import the
`*_fixture` objects into a test module to use them). Everything here cleans up after itself: in-process servers are
stopped, subprocesses get SIGTERM then SIGKILL, and their logs are printed when a test
that used them failed.

Unix sockets live under short `/tmp/dsv-*` directories (AF_UNIX paths are limited to 107
bytes; pytest's tmp_path is often longer).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from ditcore import (
    GenerationRequest,
    GenerationResult,
    generate,
    get_preset,
    load_model,
    validate_checkpoint,
    write_checkpoint,
)
from ditserve.launcher import die_with_parent, terminate
from protos.ditserve.plancache.v1 import plancache_pb2 as cache_pb
from protos.ditserve.plancache.v1 import plancache_pb2_grpc as cache_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY = get_preset("tiny")
GENERATOR_SERVICE = "ditserve.generator.v1.Generator"
PLANCACHE_SERVICE = "ditserve.plancache.v1.PlanCache"
SHM_PREFIX = "ditserve-"

# Small requests used across the service tests: t2v (plans of width 1) and t2va with a
# distinct audio shift (plans of width 2).
T2V_REQUEST: dict[str, Any] = {
    "request_id": "it-t2v",
    "task": "t2v",
    "prompt": "a red fox",
    "negative_prompt": "blurry",
    "steps": 6,
    "flow_shift": 5.0,
    "guidance_scale": 4.0,
    "seed": 7,
    "frames": 5,
    "height": 32,
    "width": 32,
}
T2VA_REQUEST: dict[str, Any] = {
    "request_id": "it-t2va",
    "task": "t2va",
    "prompt": "rain on a tin roof",
    "steps": 8,
    "flow_shift": 7.0,
    "audio_flow_shift": 3.0,
    "guidance_scale": 2.5,
    "seed": 11,
    "frames": 9,
    "height": 48,
    "width": 32,
    "audio_length": 24,
}


# ----------------------------------------------------------------------------- small helpers
def short_tmpdir(prefix: str = "dsv-") -> Path:
    """A fresh directory under /tmp with a short path (for unix sockets)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def free_port() -> int:
    """A TCP port that was free a moment ago (bind port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = "condition") -> Any:
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


def grpcurl_bin() -> str:
    """The grpcurl of this interpreter's environment (the dev extra installs it), else PATH's."""
    found = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    if found is None:
        pytest.fail("grpcurl is not installed (pip install -e '.[dev]' provides it)")
    return found


@dataclass(frozen=True)
class GrpcurlResult:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err

    def json(self) -> Any:
        return json.loads(self.out)

    def json_stream(self) -> list[Any]:
        """stdout as a sequence of JSON objects (grpcurl prints one per streamed message)."""
        dec, out, i, s = json.JSONDecoder(), [], 0, self.out
        while True:
            while i < len(s) and s[i].isspace():
                i += 1
            if i >= len(s):
                return out
            obj, i = dec.raw_decode(s, i)
            out.append(obj)


def run_grpcurl(args: Sequence[str], timeout: float = 60) -> GrpcurlResult:
    proc = subprocess.run(
        [grpcurl_bin(), *[str(a) for a in args]], capture_output=True, text=True, timeout=timeout, check=False
    )
    return GrpcurlResult(proc.returncode, proc.stdout, proc.stderr)


def status_details(err: grpc.RpcError) -> tuple[error_details_pb2.ErrorInfo | None, list[tuple[str, str]]]:
    """(ErrorInfo, [(field, description)] of BadRequest) decoded from a ditserve error."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    info: error_details_pb2.ErrorInfo | None = None
    violations: list[tuple[str, str]] = []
    if status is None:
        return None, violations
    for d in status.details:
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            d.Unpack(info)
        elif d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            br = error_details_pb2.BadRequest()
            d.Unpack(br)
            violations += [(v.field, v.description) for v in br.field_violations]
    return info, violations


def health_status(target: str, service: str = "", timeout: float = 5) -> int:
    with grpc.insecure_channel(target) as ch:
        return (
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status
        )


SERVING = health_pb2.HealthCheckResponse.SERVING


def sidecar_state(target: str, timeout: float = 5) -> cache_pb.GetStateResponse:
    """GetState of the sidecar at `target` ('unix:/path' or a socket path)."""
    target = target if target.startswith("unix:") else f"unix:{target}"
    with grpc.insecure_channel(target) as ch:
        return cache_grpc.PlanCacheStub(ch).GetState(cache_pb.GetStateRequest(), timeout=timeout)


# ----------------------------------------------------------------------------- checkpoints and references
def make_tiny_checkpoint(parent: Path, seed: int = 0) -> Path:
    return write_checkpoint(TINY, parent / f"tiny-ckpt-{seed}", seed=seed)


@functools.lru_cache(maxsize=4)
def _resident_model(checkpoint: str) -> Any:
    return load_model(validate_checkpoint(checkpoint), "resident")


def resident_sha256(checkpoint: Path, request: dict[str, Any]) -> str:
    """sha256 of ditcore's resident-mode generation of `request` (the reference), in this process."""
    return generate(_resident_model(str(checkpoint)), GenerationRequest.from_dict(dict(request))).sha256


def resident_result(checkpoint: Path, request: dict[str, Any]) -> GenerationResult:
    """ditcore's resident-mode result of `request`, in this process."""
    return generate(_resident_model(str(checkpoint)), GenerationRequest.from_dict(dict(request)))


@pytest.fixture(scope="session", name="svc_ckpt")
def svc_ckpt_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset, seed 0, for the service tests (read-only)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("svc_ckpt"))


# ----------------------------------------------------------------------------- failure reporting
def _failed_since(request: pytest.FixtureRequest, before: int) -> bool:
    return request.session.testsfailed > before


def _print_uncaptured(request: pytest.FixtureRequest, text: str) -> None:
    capman = request.config.pluginmanager.getplugin("capturemanager")
    ctx = capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext()
    with ctx:
        sys.stderr.write(text)
        sys.stderr.flush()


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


def children_of(pid: int) -> set[int]:
    """Direct children of `pid` (from /proc/<pid>/task/*/children)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out |= {int(x) for x in (task / "children").read_text().split()}
    return out


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


def shm_listing() -> set[str]:
    d = Path("/dev/shm")
    return {str(p) for p in d.glob(f"{SHM_PREFIX}*")} if d.is_dir() else set()


@dataclass
class ServiceProcess:
    """One service subprocess with its log file."""

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
                self.argv,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=service_env(fault),
                cwd=REPO_ROOT,
                preexec_fn=die_with_parent,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM, wait, then SIGKILL. Returns the exit code."""
        p = self.proc
        if p is None:
            return None
        return terminate(p, grace_s)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_log(self, pattern: str, timeout: float, since: int = 0) -> None:
        """Wait until the log (from byte `since`) matches `pattern`."""
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if rx.search(self.log()[since:]):
                return
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: log never matched {pattern!r} within {timeout:.0f} s")


class ProcessGroup:
    """Starts service processes; on teardown stops them all and removes files they leaked."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[ServiceProcess] = []
        self.extra_pids: set[int] = set()  # e.g. grandchildren of `ditserve serve`
        self.leaked_files: set[str] = set()  # shm files of SIGKILLed sidecars

    def start(self, name: str, argv: Sequence[str]) -> ServiceProcess:
        sp = ServiceProcess(name, [str(a) for a in argv], self.workdir / f"{name}.log")
        self.procs.append(sp)
        return sp.start()

    def sidecar(
        self,
        checkpoint: Path,
        socket_path: Path,
        name: str = "sidecar",
        gpu_plans: int = 64,
        plan_width: int = 2,
        host_cache_gb: float = 0.05,
    ) -> ServiceProcess:
        return self.start(name, [
            sys.executable, "-m", "plancache_service", "--checkpoint", checkpoint, "--socket", socket_path,
            "--gpu-plans", gpu_plans, "--plan-width", plan_width, "--host-cache-gb", host_cache_gb,
            "--heartbeat-s", "0.5",
        ])  # fmt: skip

    def generator(
        self, socket_path: Path, port: int, name: str = "generator", max_queue_depth: int = 8
    ) -> ServiceProcess:
        return self.start(name, [
            sys.executable, "-m", "generator_service", "--sidecar", f"unix:{socket_path}",
            "--listen", f"127.0.0.1:{port}", "--max-queue-depth", max_queue_depth,
        ])  # fmt: skip

    def logs(self) -> str:
        parts = []
        for sp in self.procs:
            parts.append(f"----- {sp.name} ({sp.log_path}) -----\n{sp.log()[-20000:]}")
        return "\n".join(parts)

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
    workdir = short_tmpdir()
    group = ProcessGroup(workdir)
    failed_before = request.session.testsfailed
    try:
        yield group
    finally:
        try:
            group.close()
        finally:
            if _failed_since(request, failed_before):
                _print_uncaptured(request, f"\n===== service logs ({request.node.nodeid}) =====\n{group.logs()}\n")
            shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(name="procs")
def procs_fixture(request: pytest.FixtureRequest) -> Iterator[ProcessGroup]:
    """A per-test group of service subprocesses (stopped at teardown; logs printed on failure)."""
    with process_group(request) as group:
        yield group


# ----------------------------------------------------------------------------- in-process servers
@dataclass
class InProcessPair:
    """A real sidecar and a real generator in this process, talking over a unix socket."""

    sidecar: Any  # plancache_service.server.SidecarServer
    generator: Any  # generator_service.server.GeneratorServer
    socket_path: Path
    checkpoint: Path
    gpu_plans: int
    plan_width: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.generator.port}"

    @property
    def sidecar_target(self) -> str:
        return f"unix:{self.socket_path}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def sidecar_channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.sidecar_target)

    def state(self) -> cache_pb.GetStateResponse:
        return sidecar_state(self.sidecar_target)

    def close(self) -> None:
        try:
            self.generator.stop(grace_s=2)
        finally:
            try:
                self.generator.backend.close()
            finally:
                self.sidecar.stop(grace_s=2)


def start_inprocess_pair(
    checkpoint: Path,
    sock_dir: Path,
    *,
    gpu_plans: int = 64,
    plan_width: int = 2,
    host_cache_bytes: int = 20 * 1000**2,
    max_queue_depth: int = 8,
    chunk_bytes: int = 1024 * 1024,
    heartbeat_s: float = 0.5,
) -> InProcessPair:
    from generator_service.app import build_server as build_generator
    from generator_service.config import GeneratorConfig
    from plancache_service.app import build_server as build_sidecar
    from plancache_service.config import CacheConfig, SidecarConfig

    sock = sock_dir / "pc.sock"
    cache = CacheConfig(gpu_plans=gpu_plans, plan_width=plan_width, host_cache_bytes=host_cache_bytes)
    sidecar = build_sidecar(SidecarConfig(checkpoint, cache, f"unix:{sock}", heartbeat_s=heartbeat_s))
    sidecar.start()
    try:
        generator = build_generator(
            GeneratorConfig(
                sidecar=f"unix:{sock}",
                listen="127.0.0.1:0",
                max_queue_depth=max_queue_depth,
                chunk_bytes=chunk_bytes,
                reconnect_s=0.2,
            )
        )
    except BaseException:
        sidecar.stop(grace_s=1)
        raise
    generator.start()
    pair = InProcessPair(sidecar, generator, sock, checkpoint, gpu_plans, plan_width)
    try:
        wait_for(lambda: health_status(pair.target) == SERVING, 60, what="the generator to attach")
    except BaseException:
        pair.close()
        raise
    return pair


@contextlib.contextmanager
def inprocess_pair(checkpoint: Path, **kwargs: Any) -> Iterator[InProcessPair]:
    sock_dir = short_tmpdir()
    try:
        pair = start_inprocess_pair(checkpoint, sock_dir, **kwargs)
        try:
            yield pair
        finally:
            pair.close()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- streams
def stream_events(responses: Any) -> list[tuple[str, Any]]:
    """(kind, message) of every GenerateStreamResponse, in order."""
    out = []
    for ev in responses:
        kind = ev.WhichOneof("event")
        out.append((kind, getattr(ev, kind)))
    return out
