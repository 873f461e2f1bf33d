"""Defaults scaled to the request (ditcore.sizing in the generator): memory-aware admission through the real gRPC
server, the step bound every PreparePlans carries, and a weight update's drain that waits for the running request as
long as its own remaining time. Time is the executor's injected clock: minutes of it pass without waiting for them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from servicekit import NOT_SERVING, REQ_FOX, Pair, StartPair, Weights, background, error_info, ref_sha, wait_for

from ditcore import GenerationRequest
from ditcore import generate as real_generate
from ditruntime.memory import MemoryBudget
from generator_service.backends import base as backend_mod
from generator_service.backends.resident import ResidentBackend
from generator_service.config import GeneratorConfig
from generator_service.execution import runner as runner_mod
from generator_service.execution.executor import Executor
from generator_service.execution.queue import DRAIN_SLACK_S
from generator_service.execution.runs import Failed, Finished, Run
from plancache_service.sidecar import Sidecar

GUARD_S = 120
BIG = {**REQ_FOX, "height": 768, "width": 1344, "num_frames": 124}  # the released canvas: inside the default limits


# ----------------------------------------------------------------------------- admission
def test_a_request_too_large_for_the_device_is_refused_naming_canvas_and_bytes(
    svc_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Pair(svc_ckpt, mode="resident", memory_reserve_bytes=0) as pair:
        pair.start()
        sizer = pair.generator.backend.sizer()
        small, big = (GenerationRequest.from_dict({**r, "request_id": "x"}) for r in (REQ_FOX, BIG))
        need_small, need_big = sizer.activations(small).peak, sizer.activations(big).peak
        assert need_small < need_big
        free = (need_small + need_big) // 2  # the device has room for the small canvas, not the big one
        monkeypatch.setattr(backend_mod, "device_free_memory", lambda device: MemoryBudget(free, "test budget"))

        with pytest.raises(grpc.RpcError) as ei:
            pair.generate(BIG, request_id="too-big")
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        info = error_info(ei.value)
        assert info is not None and info.reason == "REQUEST_TOO_LARGE_FOR_DEVICE"
        message = ei.value.details() or ""
        tokens = sizer.tokens(big).total
        for part in ("768 x 1344 x 124 frames", f"({tokens:,} tokens)", f"{need_big:,} bytes", f"{free:,} bytes free",
                     "test budget"):  # fmt: skip
            assert part in message, (part, message)
        assert (info.metadata["modeled_bytes"], info.metadata["free_bytes"]) == (str(need_big), str(free))
        assert info.metadata["tokens"] == str(tokens) and info.metadata["phase"] == "denoise step"
        assert pair.status().queue_depth == 0  # refused before it was queued

        ok = pair.generate(REQ_FOX, request_id="fits")  # the smaller canvas runs on the same device
        assert ok.sha256 == ref_sha(svc_ckpt, REQ_FOX)


def test_the_running_requests_peak_counts_as_free(svc_ckpt: Path) -> None:
    budget = MemoryBudget(0, "")
    backend = ResidentBackend(svc_ckpt, backend_mod.torch.device("cpu"), free_memory=lambda: budget)
    sizer = backend.sizer()
    assert sizer is not None
    big = GenerationRequest.from_dict({**BIG, "request_id": "big"})
    need = sizer.activations(big).peak
    budget = MemoryBudget(need - 1, "one byte short")
    with pytest.raises(backend_mod.RequestTooLargeForDeviceError, match="one byte short"):
        backend.check_memory(big)
    backend.check_memory(big, running=big)  # the running one's activations are gone before this one starts
    budget = MemoryBudget(0, "unknown")  # no figure could be read: nothing to refuse against
    backend.check_memory(big)


def test_the_adapters_a_request_would_load_count_against_free_memory(svc_ckpt: Path, tmp_path: Path) -> None:
    """What a request's not-yet-loaded adapters will hold (their factors at the transformer's dtype) counts beside
    its activations; once loaded, they count no more."""
    from ditcore.adapter_contract import AdapterUse
    from ditcore.adapter_files import write_adapter
    from ditcore.adapters import AdapterRegistry
    from ditcore.model import RunOptions

    write_adapter(tmp_path / "style.safetensors", svc_ckpt, "trunk", "diffusers", rank=4, alpha=None, seed=1)
    budget = MemoryBudget(0, "")
    options = RunOptions(adapters=AdapterRegistry(tmp_path))
    backend = ResidentBackend(svc_ckpt, backend_mod.torch.device("cpu"), free_memory=lambda: budget, options=options)
    sizer, model = backend.sizer(), backend.loaded()
    assert sizer is not None and model is not None
    request = GenerationRequest.from_dict({**REQ_FOX, "request_id": "a"})
    styled = GenerationRequest(**{**vars(request), "adapters": (AdapterUse("style"),)})
    need = sizer.activations(request).peak
    info = model.adapter_set.registry.get("style")
    pending = model.adapter_set.pending_bytes([(info, 1.0)])
    assert pending == info.numel["trunk"][0] * 2 > 0  # its factors at the transformer's bfloat16
    budget = MemoryBudget(need + pending - 1, "one byte short")
    backend.check_memory(request)  # the same canvas without the adapter fits
    with pytest.raises(backend_mod.RequestTooLargeForDeviceError, match=f"{pending:,} for its adapters not loaded"):
        backend.check_memory(styled)
    model.adapter_set.load(info)
    assert model.adapter_set.loaded_bytes()[info.identity] == pending  # the model holds what was modeled
    backend.check_memory(styled)  # loaded: nothing more to hold


# ----------------------------------------------------------------------------- the step bound
def test_every_prepare_carries_the_step_bound_modeled_then_observed(
    svc_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[float] = []
    prepare = Sidecar.prepare

    def spy(self: Sidecar, session_id: str, generation: int, keys: Any, step_bound_s: float = 0.0, *rest: Any) -> Any:
        sent.append(step_bound_s)
        return prepare(self, session_id, generation, keys, step_bound_s, *rest)

    monkeypatch.setattr(Sidecar, "prepare", spy)
    with Pair(svc_ckpt, prefetch=False) as pair:
        pair.start()
        executor: Executor = pair.generator.executor
        request = GenerationRequest.from_dict({**REQ_FOX, "request_id": "b"})
        sizer = executor.backend.sizer()
        modeled = sizer.step_s(request) * executor.sizing.step_time_factor
        first = executor.step_bound_s(request)
        assert first == modeled > 0  # nothing observed yet: the model x the factor
        pair.generate(REQ_FOX, request_id="b1")
        second = executor.step_bound_s(request)
        assert second > first  # a tiny step on this host is slower than its FLOPs: the observed step wins
        pair.generate(REQ_FOX, request_id="b2")
        assert sent == [pytest.approx(first), pytest.approx(second)]  # what reached the sidecar over gRPC


# ----------------------------------------------------------------------------- the drain
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class StepGate:
    """Holds the running request after each of its steps until the test lets it take the next one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.reached = 0
        self.allowed = 1

    def hold(self, done: int) -> None:
        with self._cond:
            self.reached = done
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.allowed > done, GUARD_S)

    def wait_reached(self, done: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.reached >= done, GUARD_S), f"step {done} never came"

    def step(self) -> None:
        with self._cond:
            self.allowed += 1
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self.allowed = 10**9
            self._cond.notify_all()


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[StepGate]:
    gate = StepGate()

    def generate(model: Any, request: Any, plans: Any, on_step: Callable[[int, int], None], **kw: Any) -> Any:
        def step(done: int, total: int) -> None:
            on_step(done, total)  # the executor observes the step on its clock first
            gate.hold(done)

        return real_generate(model, request, plans, on_step=step, **kw)

    monkeypatch.setattr(runner_mod, "generate", generate)
    try:
        yield gate
    finally:
        gate.open()


@pytest.fixture(scope="module")
def resident(svc_ckpt: Path) -> ResidentBackend:
    return ResidentBackend(svc_ckpt, backend_mod.torch.device("cpu"))


def _running(resident: ResidentBackend, clock: Clock, steps: int) -> tuple[Executor, Run]:
    executor = Executor(resident, 4, prefetch=False, clock=clock)
    executor.start()
    run = Run(GenerationRequest.from_dict({**REQ_FOX, "request_id": "drained", "num_inference_steps": steps + 1}))
    executor.submit(run)
    return executor, run


def _outcome(run: Run) -> Any:
    while True:
        event = run.events.get(timeout=GUARD_S)
        if isinstance(event, Finished | Failed):
            return event


@pytest.mark.parametrize(("timeout_s", "drained"), [(None, True), (60.0, False)])
def test_a_drain_waits_for_a_request_that_keeps_stepping_past_a_fixed_minute(
    resident: ResidentBackend, gated: StepGate, timeout_s: float | None, drained: bool
) -> None:
    # 5 steps of 29 s each on the executor's clock: 116 s in all, past the old fixed --drain-timeout-s 60
    clock = Clock()
    executor, run = _running(resident, clock, steps=5)
    try:
        gated.wait_reached(1)
        executor.pause()
        drain = background(lambda: executor.drain(timeout_s), name="drain")
        for step in range(2, 6):
            clock.now += 29.0
            if timeout_s is not None and clock.now - 1000.0 >= timeout_s:
                break  # the fixed bound has passed with the request still running: it gives up
            gated.step()
            gated.wait_reached(step)
        if drained:
            gated.open()  # the last step done: the request finishes, and the drain with it
        assert drain.result(GUARD_S) is drained
        gated.open()
        assert isinstance(_outcome(run), Finished)  # the request itself always finishes
    finally:
        executor.resume()
        executor.stop()


def test_a_derived_drain_gives_up_on_a_request_that_stalls(resident: ResidentBackend, gated: StepGate) -> None:
    clock = Clock()
    executor, run = _running(resident, clock, steps=5)
    try:
        gated.wait_reached(1)
        request = run.request
        bound = executor.remaining_s(request)  # nothing observed of it yet: its modeled remaining time
        assert bound == pytest.approx(
            executor.sizing.step_time_factor
            * (request.steps * executor.backend.sizer().step_s(request) + executor.backend.sizer().encode_s(request))
            + DRAIN_SLACK_S
        )
        executor.pause()
        drain = background(lambda: executor.drain(), name="drain")
        clock.now += bound + 1.0  # no step for longer than the request's own bound
        assert drain.result(GUARD_S) is False
        gated.open()
        assert isinstance(_outcome(run), Finished)
    finally:
        executor.resume()
        executor.stop()


def test_an_update_under_load_waits_for_the_running_request_by_default(
    pairs: StartPair, weights: Weights, gated: StepGate
) -> None:
    assert GeneratorConfig(sidecar="unix:/s").drain_timeout_s is None  # derived unless --drain-timeout-s is given
    reference = ref_sha(weights.a, REQ_FOX)  # before the update loads B beside it
    pair = pairs(weights.a, drain_timeout_s=None)
    running = background(lambda: pair.generate(REQ_FOX, request_id="under-load", timeout=GUARD_S), name="running")
    gated.wait_reached(1)
    update = background(lambda: pair.update("B"), name="update")
    wait_for(lambda: pair.health() == NOT_SERVING, 30, "the update to start draining")
    assert not update.done()
    gated.open()  # the running request goes on to its end; then the update proceeds
    result = running.result(GUARD_S)
    assert (result.generation, result.sha256) == (1, reference)
    assert update.result(GUARD_S).generation == 2
