"""What keeps slow or stalled clients from holding the public server: request-handler slots, the send watchdog and
the bounds on UploadReference and WatchJob.

The generator runs grpcio's synchronous server: each in-flight RPC holds one of its `--workers` threads, and a
server-streaming handler's thread blocks inside grpc while a message waits for the client's HTTP/2 flow-control
window (grpc asks the handler for the next message only once the previous one was handed to the transport). So a
client that stops reading holds a thread for as long as nothing cancels its RPC; a client stream's (UploadReference)
thread blocks the same way while its client sends nothing.

- `HandlerSlots`: the `--workers` threads in three budgets. `--control-workers` are left to Health, GetStatus,
  UpdateWeights, reflection and the unary Jobs RPCs, which never wait on a client; `--upload-watch-workers`
  (`UploadWatchSlots`) to UploadReference and WatchJob, whose calls last as long as their client sends or watches;
  the rest to Generate, GenerateStream and GetJobContent. A call beyond its budget is refused at once
  (RESOURCE_EXHAUSTED: HANDLERS_BUSY, UPLOAD_WATCH_BUSY), so no kind of call can take another's threads and the pool
  (`--workers` threads) always has one for each budget's calls.
- `SendWatchdog`: one thread watching every stream's sends. A stream whose current message has waited for the
  client longer than `--stream-stall-s`, or whose result transfer (from the result header to the last chunk) runs
  past `--stream-transfer-s`, is cancelled from the server side: grpc wakes the blocked handler thread, the handler's
  `finally` frees its queue slot and the result it held.
- `BoundedReceive`: a client stream's messages, each awaited at most `--upload-stall-s` and all within
  `--upload-max-s` (ReceiveTimeoutError, DEADLINE_EXCEEDED). grpc's request iterator blocks without a timeout, so a
  reader thread hands the handler one message at a time (flow control still applies: grpc is asked for the next
  message only once the handler took the last); the handler waits on that hand-off with the bounds, and once it
  has ended the call, grpc ends the reader's wait.
- A watch (WatchJob) ends OK after `--watch-max-s` (`UploadWatchSlots.watch_alive`), its job final or not: the
  client watches again.

Why not grpc.aio: the executor, the cancel callbacks and the job events are thread-based, and a stalled client is
bounded here in the same two places an aio server would need anyway (a concurrency limit and a send deadline); an
aio rewrite would add an event loop bridge to every run event without removing either.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..errors import GeneratorError, HandlersBusyError

log = logging.getLogger(__name__)

T = TypeVar("T")
StallListener = Callable[[str], None]
"""Told why ("stall" or "transfer") each time the watchdog cancels a stream."""


class UploadWatchBusyError(HandlersBusyError):
    """Every UploadReference and WatchJob slot (`--upload-watch-workers`) is held; retry later. ErrorInfo metadata
    `handlers`."""

    reason = "UPLOAD_WATCH_BUSY"


class ReceiveTimeoutError(GeneratorError):
    """An UploadReference sent no message for `--upload-stall-s`, or was still sending after `--upload-max-s`: the
    call ends and nothing it sent is kept (its bytes are freed). ErrorInfo metadata `bound` (stall or total)."""

    reason = "RECEIVE_TIMEOUT"
    grpc_code = "DEADLINE_EXCEEDED"


class SlotPool:
    """At most `limit` handlers of one kind at once; `acquire` refuses the next one at once (`busy_error()`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free = threading.BoundedSemaphore(limit)
        self._lock = threading.Lock()
        self._busy = 0

    @property
    def busy(self) -> int:
        with self._lock:
            return self._busy

    def acquire(self) -> None:
        """Take a slot, or raise `busy_error()` at once; a stream's handler pairs it with `release` in its `finally`
        (a generator cannot hold a `with` across its first yield and an abort before it)."""
        if not self._free.acquire(blocking=False):
            raise self.busy_error()
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

    def busy_error(self) -> HandlersBusyError:
        """The refusal, naming the flag that sizes this pool."""
        return HandlersBusyError(f"all {self.limit} handlers are busy; retry later", {"handlers": str(self.limit)})


class UploadWatchSlots(SlotPool):
    """UploadReference and WatchJob's own slots (`--upload-watch-workers`) and their time bounds."""

    def __init__(self, limit: int, upload_stall_s: float, upload_max_s: float, watch_max_s: float) -> None:
        super().__init__(limit)
        self.upload_stall_s = upload_stall_s
        self.upload_max_s = upload_max_s
        self.watch_max_s = watch_max_s

    def busy_error(self) -> HandlersBusyError:
        return UploadWatchBusyError(
            f"all {self.limit} UploadReference and WatchJob handlers are busy (--upload-watch-workers "
            f"{self.limit}); retry later",
            {"handlers": str(self.limit)},
        )

    @contextmanager
    def receive(self, messages: Iterator[T]) -> Iterator[Iterator[T]]:
        """An upload's messages under `--upload-stall-s` and `--upload-max-s`, its reader let go on exit."""
        bounded = BoundedReceive(messages, self.upload_stall_s, self.upload_max_s)
        try:
            yield iter(bounded)
        finally:
            bounded.close()

    def watch_alive(self, active: Callable[[], bool]) -> Callable[[], bool]:
        """`active` (the client is still there) until `--watch-max-s` from now; then False, so the watch ends OK."""
        end = time.monotonic() + self.watch_max_s
        return lambda: active() and time.monotonic() < end


class HandlerSlots(SlotPool):
    """The `workers` threads' budgets: Generate, GenerateStream and GetJobContent take from this pool (at most
    `workers - control_workers - upload_watch.limit` at once), UploadReference and WatchJob from `upload_watch`, the
    rest never wait on a client (Health, GetStatus, UpdateWeights, the unary Jobs RPCs) and take none."""

    def __init__(self, workers: int, control_workers: int, upload_watch: UploadWatchSlots) -> None:
        self.workers = workers
        self.control_workers = control_workers
        self.upload_watch = upload_watch
        super().__init__(workers - control_workers - upload_watch.limit)

    def busy_error(self) -> HandlersBusyError:
        return HandlersBusyError(
            f"all {self.limit} request handlers are busy (--workers {self.workers} less --control-workers "
            f"{self.control_workers}, kept for Health, GetStatus and UpdateWeights, less --upload-watch-workers "
            f"{self.upload_watch.limit}, kept for UploadReference and WatchJob); retry later",
            {"handlers": str(self.limit)},
        )


class _End:
    """The client stream ended (the reader's last hand-off)."""


@dataclass(frozen=True)
class _Raised:
    """grpc's iterator raised (the client cancelled, the call ended)."""

    error: BaseException


class BoundedReceive(Generic[T]):
    """An upload's `messages` (grpc's request iterator), each awaited at most `stall_s` and all within `total_s` of the start,
    else ReceiveTimeoutError. A reader thread pulls them into a one-message hand-off; `close()` lets it go once the
    handler is done (it leaves when grpc ends the call)."""

    def __init__(self, messages: Iterator[T], stall_s: float, total_s: float) -> None:
        self.stall_s = stall_s
        self.total_s = total_s
        self._messages = messages
        self._handoff: queue.Queue[T | _End | _Raised] = queue.Queue(maxsize=1)
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="upload-reader", daemon=True)

    def __iter__(self) -> Iterator[T]:
        end = time.monotonic() + self.total_s
        self._reader.start()
        while True:
            left = end - time.monotonic()
            try:
                item = self._handoff.get(timeout=max(0.0, min(self.stall_s, left)))
            except queue.Empty:
                error = self._timeout(stalled=left > self.stall_s)
                log.warning("client stream ended: %s", error)
                raise error from None
            if isinstance(item, _End):
                return
            if isinstance(item, _Raised):
                raise item.error
            yield item

    def _timeout(self, stalled: bool) -> ReceiveTimeoutError:
        if stalled:
            return ReceiveTimeoutError(
                f"the client sent nothing for {self.stall_s:g} s (--upload-stall-s); nothing of this upload is kept",
                {"bound": "stall"},
            )
        return ReceiveTimeoutError(
            f"the upload was still being received after {self.total_s:g} s (--upload-max-s); nothing of it is kept",
            {"bound": "total"},
        )

    def close(self) -> None:
        self._closed.set()

    def _read(self) -> None:
        try:
            for message in self._messages:
                if not self._hand(message):
                    return
            self._hand(_End())
        except BaseException as e:  # grpc's RpcError when the call ends under the reader: the handler re-raises it
            self._hand(_Raised(e))

    def _hand(self, item: T | _End | _Raised) -> bool:
        """Hand `item` over once the handler took the last one; False when the handler is gone."""
        while not self._closed.is_set():
            try:
                self._handoff.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False


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
