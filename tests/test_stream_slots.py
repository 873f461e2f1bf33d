"""The parts that bound slow clients, one at a time: a result keeps its queue slot until its RPC says it was sent
(Executor.delivered), a cancelled queued run leaves the queue at once (Executor.withdraw), the request-handler slots
and UploadReference / WatchJob's own refuse beyond their limits, the send watchdog's two bounds (stall, transfer) on an
injected clock, and a client stream's receive bounds (stall, total)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from servicekit import REQ_FOX, wait_for

from ditcore import GenerationRequest
from generator_service.backends.resident import ResidentBackend
from generator_service.config import GeneratorConfig
from generator_service.errors import CancelledError, HandlersBusyError
from generator_service.execution.executor import Executor
from generator_service.execution.runs import Failed, Finished, Run
from generator_service.serving.streams import (
    BoundedReceive,
    HandlerSlots,
    ReceiveTimeoutError,
    SendWatchdog,
    UploadWatchBusyError,
    UploadWatchSlots,
)


@pytest.fixture(scope="module")
def backend(resident_backend: ResidentBackend) -> ResidentBackend:
    return resident_backend


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
    cfg = GeneratorConfig(
        adaln_mode="resident", checkpoint=Path("/x"), workers=9, control_workers=2, upload_watch_workers=3
    )
    slots = HandlerSlots(cfg.workers, cfg.control_workers, UploadWatchSlots(cfg.upload_watch_workers, 30, 300, 600))
    assert slots.limit == cfg.request_handlers == 4
    held = [slots.take() for _ in range(4)]
    for h in held:
        h.__enter__()
    refused = (
        r"all 4 request handlers are busy \(--workers 9 less --control-workers 2, .* less --upload-watch-workers 3"
    )
    with pytest.raises(HandlersBusyError, match=refused), slots.take():
        pass
    for _ in range(3):  # uploads and watches have their own slots, untouched by the full pool above
        slots.upload_watch.acquire()
    with pytest.raises(UploadWatchBusyError, match=r"all 3 UploadReference and WatchJob .*--upload-watch-workers 3"):
        slots.upload_watch.acquire()
    held[0].__exit__(None, None, None)
    with slots.take():
        assert slots.busy == 4 and slots.upload_watch.busy == 3
    with pytest.raises(ValueError, match=r"--control-workers .* plus --upload-watch-workers .* less than --workers"):
        GeneratorConfig(adaln_mode="resident", checkpoint=Path("/x"), workers=12, control_workers=4)


def _sent(delays: list[float], release: threading.Event | None = None) -> Iterator[int]:
    """A client stream: message i after delays[i] seconds, then (with `release`) nothing until it is set."""
    for i, delay in enumerate(delays):
        time.sleep(delay)
        yield i
    if release is not None:
        release.wait()


def test_a_bounded_receive_ends_a_stalled_or_overlong_stream_and_lets_its_reader_go() -> None:
    whole = BoundedReceive(_sent([0, 0.01, 0.01]), stall_s=30, total_s=60)
    assert list(whole) == [0, 1, 2]
    release = threading.Event()
    stalled = BoundedReceive(_sent([0, 0], release), stall_s=0.2, total_s=60)
    got: list[int] = []
    with pytest.raises(ReceiveTimeoutError, match=r"sent nothing for 0.2 s \(--upload-stall-s\)") as err:
        got.extend(stalled)
    assert got == [0, 1] and err.value.metadata == {"bound": "stall"}
    stalled.close()
    slow = BoundedReceive(_sent([0.05] * 1000), stall_s=30, total_s=0.5)  # never stalls, never ends
    with pytest.raises(ReceiveTimeoutError, match=r"after 0.5 s \(--upload-max-s\)") as err:
        list(slow)
    assert err.value.metadata == {"bound": "total"}
    slow.close()
    release.set()  # the stalled stream's source ends: its reader, closed, leaves without handing more over
    wait_for(lambda: not any(t.name == "upload-reader" and t.is_alive() for t in threading.enumerate()), 30,
             "the readers to leave")  # fmt: skip


def test_a_bounded_receive_passes_the_source_error_on() -> None:
    def broken() -> Iterator[int]:
        yield 0
        raise KeyError("the call ended")

    with pytest.raises(KeyError, match="the call ended"):
        list(BoundedReceive(broken(), stall_s=30, total_s=60))


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
