"""The disk tier (`--plan-dir`): built plans in pack files (ditruntime.plan_packs), asked after the host tier and
before the rebuild. No gRPC here.

Lookup is per plan: a missing key is served from any pack of its identity (the partition's weight fingerprint as
committed, the adapters digest, dtype, page layout, the build's shard split and builder) holding its timesteps, so a
weight generation or adapter identity other than the pack's never matches it. A plan that fails its checksum (or
whose pack vanished meanwhile) is rebuilt in the same prepare, in one pass with any other such plan, and its pack is
deleted (unless the directory is read-only): a damaged pack is never served.

Storage is per group: after a prepare that rebuilt some of its plans, the group's pages (every plan of it, so a
pack stands alone) are copied out of the slab while the prepare still pins its slots (`TierStore.copy`, after the
cache's state lock is dropped) and handed to one writer thread, which writes the pack (temp file, fsync, rename),
indexes it and evicts the least recently used packs beyond `--plan-dir-max-gb`. So a prepare never waits for the
disk; a write that fails (a full disk, an unwritable directory) is counted and logged once, never an error; a write
that would take the pending bytes over `max_pending_bytes` is skipped and counted. A read-only directory
(`--plan-dir-read-only`: packs another sidecar wrote, e.g. on another host) is only read.
See docs/architecture.md, "The disk tier and plan packs".
"""

from __future__ import annotations

import logging
import platform
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ditcore.plans import PlanKey, distinct_keys, dtype_name
from ditcore.report import CacheReport
from ditruntime.plan_packs import PackError, PackIdentity, PackKey, PackStore, PackStoreStats, PlanRef

from .config import CacheConfig
from .device import HostLanding
from .rebuild import RebuildSource
from .tiers import NOT_KEPT, CacheCounters, RebuildTier, SlabPages, Tier, TierFill, TierStore

log = logging.getLogger(__name__)

MAX_PENDING_BYTES = 2 * 1024**3
"""Pages copied out of the slab and not yet written that the writer may hold; a group beyond it is not written."""


def builder_of(source: RebuildSource) -> str:
    """What built the pages, as far as their bits go: the device kind (a GPU's name and compute capability, a CPU's
    instruction set) and torch's version."""
    d = source.device
    if d.type == "cuda":
        major, minor = torch.cuda.get_device_capability(d)
        kind = f"cuda/{torch.cuda.get_device_name(d)}/sm_{major}{minor}"
    else:
        capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
        kind = f"{d.type}/{platform.machine()}/{capability}"
    return f"{kind}/torch {torch.__version__}"


def identity_of(source: RebuildSource, key: PlanKey, fingerprints: dict[str, str], builder: str) -> PackIdentity:
    layout = source.layout
    count = len(source.devices)
    return PackIdentity(
        weights=fingerprints[key.partition],
        partition=key.partition,
        adapters=key.adapters,
        dtype=dtype_name(source.dtype),
        num_layers=layout.num_layers,
        hidden=layout.hidden,
        time_embed_dim=layout.time_embed_dim,
        page_numel=layout.page_numel,
        shard_count=count,
        shard_mode=source.shard_mode if count > 1 else "whole",
        builder=builder,
    )


@dataclass(frozen=True)
class _Write:
    key: PackKey
    page_bytes: int
    plans: list[tuple[tuple[int, ...], memoryview]]
    nbytes: int


class DiskTier(Tier):
    """Plans in a plan directory; misses and damaged packs fall back to `rebuild` (whose builds it also stores)."""

    name = "disk"

    def __init__(self, store: PackStore, rebuild: RebuildTier, *, max_pending_bytes: int = MAX_PENDING_BYTES,
                 background: bool = True) -> None:  # fmt: skip
        self.packs = store
        self.rebuild = rebuild
        rebuild.built = set()  # the rebuild tier now records what it built, for `store`
        self.max_pending_bytes = max_pending_bytes
        self.write_skips = 0
        self._ids: tuple[RebuildSource, dict[str, str], str] | None = None  # (the source, its fingerprints, builder)
        self._identities: dict[tuple[str, str], PackIdentity] = {}
        self._pending = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Write | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        if background and not store.read_only:
            self._writer = threading.Thread(target=self._write_loop, name="plan-pack-writer", daemon=True)
            self._writer.start()

    @classmethod
    def open(cls, config: CacheConfig, rebuild: RebuildTier) -> DiskTier:
        """The tier of `config.plan_dir` (created 0700 if missing, unless read-only: then it must exist)."""
        assert config.plan_dir is not None
        store = PackStore(config.plan_dir, config.plan_dir_max_bytes, read_only=config.plan_dir_read_only)
        st = store.stats()
        log.info(
            "disk tier: %s%s, %d pack(s), %d of %d bytes", store.root, " (read-only)" if store.read_only else "",
            st.packs, st.used_bytes, st.capacity_bytes,
        )  # fmt: skip
        return cls(store, rebuild)

    # ---------------------------------------------------------------- identity
    def identity(self, key: PlanKey) -> PackIdentity:
        source = self.rebuild.source
        if self._ids is None or self._ids[0] is not source:  # a retarget swapped the source
            self._ids = (source, source.partition_fingerprints(), builder_of(source))
            self._identities = {}
        known = self._identities.get((key.partition, key.adapters))
        if known is None:  # one per partition and adapters digest (its digest computed once)
            known = self._identities[(key.partition, key.adapters)] = identity_of(source, key, self._ids[1],
                                                                                 self._ids[2])  # fmt: skip
        return known

    # ---------------------------------------------------------------- Tier
    def holds_all(self, keys: Sequence[PlanKey]) -> bool:
        return all(self.packs.lookup(self.identity(k), k.bits) is not None for k in keys)

    def fill(self, keys: Sequence[PlanKey], slots: Sequence[int], slab: SlabPages) -> TierFill:
        """Read each key's pages straight into its slot (a cpu slab) or through pinned staging (cuda), pack by pack
        in file order, each pack opened once; what is missing, damaged or gone meanwhile is rebuilt."""
        t0 = time.perf_counter()
        found: list[tuple[PlanKey, int, PlanRef]] = []
        missed: list[tuple[PlanKey, int]] = []
        for k, s in zip(keys, slots, strict=True):
            ref = self.packs.lookup(self.identity(k), k.bits)
            if ref is None:
                missed.append((k, s))
            else:
                found.append((k, s, ref))
        found.sort(key=lambda f: (f[2].header.path, f[2].entry.offset))
        landing = HostLanding(slab.copiers)
        read, nbytes, used = [], 0, []
        with self.packs.reader() as reader:
            for k, s, ref in found:
                try:
                    reader.read_into(ref, landing.buffer(slab.plans(s, k.width)))
                except PackError as e:  # corrupt (dropped, deleted unless read-only) or gone: rebuilt below
                    log.info("disk tier: %s: rebuilding %s", e, k)
                    missed.append((k, s))
                    continue
                landing.land()
                read.append(k)
                used.append(ref.header)
                nbytes += ref.entry.length
        slab.fence()
        self.packs.touch(used)
        dt = time.perf_counter() - t0
        filled = TierFill(
            CacheReport(disk_hit_plans=len(read), disk_read_s=round(dt, 6)),
            CacheCounters(disk_hit_plans=len(read), disk_read_bytes=nbytes, disk_read_s=dt),
        )
        if not missed:
            return filled
        rebuilt = self.rebuild.fill([k for k, _ in missed], [s for _, s in missed], slab)

        def commit() -> None:
            filled.commit()
            rebuilt.commit()

        counts = CacheCounters()
        counts.add(filled.counts)
        counts.add(rebuilt.counts)
        return TierFill(filled.report.plus(rebuilt.report), counts, commit)

    def store(self, group: Sequence[PlanKey], slots: Sequence[int], slab: SlabPages) -> TierStore:
        """Book a pack of the group when this prepare rebuilt some of its plans (per adapters digest: one identity a
        pack); the copy out of the slab is `copy`, the write the writer thread's."""
        built = self.rebuild.built
        fresh = built is not None and bool(built.intersection(group))
        if built is not None:
            built.clear()
        if not fresh or self.packs.read_only:
            return NOT_KEPT
        slot_of = dict(zip(group, slots, strict=True))
        source = self.rebuild.source
        page_bytes = source.page_bytes
        packs = []
        for digest in dict.fromkeys(k.adapters for k in group):
            keys = distinct_keys(k for k in group if k.adapters == digest)
            key = PackKey(self.identity(keys[0]), tuple(k.bits for k in keys))
            if not self.packs.has_pack(key):
                packs.append((key, keys))
        if not packs:
            return NOT_KEPT
        nbytes = sum(k.width * page_bytes for _, keys in packs for k in keys)
        with self._lock:
            if self._pending + nbytes > self.max_pending_bytes:
                self.write_skips += 1
                log.warning("disk tier: %d bytes of plans wait to be written; this group is not stored", self._pending)
                return NOT_KEPT
            self._pending += nbytes
        n_plans = sum(len(keys) for _, keys in packs)

        def copy() -> None:
            writes = []
            for key, keys in packs:
                plans = []
                for k in keys:
                    pages = slab.plan(slot_of[k], k.width).to("cpu", copy=True).contiguous()
                    plans.append((k.bits, pages.view(torch.uint8).view(-1).numpy().data))
                writes.append(_Write(key, page_bytes, plans, sum(b.nbytes for _, b in plans)))
            for w in writes:
                self._submit(w)

        def undo() -> None:
            with self._lock:
                self._pending -= nbytes

        return TierStore(False, copy, undo, report=CacheReport(disk_stored_plans=n_plans))

    def clear(self, partitions: set[str] | None = None) -> None:
        """Nothing to delete: packs are addressed by their weights, so those of other weights no longer match (and
        match again after an update back to them)."""
        self._ids = None

    # ---------------------------------------------------------------- writer
    def _submit(self, w: _Write) -> None:
        if self._writer is None:
            self._write(w)
        else:
            self._queue.put(w)

    def _write(self, w: _Write) -> None:
        try:
            self.packs.write(w.key, w.page_bytes, w.plans)
        except Exception:  # never a request's failure: counted by the store for OSError; anything else logged here
            log.exception("disk tier: writing plan pack %s failed", w.key.file_name)
        finally:
            with self._lock:
                self._pending -= w.nbytes

    def _write_loop(self) -> None:
        while True:
            w = self._queue.get()
            try:
                if w is None:
                    return
                self._write(w)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every pack handed to the writer is written (or failed)."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is pending, then stop the writer."""
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self._writer = None

    def stats(self) -> PackStoreStats:
        """The pack store's counters and occupancy."""
        return self.packs.stats()
