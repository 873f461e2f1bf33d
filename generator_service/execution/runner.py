"""The executor thread (no gRPC): one run at a time, in queue order.

For each run: take the prefetched lease or lease its plans now, check the lease's slot-table rows, decode its
keyframes and references (one run at a time, here, before any lease), run the denoise step (`ditcore.generate`:
diffusers' loop; on a replica, every rank's loop in lockstep) with cancellation / deadline / sidecar-session checks
after every transformer forward, and release the lease in every outcome. The release comes after the reading is
finished: `generate` waits for an event recorded after the last kernel that reads a leased slot
(`ditcore.generation.reads_finished`) before it releases, in every outcome. On session loss (the check after a step
fails) the run stops issuing work, `generate` synchronizes, and only then is the lease released and the failure
acknowledged to the client. A media run goes on to the mux thread (generator_service.execution.mux).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from ditcore import GenerationRequest, GenerationResult, H3Model, PlanKey, RequestLimits, generate
from ditcore.generation import StepCallback
from ditcore.media_cache import forget_decoded_keyframes

from ..backends.base import Backend, ServedLease
from ..errors import LeaseCheckError, SidecarUnavailableError
from .admission import check_generation
from .drain import StepBounds
from .mux import Muxer
from .prefetch import Prefetcher, lease_plans
from .queue import RunQueue
from .runs import (
    Decoding,
    Denoised,
    Failed,
    Finished,
    FinishListener,
    PlansReady,
    Run,
    RunEvent,
    Started,
    StepDone,
    quiet_run_stops,
)

log = logging.getLogger(__name__)

Denoise = Callable[
    [H3Model, GenerationRequest, "ServedLease | None", StepCallback, RequestLimits, Callable[[], None]],
    GenerationResult,
]
"""The executor's denoise step: (model, request, lease, on_step, limits, check) -> result, the lease released in
every outcome. One device: `denoise_here` (ditcore.generate); a replica of N ranks: ReplicaLink.run."""


def denoise_here(
    model: H3Model,
    request: GenerationRequest,
    lease: ServedLease | None,
    on_step: StepCallback,
    limits: RequestLimits,
    check: Callable[[], None],
) -> GenerationResult:
    """One device's denoise step: ditcore.generate (it releases the lease in every outcome once acquired)."""
    provider = _Prefetched(lease) if lease is not None else None
    return generate(model, request, provider, on_step=on_step, limits=limits, check=check)


class _Prefetched:
    """A PlanProvider that hands out an already-prepared lease (for the keys it was prepared for)."""

    def __init__(self, lease: ServedLease) -> None:
        self._lease = lease

    def acquire(self, keys: Sequence[PlanKey]) -> ServedLease:
        if list(keys) != list(self._lease.keys):
            raise LeaseCheckError("the leased plans are not the request's plan keys")
        return self._lease


class Runner:
    """The executor thread over `queue`: it hands decoded media runs to `muxer` and wakes `prefetcher` once a run's
    plans are ready (so the next run's build overlaps this one's compute)."""

    def __init__(
        self,
        queue: RunQueue,
        backend: Backend,
        limits: RequestLimits,
        bounds: StepBounds,
        muxer: Muxer,
        prefetcher: Prefetcher,
        on_finish: FinishListener,
        denoise: Denoise,
    ) -> None:
        self._queue = queue
        self._backend = backend
        self._limits = limits
        self._bounds = bounds
        self._muxer = muxer
        self._prefetcher = prefetcher
        self._on_finish = on_finish
        self._denoise_step = denoise
        quiet_run_stops()  # a cancel or deadline passes diffusers' blocks quietly: Run.emit logs it in one line
        self.thread = threading.Thread(target=self._loop, name="executor", daemon=True)

    def _loop(self) -> None:
        q = self._queue
        while True:
            with q.lock:
                while (not q.queued or q.paused) and not q.stopping:
                    q.lock.wait()
                if q.stopping:
                    return
                run = q.queued.popleft()
                q.running = run
            final: RunEvent | Denoised
            try:
                final = self._run(run)
                if isinstance(final, Denoised) and not final.run.request.decodes:
                    final = self._finished(final)
            except BaseException as e:  # never let the executor die
                log.exception("executor: unexpected error")
                final = Failed(e)
            if isinstance(final, Denoised):
                self._muxer.hand(final)
            else:
                with q.lock:  # a failure frees the queue slot before the client hears back; a result keeps it
                    q.running = None
                    q.settle(run, final)
                run.emit(final)  # a Failed error leaves with its traceback's frame locals cleared (Run.emit)
            # This frame runs until the server stops: the run, its result or its error (whose traceback reached the
            # loop's view of the slab) must not stay in it until the next run; nor its decoded keyframes.
            del run, final
            forget_decoded_keyframes()

    def _run(self, run: Run) -> RunEvent | Denoised:
        """Run one run's loop; returns its failure, or what finishing it (muxing, results) needs."""
        started = time.perf_counter()
        run.emit(Started())
        if run.prefetching:
            run.prefetch_done.wait()
        lease = run.prefetched
        run.prefetched = None
        try:
            run.check_live()
            check_generation(self._backend, run)
            run.request.keyframes(self._limits)  # their pixels, decoded here (one run at a time), before any lease
            if lease is None:
                lease = lease_plans(self._backend, self._bounds, run)
            if lease is not None:
                self._backend.verify(lease)
                run.emit(PlansReady(lease.report, lease.generation))
            self._prefetcher.wake()  # the next run's plans can build while this one denoises
            result, generation = self._denoise(run, lease)
        except BaseException as e:
            if lease is not None:
                lease.release()
            self._on_finish(run, None, e)
            return Failed(e)
        return Denoised(run, result, generation, started)

    def _finished(self, done: Denoised) -> Finished:
        """A latents run's result (nothing to decode or mux), told to the finish listener."""
        result = done.outcome()
        self._on_finish(done.run, result, None)
        return Finished(result)

    def _denoise(self, run: Run, lease: ServedLease | None) -> tuple[GenerationResult, int]:
        def on_step(done: int, total: int) -> None:
            self._bounds.observe_step(run, done)
            self._check_live(run, lease)
            run.emit(StepDone(done, total))
            if done == total and run.request.decodes:  # the loop is done: decoding starts next
                run.emit(Decoding(run.request.output_type))

        backend = self._backend
        with backend.model_lock:
            generation = lease.generation if lease is not None else backend.generation()
            # the denoise step releases the lease in every outcome
            model = backend.model()
            result = self._denoise_step(model, run.request, lease, on_step, self._limits, run.check_live)
        if lease is not None and not backend.alive(lease):
            # The session ended between the last step's check and the end of its reads (generate() waits for
            # them before releasing): the slots may have been retired and refilled, so the result is not trusted.
            raise SidecarUnavailableError("the plan-cache sidecar session ended before the request's reads finished")
        return result, generation

    def _check_live(self, run: Run, lease: ServedLease | None) -> None:
        run.check_live()
        if lease is not None and not self._backend.alive(lease):
            raise SidecarUnavailableError("the plan-cache sidecar went away during the request")
