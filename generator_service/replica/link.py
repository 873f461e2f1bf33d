"""A replica of N generator ranks, one per device, joined in one torch.distributed group (ditcore.parallel): rank 0
serves the public API, queue and executor; every rank runs each request's denoise loop together (context parallel
through diffusers). No grpc here.

Rank 0 holds a `ReplicaLink`; ranks 1..N-1 run `Follower.serve()`. Rank 0 drives every exchange, one at a time
under the link's lock: it broadcasts a work item (replica.proto `RankWork`, serialized bytes: never pickle), every
rank handles it, and the ranks gather one status each ("" = fine), so every rank learns every failure:

    Attach   cached: the sidecar session; rank r maps `slabs[r]` (its own device's slab) and loads the session's
             weights if it serves others. Rank 0 loads its own meanwhile.
    Run      one request: its fields, and in cached mode the lease (epoch, generation, step keys, slots) and the
             weights' fingerprint. Every rank checks the leased rows of the one slot table (READY, the lease's
             generation, the step's key) and that it serves those weights, then the ranks gather; only if all are
             fine do they all run diffusers' loop: rank 0 encodes the prompt and broadcasts its embedding, each
             rank reads the same slots of its own slab, and after every transformer forward rank 0 broadcasts
             whether the request stops there (cancel, deadline, the sidecar gone: `lockstep`), so every rank leaves
             the loop at the same step. After the last step every rank checks its rows again, and they gather;
             rank 0 decodes. A result is returned only when every rank was fine before the first step and after
             the last: a request never runs on mixed weights or mixed plans.
    Stage / Swap   a weight update: every rank loads the new weights beside the served ones (or the update is
             dropped on every rank), then every rank installs them (rollback / retire / drop alike).
    (empty)  a keep-alive while idle, so an idle rank's wait never reaches the group's timeout.

A rank that dies breaks the group: rank 0's next collective fails (gloo reports the closed connection at once), the
request fails with UNAVAILABLE (ReplicaUnavailableError), the replica goes NOT_SERVING, and rank 0 exits with
EXIT_REPLICA_LOST; the elastic launcher (torchrun's agent, `ditserve serve --nproc`) restarts every rank as a unit,
and they load whatever the sidecar serves. An unexpected error on a rank other than 0 exits that rank the same way
(its peers would otherwise wait in a collective it never enters).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ditcore import (
    GenerationRequest,
    GenerationResult,
    H3Model,
    RequestError,
    RequestLimits,
    generate,
    load_model,
    validate_checkpoint,
)
from ditcore.model import RunOptions, StepCallback
from ditcore.parallel import Replica, ReplicaLostError, SplitError
from ditcore.plans import PlanKey
from ditcore.references import Reference
from ditcore.report import CacheReport
from ditcore.sizing import Canvas
from ditruntime.slab import SlabMapping, descriptor_from_proto, descriptor_to_proto
from protos.ditserve.plancache.v1 import plancache_pb2 as cpb
from protos.ditserve.replica.v1 import replica_pb2 as rpb

from ..backends.sidecar_port import Attachment, check_rows
from ..errors import GeneratorError, LeaseCheckError, ReplicaUnavailableError

log = logging.getLogger(__name__)

EXIT_REPLICA_LOST = 75
"""A rank's exit status when its replica broke: the elastic launcher restarts every rank."""
KEEPALIVE_S = 30.0
"""How often an idle rank 0 sends the keep-alive."""


class RankStoppedError(GeneratorError):
    """On a rank other than 0: rank 0 stopped the request at this step (its own reason is rank 0's)."""


# ---------------------------------------------------------------------------- request on the wire
def request_to_work(request: GenerationRequest) -> rpb.Request:
    return rpb.Request(
        request_id=request.request_id, task=request.task, prompt=request.prompt,
        num_inference_steps=request.num_inference_steps, flow_shift=request.flow_shift,
        audio_flow_shift=request.audio_flow_shift, seed=request.seed, height=request.height, width=request.width,
        num_frames=request.num_frames, first_frame=request.first_frame, last_frame=request.last_frame,
        references=[rpb.Reference(data=r.data, kind=r.kind) for r in request.references],
    )  # fmt: skip


def request_from_work(msg: rpb.Request) -> GenerationRequest:
    """The request as a rank other than 0 runs it: its loop only (rank 0 decodes)."""
    return GenerationRequest(
        request_id=msg.request_id, task=msg.task, prompt=msg.prompt, num_inference_steps=msg.num_inference_steps,
        flow_shift=msg.flow_shift, audio_flow_shift=msg.audio_flow_shift, seed=msg.seed, height=msg.height,
        width=msg.width, num_frames=msg.num_frames, first_frame=msg.first_frame, last_frame=msg.last_frame,
        output_type="latents", references=tuple(Reference(r.data, r.kind) for r in msg.references),
    )  # fmt: skip


def _keys(msg: rpb.Run) -> list[PlanKey]:
    return [PlanKey(tuple(int(b) for b in k.timestep_bits), k.partition or "base") for k in msg.plan_keys]


def _key_proto(key: PlanKey) -> rpb.PlanKey:
    return rpb.PlanKey(timestep_bits=list(key.bits), partition=key.partition)


# ---------------------------------------------------------------------------- the loop in lockstep
class _Lockstep:
    """The step callback every rank runs after each transformer forward: rank 0 runs the executor's own callback
    (cancel, deadline, sidecar checks) and broadcasts whether the request stops; every rank then stops or goes on
    together. `agreed` is the error rank 0 stopped with; `done` says the loop's last forward was agreed."""

    def __init__(self, replica: Replica, on_step: StepCallback | None) -> None:
        self.replica = replica
        self.on_step = on_step
        self.agreed: BaseException | None = None
        self.done = False

    def __call__(self, done: int, total: int) -> None:
        error: BaseException | None = None
        if self.on_step is not None:
            try:
                self.on_step(done, total)
            except Exception as e:
                error = e
        if self.replica.agree(error is not None):
            self.agreed = error if error is not None else RankStoppedError(f"rank 0 stopped the request at step {done}")
            raise self.agreed
        self.done = done == total


class _Fixed:
    """A PlanProvider handing out one lease already held."""

    def __init__(self, lease: Any) -> None:
        self.lease = lease

    def acquire(self, keys: Sequence[PlanKey]) -> Any:
        return self.lease


class _HeldLease:
    """Rank 0's lease as `generate` sees it, whose release waits for the replica: `generate` releases once rank 0's
    reads are done, but the other ranks check the leased rows once more after the last step, so the slots are
    released only after every rank has (ReplicaLink.run)."""

    def __init__(self, lease: Any) -> None:
        self._lease = lease
        self.report = lease.report

    def pages(self, step: int) -> torch.Tensor:
        return self._lease.pages(step)  # type: ignore[no-any-return]

    def slab_slots(self) -> tuple[torch.Tensor, Sequence[int]]:
        return self._lease.slab_slots()  # type: ignore[no-any-return]

    def release(self) -> None:
        pass


# ---------------------------------------------------------------------------- rank 0
class ReplicaLink:
    """Rank 0's side of the replica (see the module docstring). `on_lost(message)` is called once when a rank is
    gone; the link refuses everything after that."""

    def __init__(self, replica: Replica, on_lost: Callable[[str], None], keepalive_s: float = KEEPALIVE_S) -> None:
        if not replica.leader:
            raise ValueError("ReplicaLink is rank 0's; the other ranks run Follower")
        self.replica = replica
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self.lost = ""
        self.reports: list[rpb.RankReport] = []
        """What each rank held at the last `describe`, in rank order."""
        self._stop = threading.Event()
        self._keepalive = threading.Thread(target=self._keep_alive, args=(keepalive_s,), daemon=True)
        self._keepalive.start()

    @property
    def world_size(self) -> int:
        return self.replica.world_size

    # ------------------------------------------------------------ exchanges
    def _lose(self, e: BaseException) -> ReplicaUnavailableError:
        if not self.lost:
            self.lost = f"replica rank lost: {e}"
            log.error("%s; this replica stops serving and restarts as a unit", self.lost)
            self._on_lost(self.lost)
        return ReplicaUnavailableError(self.lost)

    def _check_alive(self) -> None:
        if self.lost:
            raise ReplicaUnavailableError(self.lost)

    def _send(self, work: rpb.RankWork) -> None:
        try:
            self.replica.broadcast_bytes(work.SerializeToString())
        except ReplicaLostError as e:
            raise self._lose(e) from e

    def _gather(self, mine: str) -> list[str]:
        try:
            return self.replica.gather_status(mine)
        except ReplicaLostError as e:
            raise self._lose(e) from e

    def call(self, work: rpb.RankWork, local: Callable[[], Any] | None = None) -> Any:
        """Send `work`, run `local` here meanwhile, gather every rank's status; returns what `local` returned.
        Raises `local`'s error, else GeneratorError naming the first rank that failed."""
        with self._lock:
            self._check_alive()
            self._send(work)
            result, error = None, None
            try:
                result = local() if local is not None else None
            except Exception as e:
                error = e
            statuses = self._gather(f"{type(error).__name__}: {error}" if error is not None else "")
        if error is not None:
            raise error
        _raise_first(statuses)
        return result

    def _keep_alive(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            if self._lock.acquire(blocking=False):
                try:
                    if not self.lost:
                        with contextlib.suppress(ReplicaUnavailableError):
                            self._send(rpb.RankWork())
                finally:
                    self._lock.release()

    def stop(self) -> None:
        """Tell every rank to exit (best effort)."""
        self._stop.set()
        with self._lock:
            if not self.lost:
                with contextlib.suppress(ReplicaUnavailableError):
                    self._send(rpb.RankWork(stop=rpb.Stop()))

    # ------------------------------------------------------------ what rank 0 hands the others
    def attach(self, att: Attachment, local: Callable[[], None]) -> None:
        """A new sidecar session: every rank maps its slab and loads the session's weights (`local`: rank 0's)."""
        if len(att.slabs) != self.world_size:
            raise ValueError(
                f"the sidecar serves {len(att.slabs)} slab(s) but this replica has {self.world_size} ranks: start "
                f"the sidecar with --devices listing each rank's device"
            )
        session = cpb.Session(
            session_id=att.session_id, slab=descriptor_to_proto(att.slabs[0]),
            slabs=[descriptor_to_proto(d) for d in att.slabs], generation=att.generation,
            weights_path=att.weights_path, fingerprint=att.fingerprint,
        )  # fmt: skip
        work = rpb.Attach(epoch=att.epoch, session=session.SerializeToString(), weights_path=att.weights_path,
                          fingerprint=att.fingerprint)  # fmt: skip
        self.call(rpb.RankWork(attach=work), local)

    def stage(self, weights_path: str, fingerprint: str, local: Callable[[], Any]) -> Any:
        return self.call(rpb.RankWork(stage=rpb.Stage(weights_path=weights_path, fingerprint=fingerprint)), local)

    def swap(self, action: rpb.SwapAction) -> None:
        self.call(rpb.RankWork(swap=rpb.Swap(action=action)))

    def describe(self, model: H3Model | None) -> None:
        """Ask every rank what it holds (after an attach or a swap); GetStatus reports the last answer."""
        with self._lock:
            self._check_alive()
            self._send(rpb.RankWork(describe=rpb.Describe()))
            try:
                mine = rank_report(self.replica, model).SerializeToString()
                answers = self.replica.gather_bytes(mine)
            except ReplicaLostError as e:
                raise self._lose(e) from e
        self.reports = [rpb.RankReport.FromString(a) for a in answers]

    def settle(self, action: rpb.SwapAction) -> None:
        """A swap after the outcome is decided (retire, drop): a failure here has already taken the replica
        NOT_SERVING for a restart, which loads the sidecar's truth; it is logged, not raised."""
        try:
            self.swap(action)
        except GeneratorError as e:
            log.warning("replica: %s after the update's outcome failed: %s", rpb.SwapAction.Name(action), e)

    def check_split(self, request: GenerationRequest, sizer: Any, prompt_tokens: int | None) -> None:
        """RequestError unless a t2va request's packed rows (video + audio from the canvas, text = the prompt's
        tokens) split across the ranks; fl2va's and ref2va's (vision tokens) are checked by every rank before the first
        forward."""
        if request.task != "t2va" or sizer is None or prompt_tokens is None:
            return
        rows = sizer.shapes.tokens(dataclasses.replace(Canvas.of(request), prompt_tokens=prompt_tokens)).total
        try:
            self.replica.spec.check_rows(rows)
        except SplitError as e:
            raise RequestError("request", str(e)) from None

    def run(
        self,
        model: H3Model,
        request: GenerationRequest,
        lease: Any,
        on_step: StepCallback | None,
        limits: RequestLimits,
        check: Callable[[], None] | None,
    ) -> GenerationResult:
        """One request on every rank (the executor's denoise step for N ranks)."""
        work = rpb.Run(request=request_to_work(request), fingerprint=model.info.fingerprint)
        if lease is not None:
            work.epoch = lease.epoch
            work.generation = lease.generation
            work.plan_keys.extend(_key_proto(k) for k in lease.keys)
            work.slots.extend(lease.slots)
        provider = _Fixed(_HeldLease(lease)) if lease is not None else None
        try:
            with self._lock:
                self._check_alive()
                self._send(rpb.RankWork(run=work))
                _raise_first(self._gather(""), LeaseCheckError)  # every rank's rows and weights, before the first step
                steps = _Lockstep(self.replica, on_step)
                result, error = None, None
                try:
                    result = generate(model, request, provider, steps, limits, check)
                    if lease is not None:
                        lease.check_rows()  # after the last step too
                except ReplicaLostError as e:
                    raise self._lose(e) from e
                except Exception as e:
                    agreed = (
                        e is steps.agreed or steps.done or isinstance(e, SplitError | RequestError | LeaseCheckError)
                    )
                    if not agreed:  # failed inside the loop on rank 0 alone: the others wait in a collective it left
                        raise self._lose(e) from e
                    error = e
                statuses = self._gather("")
        finally:
            if lease is not None:
                lease.release()
        if error is not None:
            if isinstance(error, SplitError):
                raise RequestError("request", str(error)) from error
            raise error
        _raise_first(statuses, LeaseCheckError)
        assert result is not None
        return result


def rank_report(replica: Replica, model: H3Model | None) -> rpb.RankReport:
    """This rank's device and its model's components."""
    components = [rpb.Component(**dataclasses.asdict(c)) for c in model.components()] if model is not None else []
    return rpb.RankReport(rank=replica.rank, device=str(replica.device), components=components)


def _raise_first(statuses: Sequence[str], kind: type[GeneratorError] = GeneratorError) -> None:
    for rank, status in enumerate(statuses):
        if status:
            raise kind(f"replica rank {rank}: {status}")


# ---------------------------------------------------------------------------- ranks 1..N-1
@dataclass
class _Served:
    model: H3Model | None = None
    staged: H3Model | None = None
    previous: H3Model | None = None


class Follower:
    """A rank other than 0: handles rank 0's work items until told to stop (see the module docstring)."""

    def __init__(
        self, replica: Replica, mode: str, options: RunOptions, limits: RequestLimits, checkpoint: Any = None
    ) -> None:
        if replica.leader:
            raise ValueError("rank 0 serves; Follower is for the other ranks")
        self.replica = replica
        self.mode = mode
        self.options = options
        self.limits = limits
        self.served = _Served()
        self.mapping: SlabMapping | None = None
        self.epoch = -1
        if mode == "resident":  # rank 0 loads the same checkpoint at start (ResidentBackend)
            self.served.model = self._load(validate_checkpoint(checkpoint, require_adaln=True))

    def _load(self, info: Any) -> H3Model:
        return load_model(info, self.mode, self.replica.device, self.options, self.replica)

    def serve(self) -> int:
        """Handle work until Stop (returns 0); a broken group raises ReplicaLostError."""
        log.info("replica rank %d of %d on %s: following rank 0", self.replica.rank, self.replica.world_size,
                 self.replica.device)  # fmt: skip
        while True:
            work = rpb.RankWork.FromString(self.replica.broadcast_bytes(None))
            kind = work.WhichOneof("work")
            if kind is None:
                continue  # keep-alive
            if kind == "stop":
                log.info("replica rank %d: stopping", self.replica.rank)
                return 0
            if kind == "run":
                self._run(work.run)
                continue
            if kind == "describe":
                self.replica.gather_bytes(rank_report(self.replica, self.served.model).SerializeToString())
                continue
            status = ""
            try:
                if kind == "attach":
                    self._attach(work.attach)
                elif kind == "stage":
                    self.served.staged = self._load(validate_checkpoint(work.stage.weights_path, require_adaln=False))
                else:
                    self._swap(work.swap.action)
            except Exception as e:
                log.exception("replica rank %d: %s failed", self.replica.rank, kind)
                status = f"{type(e).__name__}: {e}"
            self.replica.gather_status(status)

    def _attach(self, msg: rpb.Attach) -> None:
        session = cpb.Session.FromString(msg.session)
        desc = descriptor_from_proto(session.slabs[self.replica.rank])
        old, self.mapping = self.mapping, None
        if old is not None:
            old.close()
        self.mapping = SlabMapping.open(desc, self.replica.device)
        model = self.served.model
        if model is None or model.info.fingerprint != msg.fingerprint:
            info = validate_checkpoint(msg.weights_path, require_adaln=False)
            if info.fingerprint != msg.fingerprint:
                raise ValueError(f"{msg.weights_path}: fingerprint {info.fingerprint[:16]} differs from rank 0's")
            self.served.model = self._load(info)
        self.epoch = msg.epoch

    def _swap(self, action: rpb.SwapAction) -> None:
        s = self.served
        if action == rpb.SWAP_ACTION_INSTALL:
            if s.staged is None:
                raise ValueError("no staged weights to install")
            s.previous, s.model, s.staged = s.model, s.staged, None
        elif action == rpb.SWAP_ACTION_ROLLBACK:
            if s.previous is not None:
                s.model, s.previous = s.previous, None
        elif action == rpb.SWAP_ACTION_DROP:
            s.staged = None
        elif action == rpb.SWAP_ACTION_RETIRE:
            s.previous = None

    def _ready(self, msg: rpb.Run) -> tuple[H3Model, Any]:
        """The model and lease a Run needs, or the reason this rank cannot run it."""
        model = self.served.model
        if model is None:
            raise LeaseCheckError("no weights loaded on this rank")
        if model.info.fingerprint != msg.fingerprint:
            raise LeaseCheckError(
                f"this rank serves weights {model.info.fingerprint[:16]}, rank 0 runs {msg.fingerprint[:16]}"
            )
        if self.mode == "resident":
            return model, None
        if self.mapping is None or msg.epoch != self.epoch:
            raise LeaseCheckError(f"the lease is of session epoch {msg.epoch}, this rank mapped {self.epoch}")
        lease = _RankLease(self.mapping, _keys(msg), list(msg.slots), msg.generation)
        lease.check_rows()
        return model, lease

    def _run(self, msg: rpb.Run) -> None:
        request = request_from_work(msg.request)
        try:
            model, lease = self._ready(msg)
            status = ""
        except Exception as e:
            status = f"{type(e).__name__}: {e}"
        if any(self.replica.gather_status(status)):
            return  # some rank cannot run it: none does
        try:
            generate(model, request, _Fixed(lease) if lease is not None else None, _Lockstep(self.replica, None),
                     self.limits)  # fmt: skip
            if lease is not None:
                lease.check_rows()
            status = ""
        except (RankStoppedError, SplitError, RequestError, LeaseCheckError) as e:  # every rank stops there
            status = "" if isinstance(e, RankStoppedError) else f"{type(e).__name__}: {e}"
        except ReplicaLostError:
            raise
        except Exception:
            log.exception("replica rank %d: request %s failed on this rank alone", self.replica.rank,
                          request.request_id)  # fmt: skip
            raise
        self.replica.gather_status(status)


class _RankLease:
    """A rank's view of rank 0's lease: the same slots of its own slab (ditcore.model.SlabPlanLease)."""

    def __init__(self, mapping: SlabMapping, keys: list[PlanKey], slots: list[int], generation: int) -> None:
        self.mapping, self.keys, self.slots, self.generation = mapping, keys, slots, generation
        self.report = CacheReport()

    def check_rows(self) -> None:
        check_rows(self.mapping.table, self.keys, self.slots, self.generation, "the lease on this rank")

    def slab_slots(self) -> tuple[torch.Tensor, list[int]]:
        return self.mapping.slab, self.slots

    def pages(self, step: int) -> torch.Tensor:
        return self.mapping.slab[self.slots[step], : self.keys[step].width]

    def release(self) -> None:
        pass  # rank 0 holds and releases the lease


def follow(follower: Follower) -> int:
    """A rank's main loop: exit 0 on Stop, EXIT_REPLICA_LOST when the group broke or this rank failed alone."""
    try:
        return follower.serve()
    except Exception:
        log.exception("replica rank %d: the replica broke; exiting for a restart as a unit", follower.replica.rank)
        logging.shutdown()
        os._exit(EXIT_REPLICA_LOST)
