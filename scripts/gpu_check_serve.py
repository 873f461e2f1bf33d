"""The service checks' processes: `ditserve serve` and `ditserve generate` as subprocesses (`python -m ditserve`, no
console scripts), and what the checks read of them: the sidecar's pid and host tier, device memory, /dev/shm slabs,
the serve logs."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from gpu_check_common import DITSERVE, ROOT, left


class Serve:
    """`ditserve serve` as a subprocess, on free ports, in its own run dir."""

    def __init__(
        self, work: Path, checkpoint: Path, name: str, mode: str, device: str, port: int, gpu_plans: int,
        extra: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.run_dir = work / f"run-{name}"
        self.port, self.name = port, name
        self.log = open(work / f"serve-{name}.log", "w")  # noqa: SIM115 (closed in stop)
        argv = [*DITSERVE, "serve", "--checkpoint", str(checkpoint), "--adaln-mode", mode, "--device", device,
                "--port", str(port), "--run-dir", str(self.run_dir), "--no-metrics", "--gpu-plans", str(gpu_plans),
                "--host-cache-gb", "1", *extra]  # fmt: skip
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.target = f"127.0.0.1:{port}"

    def status(self) -> Any:
        from ditserve.client import GeneratorClient

        with GeneratorClient(self.target) as client:
            return client.status(timeout=5)

    def wait_serving(self, timeout: float = 240) -> Any:
        end = time.monotonic() + left(timeout)
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve ({self.name}) exited {self.proc.returncode}; see {self.log.name}")
            try:
                st = self.status()
                if st.serving:
                    return st
            except Exception:  # not up yet
                pass
            time.sleep(0.5)
        raise RuntimeError(f"serve ({self.name}) not serving after {timeout} s; see {self.log.name}")

    def sidecar_pid(self) -> int | None:
        """The sidecar among serve's children, read from /proc (pgrep may be missing on the device)."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue  # a process that ended meanwhile
            if ppid == self.proc.pid and b"plancache_service" in cmdline:
                return int(stat.parent.name)
        return None

    def generator_log(self) -> str:
        path = self.run_dir / "generator.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def generate(
    target: str, requests: list[dict[str, Any]], work: Path, timeout: float = 600
) -> tuple[int, list[Any], str]:
    path = work / f"requests-{requests[0]['request_id']}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    proc = subprocess.run([*DITSERVE, "generate", "--target", target, "--requests", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=left(timeout))  # fmt: skip
    lines = [json.loads(s) for s in proc.stdout.splitlines() if s.strip().startswith("{")]
    return proc.returncode, lines, proc.stderr


def device_memory_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        return int(out.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def shm_slabs() -> int:
    return len([p for p in Path("/dev/shm").glob("ditserve-*")])


def sidecar_host_pinned(run_dir: Path) -> bool | None:
    import grpc

    from ditruntime.paths import SOCKET_NAME
    from protos.ditserve.plancache.v1 import plancache_pb2 as pb
    from protos.ditserve.plancache.v1 import plancache_pb2_grpc as pb_grpc

    sock = run_dir / SOCKET_NAME  # the public socket (its relay's private one is in .plancache.sock.d/)
    if not sock.exists():
        return None
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        state = pb_grpc.PlanCacheStub(ch).GetState(pb.GetStateRequest(), timeout=10)
    return bool(state.stats.host_pinned)


def keep_serve_logs(work: Path, out: Path) -> None:
    """The tail of every serve log and of the generator's and sidecar's own logs, in one file under `out`."""
    parts = []
    for log in sorted([*work.glob("serve-*.log"), *work.glob("run-*/*.log")]):
        text = log.read_text(errors="replace")
        parts.append(f"===== {log.relative_to(work)} (last 20000 of {len(text)} characters)\n{text[-20000:]}")
    if parts:
        (out / "serve-logs.txt").write_text("\n".join(parts))
