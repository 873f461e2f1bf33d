"""Supervised service processes: a child started so that it dies with its parent (PR_SET_PDEATHSIG), waited on
until its gRPC health says SERVING (or its HTTP answers), and stopped with SIGTERM then SIGKILL (`Child`)."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
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


def wait_healthy(
    target: str,
    timeout_s: float,
    proc: subprocess.Popen[bytes] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Poll grpc.health.v1 until SERVING; raise if the process exits or time runs out."""
    end = time.monotonic() + timeout_s
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < end:
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


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll `url` until it answers HTTP at all (any status: a 401 is an up server that wants a key)."""
    import urllib.error
    import urllib.request

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
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


class Child:
    """One supervised service process."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        health_target: str,
        log_path: Path,
        credentials: grpc.ChannelCredentials | None = None,
        env: dict[str, str] | None = None,
        config: GeneratorConfig | SidecarConfig | None = None,
        ready: Callable[[subprocess.Popen[bytes], float], None] | None = None,
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
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts: list[float] = []

    def start(self, timeout_s: float = 120.0) -> None:
        logf = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            self.argv, stdout=logf, stderr=subprocess.STDOUT, preexec_fn=die_with_parent, env=self.env
        )
        logf.close()
        try:
            if self.ready is not None:
                self.ready(self.proc, timeout_s)
            else:
                wait_healthy(self.health_target, timeout_s, self.proc, self.credentials)
        except Exception as e:
            self.stop()
            raise RuntimeError(f"{self.name} failed to start ({e}); see {self.log_path}") from e

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is not None:
            terminate(self.proc, grace_s)

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None
