"""The plan cache core (no gRPC): slots with per-plan LRU and leases over a fixed slab.

Protocol (docs/architecture.md, "The slab and the lease protocol"), for one request's
per-step plan keys:

    lease = cache.prepare(generation, keys, owner)   # validate -> hits -> a tier fills the misses
    ... the consumer reads slab[lease.slots[i], :keys[i].width] for step i ...
    cache.release(lease.lease_id)                     # or release_owner(owner) when a session dies

prepare, in order: validate count, width, finiteness and generation before touching any
state; touch slot hits (LRU); take free slots, else evict least-recently-used plans no live
lease holds; give each missing plan to the first of `self.tiers` (host memory, the disk tier
with `--plan-dir`, then the rebuild) that holds it, and let each tier fill its share (the host
swaps in every plan it holds, whichever group stored it; the disk reads its plans from their
packs; the rebuild builds the rest in one pass); publish READY; let each tier store the group
(the host tier skips it when it cannot fit; the disk tier writes a pack when plans were rebuilt);
return the lease. A failed
prepare returns its slots to the free list (or, after publishing, just unpins them) and is
retryable.

Locking: `_prepare_lock` serializes prepares (and invalidation); `_state` guards bookkeeping
(the tiers' too) and is never held while pages are copied: not during a fill (rebuild or
swap-in) nor during a tier's store copy, so `release` never waits on a copy. The store copy
reads the group's slots while the prepare still holds their pins (taken by `_reserve`, handed
to the lease only after the copy), and under `_prepare_lock`, so no prepare can evict or
refill them while they are read.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from ditcore.plans import PlanKey, distinct_keys
from ditcore.report import CacheReport
from ditruntime.errors import GenerationMismatchError
from ditruntime.plan_packs import PackStoreStats
from ditruntime.slab import (
    COL_ADAPTERS,
    COL_GENERATION,
    COL_LENGTH,
    COL_PARTITION,
    COL_SEQ,
    COL_STATE,
    EMPTY,
    FILLING,
    READY,
    ROW_WORDS,
)

from .config import CacheConfig
from .device import Copier, SlabMemory
from .disk_tier import DiskTier
from .errors import (
    CacheBusyError,
    InvalidPlanRequestError,
    PartitionUnavailableError,
    PlanCacheError,
    PlanCapacityError,
    RebuildError,
    SlabBusyError,
    UnknownLeaseError,
)
from .host_tier import HostTier
from .rebuild import RebuildSource
from .tiers import CacheCounters, HostMemoryTier, RebuildTier, SlabPages, Tier, TierStore

MAX_KEYS = 1000  # one key per step; steps are capped at 1000


@dataclass(frozen=True)
class Lease:
    """The slots one request holds: `slots[i]` holds the plan of step i."""

    lease_id: int
    owner: str
    generation: int
    keys: tuple[PlanKey, ...]
    slots: tuple[int, ...]
    report: CacheReport


@dataclass(frozen=True)
class PartitionState:
    """One transformer partition the cache serves plans of (GetState's `Partition`)."""

    name: str
    folder: str
    fingerprint: str
    slots_ready: int
    slots_allowed: int


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache: GetState's `CacheStats` message, field for field, except
    `generation` and `leases_held`, which travel on `GetStateResponse` itself."""

    generation: int
    num_slots: int
    slot_width: int
    page_bytes: int
    slots_ready: int
    slots_leased: int
    leases_held: int
    host_capacity_bytes: int
    host_used_bytes: int
    host_groups: int
    host_pinned: bool
    slot_hit_plans: int
    host_hit_plans: int
    built_plans: int
    rebuild_passes: int
    rebuild_s: float
    swap_in_bytes: int
    swap_in_s: float
    slot_evictions: int
    host_group_evictions: int
    host_pressure_skips: int
    prepares: int
    failed_prepares: int
    disk_capacity_bytes: int = 0
    disk_used_bytes: int = 0
    disk_packs: int = 0
    disk_read_only: bool = False
    disk_hit_plans: int = 0
    disk_read_bytes: int = 0
    disk_read_s: float = 0.0
    disk_stored_plans: int = 0
    disk_written_bytes: int = 0
    disk_evictions: int = 0
    disk_corrupt_packs: int = 0
    disk_write_errors: int = 0
    disk_write_skips: int = 0
    rebuild_read_bytes: int = 0
    rebuild_read_s: float = 0.0

    def to_dict(self) -> dict[str, float | int | bool]:
        return asdict(self)


class PlanCache:
    def __init__(self, config: CacheConfig, source: RebuildSource, generation: int = 0) -> None:
        self.config = config
        self.generation = generation
        devices = config.slab_devices
        if len(devices) != len(source.devices):
            raise PlanCacheError(f"the slab has {len(devices)} device(s) {devices}, its rebuild source builds for "
                                 f"{len(source.devices)}: build the source on the same --devices")  # fmt: skip
        self.device = torch.device(config.primary_device)
        self.memory = SlabMemory(
            config.gpu_plans, config.plan_width, source.page_numel, source.dtype, devices, config.shm_dir
        )
        self.slab = self.memory.slab  # (S, W, P): the first device's; `memory.slabs` holds every device's
        self.table = self.memory.table  # (S, ROW_WORDS + W) int64
        self._rows = self.table.numpy()  # the same shared memory: `_mark`'s word stores without torch dispatch
        self.copier = Copier(self.device)
        self._pages = SlabPages(
            self.slab, self.copier, tuple(self.memory.slabs), tuple(Copier(s.device) for s in self.memory.slabs)
        )
        self._host = HostMemoryTier.allocate(config, source.page_numel, source.dtype, self.device)
        self._rebuild = RebuildTier(source)
        self.disk = DiskTier.open(config, self._rebuild) if config.plan_dir is not None else None
        """The disk tier (`--plan-dir`), or None."""
        # Asked in order for a group's missing plans; the last one holds every plan.
        self.tiers: list[Tier] = [self._host, *([self.disk] if self.disk is not None else []), self._rebuild]
        n = config.gpu_plans
        self._slot_key: list[PlanKey | None] = [None] * n
        self._key_slot: dict[PlanKey, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # READY slots, least recent first
        self._pins = [0] * n
        self._free = list(range(n))[::-1]  # pop() gives the lowest slot
        self._leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)
        self._state = threading.RLock()
        self._prepare_lock = threading.Lock()
        self.counters = CacheCounters()

    @property
    def source(self) -> RebuildSource:
        """The checkpoint rebuilds read (changed by `retarget`)."""
        return self._rebuild.source

    @property
    def host(self) -> HostTier:
        """The host tier's bookkeeping (groups, plans, page buffer)."""
        return self._host.host

    @property
    def host_pinned(self) -> bool:
        return self._host.pinned

    # ================================================================ protocol
    def prepare(self, generation: int, keys: Sequence[PlanKey], owner: str) -> Lease:
        """Make every plan of one request resident and lease its slots (see module doc)."""
        with self._prepare_lock:
            with self._state:
                self._validate(generation, keys)
                group = distinct_keys(keys)
                hits, missing, new_slots = self._reserve(group)
                parts = self._split_by_tier(missing, new_slots)
            try:
                report = self._fill(parts, len(hits))
            except BaseException as e:
                self._unreserve(hits, new_slots)
                if isinstance(e, PlanCacheError) or not isinstance(e, Exception):
                    raise
                raise RebuildError(f"prepare failed: {e}") from e
            with self._state:
                for k, s in zip(missing, new_slots, strict=True):
                    self._publish(s, k)
                stores = self._book_stores(group)
            try:
                for st in stores:
                    st.copy()  # outside `_state`: releases and stats go on meanwhile
            except BaseException as e:
                with self._state:
                    for st in stores:
                        st.undo()
                    self._unpin(group)
                    self.counters.failed_prepares += 1
                if not isinstance(e, Exception):
                    raise
                raise RebuildError(f"prepare failed: storing the group in a tier: {e}") from e
            with self._state:
                for st in stores:
                    report = report.plus(st.report)
                report = report.replace(host_stored=any(st.kept for st in stores))
                lease = Lease(
                    next(self._ids), owner, generation, tuple(keys), tuple(self._key_slot[k] for k in keys), report
                )
                self._leases[lease.lease_id] = lease
                self.counters.prepares += 1
                self.counters.slot_hit_plans += len(hits)
                return lease

    def check_request(self, keys: Sequence[PlanKey]) -> None:
        """Raise the error `prepare` would raise for these keys' shape alone (no state change)."""
        with self._state:
            self._validate(self.generation, keys)

    def release(self, lease_id: int) -> Lease:
        with self._state:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                raise UnknownLeaseError(f"no live lease {lease_id}")
            for s in set(lease.slots):
                self._pins[s] -= 1
            return lease

    def release_owner(self, owner: str) -> int:
        """Release every lease of `owner` (its session ended); returns how many."""
        with self._state:
            ids = [i for i, lease in self._leases.items() if lease.owner == owner]
            for i in ids:
                self.release(i)
            return len(ids)

    def invalidate(self) -> None:
        """Drop every plan from the slab and every tier. Refused while leases are live."""
        with self._prepare_lock, self._state:
            self._invalidate_locked()

    def _invalidate_locked(self) -> None:
        if self._leases:
            raise CacheBusyError(f"cannot invalidate: {len(self._leases)} lease(s) still held")
        self.table.zero_()
        self._slot_key = [None] * self.config.gpu_plans
        self._key_slot.clear()
        self._lru.clear()
        self._free = list(range(self.config.gpu_plans))[::-1]
        for tier in self.tiers:
            tier.clear()

    def retarget(self, source: RebuildSource, generation: int, before: Callable[[], None] | None = None) -> set[str]:
        """Point rebuilds at a new checkpoint under a new generation: the plans of every partition whose files
        changed are dropped from the slab and the host tier; those of a partition whose files are the same
        (`RebuildSource.unchanged_partitions`) stay, their slots restamped with the new generation. Returns the
        partitions kept.

        Refused while leases are live. `before()` runs after that check, under the cache's
        locks, before anything changes (the sidecar persists the new generation there);
        if it raises, nothing changes.
        """
        mismatch = self.source.geometry_mismatch(source)
        if mismatch is not None:
            raise PlanCacheError(f"retarget: the new checkpoint does not fit the slab ({mismatch})")
        with self._prepare_lock, self._state:
            if self._leases:
                raise CacheBusyError(f"cannot retarget: {len(self._leases)} lease(s) still held")
            kept = self.source.unchanged_partitions(source) & set(source.partitions)
            if before is not None:
                before()
            self.generation = generation
            for s, key in enumerate(self._slot_key):
                if key is None:
                    continue
                if key.partition in kept:
                    self._mark(s, READY, key)  # the same pages, under the new generation
                else:
                    del self._key_slot[key]
                    del self._lru[s]
                    self._slot_key[s] = None
                    self._mark(s, EMPTY, None)
                    self._free.append(s)
            self._free.sort(reverse=True)  # pop() gives the lowest slot
            dropped = set(self.source.partitions) - kept
            for tier in self.tiers:
                tier.clear(dropped)
            self._rebuild.source = source
            return kept

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()  # packs handed to the writer are written first
        self.memory.close()
        self.host.buffer.close()

    # ================================================================ queries
    def leases(self) -> list[Lease]:
        with self._state:
            return list(self._leases.values())

    def resident_keys(self) -> list[PlanKey]:
        """READY plans, least recently used first."""
        with self._state:
            return [k for s in self._lru if (k := self._slot_key[s]) is not None]

    def partition_states(self) -> tuple[PartitionState, ...]:
        """Every served partition: its folder, fingerprint and slots (READY, allowed)."""
        with self._state:
            source = self.source
            fingerprints = source.partition_fingerprints()
            return tuple(
                PartitionState(
                    name,
                    source.info.partitions[name].folder,
                    fingerprints[name],
                    sum(1 for k in self._slot_key if k is not None and k.partition == name),
                    len(self.config.partition_slots(name)),
                )
                for name in source.partitions
            )

    def slot_of(self, key: PlanKey) -> int | None:
        with self._state:
            return self._key_slot.get(key)

    def stats(self) -> CacheStats:
        with self._state:
            c, host = self.counters, self.host
            d = self.disk.stats() if self.disk is not None else PackStoreStats()
            return CacheStats(
                generation=self.generation,
                num_slots=self.config.gpu_plans,
                slot_width=self.config.plan_width,
                page_bytes=self.source.page_bytes,
                slots_ready=len(self._lru),
                slots_leased=sum(1 for p in self._pins if p > 0),
                leases_held=len(self._leases),
                host_capacity_bytes=host.capacity_pages * host.page_bytes,
                host_used_bytes=host.used_pages * host.page_bytes,
                host_groups=len(host.groups()),
                host_pinned=self.host_pinned,
                slot_hit_plans=c.slot_hit_plans,
                host_hit_plans=c.host_hit_plans,
                built_plans=c.built_plans,
                rebuild_passes=c.rebuild_passes,
                rebuild_s=round(c.rebuild_s, 6),
                swap_in_bytes=c.swap_in_bytes,
                swap_in_s=round(c.swap_in_s, 6),
                slot_evictions=c.slot_evictions,
                host_group_evictions=host.group_evictions,
                host_pressure_skips=host.pressure_skips,
                prepares=c.prepares,
                failed_prepares=c.failed_prepares,
                disk_hit_plans=c.disk_hit_plans,
                disk_read_bytes=c.disk_read_bytes,
                disk_read_s=round(c.disk_read_s, 6),
                disk_capacity_bytes=d.capacity_bytes,
                disk_used_bytes=d.used_bytes,
                disk_packs=d.packs,
                disk_read_only=d.read_only,
                disk_stored_plans=d.stored_plans,
                disk_written_bytes=d.written_bytes,
                disk_evictions=d.evictions,
                disk_corrupt_packs=d.corrupt_packs,
                disk_write_errors=d.write_errors,
                disk_write_skips=self.disk.write_skips if self.disk is not None else 0,
                rebuild_read_bytes=c.rebuild_read_bytes,
                rebuild_read_s=round(c.rebuild_read_s, 6),
            )

    # ================================================================ internals
    def _validate(self, generation: int, keys: Sequence[PlanKey]) -> None:
        if generation != self.generation:
            raise GenerationMismatchError(self.generation, generation, field="generation")
        if not keys:
            raise InvalidPlanRequestError("plan_keys", "must hold at least one plan key (one per step)")
        if len(keys) > MAX_KEYS:
            raise InvalidPlanRequestError("plan_keys", f"holds {len(keys)} keys; allowed at most {MAX_KEYS}")
        served = self.source.partitions
        for i, k in enumerate(keys):
            if k.partition not in served:
                raise PartitionUnavailableError(
                    f"plan_keys[{i}] is of the '{k.partition}' partition; the served repository "
                    f"{self.source.path} has {list(served)} (ref2va's plans need its transformer_ref/)"
                )
            if k.partition != keys[0].partition:
                raise InvalidPlanRequestError(
                    f"plan_keys[{i}]", f"is of the '{k.partition}' partition, plan_keys[0] of '{keys[0].partition}': "
                    "one request runs one partition's transformer"
                )  # fmt: skip
            if k.width < 1 or len(set(k.bits)) != k.width:
                raise InvalidPlanRequestError(f"plan_keys[{i}]", "must hold 1+ distinct timesteps")
            if not k.is_finite():
                raise InvalidPlanRequestError(f"plan_keys[{i}]", f"has a non-finite timestep {k}")
            if k.width > self.config.plan_width:
                raise PlanCapacityError(
                    f"plan_keys[{i}] has {k.width} distinct timesteps but a slot holds at most "
                    f"{self.config.plan_width} (--plan-width)"
                )
        n = len(distinct_keys(keys))
        room = len(self.config.partition_slots(keys[0].partition))
        if n > room:
            where = "" if room == self.config.gpu_plans else f" of the '{keys[0].partition}' partition (--ref-plans)"
            raise PlanCapacityError(
                f"the request needs {n} distinct plans but the slab holds at most {room}{where} (--gpu-plans)"
            )

    def _reserve(self, group: list[PlanKey]) -> tuple[list[PlanKey], list[PlanKey], list[int]]:
        """Pin hits and take slots for misses (marked FILLING). Raises before any change."""
        hits = [k for k in group if k in self._key_slot]
        missing = [k for k in group if k not in self._key_slot]
        hit_slots = {self._key_slot[k] for k in hits}
        allowed = self.config.partition_slots(group[0].partition) if group else range(0)
        free = [s for s in self._free if s in allowed]  # the stack's order: the lowest slot last
        evictable = [s for s in self._lru if self._pins[s] == 0 and s not in hit_slots and s in allowed]
        if len(free) + len(evictable) < len(missing):
            held = sum(1 for s in allowed if self._pins[s] > 0)
            raise SlabBusyError(
                f"the request needs {len(missing)} new slots but only {len(free) + len(evictable)} of "
                f"{len(allowed)} are free of live leases ({held} leased); retry after a release"
            )
        for s in hit_slots:
            self._lru.move_to_end(s)
            self._pins[s] += 1
        new_slots = []
        for k in missing:
            if free:
                s = free.pop()
                self._free.remove(s)
            else:
                s = evictable.pop(0)
                self._evict(s)
            self._pins[s] += 1
            self._mark(s, FILLING, k)
            new_slots.append(s)
        return hits, missing, new_slots

    def _unreserve(self, hits: list[PlanKey], new_slots: list[int]) -> None:
        with self._state:
            for k in hits:
                self._pins[self._key_slot[k]] -= 1
            for s in new_slots:
                self._pins[s] -= 1
                self._mark(s, EMPTY, None)
                self._free.append(s)
            self.counters.failed_prepares += 1

    def _evict(self, s: int) -> None:
        key = self._slot_key[s]
        assert key is not None and self._pins[s] == 0, "only unleased READY slots are evicted"
        del self._key_slot[key]
        del self._lru[s]
        self._slot_key[s] = None
        self._mark(s, EMPTY, None)
        self.counters.slot_evictions += 1

    def _split_by_tier(self, missing: list[PlanKey], slots: list[int]) -> list[tuple[Tier, list[PlanKey], list[int]]]:
        """Each missing plan (and its FILLING slot) with the first tier that holds it, per tier in tier order: the
        host tier swaps in every plan it holds, whichever group stored it; the rebuild builds the rest in one pass."""
        parts: dict[int, tuple[list[PlanKey], list[int]]] = {}
        for k, s in zip(missing, slots, strict=True):
            i = next((i for i, t in enumerate(self.tiers) if t.holds_all([k])), None)
            assert i is not None, "the last tier (the rebuild) holds every plan"
            keys, where = parts.setdefault(i, ([], []))
            keys.append(k)
            where.append(s)
        return [(self.tiers[i], *parts[i]) for i in sorted(parts)]

    def _fill(self, parts: list[tuple[Tier, list[PlanKey], list[int]]], n_hits: int) -> CacheReport:
        """Have each tier write its missing plans' pages into their FILLING slots (each fill fenced); the fills'
        bookkeeping and counters are committed only once every one of them succeeded."""
        fills = [tier.fill(keys, slots, self._pages) for tier, keys, slots in parts]
        report = CacheReport(gpu_hit_plans=n_hits)
        with self._state:
            for filled in fills:
                filled.commit()
                self.counters.add(filled.counts)
                report = report.plus(filled.report)
        return report

    def _publish(self, s: int, key: PlanKey) -> None:
        self._slot_key[s] = key
        self._key_slot[key] = s
        self._lru[s] = None
        self._lru.move_to_end(s)
        self._mark(s, READY, key)

    def _mark(self, s: int, state: int, key: PlanKey | None) -> None:
        """Write one slot-table row; READY is written last, after the key and generation."""
        row = self._rows[s]  # numpy word stores, in program order (the generator's reader relies on the order)
        row[COL_STATE] = FILLING if state == READY else state
        if key is not None:
            row[ROW_WORDS : ROW_WORDS + key.width] = key.bits
            row[ROW_WORDS + key.width :] = 0
            row[COL_LENGTH] = key.width
            row[COL_PARTITION] = key.partition_code
            row[COL_ADAPTERS] = key.adapters_code
        else:
            row[ROW_WORDS:] = 0
            row[COL_LENGTH] = 0
            row[COL_PARTITION] = 0
            row[COL_ADAPTERS] = 0
        row[COL_GENERATION] = self.generation
        row[COL_SEQ] += 1
        row[COL_STATE] = state

    def _book_stores(self, group: list[PlanKey]) -> list[TierStore]:
        """Offer the published group to every tier (under `_state`); their copies run after it is dropped."""
        slots = [self._key_slot[k] for k in group]
        return [tier.store(group, slots, self._pages) for tier in self.tiers]

    def _unpin(self, group: list[PlanKey]) -> None:
        """Drop the pins `_reserve` took on a published group's slots (a prepare failed after publishing)."""
        for s in {self._key_slot[k] for k in group}:
            self._pins[s] -= 1
