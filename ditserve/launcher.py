"""`ditserve serve`: start the sidecar, wait for its health, start the generator, supervise.
Its flags are the children's config declarations (GeneratorConfig, CacheConfig, SidecarConfig);
each child gets its config rendered back to flags (ditruntime.flags.to_argv).

Creates the demo checkpoint (a MiniMax-H3 repository of preset `tiny`, released mixed precision, seed 0) in the run
dir when no --checkpoint is given.
SIGINT / SIGTERM stop the generator, then the sidecar (which removes its /dev/shm files): each child runs in a
process group of its own, so a terminal's Ctrl-C reaches this process alone, and a replica (--nproc) stops through its
rank 0, which stops the others; children get SIGTERM if this process dies (PR_SET_PDEATHSIG), so nothing is
orphaned. A child that crashes is restarted (the generator reattaches by itself). Each child is a `supervise.Child`.

A replica across nodes (--nnodes M, one `serve` per node, each with its --node-rank K and the same --rdzv-endpoint):
every node runs its own sidecar and its --nproc ranks under torchrun (static rendezvous at --rdzv-endpoint, hosted by
node 0). Node 0 serves the public port as with one node; a node K > 0 serves nothing public (its ranks follow rank 0):
its generator is up once torchrun's agent is running, and it is stopped through the agent's process group.
With nodes on different hosts, --sidecar-listen HOST:PORT puts each node's sidecar on TCP with mutual TLS
(--sidecar-tls-ca/-cert/-key: one pair for server and client auth, which rank 0 presents too) and the generator's admin
token, reached by rank 0 at --sidecar-advertise (default: --sidecar-listen), the generator's --sidecar.

The admin token never goes on a child's argv (world-readable in /proc/PID/cmdline, `ps`): the generator gets it in
its environment ($DITSERVE_ADMIN_TOKEN; /proc/PID/environ is readable by its own uid only) or, with
--admin-token-file, the file's path; the sidecar gets the same on TCP (--sidecar-listen), and on the run dir's unix
socket, where the peer's uid is the credential, no token at all.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc

from ditcore import validate_checkpoint, write_repository
from ditcore.checkpoint_files import is_repository_dir
from ditruntime.auth import ADMIN_TOKEN_ENV, check_tls_flags, is_loopback_host, plaintext_admin_warning
from ditruntime.flags import LaunchOptions, add_flags, from_args, to_argv
from ditruntime.paths import SOCKET_NAME, default_run_dir, ensure_private_dir, prepare_dir, require_dir
from ditruntime.tls import mutual_tls_channel_credentials
from generator_service.config import GeneratorConfig
from plancache_service.config import CacheConfig, SidecarConfig

from .commands import quiet_model_libraries
from .errors import UsageError
from .supervise import Child, StopRequested, replica_leader, wait_http

log = logging.getLogger("ditserve.serve")
DEMO_PRESET = "tiny"
DEMO_PRECISION = "mixed"
MAX_RESTARTS_PER_MIN = 5


def demo_path(run_dir: Path) -> Path:
    return run_dir / f"demo-h3-{DEMO_PRESET}-{DEMO_PRECISION}"


def demo_checkpoint(run_dir: Path) -> Path:
    """The demo repository, written on first use. model_index.json is the last file a write lays down, so a
    directory without it is an interrupted write: it is removed and written again."""
    path = demo_path(run_dir)
    if is_repository_dir(path):
        return path
    print(f"creating the demo checkpoint (MiniMax-H3 preset {DEMO_PRESET}, {DEMO_PRECISION}) in {path}", flush=True)
    shutil.rmtree(path, ignore_errors=True)
    quiet_model_libraries()
    write_repository(path, preset=DEMO_PRESET, seed=0, dtype=DEMO_PRECISION)
    return path


SERVE_GENERATOR_EXCLUDE = (
    "checkpoint", "sidecar", "listen", "metrics_port", "max_message_bytes", "prefetch", "state_dir",
)  # fmt: skip
"""GeneratorConfig fields that are not `serve` flags: derived from serve's own options, or left at
default (serve's one --state-dir holds the sidecar's state file and the generator's jobs). Its --sidecar-tls-* are
serve's: this node's TCP sidecar's pair and CA (--sidecar-listen), which rank 0 presents to every TCP sidecar."""
SERVE_CACHE_EXCLUDE = ("device", "devices")
"""One --device / --devices (GeneratorConfig's) places both the transformer and the slab(s)."""
REPLICA_MAX_RESTARTS = 3
"""How often torchrun's agent restarts a replica's ranks as a unit before it gives up (then serve restarts it)."""
SERVE_SIDECAR_ONLY = ("state_dir",)
"""The SidecarConfig flags of `serve` besides the cache's (the rest derive from serve's options)."""
SERVE_LAUNCH_EXCLUDE = ("threads",)
FORWARDED_LAUNCH = ("log_level", "log_format")
"""Launch options both children get from `serve`."""
ANY_HOST = ("0.0.0.0", "::", "[::]")
"""Listen hosts that bind every interface: no address a client can reach."""


def replica_devices(gen: GeneratorConfig, nproc: int) -> list[str]:
    """Each rank's device, in rank order: --devices (as many as --nproc), else --device for every rank."""
    listed = [d.strip() for d in gen.devices.split(",") if d.strip()]
    if listed and len(listed) != nproc:
        raise ValueError(f"--devices lists {len(listed)} device(s) but --nproc is {nproc}: one device per rank")
    return listed or [gen.device] * nproc


def check_nodes(args: argparse.Namespace) -> None:
    """--nnodes, --node-rank and --rdzv-endpoint agree (ValueError naming the flag and what it allows)."""
    nnodes, rank, endpoint = args.nnodes, args.node_rank, args.rdzv_endpoint
    if nnodes < 1:
        raise ValueError(f"--nnodes must be at least 1, got {nnodes}")
    if not 0 <= rank < nnodes:
        raise ValueError(f"--node-rank must be in [0, {nnodes}) for --nnodes {nnodes}, got {rank}")
    if nnodes == 1:
        if endpoint is not None:
            raise ValueError(
                f"--rdzv-endpoint is for a replica across nodes (--nnodes at least 2), got it with --nnodes 1: "
                f"drop --rdzv-endpoint {endpoint}"
            )
        return
    if endpoint is None:
        raise ValueError(
            f"--rdzv-endpoint HOST:PORT is required with --nnodes {nnodes} (at least 2): where node 0 hosts the "
            "replica's rendezvous, the same on every node"
        )
    _host_port(endpoint, "--rdzv-endpoint")
    if rank > 0 and args.openai_port is not None:
        raise ValueError(
            f"--openai-port is served by node 0 alone (--node-rank 0), got it with --node-rank {rank}: a node "
            "K > 0 serves nothing public"
        )


def _host_port(address: str, flag: str) -> str:
    """The host of `address` (HOST:PORT, [V6]:PORT); ValueError naming `flag` otherwise."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{flag} must be HOST:PORT with PORT in [1, 65535], got {address!r}")
    return host


def sidecar_addresses(args: argparse.Namespace, run_dir: Path) -> tuple[str, str]:
    """Where this node's sidecar listens, and the --sidecar its generator ranks name (where rank 0 reaches it): the
    run dir's unix socket for both, or --sidecar-listen HOST:PORT (TCP, mutual TLS) and --sidecar-advertise (default:
    the same). ValueError naming the flags."""
    listen, advertise = args.sidecar_listen, args.sidecar_advertise
    tls = {"--sidecar-tls-ca": args.sidecar_tls_ca, "--sidecar-tls-cert": args.sidecar_tls_cert,
           "--sidecar-tls-key": args.sidecar_tls_key}  # fmt: skip
    if not listen:
        if advertise:
            raise ValueError(
                f"--sidecar-advertise {advertise} is where rank 0 reaches this node's TCP sidecar: it needs "
                "--sidecar-listen HOST:PORT (without it the sidecar is on the run dir's unix socket)"
            )
        if (args.node_rank > 0 or args.nnodes == 1) and (given := [k for k, v in tls.items() if v is not None]):
            raise ValueError(
                f"{', '.join(given)}: apply to TCP sidecars: this node's (--sidecar-listen HOST:PORT), or, on node 0 "
                "of a replica across nodes (--nnodes 2 or more), the other nodes' that rank 0 reaches"
            )
        unix = f"unix:{run_dir / SOCKET_NAME}"
        return unix, unix
    if args.adaln_mode != "cached":
        raise ValueError(f"--sidecar-listen {listen}: resident mode (--adaln-mode resident) runs no sidecar")
    host = _host_port(listen, "--sidecar-listen")
    check_tls_flags(tls, required=True, needed_by=f"--sidecar-listen {listen} (TCP)", stray="",
                    hint=" (one certificate for server and client auth, signed by the CA)")  # fmt: skip
    if not advertise:
        if host in ANY_HOST:
            raise ValueError(
                f"--sidecar-listen {listen} binds every interface: give --sidecar-advertise HOST:PORT, the address "
                "rank 0 reaches this node's sidecar at (its certificate must name HOST)"
            )
        return listen, listen
    if _host_port(advertise, "--sidecar-advertise") in ANY_HOST:
        raise ValueError(
            f"--sidecar-advertise must be an address rank 0 can reach this node's sidecar at, got {advertise!r}"
        )
    return listen, advertise


def child_configs(
    args: argparse.Namespace, run_dir: Path, checkpoint: Path
) -> tuple[GeneratorConfig, SidecarConfig | None]:
    """The generator's config and, in cached mode, the sidecar's, from `serve`'s flags."""
    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    check_nodes(args)
    cached = args.adaln_mode == "cached"
    listen, address = sidecar_addresses(args, run_dir)
    gen = from_args(
        GeneratorConfig,
        args,
        exclude=SERVE_GENERATOR_EXCLUDE,
        checkpoint=None if cached else checkpoint,
        sidecar=address if cached else "",
        listen=f"{args.host}:{args.port}",
        metrics_port=args.metrics_port,
    )
    state_dir = Path(args.state_dir) if args.state_dir is not None else run_dir / "state"
    gen = replace(gen, jobs=replace(gen.jobs, state_dir=state_dir))  # the jobs store beside the sidecar's state file
    if not cached:
        return gen, None
    slab_devices = ",".join(replica_devices(gen, args.nproc)) if args.nproc > 1 else ""
    tcp: dict[str, Any] = {}
    if not listen.startswith("unix"):  # TCP: mutual TLS, and the generator's admin token
        tcp = {"tls_cert": gen.sidecar_tls_cert, "tls_key": gen.sidecar_tls_key, "tls_client_ca": gen.sidecar_tls_ca,
               "admin_token": gen.admin_token, "admin_token_file": gen.admin_token_file}  # fmt: skip
    side = from_args(
        SidecarConfig,
        args,
        only=SERVE_SIDECAR_ONLY,
        checkpoint=checkpoint,
        cache=from_args(CacheConfig, args, exclude=SERVE_CACHE_EXCLUDE, device=gen.device, devices=slab_devices),
        address=listen,
        metrics_port=None if args.metrics_port is None else args.metrics_port + 1,
        metrics_host=gen.metrics_bind_host,  # both services' /metrics where serve's --metrics-host / --host says
        reflection=gen.reflection,
        adapter_dir=gen.adapter_dir,  # the sidecar builds the plans of the generator's modulation adapters
        **tcp,
    )
    if side.state_dir is None:
        side = replace(side, state_dir=run_dir / "state")
    return gen, side


def build_children(
    args: argparse.Namespace, launch: LaunchOptions, gen: GeneratorConfig, side: SidecarConfig | None
) -> list[Child]:
    """The supervised processes: each child's argv renders its config (`to_argv`), nothing else."""
    py = sys.executable
    run_dir = Path(launch.run_dir or default_run_dir())
    common = to_argv(launch, only=FORWARDED_LAUNCH)
    children = []
    if side is not None:  # TCP: checked where rank 0 reaches it (its certificate names that), with mutual TLS
        where = f"--listen={side.address}" if side.tcp else f"--socket={side.address.removeprefix('unix:')}"
        side_argv = [py, "-m", "plancache_service", *to_argv(side, exclude=("address", "admin_token")), where]
        target, side_creds = (gen.sidecar, sidecar_health_credentials(side)) if side.tcp else (side.address, None)
        side_log, side_env = run_dir / "plancache.log", child_env(side.admin_token if side.tcp else "")
        children.append(Child("plancache sidecar", side_argv + common, target, side_log, side_creds, side_env, side))
    host = args.host
    health_host = "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host
    gen_argv = [*generator_launcher(args), *to_argv(gen, exclude=("admin_token",)), *common]
    health = f"{health_host}:{args.port}"
    gen_log, creds = run_dir / "generator.log", health_credentials(gen)
    env = child_env(gen.admin_token)
    if args.node_rank > 0:  # no public server here: up once torchrun's agent runs, stopped through its group
        children.append(
            Child("generator", gen_argv, health, gen_log, creds, env, gen, ready=wait_running, leader=agent_group)
        )
    else:  # rank 0 of a replica (one node or several) is stopped through itself, which stops the others
        leader = replica_leader if args.nproc > 1 or args.nnodes > 1 else None
        children.append(Child("generator", gen_argv, health, gen_log, creds, env, gen, leader=leader))
    if args.openai_port is not None:
        children.append(openai_child(args, gen, health, run_dir))
    return children


def generator_launcher(args: argparse.Namespace) -> list[str]:
    """How the generator starts: itself (one rank), or torchrun's elastic agent for --nproc ranks (restarted as a
    unit), on one node (--standalone) or as node --node-rank of --nnodes (static rendezvous at --rdzv-endpoint, even
    with one rank per node)."""
    py = sys.executable
    restarts = f"--max-restarts={REPLICA_MAX_RESTARTS}"
    if args.nnodes > 1:
        return [py, "-m", "torch.distributed.run", f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}",
                "--rdzv-backend=static", f"--rdzv-endpoint={args.rdzv_endpoint}", f"--nproc-per-node={args.nproc}",
                restarts, "-m", "generator_service"]  # fmt: skip
    if args.nproc > 1:  # one rank per device
        return [py, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={args.nproc}",
                restarts, "-m", "generator_service"]  # fmt: skip
    return [py, "-m", "generator_service"]


NODE_SETTLE_S = 1.0
"""How long a node K > 0's torchrun agent must keep running for `serve` to call it up (it has no port to check)."""


def wait_running(
    proc: subprocess.Popen[bytes],
    timeout_s: float,
    stop: threading.Event | None = None,
    settle_s: float = NODE_SETTLE_S,
) -> None:
    """`Child.ready` for a node K > 0: returns once `proc` is still running after `settle_s` (or `timeout_s`, if
    shorter); RuntimeError if it exits first, StopRequested once `stop` is set."""
    end = time.monotonic() + min(settle_s, timeout_s)
    while True:
        if stop is not None and stop.is_set():
            raise StopRequested("stopped while starting")
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} within {settle_s:g} s of its start")
        if time.monotonic() >= end:
            return
        time.sleep(0.05)


def agent_group(agent_pid: int) -> int:
    """`Child.leader` for a node K > 0 (no rank 0 here to stop the replica through): the torchrun agent's process
    group, as the negative pid `os.kill` signals a group by (`Child` starts each child as its own group's leader).
    The agent, signalled, stops this node's ranks (each in a session of its own) and exits."""
    return -agent_pid


def openai_child(args: argparse.Namespace, gen: GeneratorConfig, target: str, run_dir: Path) -> Child:
    """The /v1/videos facade (ditserve openai-api) on serve's --host and --openai-port, a client of the generator
    (over TLS trusting the certificate the generator serves, presenting it too under mutual TLS)."""
    argv = [sys.executable, "-m", "ditserve", "openai-api", "--target", target, "--host", args.host,
            "--port", str(args.openai_port)]  # fmt: skip
    if args.openai_allowed_hosts:
        argv += ["--allowed-hosts", args.openai_allowed_hosts]
    if args.openai_cors_origins:
        argv += ["--cors-origins", args.openai_cors_origins]
    if gen.tls_cert is not None:
        argv += ["--tls-ca", str(gen.tls_cert)]
        if gen.tls_client_ca is not None:
            argv += ["--tls-cert", str(gen.tls_cert), "--tls-key", str(gen.tls_key)]
    probe = "127.0.0.1" if args.host in ("0.0.0.0", "::", "[::]") else args.host
    url = f"{_base(probe, args.openai_port)}/v1/videos"
    return Child("openai-api", argv, target, run_dir / "openai-api.log", None, None, None,
                 ready=lambda proc, timeout, stop: wait_http(url, timeout, proc, stop))  # fmt: skip


def child_env(admin_token: str) -> dict[str, str]:
    """This process's environment with $DITSERVE_ADMIN_TOKEN set to `admin_token` (removed when it is empty): how
    a token given as --admin-token reaches the generator, and how the sidecar is kept from inheriting one. A
    --admin-token-file travels as its path on the argv."""
    env = {k: v for k, v in os.environ.items() if k != ADMIN_TOKEN_ENV}
    if admin_token:
        env[ADMIN_TOKEN_ENV] = admin_token
    return env


def _base(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _url(host: str, port: int) -> str:
    return f"{_base(host, port)}/metrics"


def banner(args: argparse.Namespace, gen: GeneratorConfig, checkpoint: Path, run_dir: Path) -> str:
    """What `serve` prints once both children are healthy: where each thing listens, as bound."""
    tls = gen.tls_cert is not None
    if args.node_rank > 0:
        lines = [
            f"ditserve serving: node {args.node_rank} of {args.nnodes} of a replica ({args.nproc} rank(s) here, "
            f"{args.adaln_mode} mode), following the replica's rank 0 at rendezvous endpoint {args.rdzv_endpoint}; "
            f"checkpoint {checkpoint}, run dir {run_dir}"
        ]
    else:
        lines = [
            f"ditserve serving: generator on {args.host}:{args.port} ({args.adaln_mode} mode, "
            f"{'TLS' if tls else 'plaintext'}), checkpoint {checkpoint}, run dir {run_dir}"
        ]
        if args.nnodes > 1:
            lines.append(
                f"  replica: node 0 of {args.nnodes} ({args.nproc} rank(s) here), rendezvous at {args.rdzv_endpoint}"
            )
    if args.metrics_port is not None:
        host = gen.metrics_bind_host
        where = "" if is_loopback_host(host) else " (reachable from other hosts)"
        served = [] if args.node_rank > 0 else [f"{_url(host, args.metrics_port)} (generator)"]  # rank 0's alone
        if args.adaln_mode == "cached":
            served.append(f"{_url(host, args.metrics_port + 1)} (sidecar)")
        if served:
            lines.append(f"  metrics{where}: {', '.join(served)}")
    if args.sidecar_listen and args.adaln_mode == "cached":
        lines.append(f"  sidecar: TCP {args.sidecar_listen} (mutual TLS), reached by rank 0 at {gen.sidecar}")
    if args.node_rank > 0:  # no public server on this node: requests go to node 0's --port
        sidecar = f"sidecar {gen.sidecar}" if gen.sidecar else "no sidecar (resident mode)"
        lines.append(f"  this node's ranks: {sidecar}; no public gRPC port here (requests go to node 0)")
        return "\n".join(lines)
    target = f"127.0.0.1:{args.port}" if args.host in ("0.0.0.0", "::", "[::]") else f"{args.host}:{args.port}"
    transport = f"-cacert {gen.tls_cert}" if tls else "-plaintext"
    lines.append(
        f'  try: grpcurl {transport} -d \'{{"prompt": "a red fox"}}\' {target} ditserve.generator.v1.Generator/Generate'
    )
    if args.openai_port is not None:
        lines.append(f"  openai-compatible /v1/videos: {_base(args.host, args.openai_port)}/v1")
    return "\n".join(lines)


def warnings(args: argparse.Namespace, gen: GeneratorConfig) -> list[str]:
    """What `serve` tells the operator before it starts anything: an admin token given on its own command line
    (visible to every user in `ps`), and one served in plaintext beyond loopback."""
    out = []
    if getattr(args, "admin_token", None):
        out.append(
            "--admin-token on the command line is visible to other users (ps, /proc/PID/cmdline); prefer "
            f"--admin-token-file or ${ADMIN_TOKEN_ENV}"
        )
    tls, token = gen.tls_cert is not None, bool(gen.admin_secret)
    if getattr(args, "sidecar_listen", "") and gen.adaln_mode == "cached" and not token:
        out.append(
            f"--sidecar-listen {args.sidecar_listen}: no admin token (--admin-token-file or ${ADMIN_TOKEN_ENV}), so "
            "this TCP sidecar refuses weight updates and the replica's UpdateWeights fails: give every node rank "
            "0's token"
        )
    plaintext = plaintext_admin_warning(gen.listen, tls, token, gen.allow_plaintext_admin)
    if plaintext:
        out.append(plaintext)
    return out


def health_credentials(gen: GeneratorConfig) -> grpc.ChannelCredentials | None:
    """With TLS, the launcher checks health as a client trusting the server's own certificate."""
    if gen.tls_cert is None or gen.tls_key is None:
        return None
    client_pair = {}
    if gen.tls_client_ca:  # mutual TLS: present the server's own pair (it must be signed by that CA)
        client_pair = {"private_key": gen.tls_key.read_bytes(), "certificate_chain": gen.tls_cert.read_bytes()}
    return grpc.ssl_channel_credentials(root_certificates=gen.tls_cert.read_bytes(), **client_pair)


def sidecar_health_credentials(side: SidecarConfig) -> grpc.ChannelCredentials:
    """How `serve` checks a TCP sidecar's health: mutual TLS with the sidecar's own pair, trusting its client CA (serve's
    --sidecar-tls-*: one pair for server and client auth, signed by that CA). ValueError naming the flag of a bad
    file."""
    assert side.tls_client_ca is not None and side.tls_cert is not None and side.tls_key is not None
    return mutual_tls_channel_credentials(side.tls_client_ca, side.tls_cert, side.tls_key, "--sidecar-tls")


def prepare(args: argparse.Namespace) -> tuple[Path, Path, list[Child]]:
    """The run dir, the checkpoint and the children; bad flags or a bad checkpoint raise before any start.
    Prints `warnings` (to stderr)."""
    if args.no_metrics:
        args.metrics_port = None
    launch = from_args(LaunchOptions, args, exclude=SERVE_LAUNCH_EXCLUDE)
    run_dir = ensure_private_dir(launch.run_dir or default_run_dir())
    checkpoint = Path(args.checkpoint) if args.checkpoint else demo_path(run_dir)
    try:
        gen, side = child_configs(args, run_dir, checkpoint)
        if side is not None and side.tcp:
            sidecar_health_credentials(side)  # an unreadable or non-PEM --sidecar-tls-* file, before any start
    except ValueError as e:  # a combination of flags no config accepts
        raise UsageError(str(e)) from e
    if side is not None and side.state_dir is not None:  # every directory flag, before any child starts
        prepare_dir(side.state_dir, "--state-dir")
    if side is not None and side.cache.plan_dir is not None:
        if side.cache.plan_dir_read_only:
            require_dir(side.cache.plan_dir, "--plan-dir")
        else:
            prepare_dir(side.cache.plan_dir, "--plan-dir")
    if gen.weights_root is not None:
        require_dir(gen.weights_root, "--weights-root")
    for warning in warnings(args, gen):
        print(f"ditserve serve: warning: {warning}", file=sys.stderr, flush=True)
    if not args.checkpoint:
        demo_checkpoint(run_dir)
    validate_checkpoint(checkpoint)
    return run_dir, checkpoint, build_children(args, launch, gen, side)


def serve(args: argparse.Namespace) -> int:
    run_dir, checkpoint, children = prepare(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        for child in children:
            print(f"starting {child.name} (log: {child.log_path})", flush=True)
            child.start(stop=stop)
        gen = next(c.config for c in children if isinstance(c.config, GeneratorConfig))
        print(banner(args, gen, checkpoint, run_dir), flush=True)
        while not stop.wait(0.5):
            for child in children:
                if child.exited():
                    _restart(child, stop)
    except StopRequested:
        pass  # signalled while a child was starting
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
        child.start(stop=stop)


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """serve's own options, then the children's flags from their config declarations."""
    p.add_argument(
        "--checkpoint", default=None, help="MiniMax-H3 repository (default: a generated tiny demo repository)"
    )
    p.add_argument("--port", type=int, default=50051, help="generator port (default %(default)s)")
    p.add_argument(
        "--nproc", type=int, default=1,
        help="generator ranks of one replica, one per device (--devices, else --device for each), started by "
        "torchrun's elastic agent; the sidecar gets one slab per rank (default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--nnodes", type=int, default=1,
        help="nodes of one replica across hosts, each running `serve` with the same --nnodes and --rdzv-endpoint "
        "and its own --node-rank, --nproc ranks on each, started by torchrun with a static rendezvous "
        "(default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--node-rank", type=int, default=0,
        help="this node's place in the replica, in [0, --nnodes): node 0 serves --port (and --openai-port), a node "
        "K > 0 serves nothing public, its ranks follow rank 0 (default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--rdzv-endpoint", default=None, metavar="HOST:PORT",
        help="with --nnodes 2 or more (required then): the replica's rendezvous, hosted by node 0 at this address, "
        "the same on every node",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="generator bind address (default %(default)s)")
    p.add_argument(
        "--metrics-port", type=int, default=9400, help="generator /metrics on P, sidecar on P+1 (default %(default)s)"
    )
    p.add_argument("--no-metrics", action="store_true", help="serve no /metrics")
    p.add_argument(
        "--openai-port", type=int, default=None,
        help="also serve the OpenAI-compatible /v1/videos facade on --host at this port (default off; its key: "
        "$DITSERVE_OPENAI_API_KEY)",
    )  # fmt: skip
    p.add_argument(
        "--openai-allowed-hosts", default="",
        help="the facade's --allowed-hosts: Host header values it serves (default: loopback names and --host; "
        "give the names clients use when --host is 0.0.0.0)",
    )  # fmt: skip
    p.add_argument("--openai-cors-origins", default="", help="the facade's --cors-origins (default: no CORS)")
    add_flags(p, LaunchOptions, exclude=SERVE_LAUNCH_EXCLUDE)
    add_flags(p, GeneratorConfig, exclude=SERVE_GENERATOR_EXCLUDE, group="generator")
    side = p.add_argument_group("plan-cache sidecar (cached mode)")
    side.add_argument(
        "--sidecar-listen", default="", metavar="HOST:PORT",
        help="this node's sidecar listens on TCP here with mutual TLS (--sidecar-tls-ca, --sidecar-tls-cert, "
        "--sidecar-tls-key: one pair for server and client auth) and the generator's admin token, for a replica "
        "across hosts (default: the run dir's unix socket)",
    )  # fmt: skip
    side.add_argument(
        "--sidecar-advertise", default="", metavar="HOST:PORT",
        help="where rank 0 reaches this node's --sidecar-listen sidecar, named by its certificate (default: "
        "--sidecar-listen; required when that binds 0.0.0.0 or ::)",
    )  # fmt: skip
    add_flags(side, CacheConfig, exclude=SERVE_CACHE_EXCLUDE)
    add_flags(side, SidecarConfig, only=SERVE_SIDECAR_ONLY)
