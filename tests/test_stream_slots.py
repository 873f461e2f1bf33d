"""The parts that bound slow clients, one at a time: a result keeps its queue slot until its RPC says it was sent
(Executor.delivered), a cancelled queued run leaves the queue at once (Executor.withdraw), the request-handler slots
refuse beyond their limit, and the send watchdog's two bounds (stall, transfer) on an injected clock."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from servicekit import REQ_FOX, wait_for

from ditcore import GenerationRequest
from generator_service.backends.resident import ResidentBackend
from generator_service.config import GeneratorConfig
from generator_service.errors import CancelledError, HandlersBusyError
from generator_service.execution.executor import Executor
from generator_service.execution.runs import Failed, Finished, Run
from generator_service.serving.streams import HandlerSlots, SendWatchdog


@pytest.fixture(scope="module")
def backend(svc_ckpt: Path) -> Iterator[ResidentBackend]:
    b = ResidentBackend(svc_ckpt, torch.device("cpu"))
    b.start()
    wait_for(lambda: b.status().serving, 120, "the model to load")
    yield b
    b.close()


def _run(i: int) -> Run:
    return Run(GenerationRequest.from_dict({**REQ_FOX, "request_id": f"j{i}", "seed": i}))


def _final(run: Run) -> object:
    while True:
        event = run.events.get(timeout=120)
        if isinstance(event, (Failed, Finished)):
            return event


def test_a_result_keeps_its_queue_slot_until_it_is_delivered(backend: ResidentBackend) -> None:
    ex = Executor(backend, max_queue_depth=1, prefetch=False)
    ex.start()
    try:
        run = _run(0)
        ex.submit(run)
        assert isinstance(_final(run), Finished)
        assert ex.queue_depth == 1  # finished, but its RPC has not sent it yet
        with pytest.raises(Exception, match="the queue is full"):
            ex.submit(_run(1))
        ex.delivered(run)
        ex.delivered(run)  # idempotent
        assert ex.queue_depth == 0
        late = _run(2)  # an RPC that ended before its run finished: its result never holds a slot
        ex.submit(late)
        ex.delivered(late)
        assert isinstance(_final(late), Finished)
        wait_for(lambda: ex.queue_depth == 0, 10, "the slot of a run whose RPC ended first")
    finally:
        ex.stop()


def test_a_cancelled_queued_job_leaves_the_queue_at_once(backend: ResidentBackend) -> None:
    ex = Executor(backend, max_queue_depth=4, prefetch=False)
    ex.pause()
    ex.start()
    try:
        a, b = _run(0), _run(1)
        ex.submit(a)
        ex.submit(b)
        assert ex.queue_depth == 2
        b.cancel()
        assert ex.withdraw(b)
        assert ex.queue_depth == 1
        final = _final(b)
        assert isinstance(final, Failed) and isinstance(final.error, CancelledError)
        assert not ex.withdraw(b)  # no longer queued
    finally:
        ex.stop()


def test_handler_slots_refuse_beyond_the_limit_naming_the_flags() -> None:
    cfg = GeneratorConfig(adaln_mode="resident", checkpoint=Path("/x"), workers=6, control_workers=2)
    slots = HandlerSlots(cfg.request_handlers, cfg.workers)
    held = [slots.take() for _ in range(4)]
    for h in held:
        h.__enter__()
    refused = r"all 4 request handlers are busy \(--workers 6 less --control-workers 2"
    with pytest.raises(HandlersBusyError, match=refused), slots.take():
        pass
    held[0].__exit__(None, None, None)
    with slots.take():
        assert slots.busy == 4
    with pytest.raises(ValueError, match=r"--control-workers .* must be less than --workers"):
        GeneratorConfig(adaln_mode="resident", checkpoint=Path("/x"), workers=4, control_workers=4)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_watchdog_cancels_a_stalled_send_and_an_overlong_transfer_only() -> None:
    clock = _Clock()
    reasons: list[str] = []
    dog = SendWatchdog(stall_s=30, transfer_s=600, on_cancel=reasons.append, clock=clock)
    cancelled: list[str] = []
    quiet = dog.watch("quiet", lambda: cancelled.append("quiet"))  # denoising: no send pending, however long
    stalled = dog.watch("stalled", lambda: cancelled.append("stalled"))
    slow = dog.watch("slow", lambda: cancelled.append("slow"))  # reads, but too slowly overall
    stalled.sending()
    slow.start_transfer()
    clock.now += 29
    assert dog.check() == 0
    clock.now += 2  # the stalled send has waited 31 s
    assert dog.check() == 1 and cancelled == ["stalled"]
    for _ in range(20):  # every message of the slow one is taken within 30 s, the transfer takes too long
        slow.sending()
        clock.now += 29
        slow.sent()
        dog.check()
    assert cancelled == ["stalled", "slow"] and reasons == ["stall", "transfer"]
    assert dog.check() == 0  # each is cancelled once
    clock.now += 10**6
    assert dog.check() == 0 and "quiet" not in cancelled
    for w in (quiet, stalled, slow):
        w.close()
    assert dog.watched == 0
