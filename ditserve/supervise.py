"""Supervised service processes: a child started so that it dies with its parent (PR_SET_PDEATHSIG), in a process
group of its own (a terminal's Ctrl-C reaches the supervisor alone, which stops its children in order), waited on
until its gRPC health says SERVING (or its HTTP answers), and stopped with SIGTERM then SIGKILL (`Child`); a
replica through its rank 0 (`replica_leader`)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from generator_service.config import GeneratorConfig
from plancache_service.config import SidecarConfig


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when its parent dies (Linux PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class StopRequested(Exception):
    """The supervisor was told to stop while it waited for a child to come up."""


def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise StopRequested("stopped while starting")


def wait_healthy(
    target: str,
    timeout_s: float,
    proc: subprocess.Popen[bytes] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Poll grpc.health.v1 until SERVING; raise if the process exits, `stop` is set or time runs out."""
    end = time.monotonic() + timeout_s
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < end:
            _check_stop(stop)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process exited with code {proc.returncode} before becoming healthy")
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{target} did not become healthy within {timeout_s:.0f} s")


def wait_http(
    url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None, stop: threading.Event | None = None
) -> None:
    """Poll `url` until it answers HTTP at all (any status: a 401 is an up server that wants a key)."""
    import urllib.error
    import urllib.request

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        _check_stop(stop)
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before it served {url}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def terminate(proc: subprocess.Popen[Any], grace_s: float = 20.0) -> int | None:
    """SIGTERM, wait up to `grace_s`, then SIGKILL; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def replica_leader(agent_pid: int) -> int | None:
    """Rank 0 among the workers of torchrun's elastic agent `agent_pid` (its children whose environment says
    RANK=0), or None (not started yet, or gone)."""
    for task in Path(f"/proc/{agent_pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            for pid in map(int, (task / "children").read_text().split()):
                with contextlib.suppress(OSError):
                    if b"RANK=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                        return pid
    return None


class Child:
    """One supervised service process. `leader(pid)`: the process to stop it through (a replica's rank 0) instead of
    `pid` itself."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        health_target: str,
        log_path: Path,
        credentials: grpc.ChannelCredentials | None = None,
        env: dict[str, str] | None = None,
        config: GeneratorConfig | SidecarConfig | None = None,
        ready: Callable[[subprocess.Popen[bytes], float, threading.Event | None], None] | None = None,
        leader: Callable[[int], int | None] | None = None,
    ) -> None:
        self.config = config
        self.ready = ready
        """How to tell it is up (default: its gRPC health at `health_target`)."""
        """The config its argv renders."""
        self.credentials = credentials
        self.name = name
        self.argv = argv
        self.env = env
        """The child's whole environment (None: this process's)."""
        self.health_target = health_target
        self.log_path = log_path
        self.leader = leader
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts: list[float] = []

    def start(self, timeout_s: float = 120.0, stop: threading.Event | None = None) -> None:
        """Start it and wait until it is up; StopRequested (it stopped again) once `stop` is set meanwhile."""
        logf = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(  # its own process group: a terminal's Ctrl-C is the supervisor's to handle
            self.argv, stdout=logf, stderr=subprocess.STDOUT, preexec_fn=die_with_parent, env=self.env,
            process_group=0,
        )  # fmt: skip
        logf.close()
        try:
            if self.ready is not None:
                self.ready(self.proc, timeout_s, stop)
            else:
                wait_healthy(self.health_target, timeout_s, self.proc, self.credentials, stop)
        except StopRequested:
            self.stop()
            raise
        except Exception as e:
            self.stop()
            raise RuntimeError(f"{self.name} failed to start ({e}); see {self.log_path}") from e

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`. A replica is stopped through its rank 0, which stops the other
        ranks (each exits 0), so torchrun's agent, signalled by no one, exits 0 too: a signalled agent sends the
        signal to every rank at once and ends in a traceback of its own."""
        if self.proc is None:
            return
        leader = self.leader(self.proc.pid) if self.leader is not None and self.proc.poll() is None else None
        if leader is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(leader, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        terminate(self.proc, grace_s)

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None
