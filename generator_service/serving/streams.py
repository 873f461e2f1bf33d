"""What keeps slow or stalled clients from holding the public server: request-handler slots and the send watchdog.

The generator runs grpcio's synchronous server: each in-flight RPC holds one of its `--workers` threads, and a
server-streaming handler's thread blocks inside grpc while a message waits for the client's HTTP/2 flow-control
window (grpc asks the handler for the next message only once the previous one was handed to the transport). So a
client that stops reading holds a thread for as long as nothing cancels its RPC.

- `HandlerSlots`: Generate and GenerateStream may hold at most `workers - control_workers` threads at once (more are
  refused at once with RESOURCE_EXHAUSTED, HANDLERS_BUSY); the rest are left to Health, GetStatus, UpdateWeights
  and reflection, which never wait on a client.
- `SendWatchdog`: one thread watching every stream's sends. A stream whose current message has waited for the
  client longer than `--stream-stall-s`, or whose result transfer (from the result header to the last chunk) runs
  past `--stream-transfer-s`, is cancelled from the server side: grpc wakes the blocked handler thread, the handler's
  `finally` frees its queue slot and the result it held.

Why not grpc.aio: the executor, the cancel callbacks and the job events are thread-based, and a stalled client is
bounded here in the same two places an aio server would need anyway (a concurrency limit and a send deadline); an
aio rewrite would add an event loop bridge to every run event without removing either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..errors import HandlersBusyError

log = logging.getLogger(__name__)

StallListener = Callable[[str], None]
"""Told why ("stall" or "transfer") each time the watchdog cancels a stream."""


class HandlerSlots:
    """At most `limit` request handlers (Generate, GenerateStream) at once; `take` refuses the next one at once."""

    def __init__(self, limit: int, workers: int) -> None:
        self.limit = limit
        self.workers = workers
        self._free = threading.BoundedSemaphore(limit)
        self._lock = threading.Lock()
        self._busy = 0

    @property
    def busy(self) -> int:
        with self._lock:
            return self._busy

    def acquire(self) -> None:
        """Take a slot, or raise HandlersBusyError at once; a stream's handler pairs it with `release` in its
        `finally` (a generator cannot hold a `with` across its first yield and an abort before it)."""
        if not self._free.acquire(blocking=False):
            raise HandlersBusyError(
                f"all {self.limit} request handlers are busy (--workers {self.workers} less "
                f"--control-workers {self.workers - self.limit}, kept for Health, GetStatus and UpdateWeights); "
                "retry later",
                {"handlers": str(self.limit)},
            )
        with self._lock:
            self._busy += 1

    def release(self) -> None:
        with self._lock:
            self._busy -= 1
        self._free.release()

    @contextmanager
    def take(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()


@dataclass(eq=False)
class StreamWatch:
    """One stream's sends, as its handler reports them. `sending()` before each yield, `sent()` after it resumes."""

    name: str
    cancel: Callable[[], None]
    waiting_since: float | None = None  # the watchdog's clock when the message now being sent was yielded
    transfer_deadline: float | None = None
    cancelled: str = ""  # why the watchdog cancelled it ("" while it did not)
    _watchdog: SendWatchdog | None = field(default=None, repr=False)

    def sending(self) -> None:
        assert self._watchdog is not None
        self.waiting_since = self._watchdog.clock()

    def sent(self) -> None:
        self.waiting_since = None

    def start_transfer(self) -> None:
        """The result header is about to go: the rest must arrive within the transfer bound."""
        assert self._watchdog is not None
        self.transfer_deadline = self._watchdog.clock() + self._watchdog.transfer_s

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.forget(self)


class SendWatchdog:
    """Cancels a stream whose current message has waited for its client longer than `stall_s`, or whose result
    transfer ran past `transfer_s`. `clock` (monotonic seconds) is injected by tests."""

    def __init__(
        self,
        stall_s: float,
        transfer_s: float,
        on_cancel: StallListener | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stall_s = stall_s
        self.transfer_s = transfer_s
        self.clock = clock
        self._on_cancel = on_cancel or (lambda _: None)
        self._lock = threading.Lock()
        self._watches: set[StreamWatch] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.interval_s = max(0.05, min(1.0, stall_s / 4, transfer_s / 4))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="send-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def watch(self, name: str, cancel: Callable[[], None]) -> StreamWatch:
        w = StreamWatch(name, cancel, _watchdog=self)
        with self._lock:
            self._watches.add(w)
        return w

    def forget(self, w: StreamWatch) -> None:
        with self._lock:
            self._watches.discard(w)

    @property
    def watched(self) -> int:
        with self._lock:
            return len(self._watches)

    def check(self) -> int:
        """Cancel every stream over a bound now; returns how many were cancelled (the thread calls this)."""
        now = self.clock()
        with self._lock:
            watches = list(self._watches)
        cancelled = 0
        for w in watches:
            waiting = w.waiting_since
            if w.cancelled:
                continue
            if waiting is not None and now - waiting > self.stall_s:
                w.cancelled = "stall"
                why = f"its client read nothing for {now - waiting:.1f} s (--stream-stall-s {self.stall_s:g})"
            elif w.transfer_deadline is not None and now > w.transfer_deadline:
                w.cancelled = "transfer"
                why = f"its result took longer than --stream-transfer-s {self.transfer_s:g} to send"
            else:
                continue
            log.warning("stream %s cancelled: %s", w.name, why)
            self._on_cancel(w.cancelled)
            w.cancel()
            cancelled += 1
        return cancelled

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # never let the watchdog die
                log.exception("send watchdog: unexpected error")
