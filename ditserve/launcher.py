"""`ditserve serve`: start the sidecar, wait for its health, start the generator, supervise.

Creates the demo checkpoint (preset `small`) in the run dir when no --checkpoint is given.
SIGINT / SIGTERM stop the generator, then the sidecar (which removes its /dev/shm files);
children get SIGTERM if this process dies (PR_SET_PDEATHSIG), so nothing is orphaned. A
child that crashes is restarted (the generator reattaches by itself).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ditcore import get_preset, validate_checkpoint, write_checkpoint
from ditcore.checkpoint import is_checkpoint_dir
from ditruntime.paths import default_run_dir, ensure_private_dir

log = logging.getLogger("ditserve.serve")
DEMO_PRESET = "small"
MAX_RESTARTS_PER_MIN = 5


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


def demo_checkpoint(run_dir: Path) -> Path:
    path = run_dir / f"demo-checkpoint-{DEMO_PRESET}"
    if not is_checkpoint_dir(path):
        print(f"creating the demo checkpoint (preset {DEMO_PRESET}) in {path}", flush=True)
        write_checkpoint(get_preset(DEMO_PRESET), path, seed=0)
    return path


class Child:
    """One supervised service process."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        health_target: str,
        log_path: Path,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.credentials = credentials
        self.name = name
        self.argv = argv
        self.health_target = health_target
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts: list[float] = []

    def start(self, timeout_s: float = 120.0) -> None:
        logf = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(self.argv, stdout=logf, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        logf.close()
        try:
            wait_healthy(self.health_target, timeout_s, self.proc, self.credentials)
        except Exception as e:
            self.stop()
            raise RuntimeError(f"{self.name} failed to start ({e}); see {self.log_path}") from e

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is not None:
            terminate(self.proc, grace_s)

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None


def build_children(args: argparse.Namespace, run_dir: Path, checkpoint: Path) -> list[Child]:
    py = sys.executable
    sock = run_dir / "plancache.sock"
    host = args.host
    gen_argv = [py, "-m", "generator_service", "--listen", f"{host}:{args.port}", "--device", args.device]
    gen_argv += ["--max-queue-depth", str(args.max_queue_depth), "--log-level", args.log_level]
    gen_argv += ["--drain-timeout-s", str(args.drain_timeout_s), "--log-format", args.log_format]
    if args.metrics_port is not None:
        gen_argv += ["--metrics-port", str(args.metrics_port)]
    for flag in (
        "max_steps",
        "max_frames",
        "max_height",
        "max_width",
        "max_prompt_bytes",
        "tls_cert",
        "tls_key",
        "tls_client_ca",
    ):
        if getattr(args, flag) is not None:
            gen_argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.weights_root:
        gen_argv += ["--weights-root", args.weights_root]
    if args.admin_token:
        gen_argv += ["--admin-token", args.admin_token]  # also inherited as $DITSERVE_ADMIN_TOKEN
    health_host = "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host
    children = []
    if args.adaln_mode == "resident":
        gen_argv += ["--adaln-mode", "resident", "--checkpoint", str(checkpoint)]
    else:
        side_argv = [py, "-m", "plancache_service", "--checkpoint", str(checkpoint), "--socket", str(sock)]
        side_argv += ["--gpu-plans", str(args.gpu_plans), "--plan-width", str(args.plan_width)]
        side_argv += [
            "--host-cache-gb",
            str(args.host_cache_gb),
            "--device",
            args.device,
            "--log-level",
            args.log_level,
            "--state-dir",
            args.state_dir or str(run_dir / "state"),
            "--log-format",
            args.log_format,
        ]
        if args.metrics_port is not None:
            side_argv += ["--metrics-port", str(args.metrics_port + 1)]
        children.append(Child("plancache sidecar", side_argv, f"unix:{sock}", run_dir / "plancache.log"))
        gen_argv += ["--adaln-mode", "cached", "--sidecar", f"unix:{sock}"]
    creds = None
    if args.tls_cert:  # the launcher checks health as a TLS client trusting the server's own certificate
        client_pair = {}
        if args.tls_client_ca:  # mutual TLS: present the server's own pair (it must be signed by that CA)
            client_pair = {
                "private_key": Path(args.tls_key).read_bytes(),
                "certificate_chain": Path(args.tls_cert).read_bytes(),
            }
        creds = grpc.ssl_channel_credentials(root_certificates=Path(args.tls_cert).read_bytes(), **client_pair)
    children.append(Child("generator", gen_argv, f"{health_host}:{args.port}", run_dir / "generator.log", creds))
    return children


def serve(args: argparse.Namespace) -> int:
    if args.no_metrics:
        args.metrics_port = None
    run_dir = ensure_private_dir(args.run_dir or default_run_dir())
    checkpoint = Path(args.checkpoint) if args.checkpoint else demo_checkpoint(run_dir)
    validate_checkpoint(checkpoint)  # a bad one is refused here, before any child starts
    children = build_children(args, run_dir, checkpoint)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        for child in children:
            print(f"starting {child.name} (log: {child.log_path})", flush=True)
            child.start()
        print(
            f"ditserve serving: generator on {args.host}:{args.port} ({args.adaln_mode} mode), "
            f"checkpoint {checkpoint}, run dir {run_dir}\n"
            + (
                f"  metrics: http://127.0.0.1:{args.metrics_port}/metrics (generator), "
                f"http://127.0.0.1:{args.metrics_port + 1}/metrics (sidecar)\n"
                if args.metrics_port is not None and args.adaln_mode == "cached"
                else ""
            )
            + f'  try: grpcurl -plaintext -d \'{{"prompt": "a cat"}}\' 127.0.0.1:{args.port} '
            "ditserve.generator.v1.Generator/Generate",
            flush=True,
        )
        while not stop.wait(0.5):
            for child in children:
                if child.exited():
                    _restart(child, stop)
    except RuntimeError as e:
        print(f"ditserve serve: error: {e}", file=sys.stderr)
        return 1
    finally:
        for child in reversed(children):
            child.stop()
    print("ditserve stopped", flush=True)
    return 0


def _restart(child: Child, stop: threading.Event) -> None:
    now = time.monotonic()
    child.restarts = [t for t in child.restarts if now - t < 60] + [now]
    if len(child.restarts) > MAX_RESTARTS_PER_MIN:
        raise RuntimeError(f"{child.name} crashed {len(child.restarts)} times within a minute; giving up")
    code = child.proc.returncode if child.proc else None
    print(f"{child.name} exited with code {code}; restarting", file=sys.stderr, flush=True)
    if not stop.is_set():
        child.start()


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    from plancache_service.config import GB, CacheConfig

    p.add_argument("--checkpoint", default=None, help="checkpoint dir (default: a generated demo checkpoint)")
    p.add_argument("--port", type=int, default=50051, help="generator port (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="generator bind address (default %(default)s)")
    p.add_argument("--run-dir", default=None, help=f"socket, logs, demo checkpoint (default {default_run_dir()})")
    p.add_argument("--adaln-mode", choices=("cached", "resident"), default="cached")
    p.add_argument("--gpu-plans", type=int, default=CacheConfig.gpu_plans)
    p.add_argument("--plan-width", type=int, default=CacheConfig.plan_width)
    p.add_argument("--host-cache-gb", type=float, default=CacheConfig.host_cache_bytes / GB)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-queue-depth", type=int, default=16)
    p.add_argument("--log-level", default="INFO", help="services' log level (default %(default)s)")
    p.add_argument("--weights-root", default=None, help="UpdateWeights paths must resolve inside it (default: off)")
    p.add_argument("--admin-token", default=None, help="UpdateWeights bearer token (default: $DITSERVE_ADMIN_TOKEN)")
    p.add_argument("--state-dir", default=None, help="sidecar state file dir (default <run-dir>/state)")
    p.add_argument("--drain-timeout-s", type=float, default=60.0, help="update drain bound (default %(default)s)")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="services' log format")
    p.add_argument(
        "--metrics-port", type=int, default=9400, help="generator /metrics on P, sidecar on P+1 (default %(default)s)"
    )
    p.add_argument("--no-metrics", action="store_true", help="serve no /metrics")
    for name in ("steps", "frames", "height", "width", "prompt-bytes"):
        p.add_argument(f"--max-{name}", type=int, default=None, help="generator limit (default: the model's)")
    p.add_argument("--tls-cert", default=None, help="serve the generator port over TLS (PEM)")
    p.add_argument("--tls-key", default=None, help="PEM key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, help="require client certificates signed by this CA")
