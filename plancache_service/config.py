"""Plan-cache configuration: one frozen dataclass, built from CLI flags, passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GB = 1000**3


@dataclass(frozen=True)
class CacheConfig:
    """Capacity and placement of the plan cache."""

    gpu_plans: int = 128
    """Slots in the slab (`--gpu-plans`): plans resident at once. 128 holds two 50-step
    schedules plus a third's worth of headroom, so two alternating schedules never thrash."""
    plan_width: int = 2
    """Pages per slot (`--plan-width`): the widest plan accepted. t2va with distinct video and
    audio shifts needs 2; t2v needs 1."""
    host_cache_bytes: int = 8 * GB
    """Byte cap of the host tier (`--host-cache-gb`); 0 disables it. Clipped at start to the
    available memory minus `host_reserve_bytes`."""
    host_reserve_bytes: int = 2 * 1024**3
    """Memory left to everything else when clipping the host tier to available memory."""
    device: str = "cpu"
    """Where the slab lives: "cpu" (a /dev/shm file) or "cuda[:N]" (device memory)."""
    shm_dir: str = "/dev/shm"
    """Directory of the CPU slab and of the slot table (falls back to the temp dir)."""

    def __post_init__(self) -> None:
        if not 1 <= self.gpu_plans <= 1_000_000:
            raise ValueError(f"gpu_plans (--gpu-plans) must be in [1, 1000000], got {self.gpu_plans}")
        if not 1 <= self.plan_width <= 16:
            raise ValueError(f"plan_width (--plan-width) must be in [1, 16], got {self.plan_width}")
        if self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes (--host-cache-gb) must be >= 0, got {self.host_cache_bytes}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")


@dataclass(frozen=True)
class SidecarConfig:
    """Everything `ditserve plancache` is started with."""

    checkpoint: Path
    """Checkpoint plans are rebuilt from (needs native adaln_proj tensors)."""
    cache: CacheConfig
    """Slab and host-tier capacity and placement."""
    address: str
    """'unix:/path' (default: <run dir>/plancache.sock) or 'host:port' (TCP, opt-in)."""
    heartbeat_s: float = 1.0
    """Interval of Attach-stream heartbeats."""
    state_dir: Path | None = None
    """Where (generation, weights_path, digests) persist; its state file wins over `checkpoint`."""
    metrics_port: int | None = None
    """Prometheus /metrics HTTP port (off when None)."""
