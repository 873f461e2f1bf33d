"""Plan-cache configuration: frozen dataclasses whose fields declare their own CLI flags
(ditruntime.flags), built from `ditserve plancache` / `serve` / `generate-local` flags, passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ditcore.rebuild import SHARD_MODES
from ditruntime.auth import (
    ADMIN_TOKEN_ENV,
    ADMIN_TOKEN_FILE_HELP,
    ADMIN_TOKEN_HELP,
    METRICS_HOST_HELP,
    REFLECTION_HELP,
    check_tls_flags,
    listen_host,
    resolve_admin_token,
)
from ditruntime.flags import check_bounds, flag, flag_metadata

GB = 1000**3


@dataclass(frozen=True)
class CacheConfig:
    """Capacity and placement of the plan cache."""

    gpu_plans: int = flag(128, "slab slots (default %(default)s)", low=1, high=1_000_000)
    """Slots in the slab (`--gpu-plans`): plans resident at once. 128 holds two 50-step
    schedules plus a third's worth of headroom, so two alternating schedules never thrash."""
    plan_width: int = flag(4, "pages per slot (default %(default)s)", low=1, high=16)
    """Pages per slot (`--plan-width`): the widest plan accepted. A MiniMax-H3 t2va step has 2 distinct
    timesteps (video and text rows at the video one, audio rows at the audio one) unless they coincide
    (the first step, or equal shifts); an fl2va step adds its keyframe rows' max(video t, 0.999): 3; a ref2va step
    its image / video reference rows' max(video t, 0.999) and, with an audio reference, the audio reference rows'
    1.0: 4 (ditcore.plans.MAX_PLAN_WIDTH). 3 serves t2va and fl2va (and ref2va without audio) with a quarter less
    slab; 2 serves t2va alone."""
    ref_plans: int = flag(
        0, "slots kept for the ref partition's plans (transformer_ref/, ref2va); 0: both partitions share every "
        "slot, least recently used first (default %(default)s)", low=0, high=1_000_000,
    )  # fmt: skip
    """Split the slab by partition (`--ref-plans N`): the last N slots hold only ref2va's plans (the
    `transformer_ref/` partition), the rest only the base partition's, so a burst of one task never evicts the
    other's plans. 0 (default): one LRU across both partitions."""
    host_cache_bytes: int = flag(
        8 * GB, "host tier cap, 0 = off (default %(default)s)", name="--host-cache-gb", scale=GB, flag_type=float, low=0
    )
    """Byte cap of the host tier (`--host-cache-gb`, decimal GB); 0 disables it. Clipped at start to
    the memory budget (MemAvailable, and every cgroup limit above the process minus its working set)
    minus `host_reserve_bytes`; the tier is then exactly the whole pages that fit."""
    plan_dir: Path | None = flag(
        None, "disk tier: keep built plans as pack files in this directory, asked after the host tier and before a "
        "rebuild (default: off)",
    )  # fmt: skip
    """The disk tier's directory (`--plan-dir`): after a prepare that rebuilt plans, the group's pages are written
    there as one pack, addressed by everything that determines their bits (the partition's weight fingerprint, the
    adapters digest, dtype, page layout, shard split, builder, timesteps), so a restarted sidecar (or another one
    sharing the directory) reads them instead of rebuilding. Created 0700 when missing (unless
    `--plan-dir-read-only`). docs/architecture.md, "The disk tier and plan packs"."""
    plan_dir_max_bytes: int = flag(
        64 * GB, "disk tier size bound; least recently used packs are deleted beyond it (default %(default)s)",
        name="--plan-dir-max-gb", scale=GB, flag_type=float, low=0,
    )  # fmt: skip
    """Byte bound of `--plan-dir` (decimal GB, like `--host-cache-gb`): after each pack written, the least recently
    used packs (last read or written) are deleted until the directory's packs fit."""
    plan_dir_read_only: bool = flag(
        False,
        "read --plan-dir's packs (e.g. a directory another sidecar writes) but never write, touch or delete there",
    )
    """Use `--plan-dir` read-only: it must exist; packs another sidecar wrote (another host sharing the volume) are
    read, a damaged one is left in place unused, nothing is written, touched, evicted or deleted."""
    host_reserve_bytes: int = 2 * 1024**3
    """Memory left to everything else when clipping the host tier to available memory."""
    host_chunk_bytes: int = 64 * 1024**2
    """The host tier is allocated (and on cuda page-locked) in chunks of as many whole pages as fit
    in this many bytes (at least one page), so the pinned bytes are the tier's bytes, not a power of two."""
    device: str = flag("cpu", "cpu or cuda[:N] (default %(default)s)")
    """Where the slab lives: "cpu" (a /dev/shm file) or "cuda[:N]" (device memory)."""
    devices: str = flag(
        "", "slab devices of a replica, one per generator rank in rank order, comma-separated (e.g. "
        "cuda:0,cuda:1; default: --device alone)",
    )  # fmt: skip
    """A replica of N generator ranks: one slab per device listed, all with the same
    slot layout and one slot table, rank r reading `slabs[r]`. Overrides `--device`. The same device may repeat
    (`cpu,cpu`: two CPU ranks, two shm slabs). A rebuild is sharded across them (`--rebuild-shard`)."""
    rebuild_shard: str = flag(
        "auto", "how a rebuild is split across --devices: auto, rows or projections (default %(default)s)",
        choices=("auto", *SHARD_MODES),
    )  # fmt: skip
    """With N slab devices each computes 1/N of every page: "rows" (its slice of every projection's output
    features, reading 1/N of the plan tensors), "projections" (whole projections round-robin, the unsharded GEMMs
    themselves), or "auto": rows where measured bitwise the unsharded pages on that device and dtype
    (ditcore.rebuild.row_split_is_exact), else projections. Its columns are then copied into every other slab."""
    shm_dir: str = "/dev/shm"
    """Directory of the CPU slab and of the slot table (falls back to the temp dir)."""

    @property
    def slab_devices(self) -> tuple[str, ...]:
        """One device per slab, in rank order: `--devices` split, else (`--device`,)."""
        listed = tuple(d.strip() for d in self.devices.split(",") if d.strip())
        return listed if listed else (self.device,)

    @property
    def primary_device(self) -> str:
        """The first slab's device (the host tier is pinned for it)."""
        return self.slab_devices[0]

    def partition_slots(self, partition: str) -> range:
        """The slots `partition`'s plans may occupy: every slot when shared, else its side of the split."""
        if self.ref_plans == 0:
            return range(self.gpu_plans)
        split = self.gpu_plans - self.ref_plans
        return range(split, self.gpu_plans) if partition == "ref" else range(split)

    def __post_init__(self) -> None:
        if self.ref_plans and self.ref_plans >= self.gpu_plans:
            raise ValueError(
                f"--ref-plans must be below --gpu-plans ({self.gpu_plans}) so each partition keeps a slot, got "
                f"{self.ref_plans}"
            )
        check_bounds(self)
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device (--device) must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        for d in self.slab_devices:
            if not (d == "cpu" or d.startswith("cuda")):
                raise ValueError(f"--devices must list 'cpu' or 'cuda[:N]' devices, got {d!r} in {self.devices!r}")
        if len({d.split(":")[0] for d in self.slab_devices}) > 1:
            raise ValueError(f"--devices must be all cpu or all cuda, got {self.devices!r}")
        if self.plan_dir_read_only and self.plan_dir is None:
            raise ValueError("--plan-dir-read-only needs --plan-dir")
        if self.host_chunk_bytes < 1:
            raise ValueError(f"host_chunk_bytes must be positive, got {self.host_chunk_bytes}")


@dataclass(frozen=True)
class SidecarConfig:
    """Everything `ditserve plancache` is started with."""

    checkpoint: Path = field(metadata=flag_metadata("MiniMax-H3 repository directory (the rebuild source)"))
    """The diffusers MiniMax-H3 repository plans are built from; its transformer must hold its native
    adaln_proj and norm_out.linear tensors (a repository stripped for cached generators is refused)."""
    cache: CacheConfig
    """Slab and host-tier capacity and placement (its flags join `ditserve plancache`'s)."""
    address: str
    """'unix:/path' (default: <run dir>/plancache.sock) or 'host:port' (TCP, opt-in); set by the
    launch options --socket / --listen / --run-dir, not a flag of its own."""
    heartbeat_s: float = flag(1.0, "session heartbeat interval (default %(default)s)", low=0.05, high=60)
    """Interval of Attach-stream heartbeats."""
    session_grace_s: float = flag(
        30.0, "keep a vanished session's slots pinned at least this long unless its process is gone (default "
        "%(default)s; longer for long steps: --session-grace-steps)",
        low=0, high=3600,
    )  # fmt: skip
    """The floor of how long the slots a vanished session leased stay unusable (never evicted nor refilled)
    when its peer process is not known to be gone: a bound on how long its already-queued kernels may still
    read them (docs/architecture.md, "The slab and the lease protocol"). A lease whose PreparePlans carried a
    step bound stays pinned for max(this, `session_grace_steps` x that bound): a released maximum canvas
    step models at ~44 s on an H200, above this floor."""
    session_grace_steps: float = flag(
        2.0, "keep a vanished session's slots pinned at least this many of its step bounds (default %(default)s)",
        low=0, high=100,
    )  # fmt: skip
    """How many of a lease's step bounds (PreparePlansRequest.step_bound_s, the generator's bound on one denoise
    step) its slots stay pinned after its session vanished: the step in flight and one more that may already be
    queued on the device."""
    adapter_dir: Path | None = flag(
        None, "directory of adapters whose modulation plans are built here: the generator's --adapter-dir "
        "(default: none; plans with adapters are refused)",
    )  # fmt: skip
    """The adapters (ditcore.adapters) a PreparePlans may name for its keys' adapters digest: read by name, each
    must have the identity the generator read (the same files)."""
    state_dir: Path | None = flag(
        None, "persist the weight generation here (state file wins over --checkpoint; serve: default <run-dir>/state)"
    )
    """Where (generation, weights_path, digests) persist; its state file wins over `checkpoint`."""
    metrics_port: int | None = flag(None, "serve Prometheus /metrics on this port (default off)")
    """Prometheus /metrics HTTP port (off when None)."""
    metrics_host: str = flag("", METRICS_HOST_HELP)
    """Host /metrics binds to; empty: the TCP `address`'s host, or 127.0.0.1 on the unix socket. The resolved
    host is `metrics_bind_host`."""
    reflection: bool = flag(True, REFLECTION_HELP, negate=True)
    """Serve gRPC server reflection (`--no-reflection`: don't)."""
    tls_cert: Path | None = flag(None, "PEM server certificate (required with --listen)")
    """TCP only: the sidecar's PEM certificate (mutual TLS with tls_key and tls_client_ca)."""
    tls_key: Path | None = flag(None, "PEM private key of --tls-cert (required with --listen)")
    """TCP only: the PEM private key of tls_cert."""
    tls_client_ca: Path | None = flag(
        None, "PEM CA that must have signed the client's certificate (required with --listen)"
    )
    """TCP only: clients (the generator) must present a certificate this CA signed."""
    admin_token: str = flag("", ADMIN_TOKEN_HELP, env=ADMIN_TOKEN_ENV)
    """TCP only: Prepare/Commit/AbortWeightUpdate need `authorization: Bearer <admin_token>` (empty:
    refused). On the unix socket the peer's uid is the credential and the token is not asked. At least 16
    characters (ditruntime.auth.check_admin_token); the token in use is `admin_secret`."""
    admin_token_file: Path | None = flag(None, ADMIN_TOKEN_FILE_HELP)
    """A file holding the admin token instead (read once at start, stripped; refused when other users may read
    it)."""

    @property
    def tcp(self) -> bool:
        """Listening on TCP (mutual TLS + admin token), not on the unix socket (peer uid)."""
        return not self.address.startswith("unix")

    @property
    def metrics_bind_host(self) -> str:
        """Where /metrics binds: `metrics_host`, else the host of `address` (127.0.0.1 for a unix socket)."""
        return self.metrics_host or listen_host(self.address)

    @cached_property
    def admin_secret(self) -> str:
        """The admin token in use: `admin_token`, or `admin_token_file`'s contents (read once, checked at start)."""
        return resolve_admin_token(self.admin_token, self.admin_token_file)

    def __post_init__(self) -> None:
        check_bounds(self)
        _ = self.admin_secret  # a short token or an unreadable --admin-token-file is refused now
        check_tls_flags(
            {"--tls-cert": self.tls_cert, "--tls-key": self.tls_key, "--tls-client-ca": self.tls_client_ca},
            required=self.tcp,
            needed_by=f"--listen {self.address} (TCP)",
            stray="TLS applies only with --listen HOST:PORT (the unix socket checks the peer's uid)",
            hint="; the unix socket (--socket) needs none",
        )
