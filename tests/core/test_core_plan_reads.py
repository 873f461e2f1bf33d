"""The plan-reading path of a cached denoise step, checked by instrumentation on CPU (tests/test_gpu_plan_reads.py
counts real syncs and captures a CUDA graph where a GPU is lent):

- a lease on a slab is read through ditcore.plans.SlotReads: the slot indices go to the device once per request and
  every step is exactly one indexed read (`index_select`) of the slab;
- nothing in the plan-reading modules (the forward pre-hook's StepPlans.before_forward, SlotReads.read,
  PlanLinear.forward) reads a tensor value on the host: `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool()`,
  `int()`, `float()`, `.to()` raise there, and no `aten._local_scalar_dense` (the op behind every host read) runs;
- the forward's timesteps are checked against the plan without a host read per step: shape per step (a width
  mismatch is refused before any page is read), values once after the loop;
- the lease is released only after the final synchronization point (`reads_finished`), which follows the last
  forward, in every outcome;
- and the latents stay torch.equal to diffusers' (the resident model).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ditcore.generation as generation_mod
from ditcore import CacheReport, GenerationRequest, PlanBuilder, PlanKey, generate, load_model
from ditcore.denoise import PlanKeyMismatchError, StepPlans
from ditcore.generation import SlabPlanLease
from ditcore.plans import PlanLinear, SlotReads
from ditcore.repo import write_repository

REQUEST = GenerationRequest(request_id="r1", prompt="rain on a tin roof", num_inference_steps=5, seed=7,
                            height=32, width=64, num_frames=141, flow_shift=9.0, audio_flow_shift=2.5)  # fmt: skip
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "to")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repository(tmp_path_factory.mktemp("reads") / "mixed", "tiny", seed=11, dtype="mixed")


class SlabLease:
    """A ditcore SlabPlanLease over an in-process slab (what the sidecar's lease maps), with an event log."""

    def __init__(self, slab: torch.Tensor, slots: list[int], log: list[str]) -> None:
        self.slab, self.slots, self.log = slab, slots, log
        self.released = 0

    @property
    def report(self) -> CacheReport:
        return CacheReport(built_plans=len(set(self.slots)))

    def pages(self, step: int) -> torch.Tensor:
        raise AssertionError("a slab lease is read through SlotReads, never pages(step)")

    def slab_slots(self) -> tuple[torch.Tensor, Sequence[int]]:
        return self.slab, self.slots

    def release(self) -> None:
        self.log.append("release")
        self.released += 1


class SlabProvider:
    """Builds the request's distinct plans into a slab with spare slots, in reverse order (slot != step)."""

    def __init__(self, repo: Path, width: int = 2, spare: int = 3) -> None:
        self.builder = PlanBuilder(repo / "transformer")
        self.width, self.spare = width, spare
        self.leases: list[SlabLease] = []
        self.log: list[str] = []

    def acquire(self, keys: Sequence[PlanKey]) -> SlabLease:
        distinct = list(dict.fromkeys(keys))[::-1]
        slab = torch.full((len(distinct) + self.spare, self.width, self.builder.layout.page_numel), float("nan"),
                          dtype=self.builder.projection_dtype)  # fmt: skip
        slot_of = {k: self.spare + i for i, k in enumerate(distinct)}
        self.builder.build(distinct, [slab[slot_of[k], : k.width] for k in distinct])
        self.leases.append(SlabLease(slab, [slot_of[k] for k in keys], self.log))
        return self.leases[-1]


class HostReadGuard(TorchDispatchMode):
    """Records every aten op run under it; `_local_scalar_dense` is a host read of a tensor value."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func.overloadpacket.__name__))
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            raise AssertionError("a host read of a tensor value inside the plan-reading path")
        return func(*args, **(kwargs or {}))


class Instrument:
    """Wraps the plan-reading functions: inside them host reads raise and every aten op is recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.inside = threading.local()
        self.guard = HostReadGuard()
        self.gathers: list[int] = []  # index_select calls per forward
        self.forwards = 0
        for name in HOST_READS:
            monkeypatch.setattr(torch.Tensor, name, self._forbid(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(StepPlans, "before_forward", self._region(StepPlans.before_forward, step=True))
        monkeypatch.setattr(SlotReads, "read", self._region(SlotReads.read))
        monkeypatch.setattr(PlanLinear, "forward", self._region(PlanLinear.forward))
        real_index_select = torch.index_select

        def index_select(*args: Any, **kwargs: Any) -> Any:
            if getattr(self.inside, "on", False):
                self.gathers[-1] += 1
            return real_index_select(*args, **kwargs)

        monkeypatch.setattr(torch, "index_select", index_select)

    def _forbid(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def method(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if getattr(self.inside, "on", False):
                raise AssertionError(f"Tensor.{name} called inside the plan-reading path")
            return real(t, *args, **kwargs)

        return method

    def _region(self, fn: Callable[..., Any], step: bool = False) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if step:
                self.forwards += 1
                self.gathers.append(0)
            if getattr(self.inside, "on", False):
                return fn(*args, **kwargs)
            self.inside.on = True
            try:
                with self.guard:
                    return fn(*args, **kwargs)
            finally:
                self.inside.on = False

        return wrapped


@contextmanager
def instrumented(monkeypatch: pytest.MonkeyPatch) -> Iterator[Instrument]:
    with monkeypatch.context() as m:
        yield Instrument(m)


def test_one_gather_per_step_and_no_host_read_in_the_plan_reading_path(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    resident = generate(load_model(repo, "resident"), REQUEST)
    cached = load_model(repo, "cached")
    provider = SlabProvider(repo)
    with instrumented(monkeypatch) as ins:
        out = generate(cached, REQUEST, provider)
    steps = len(cached.plan_keys(REQUEST))
    assert ins.forwards == steps and ins.gathers == [1] * steps, ins.gathers
    assert "_local_scalar_dense" not in ins.guard.ops and "index_select" in ins.guard.ops
    assert isinstance(provider.leases[0], SlabPlanLease) and provider.leases[0].released == 1
    assert torch.equal(out.video, resident.video) and torch.equal(out.audio, resident.audio)
    assert out.sha256 == resident.sha256


def test_slot_reads_gather_each_steps_rows_with_one_device_index_tensor() -> None:
    slab = torch.arange(5 * 2 * 3, dtype=torch.float32).view(5, 2, 3)
    reads = SlotReads(slab, [4, 0, 4, 2], [1, 2, 1, 2])
    assert reads.index.tolist() == [8, 0, 1, 8, 4, 5] and reads.index.device == slab.device
    for step, (slot, width) in enumerate([(4, 1), (0, 2), (4, 1), (2, 2)]):
        got = reads.read(step)
        assert torch.equal(got, slab[slot, :width]) and got.data_ptr() == reads.buffer.data_ptr()
    with pytest.raises(ValueError, match="slot 5 is outside the slab's 5 slots"):
        SlotReads(slab, [5], [1])
    with pytest.raises(ValueError, match="plan width 3 does not fit a slot of 2 pages"):
        SlotReads(slab, [0], [3])


def test_timesteps_checked_by_shape_per_step_and_by_value_after_the_loop() -> None:
    keys = [PlanKey.from_timesteps(0.0), PlanKey.from_timesteps(0.25, 0.5)]
    read: list[int] = []
    plans = StepPlans(keys, lambda i: (read.append(i), torch.zeros(1))[1])
    with pytest.raises(PlanKeyMismatchError, match=r"step 0: .* shape \(2,\), the plan has 1"):
        plans.before_forward(torch.tensor([0.0, 0.5]))
    assert read == [], "no page is read for a forward of the wrong width"
    plans = StepPlans(keys, lambda i: torch.zeros(1))
    plans.before_forward(keys[0].timesteps())
    plans.before_forward(torch.tensor([0.25, 0.75]))  # right width, wrong value: found after the loop
    with pytest.raises(PlanKeyMismatchError, match=r"step 1: the transformer got plan key \(0\.2500, 0\.7500\)"):
        plans.verify()
    plans = StepPlans(keys, lambda i: torch.zeros(1))
    plans.before_forward(keys[0].timesteps())
    with pytest.raises(PlanKeyMismatchError, match="ran 1 forwards, the plan has 2 steps"):
        plans.verify()


@pytest.mark.parametrize("abort_at", [None, 2])
def test_lease_released_only_after_the_final_synchronization(
    repo: Path, monkeypatch: pytest.MonkeyPatch, abort_at: int | None
) -> None:
    cached = load_model(repo, "cached")
    provider = SlabProvider(repo)
    log = provider.log
    real = generation_mod.reads_finished

    def fence(device: torch.device) -> None:
        log.append("fence")
        real(device)

    monkeypatch.setattr(generation_mod, "reads_finished", fence)
    handle = cached.transformer.register_forward_hook(lambda *_: log.append("forward"))

    def on_step(done: int, total: int) -> None:
        if done == abort_at:
            raise RuntimeError(f"aborted at step {done}")

    try:
        if abort_at is None:
            generate(cached, REQUEST, provider, on_step=on_step)
        else:
            with pytest.raises(RuntimeError, match="aborted at step 2"):
                generate(cached, REQUEST, provider, on_step=on_step)
    finally:
        handle.remove()
    steps = len(cached.plan_keys(REQUEST)) if abort_at is None else abort_at
    assert log == ["forward"] * steps + ["fence", "release"]
    assert cached.holder._pages is None, "no page buffer outlives the request"
