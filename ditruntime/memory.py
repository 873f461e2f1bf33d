"""Memory this process can still take: host memory (MemAvailable bounded by every cgroup limit) and device memory
(cudaMemGetInfo plus what torch's caching allocator holds free). The host tier sizes itself with `host_memory_budget`;
the generator's admission check reads `free_memory(device)`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class MemoryBudget:
    """Memory this process can still take, and what bounds it (`bytes` 0 with `source` "unknown": no bound could be
    read)."""

    bytes: int
    source: str


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: Path, name: str) -> int:
    """One field of a cgroup memory.stat file (0 when absent)."""
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == name and v.strip().isdigit():
                return int(v)
    except OSError:
        pass
    return 0


def _meminfo_available(proc: Path) -> int | None:
    """MemAvailable of /proc/meminfo in bytes: free memory plus the page cache and slab the kernel can reclaim
    (free pages alone, SC_AVPHYS_PAGES, read almost nothing on a host with a full page cache)."""
    try:
        lines = (proc / "meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            fields = rest.split()
            if fields and fields[0].isdigit():
                return int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return None


def _cgroup_dirs(proc: Path, root: Path) -> tuple[list[Path], list[Path]]:
    """The process's cgroup v2 directories and v1 memory-controller directories, innermost first, each followed
    by its ancestors up to the mount (a container's own cgroup is usually the mount itself)."""

    def chain(mount: Path, rel: str) -> list[Path]:
        parts = [p for p in rel.split("/") if p and p not in (".", "..")]
        dirs = [mount.joinpath(*parts[:i]) for i in range(len(parts), 0, -1)]
        return [d for d in dirs if d.is_dir()] + [mount]

    v2: list[Path] = []
    v1: list[Path] = []
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hid == "0" and controllers == "":
            v2 = chain(root, rel)
        elif "memory" in controllers.split(","):
            v1 = chain(root / "memory", rel)
    if not lines:
        v2, v1 = [root], [root / "memory"]
    return v2, v1


_V1_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge page-rounded number


def host_memory_budget(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> MemoryBudget:
    """What the host tier may take: MemAvailable (/proc/meminfo), bounded by every cgroup limit above this process
    (v2 memory.max, v1 memory.limit_in_bytes) minus that cgroup's working set (usage less its inactive page cache,
    which the kernel reclaims before it OOM-kills)."""
    avail = _meminfo_available(proc)
    best = MemoryBudget(avail, f"MemAvailable {avail} bytes ({proc / 'meminfo'})") if avail is not None else None
    v2, v1 = _cgroup_dirs(proc, cgroup_root)
    candidates: list[MemoryBudget] = []
    for d in v2:
        limit_text = ""
        with contextlib.suppress(OSError):
            limit_text = (d / "memory.max").read_text().strip()
        usage = _read_int(d / "memory.current")
        if not limit_text.isdigit() or usage is None:
            continue  # "max" (no limit) or no such controller here
        working = max(0, usage - _stat_value(d / "memory.stat", "inactive_file"))
        limit = int(limit_text)
        candidates.append(
            MemoryBudget(max(0, limit - working), f"cgroup v2 {d / 'memory.max'} {limit} bytes, {working} in use")
        )
    for d in v1:
        limit_v1 = _read_int(d / "memory.limit_in_bytes")
        usage = _read_int(d / "memory.usage_in_bytes")
        if limit_v1 is None or usage is None or limit_v1 >= _V1_UNLIMITED:
            continue
        working = max(0, usage - _stat_value(d / "memory.stat", "total_inactive_file"))
        candidates.append(
            MemoryBudget(
                max(0, limit_v1 - working),
                f"cgroup v1 {d / 'memory.limit_in_bytes'} {limit_v1} bytes, {working} in use",
            )
        )
    for c in candidates:
        if best is None or c.bytes < best.bytes:
            best = c
    return best if best is not None else MemoryBudget(0, "unknown")


def cuda_free_memory(device: torch.device) -> MemoryBudget:
    """What `device` can still give this process: the driver's free bytes plus the bytes torch's caching allocator
    reserved but holds no tensor in (this process reuses those before asking the driver)."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return MemoryBudget(free + cached, f"cudaMemGetInfo on {device}: {free} bytes free + {cached} cached by torch")


def free_memory(device: torch.device) -> MemoryBudget:
    """Free memory where a model on `device` allocates its activations: device memory on cuda, host memory on cpu."""
    if device.type == "cuda":
        return cuda_free_memory(device)
    return host_memory_budget()


def device_name(device: torch.device) -> str:
    """The accelerator's product name ("NVIDIA H200"), or "cpu"."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return "cpu"
