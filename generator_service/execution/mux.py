"""The mux thread (no gRPC): media output types ("mp4", "frames_and_wav") are decoded by the executor thread, under
the model lock, after the lease is released; encoding the file ("mux", `ditcore.media.encode`) needs no model, so the
mux thread does it while the executor thread starts the next run. At most one run muxes at a time (a decoded run
waits for the mux thread before the executor takes another, which bounds the decoded media held at two runs'). Cancel
and the deadline are checked in the encoders' frame loops too.
"""

from __future__ import annotations

import logging
import threading
import time

from ditcore.media import encode

from ..errors import GeneratorError, MediaEncodeError
from .queue import RunQueue
from .runs import Denoised, Failed, Finished, FinishListener, Muxing, RunEvent

log = logging.getLogger(__name__)


class Muxer:
    """The mux thread and its one slot (`RunQueue.muxing`)."""

    def __init__(self, queue: RunQueue, on_finish: FinishListener) -> None:
        self._queue = queue
        self._on_finish = on_finish
        self._stopping = False  # under the queue's lock
        self.thread = threading.Thread(target=self._loop, name="mux", daemon=True)

    def hand(self, done: Denoised) -> None:
        """Give a decoded run to the mux thread once it is free (the run moves from running to muxing); while
        shutting down, with no mux thread to take it, mux it here."""
        q = self._queue
        with q.lock:
            while q.muxing is not None and not self._stopping:
                q.lock.wait()
            if not self._stopping:
                q.running, q.muxing = None, done
                q.lock.notify_all()
                return
        final = self._mux(done)
        with q.lock:
            q.running = None
            q.settle(done.run, final)
        done.run.emit(final)

    def stop(self, timeout_s: float) -> None:
        """The mux thread finishes the run it holds, then exits."""
        with self._queue.lock:
            self._stopping = True
            self._queue.lock.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout_s)

    def _loop(self) -> None:
        q = self._queue
        while True:
            with q.lock:
                while q.muxing is None and not self._stopping:
                    q.lock.wait()
                done = q.muxing
                if done is None:
                    return
            final: RunEvent
            try:
                final = self._mux(done)
            except BaseException as e:  # never let the mux thread die
                log.exception("mux: unexpected error")
                final = Failed(e)
            with q.lock:  # as on the executor thread: a result keeps the queue slot until it is sent
                q.muxing = None
                q.settle(done.run, final)
            done.run.emit(final)
            del done, final  # nothing of the run (its media, its error) waits here for the next one

    def _mux(self, done: Denoised) -> RunEvent:
        """Encode the decoded media as the request's output type and finish the run."""
        run, media = done.run, done.result.media
        try:
            run.check_live()  # a cancelled or late request is not encoded for nobody
            if media is None:
                raise MediaEncodeError(f"request {run.request.request_id} has no decoded media to encode")
            run.emit(Muxing(run.request.output_type))
            t0 = time.perf_counter()
            try:
                encoded = encode(media, run.request.output_type, check=run.check_live)
            except GeneratorError:  # cancelled or past its deadline while encoding
                raise
            except Exception as e:
                raise MediaEncodeError(f"encoding the {run.request.output_type} failed: {e}") from e
            mux_ms = (time.perf_counter() - t0) * 1000
        except BaseException as e:
            self._on_finish(run, None, e)
            return Failed(e)
        result = done.outcome(encoded, mux_ms)
        self._on_finish(run, result, None)
        return Finished(result)
