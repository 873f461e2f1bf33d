"""Sidecar Prometheus metrics: read from the cache's own counters at scrape time, so every
number on /metrics is exactly what GetState reports (nothing is counted twice)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .cache import CacheStats
from .sidecar import Sidecar

P = "ditserve_plancache"


class SidecarCollector(Collector):
    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        st = self.sidecar.state()
        yield from _cache_counters(st.stats)
        yield from _cache_gauges(st.stats)
        yield GaugeMetricFamily(f"{P}_generation", "Weight generation served", value=st.generation)
        yield GaugeMetricFamily(f"{P}_serving", "1 if serving plans", value=1 if st.serving else 0)
        yield GaugeMetricFamily(f"{P}_session_attached", "1 if a generator is attached", value=1 if st.session else 0)
        upd = CounterMetricFamily(f"{P}_weight_updates", "Weight update outcomes at the sidecar", labels=["outcome"])
        for outcome, n in asdict(self.sidecar.update_outcomes).items():
            upd.add_metric([outcome], n)
        yield upd


def _cache_counters(s: CacheStats) -> Iterator[CounterMetricFamily]:
    plans = CounterMetricFamily(f"{P}_plans", "Plans served by tier", labels=["tier"])
    plans.add_metric(["slot_hit"], s.slot_hit_plans)
    plans.add_metric(["host_hit"], s.host_hit_plans)
    plans.add_metric(["disk_hit"], s.disk_hit_plans)
    plans.add_metric(["built"], s.built_plans)
    yield plans
    yield CounterMetricFamily(
        f"{P}_rebuild_passes", "Rebuild passes (one checkpoint stream each)", value=s.rebuild_passes
    )
    yield CounterMetricFamily(f"{P}_rebuild_seconds", "Seconds spent rebuilding plans", value=s.rebuild_s)
    yield CounterMetricFamily(f"{P}_swap_in_bytes", "Bytes swapped in from the host tier", value=s.swap_in_bytes)
    yield CounterMetricFamily(f"{P}_swap_in_seconds", "Seconds spent swapping in", value=s.swap_in_s)
    ev = CounterMetricFamily(f"{P}_evictions", "Evictions by tier", labels=["tier"])
    ev.add_metric(["slot"], s.slot_evictions)
    ev.add_metric(["host_group"], s.host_group_evictions)
    ev.add_metric(["disk_pack"], s.disk_evictions)
    yield ev
    yield CounterMetricFamily(f"{P}_disk_read_bytes", "Page bytes read from the disk tier", value=s.disk_read_bytes)
    yield CounterMetricFamily(f"{P}_disk_read_seconds", "Seconds spent reading the disk tier", value=s.disk_read_s)
    yield CounterMetricFamily(
        f"{P}_disk_stored_plans", "Plans written to the disk tier in packs", value=s.disk_stored_plans
    )
    yield CounterMetricFamily(f"{P}_disk_written_bytes", "Bytes of plan packs written", value=s.disk_written_bytes)
    yield CounterMetricFamily(
        f"{P}_disk_corrupt_packs", "Damaged plan packs found (deleted unless read-only)", value=s.disk_corrupt_packs
    )
    yield CounterMetricFamily(
        f"{P}_disk_write_errors", "Plan pack writes that failed (full disk, unwritable directory)",
        value=s.disk_write_errors,
    )  # fmt: skip
    yield CounterMetricFamily(
        f"{P}_disk_write_skips", "Groups not written: too many bytes waiting for the writer", value=s.disk_write_skips
    )
    yield CounterMetricFamily(
        f"{P}_host_pressure_skips", "Groups that could not fit the host tier", value=s.host_pressure_skips
    )
    yield CounterMetricFamily(
        f"{P}_rebuild_read_bytes", "Checkpoint plan-tensor bytes rebuild passes read", value=s.rebuild_read_bytes
    )
    yield CounterMetricFamily(
        f"{P}_rebuild_read_seconds", "Seconds rebuild passes spent reading the checkpoint (read throughput: bytes "
        "/ seconds)", value=s.rebuild_read_s,
    )  # fmt: skip
    prep = CounterMetricFamily(f"{P}_prepares", "PreparePlans outcomes", labels=["outcome"])
    prep.add_metric(["ok"], s.prepares)
    prep.add_metric(["failed"], s.failed_prepares)
    yield prep


def _cache_gauges(s: CacheStats) -> Iterator[GaugeMetricFamily]:
    yield GaugeMetricFamily(f"{P}_leases", "Leases held", value=s.leases_held)
    slots = GaugeMetricFamily(f"{P}_slots", "Slab slots by state", labels=["state"])
    slots.add_metric(["total"], s.num_slots)
    slots.add_metric(["ready"], s.slots_ready)
    slots.add_metric(["leased"], s.slots_leased)
    yield slots
    host = GaugeMetricFamily(f"{P}_host_bytes", "Host tier bytes", labels=["kind"])
    host.add_metric(["capacity"], s.host_capacity_bytes)
    host.add_metric(["used"], s.host_used_bytes)
    yield host
    yield GaugeMetricFamily(f"{P}_host_groups", "Groups in the host tier", value=s.host_groups)
    disk = GaugeMetricFamily(f"{P}_disk_bytes", "Disk tier bytes", labels=["kind"])
    disk.add_metric(["capacity"], s.disk_capacity_bytes)
    disk.add_metric(["used"], s.disk_used_bytes)
    yield disk
    yield GaugeMetricFamily(f"{P}_disk_packs", "Plan packs in the disk tier", value=s.disk_packs)


def sidecar_registry(sidecar: Sidecar) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(SidecarCollector(sidecar))
    return registry
