"""The cache report: where one request's distinct plans came from and what that cost.

One dataclass from the plan-cache core to the client: the core fills it, leases carry it,
`generate()` returns it, and both protos' `CacheReport` messages are converted from its
fields by name (`ditruntime.convert`, which refuses a field with no counterpart).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class CacheReport:
    gpu_hit_plans: int = 0
    """Distinct plans already resident in slab slots."""
    host_hit_plans: int = 0
    """Distinct plans swapped in from the host tier."""
    built_plans: int = 0
    """Distinct plans rebuilt from the checkpoint."""
    rebuild_s: float = 0.0
    """Seconds spent in the rebuild pass."""
    swap_in_s: float = 0.0
    """Seconds spent swapping in from the host tier."""
    host_stored: bool = False
    """Whether the request's plan group is now held by the host tier."""
    disk_hit_plans: int = 0
    """Distinct plans read from the disk tier (--plan-dir packs)."""
    disk_read_s: float = 0.0
    """Seconds spent reading (and verifying) plans from the disk tier."""
    disk_stored_plans: int = 0
    """Plans this prepare wrote to the disk tier."""
    rebuild_read_bytes: int = 0
    """Checkpoint bytes the rebuild pass read."""
    rebuild_read_s: float = 0.0
    """Seconds the rebuild pass spent reading them (its read throughput: rebuild_read_bytes / rebuild_read_s)."""

    @property
    def plans(self) -> int:
        """Distinct plans the request needed (every tier together)."""
        return self.gpu_hit_plans + self.host_hit_plans + self.disk_hit_plans + self.built_plans

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> CacheReport:
        return replace(self, **changes)

    def plus(self, other: CacheReport) -> CacheReport:
        """Both reports' counts and seconds summed (seconds rounded to the microsecond), flags or-ed: the report of
        a prepare whose plans came from several tiers."""
        out: dict[str, Any] = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            out[f.name] = a or b if isinstance(a, bool) else round(a + b, 6) if isinstance(a, float) else a + b
        return CacheReport(**out)
