"""Shared helpers for the plan-cache tests: schedules, cache construction, expected-state checks, and the oracle.

Imported by tests/plancache/test_plancache_*.py (their conftest puts this directory on sys.path). Kept apart from
conftest.py on purpose: these are plain functions and classes; fixtures live in conftest.py.

Schedules are real MiniMax-H3 t2va schedules: a `Sched` is a request's step count and shifts, and its plan keys are
what `H3Model.plan_keys` gives (ditcore.schedule.ScheduleKeys over the tiny repository's own schedulers). Each step's
key is the float32 bits of its distinct timesteps: width 1 at the first step (t = 0 for video and audio) and
wherever the two shifts agree, width 2 elsewhere. The oracle (`DiffusersPages`) is diffusers' own transformer.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ditcore.checkpoint import validate_checkpoint
from ditcore.plans import PageLayout, PlanKey, distinct_keys
from ditcore.presets import get_preset
from ditcore.request import GenerationRequest
from ditcore.schedule import ScheduleKeys
from ditruntime.slab import COL_GENERATION, COL_LENGTH, COL_STATE, EMPTY, READY, ROW_WORDS
from plancache_service.app import build_server
from plancache_service.cache import Lease, PlanCache
from plancache_service.config import CacheConfig, SidecarConfig
from plancache_service.rebuild import RebuildSource
from plancache_service.server import SidecarServer

_TINY = get_preset("tiny")
TINY_LAYOUT = PageLayout(_TINY.num_layers, _TINY.hidden_size, _TINY.time_embed_dim)
PAGE_BYTES = TINY_LAYOUT.page_bytes(torch.bfloat16)
"""Bytes of one page of the tiny preset in the released mixed precision (`tiny_ckpt`): bfloat16 projections."""
CPU = torch.device("cpu")


# ---------------------------------------------------------------------------- schedules
_SCHEDULERS: list[ScheduleKeys] = []


def use_schedulers(repo: Path) -> None:
    """Take plan keys from `repo`'s schedulers (conftest.py does this once per session, with `tiny_ckpt`)."""
    _SCHEDULERS[:] = [ScheduleKeys(repo)]


@dataclass(frozen=True)
class Sched:
    """A t2va request's schedule: `forwards` transformer steps (num_inference_steps - 1) and the two shifts."""

    forwards: int
    shift: float
    audio_shift: float

    def request(self, **fields: Any) -> GenerationRequest:
        return GenerationRequest(
            num_inference_steps=self.forwards + 1, flow_shift=self.shift, audio_flow_shift=self.audio_shift, **fields
        )

    def plan_keys(self) -> list[PlanKey]:
        assert _SCHEDULERS, "use_schedulers(repo) first (the plancache conftest does)"
        return _SCHEDULERS[0].keys(self.request())


def sched(forwards: int, shift: float, audio_shift: float | None = None) -> Sched:
    """A schedule; `audio_shift` defaults to `shift`, which makes every plan width 1."""
    return Sched(forwards, shift, shift if audio_shift is None else audio_shift)


# The headline pair: two 20-step t2va schedules with different video shifts (same audio shift). Each has 20 distinct
# plans: the first (t = 0, width 1) is shared, the other 19 are width 2.
T2VA_A = sched(20, 5.0, 3.0)
T2VA_B = sched(20, 7.0, 3.0)

# Three 4-step schedules with equal shifts: 4 width-1 plans each; all three share the first plan (t = 0).
X, Y, Z = sched(4, 2.0), sched(4, 4.0), sched(4, 8.0)


def keys_of(spec: Sched) -> list[PlanKey]:
    return spec.plan_keys()


def group_of(spec_or_keys: Sched | Sequence[PlanKey]) -> tuple[PlanKey, ...]:
    keys = spec_or_keys.plan_keys() if isinstance(spec_or_keys, Sched) else spec_or_keys
    return tuple(distinct_keys(keys))


def pages_needed(keys: Iterable[PlanKey]) -> int:
    return sum(k.width for k in set(keys))


# ---------------------------------------------------------------------------- caches
def make_cache(
    ckpt: Path | str | RebuildSource,
    *,
    gpu_plans: int,
    plan_width: int = 2,
    host_pages: int = 0,
    shm_dir: Path | str,
    generation: int = 0,
) -> PlanCache:
    """A CPU PlanCache over a repository (or source); the host tier holds `host_pages` pages."""
    source = ckpt if isinstance(ckpt, RebuildSource) else RebuildSource(ckpt, CPU)
    config = CacheConfig(
        gpu_plans=gpu_plans,
        plan_width=plan_width,
        host_cache_bytes=host_pages * source.page_bytes,
        host_reserve_bytes=0,
        shm_dir=str(shm_dir),
    )
    return PlanCache(config, source, generation=generation)


MakeCache = Callable[..., PlanCache]


@contextlib.contextmanager
def cache_factory(source: RebuildSource, shm_dir: Path) -> Iterator[MakeCache]:
    """make(gpu_plans=..., plan_width=2, host_pages=0, generation=0, source=...) -> a cache;
    every cache made is closed on exit (the `make` fixture)."""
    caches: list[PlanCache] = []

    def make(*, source: RebuildSource = source, **sizes: int) -> PlanCache:
        cache = make_cache(source, shm_dir=shm_dir, **sizes)
        caches.append(cache)
        return cache

    try:
        yield make
    finally:
        for c in caches:
            c.close()


@contextlib.contextmanager
def running_sidecar(repo: Path, prefix: str, host_pages: int, **cache: Any) -> Iterator[SidecarServer]:
    """A started sidecar on `repo` in a fresh short /tmp run dir (unix socket paths are capped), its host tier
    `host_pages` pages (no reserve), its slab in that dir; `cache` sets the other CacheConfig fields."""
    run_dir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    info = validate_checkpoint(repo)
    config = SidecarConfig(
        checkpoint=repo,
        cache=CacheConfig(
            host_cache_bytes=host_pages * info.layout.page_bytes(info.projection_dtype),
            host_reserve_bytes=0,
            shm_dir=str(run_dir),
            **cache,
        ),
        address=f"unix:{run_dir}/plancache.sock",
        heartbeat_s=0.2,
    )
    server = build_server(config)
    server.start()
    try:
        yield server
    finally:
        server.stop(grace_s=1.0)
        shutil.rmtree(run_dir, ignore_errors=True)


def prepare(cache: PlanCache, spec_or_keys: Sched | Sequence[PlanKey], owner: str = "test") -> Lease:
    keys = spec_or_keys.plan_keys() if isinstance(spec_or_keys, Sched) else list(spec_or_keys)
    return cache.prepare(cache.generation, keys, owner)


def run(cache: PlanCache, spec_or_keys: Sched | Sequence[PlanKey], owner: str = "test") -> Lease:
    """prepare + release; returns the lease (its report is what the request saw)."""
    lease = prepare(cache, spec_or_keys, owner)
    cache.release(lease.lease_id)
    return lease


# ---------------------------------------------------------------------------- expected state
def expect(
    cache: PlanCache,
    *,
    resident: int | set[PlanKey] | list[PlanKey] | None = None,
    host_groups: int | list[tuple[PlanKey, ...]] | None = None,
    leases: int | set[int] | None = None,
    **stats: Any,
) -> None:
    """Compare the cache with an expected state; every given field must match exactly.

    resident: a count, a set of keys (any order) or a list (exact LRU order, oldest first).
    host_groups: a count or the exact list of groups (LRU order, oldest first).
    leases: a count or the set of live lease ids.
    **stats: CacheStats fields (built_plans=..., host_hit_plans=..., slot_evictions=...).
    """
    got = cache.stats()
    rk = cache.resident_keys()
    if resident is not None:
        if isinstance(resident, int):
            assert len(rk) == resident, f"resident count {len(rk)} != {resident}"
        elif isinstance(resident, set):
            assert set(rk) == resident, (
                f"resident keys differ: missing {len(resident - set(rk))}, extra {len(set(rk) - resident)}"
            )
            assert len(rk) == len(resident)
        else:
            assert rk == list(resident), "resident keys / LRU order differ"
    if host_groups is not None:
        groups = cache.host.groups()
        if isinstance(host_groups, int):
            assert len(groups) == host_groups, f"host groups {len(groups)} != {host_groups}"
        else:
            assert groups == list(host_groups), "host groups / order differ"
    if leases is not None:
        live = cache.leases()
        if isinstance(leases, int):
            assert len(live) == leases, f"live leases {len(live)} != {leases}"
        else:
            assert {lease.lease_id for lease in live} == leases
    d = got.to_dict()
    for name, want in stats.items():
        assert name in d, f"unknown stat {name}"
        assert d[name] == want, f"stat {name} = {d[name]!r}, expected {want!r}"
    check_invariants(cache)


def check_invariants(cache: PlanCache) -> None:
    """Structural invariants that must hold between any two operations."""
    st = cache.stats()
    rk = cache.resident_keys()
    assert len(rk) == len(set(rk)) == st.slots_ready
    slots = {}
    for k in rk:
        s = cache.slot_of(k)
        assert s is not None
        slots[s] = k
    assert len(slots) == len(rk), "two resident keys share a slot"
    # slot table rows: READY rows are exactly the resident slots, with their keys; others EMPTY
    table = cache.table
    for s in range(cache.config.gpu_plans):
        row = table[s]
        if s in slots:
            k = slots[s]
            assert int(row[COL_STATE]) == READY
            assert int(row[COL_GENERATION]) == cache.generation
            assert int(row[COL_LENGTH]) == k.width
            assert tuple(int(x) for x in row[ROW_WORDS : ROW_WORDS + k.width]) == k.bits
            assert not row[ROW_WORDS + k.width :].any()
        else:
            assert int(row[COL_STATE]) == EMPTY, f"slot {s} is not resident but its row is not EMPTY"
    # leases point at READY slots holding their keys
    leased: set[int] = set()
    for lease in cache.leases():
        assert lease.generation == cache.generation
        for k, s in zip(lease.keys, lease.slots, strict=True):
            assert slots.get(s) == k, "a lease's slot does not hold its key"
            leased.add(s)
    assert st.slots_leased == len(leased)
    assert st.leases_held == len(cache.leases())
    # host tier bookkeeping
    host = cache.host
    assert st.host_used_bytes <= st.host_capacity_bytes
    assert host.used_pages == sum(k.width for k in host.plan_keys())
    held_by_groups: set[PlanKey] = set()
    for g in host.groups():
        assert host.holds_all(g)
        held_by_groups.update(g)
    assert held_by_groups == host.plan_keys(), "a host plan is held by no group (leak) or vice versa"
    assert st.host_groups == len(host.groups())


def snapshot(cache: PlanCache) -> dict[str, Any]:
    """Everything a rejected request must leave untouched."""
    return {
        "stats": cache.stats(),
        "resident": cache.resident_keys(),
        "table": cache.table.clone(),
        "slab": cache.slab.clone(),
        "leases": [(lease.lease_id, lease.slots) for lease in cache.leases()],
        "host_groups": cache.host.groups(),
        "host_plans": cache.host.plan_keys(),
        "host_buffer": cache.host.buffer.gather(),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal is False for NaN == NaN, and host pages start uninitialized)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_unchanged(cache: PlanCache, before: dict[str, Any]) -> None:
    after = snapshot(cache)
    assert after["stats"] == before["stats"]
    assert after["resident"] == before["resident"]
    assert torch.equal(after["table"], before["table"])
    assert same_bits(after["slab"], before["slab"])
    assert after["leases"] == before["leases"]
    assert after["host_groups"] == before["host_groups"]
    assert after["host_plans"] == before["host_plans"]
    assert same_bits(after["host_buffer"], before["host_buffer"])


# ---------------------------------------------------------------------------- the oracle
class DiffusersPages:
    """A plan's pages as diffusers itself computes them: the reference every cached page is compared with.

    Loads the repository's transformer with diffusers' own `MiniMaxH3Transformer3DModel.from_pretrained` (at the
    repository's precision: bfloat16 with `_keep_in_fp32_modules` in float32 for mixed, float32 otherwise) and runs
    its forward with `timestep` = the key's timesteps on a three-row packed sequence (one video, one text, one audio
    row), hooking the outputs of every block's `adaln_proj.linear` and of `norm_out.linear`. A page row is those
    outputs' row for one timestep, concatenated in block order: exactly the rows the forward's modulation reads.
    Nothing of ditcore.plans / ditcore.rebuild is involved.
    """

    def __init__(self, repo: Path | str) -> None:
        from diffusers import MiniMaxH3Transformer3DModel

        info = validate_checkpoint(repo)
        self.dtype = info.projection_dtype
        self.model = MiniMaxH3Transformer3DModel.from_pretrained(
            Path(repo) / "transformer", torch_dtype=info.projection_dtype
        ).eval()
        self.modules = [b.adaln_proj.linear for b in self.model.transformer_blocks] + [self.model.norm_out.linear]
        self.forwards = 0
        self._pages: dict[PlanKey, torch.Tensor] = {}

    def _inputs(self, timestep: torch.Tensor) -> dict[str, torch.Tensor]:
        cfg = self.model.config
        width = timestep.numel()
        patch = cfg.in_channels * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]
        g = torch.Generator().manual_seed(0)
        return {
            "hidden_states": torch.randn(1, 1, patch, generator=g),
            "audio_hidden_states": torch.randn(1, 1, cfg.audio_in_channels, generator=g),
            "encoder_hidden_states": torch.randn(1, 1, cfg.text_dim, generator=g),
            "timestep": timestep,
            # rows: text, video, audio; the audio row reads the last timestep, the others the first
            "timestep_indices": torch.tensor([0, 0, width - 1]),
            "token_tags": torch.tensor([1, 0, 2]),
            "position_ids": torch.zeros(3, 3, dtype=torch.long),
            "video_indices": torch.tensor([1]),
            "audio_indices": torch.tensor([2]),
            "text_indices": torch.tensor([0]),
        }

    @torch.no_grad()
    def pages(self, key: PlanKey) -> torch.Tensor:
        """(width, page_numel) in the projection dtype: diffusers' adaln_proj / norm_out.linear output rows."""
        if key not in self._pages:
            captured: dict[int, torch.Tensor] = {}
            hooks = [
                m.register_forward_hook(lambda _m, _a, out, i=i: captured.__setitem__(i, out.detach().clone()))
                for i, m in enumerate(self.modules)
            ]
            try:
                self.model(**self._inputs(key.timesteps()))
            finally:
                for h in hooks:
                    h.remove()
            self.forwards += 1
            assert sorted(captured) == list(range(len(self.modules))), "a projection did not run"
            self._pages[key] = torch.cat([captured[i] for i in range(len(self.modules))], dim=1)
        return self._pages[key]


def assert_slots_match_reference(cache: PlanCache, ref: DiffusersPages, keys: Iterable[PlanKey] | None = None) -> None:
    """Every (given or resident) plan's slot pages equal diffusers' rows (torch.equal: bit for bit)."""
    for k in cache.resident_keys() if keys is None else keys:
        s = cache.slot_of(k)
        assert s is not None, f"{k} is not resident"
        assert torch.equal(cache.slab[s, : k.width], ref.pages(k)), f"slot {s} of {k} differs from diffusers"


def assert_host_matches_reference(cache: PlanCache, ref: DiffusersPages) -> None:
    """Every plan the host tier holds equals diffusers' rows."""
    for k in cache.host.plan_keys():
        assert torch.equal(torch.stack(cache.host.page_rows(k)), ref.pages(k)), f"host pages of {k} differ"
