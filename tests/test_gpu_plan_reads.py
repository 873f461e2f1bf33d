"""The cached denoise step's plan reading on a real GPU (marked `gpu`: skipped without CUDA; the CPU counterpart is
tests/core/test_core_plan_reads.py):

- host syncs per denoise step, counted: `torch.cuda.set_sync_debug_mode("warn")` around every whole loop step
  (diffusers' transformer forward and both scheduler steps; its warnings are counted), for a cached and a resident
  generate; the cache adds none (the cached step syncs exactly as often as the resident one), and inside every
  plan-reading function (the forward pre-hook's StepPlans.before_forward, SlotReads.read, every PlanLinear.forward)
  the mode is "error": a sync there fails the test. The cached result still equals the resident one bit for bit. The
  counts are printed and recorded as the test's `syncs_per_step` property (scripts/gpu_check.py prints them);
- one step's plan reading (the gather and every PlanLinear) is captured in a CUDA graph and replayed: it reads the
  slab live (a changed slab gives changed pages on replay), at fixed addresses;
- the lease is released only once the stream is idle (the event after the last reading kernel has completed).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3DenoiseLoopWrapper

from ditcore import CacheReport, GenerationRequest, PlanBuilder, PlanKey, generate, load_model, write_repository
from ditcore.denoise import StepPlans
from ditcore.plans import PlanLinear, SlotReads

pytestmark = pytest.mark.gpu

REQUEST = GenerationRequest(request_id="g1", prompt="rain on a tin roof", num_inference_steps=5, seed=7,
                            height=32, width=64, num_frames=141, flow_shift=9.0, audio_flow_shift=2.5)  # fmt: skip


class CudaSlabLease:
    def __init__(self, slab: torch.Tensor, slots: list[int]) -> None:
        self.slab, self.slots = slab, slots
        self.idle_at_release: list[bool] = []

    @property
    def report(self) -> CacheReport:
        return CacheReport(built_plans=len(set(self.slots)))

    def pages(self, step: int) -> torch.Tensor:
        raise AssertionError("read through SlotReads")

    def slab_slots(self) -> tuple[torch.Tensor, Sequence[int]]:
        return self.slab, self.slots

    def release(self) -> None:
        self.idle_at_release.append(torch.cuda.current_stream().query())


class CudaSlabProvider:
    def __init__(self, repo: Path) -> None:
        self.builder = PlanBuilder(repo / "transformer", "cuda")
        self.leases: list[CudaSlabLease] = []

    def acquire(self, keys: Sequence[PlanKey]) -> CudaSlabLease:
        distinct = list(dict.fromkeys(keys))[::-1]
        slab = torch.zeros(len(distinct) + 2, 2, self.builder.layout.page_numel, dtype=self.builder.projection_dtype,
                           device="cuda")  # fmt: skip
        slot_of = {k: 2 + i for i, k in enumerate(distinct)}
        self.builder.build(distinct, [slab[slot_of[k], : k.width] for k in distinct])
        torch.cuda.synchronize()
        self.leases.append(CudaSlabLease(slab, [slot_of[k] for k in keys]))
        return self.leases[-1]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repository(tmp_path_factory.mktemp("gpu_reads") / "mixed", "tiny", seed=11, dtype="mixed")


SYNC_WARNING = "called a synchronizing CUDA operation"  # what torch warns in sync debug mode "warn"


def _no_sync(fn: Callable[..., Any], calls: list[str], name: str) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(before)

    return wrapped


@contextmanager
def syncs_per_step(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Host syncs of each denoise loop step: the whole step (diffusers' `loop_step`: the transformer forward, then
    the video and audio scheduler steps) runs in sync debug mode "warn" and its sync warnings are counted."""
    counts: list[int] = []
    loop_step = MiniMaxH3DenoiseLoopWrapper.loop_step

    def counted(self: Any, components: Any, state: Any, **kwargs: Any) -> Any:
        before = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return loop_step(self, components, state, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(before)
                counts.append(sum(SYNC_WARNING in str(w.message) for w in caught))

    with monkeypatch.context() as m:
        m.setattr(MiniMaxH3DenoiseLoopWrapper, "loop_step", counted)
        yield counts


def test_the_cache_adds_no_sync_to_a_denoise_step(
    repo: Path, monkeypatch: pytest.MonkeyPatch, record_property: Callable[[str, object], None]
) -> None:
    resident_model = load_model(repo, "resident", "cuda")
    cached = load_model(repo, "cached", "cuda")
    steps = len(cached.plan_keys(REQUEST))
    generate(resident_model, REQUEST)  # warm-up: first-call work (kernel loading, allocator growth) is not a step's
    with syncs_per_step(monkeypatch) as resident_syncs:
        resident = generate(resident_model, REQUEST)
    provider = CudaSlabProvider(repo)
    calls: list[str] = []
    monkeypatch.setattr(StepPlans, "before_forward", _no_sync(StepPlans.before_forward, calls, "step"))
    monkeypatch.setattr(SlotReads, "read", _no_sync(SlotReads.read, calls, "gather"))
    monkeypatch.setattr(PlanLinear, "forward", _no_sync(PlanLinear.forward, calls, "linear"))
    generate(cached, REQUEST, provider)  # warm-up, as above
    calls.clear()
    with syncs_per_step(monkeypatch) as cached_syncs:
        out = generate(cached, REQUEST, provider)
    record = {"steps": steps, "cached": cached_syncs, "resident": resident_syncs, "plan_reads": 0}
    record_property("syncs_per_step", json.dumps(record))
    print(f"host syncs per denoise step (forward + scheduler steps): {json.dumps(record)}")
    assert len(cached_syncs) == len(resident_syncs) == steps, "the counter did not see every loop step"
    # every plan-reading function ran in "error" mode (a sync there raises), once per step / per PlanLinear
    assert calls.count("step") == calls.count("gather") == steps
    assert calls.count("linear") == steps * (cached.info.layout.num_layers + 1)
    assert cached_syncs == resident_syncs, "the cached step syncs more often than the resident one"
    assert torch.equal(out.video, resident.video) and torch.equal(out.audio, resident.audio)
    assert provider.leases[-1].idle_at_release == [True], "released before the reading kernels finished"


def test_one_steps_plan_reading_is_captured_in_a_cuda_graph(repo: Path) -> None:
    cached = load_model(repo, "cached", "cuda")
    keys = cached.plan_keys(REQUEST)
    lease = CudaSlabProvider(repo).acquire(keys)
    reads = SlotReads(lease.slab, lease.slots, [k.width for k in keys])
    holder = cached.holder
    linears = [m for m in cached.transformer.modules() if isinstance(m, PlanLinear)]
    step = 1
    x = torch.zeros(keys[step].width, cached.info.layout.time_embed_dim, device="cuda")

    def read_step() -> list[torch.Tensor]:
        holder.set(reads.read(step))
        return [m(x) for m in linears]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, as torch.cuda.graphs recommends
        read_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = read_step()
    slot, width = lease.slots[step], keys[step].width

    def expected() -> list[torch.Tensor]:
        rows = lease.slab[slot, :width]
        return [rows[:, m.offset : m.offset + m.numel] for m in linears]

    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, expected(), strict=True))
    lease.slab[slot, :width] += 1  # the graph reads the slab live, not a copy taken at capture
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, expected(), strict=True))
    holder.clear()
