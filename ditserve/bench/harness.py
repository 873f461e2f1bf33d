"""Benchmark harness: start real service pairs (sidecar + generator over a unix socket) with a
given cache configuration, run MiniMax-H3 requests through the Python client, record per-request
stages, and read what each service process holds in memory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ditcore.report import CacheReport
from protos.ditserve.generator.v1 import generator_pb2 as pb

from ..client import GeneratorClient
from ..supervise import terminate, wait_healthy
from .measure import process_memory

ARM_MODES = ("cached", "resident", "sidecar")


@dataclass(frozen=True)
class Arm:
    """One service configuration."""

    name: str
    gpu_plans: int = 128
    host_cache_gb: float = 8.0
    mode: str = "cached"  # a pair; "resident": a lone resident generator; "sidecar": a lone sidecar
    prefetch: bool = True
    partitions: str = "auto"  # the generator's --partitions
    adapter_dir: Path | None = None  # --adapter-dir of both services (the sidecar builds the adapters' plans)

    def __post_init__(self) -> None:
        if self.mode not in ARM_MODES:
            raise ValueError(f"arm {self.name}: mode must be one of {list(ARM_MODES)}, got {self.mode!r}")


@dataclass
class Record:
    arm: str
    label: str  # schedule label, e.g. "A" (see context.SCHEDULES)
    request_id: str
    latency_s: float  # client-side, submit to last chunk
    sha256: str
    generation: int
    timings_ms: dict[str, float]
    cache: CacheReport
    tier: str = ""  # "built", "host", "slot", "resident"
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def service_s(self) -> float:
        """Latency without queue wait (what the request itself cost once it started)."""
        return self.latency_s - self.timings_ms.get("queue_ms", 0.0) / 1000


def tier_of(cache: CacheReport, mode: str) -> str:
    if mode == "resident":
        return "resident"
    if cache.built_plans:
        return "built"
    if cache.host_hit_plans:
        return "host"
    return "slot"


class Services:
    """A running pair (or a lone resident generator, or a lone sidecar) in subprocesses; a context manager.

    A pair's two processes start together (their imports overlap); the generator attaches once the sidecar serves.
    """

    def __init__(self, checkpoint: Path, arm: Arm, device: str, threads: int, workdir: Path) -> None:
        self.arm = arm
        self.dir = Path(tempfile.mkdtemp(prefix="ditbench-", dir="/tmp"))  # short socket path
        self.sock = self.dir / "plancache.sock"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.names: list[str] = []  # parallel to procs: "sidecar", "generator"
        self.logs = workdir
        py = sys.executable
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.target = f"127.0.0.1:{_free_port()}"
        common = ["--device", device, "--threads", str(threads), "--log-level", "WARNING"]
        self.metrics_ports = {"generator": _free_port(), "sidecar": _free_port()}
        health: list[str] = []
        try:
            if arm.mode != "resident":
                side = [py, "-m", "plancache_service", "--checkpoint", str(checkpoint), "--socket", str(self.sock)]
                side += ["--gpu-plans", str(arm.gpu_plans), "--host-cache-gb", str(arm.host_cache_gb), *common]
                side += ["--metrics-port", str(self.metrics_ports["sidecar"])]
                if arm.adapter_dir is not None:
                    side += ["--adapter-dir", str(arm.adapter_dir)]
                self._spawn(side, env, "sidecar")
                health.append(f"unix:{self.sock}")
            if arm.mode != "sidecar":
                gen = [py, "-m", "generator_service", "--listen", self.target, *common]
                gen += ["--metrics-port", str(self.metrics_ports["generator"]), "--partitions", arm.partitions]
                if arm.adapter_dir is not None:
                    gen += ["--adapter-dir", str(arm.adapter_dir)]
                if arm.mode == "resident":
                    gen += ["--adaln-mode", "resident", "--checkpoint", str(checkpoint)]
                else:
                    gen += ["--sidecar", f"unix:{self.sock}"]
                    if not arm.prefetch:
                        gen.append("--no-prefetch")
                self._spawn(gen, env, "generator")
                health.append(self.target)
            for target, proc in zip(health, self.procs, strict=True):
                wait_healthy(target, 300, proc)
        except BaseException:
            self.close()
            raise
        self.client = GeneratorClient(self.target) if "generator" in self.names else None

    def _spawn(self, argv: list[str], env: dict[str, str], name: str) -> None:
        log = open(self.logs / f"{self.arm.name}-{name}.log", "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.procs.append(proc)
        self.names.append(name)

    @property
    def generator(self) -> GeneratorClient:
        if self.client is None:
            raise RuntimeError(f"arm {self.arm.name} runs no generator")
        return self.client

    def run(self, label: str, request: dict[str, Any], request_id: str) -> Record:
        """One request (GenerationRequest fields) over GenerateStream, timed from the client."""
        t0 = time.perf_counter()
        res = self.generator.generate({**request, "request_id": request_id}, timeout=1800)
        latency = time.perf_counter() - t0
        extra = {}
        if res.media is not None:
            extra["media"] = {"content_type": res.media.content_type, "size_bytes": res.media.size}
        return Record(
            self.arm.name, label, request_id, latency, res.sha256, res.generation,
            res.timings_ms, res.cache, tier_of(res.cache, self.arm.mode), extra,
        )  # fmt: skip

    def status(self) -> pb.GetStatusResponse:
        """The generator's GetStatus (mode, preset, precision, memory of its transformer)."""
        return self.generator.status()

    def process_memory(self) -> dict[str, dict[str, int]]:
        """/proc memory of each running service process, by name ("sidecar", "generator")."""
        return {name: process_memory(p.pid) for name, p in zip(self.names, self.procs, strict=True)}

    def scrape(self) -> str:
        """Both services' /metrics, as Prometheus would see them."""
        import urllib.request

        out = []
        for name, port in self.metrics_ports.items():
            if name not in self.names:  # resident arms have no sidecar; a stopped generator has no metrics
                continue
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            out.append(f"# ---- {name} (:{port}/metrics, arm {self.arm.name})\n{body}")
        return "\n".join(out)

    def close(self) -> None:
        if getattr(self, "client", None) is not None:
            self.generator.close()
        for p in reversed(self.procs):
            terminate(p, 30)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
