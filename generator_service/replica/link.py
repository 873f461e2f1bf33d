"""Rank 0's side of a replica: `ReplicaLink` drives every exchange with the other ranks (their side:
generator_service.replica.follower; the work items: generator_service.replica.work). No grpc here.

A replica of N generator ranks, one per device, joined in one torch.distributed group (ditcore.parallel): rank 0
serves the public API, queue and executor; every rank runs each request's denoise loop together (context parallel
through diffusers).

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
    Stop     rank 0 stops: every rank exits 0. A SIGINT or SIGTERM reaching every rank at once stops rank 0 alone;
             the others follow until its Stop, or end quietly when it is gone first (follower.follow).

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
import threading
from collections.abc import Callable
from typing import Any

from ditcore import GenerationRequest, GenerationResult, H3Model, RequestError, RequestLimits, generate
from ditcore.adapter_contract import AdapterError, AdapterNotFoundError
from ditcore.generation import StepCallback
from ditcore.parallel import SplitError
from ditcore.replica import Replica, ReplicaLostError
from ditcore.sizing import Canvas
from ditruntime.slab import descriptor_to_proto
from protos.ditserve.plancache.v1 import plancache_pb2 as cpb
from protos.ditserve.replica.v1 import replica_pb2 as rpb

from ..backends.sidecar_port import Attachment
from ..errors import GeneratorError, LeaseCheckError, ReplicaUnavailableError
from .leases import Fixed, HeldLease, Lockstep
from .work import key_to_work, raise_first, rank_report, request_to_work

log = logging.getLogger(__name__)

KEEPALIVE_S = 30.0
"""How often an idle rank 0 sends the keep-alive."""
REPLICA_TIMEOUT_MIN_S = 2 * KEEPALIVE_S
"""The shortest collective timeout (--replica-timeout-s) a replica runs with: an idle rank waits in a broadcast
until the next keep-alive, so a timeout under KEEPALIVE_S breaks every idle replica (which then restarts as a unit,
again and again); twice it leaves a late keep-alive (rank 0 busy, a slow host) its slack."""


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
            if self._stop.is_set():  # stopping: the other ranks may have stopped first (signalled with this one)
                log.info("replica: the other ranks had gone when this one stopped")
            else:
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
        raise_first(statuses)
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
        """A new sidecar session (on a replica across nodes, one per node): every rank maps its node's slab of it and
        loads the session's weights (`local`: rank 0's)."""
        nodes = att.node_attachments
        if len(nodes) != self.replica.nnodes:
            raise ValueError(f"{len(nodes)} sidecar session(s) for a replica of {self.replica.nnodes} node(s)")
        for n, node in enumerate(nodes):
            if len(node.slabs) != self.replica.per_node:
                where = f"node {n}'s sidecar" if len(nodes) > 1 else "the sidecar"
                raise ValueError(
                    f"{where} serves {len(node.slabs)} slab(s) but this replica has {self.replica.per_node} rank(s) "
                    "per node: start each node's sidecar with --devices listing each of its ranks' devices"
                )
        sessions = [
            cpb.Session(
                session_id=node.session_id, slab=descriptor_to_proto(node.slabs[0]),
                slabs=[descriptor_to_proto(d) for d in node.slabs], generation=node.generation,
                weights_path=node.weights_path, fingerprint=node.fingerprint,
            ).SerializeToString()
            for node in nodes
        ]  # fmt: skip
        work = rpb.Attach(epoch=att.epoch, node_sessions=sessions, weights_path=att.weights_path,
                          fingerprint=att.fingerprint)  # fmt: skip
        self.call(rpb.RankWork(attach=work), local)

    def stage(self, weights_path: str, fingerprint: str, local: Callable[[], Any]) -> Any:
        return self.call(rpb.RankWork(stage=rpb.Stage(weights_path=weights_path, fingerprint=fingerprint)), local)

    def swap(self, action: rpb.SwapAction) -> None:
        self.call(rpb.RankWork(swap=rpb.Swap(action=action)))

    def describe(self, model: H3Model | None) -> None:
        """Ask every rank what it holds (after an attach or a swap); GetStatus reports the last answer.
        GeneratorError when a rank serves other transformer partitions than rank 0 (each rank places its model by
        its own free memory: unequal devices could choose differently): the replica then does not serve."""
        with self._lock:
            self._check_alive()
            self._send(rpb.RankWork(describe=rpb.Describe()))
            try:
                mine = rank_report(self.replica, model).SerializeToString()
                answers = self.replica.gather_bytes(mine)
            except ReplicaLostError as e:
                raise self._lose(e) from e
        self.reports = [rpb.RankReport.FromString(a) for a in answers]
        check_same_partitions(self.reports)

    def settle(self, action: rpb.SwapAction) -> None:
        """A swap after the outcome is decided (retire, drop): a failure here has already taken the replica
        NOT_SERVING for a restart, which loads the sidecar's truth; it is logged, not raised."""
        try:
            self.swap(action)
        except GeneratorError as e:
            log.warning("replica: %s after the update's outcome failed: %s", rpb.SwapAction.Name(action), e)

    def check_split(self, request: GenerationRequest, sizer: Any, prompt_tokens: int | None) -> None:
        """RequestError unless a t2va request's packed rows (video + audio from the canvas, text = the prompt's
        tokens) run on the layout: any length, but on a unified Ulysses x ring layout a multiple of the ranks
        (ParallelSpec.check_rows); fl2va's and ref2va's (vision tokens) are checked by every rank before the first
        forward."""
        if not self.replica.spec.unified or request.task != "t2va" or sizer is None or prompt_tokens is None:
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
        """One request on every rank (the executor's denoise step for N ranks). Its adapters are read here once and
        every rank must find the same identities (its own --adapter-dir read by the same names)."""
        try:
            uses = model.adapter_set.resolve(request)
            level, _ = model.quality.for_request(request, self.replica.world_size, uses)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        step_cache = level.cache if level is not None else None
        work = rpb.Run(request=request_to_work(request, [info.identity for info, _ in uses], step_cache),
                       fingerprint=model.info.fingerprint)  # fmt: skip
        if lease is not None:
            work.epoch = lease.epoch
            work.plan_keys.extend(key_to_work(k) for k in lease.keys)
            work.nodes.extend(rpb.NodeLease(generation=g, slots=s) for g, s in lease.node_leases)
        provider = Fixed(HeldLease(lease)) if lease is not None else None
        try:
            with self._lock:
                self._check_alive()
                self._send(rpb.RankWork(run=work))
                raise_first(self._gather(""), LeaseCheckError)  # every rank's rows and weights, before the first step
                steps = Lockstep(self.replica, on_step)
                result, error = None, None
                try:
                    result = generate(model, request, provider, steps, limits, check, uses)
                    if lease is not None:
                        lease.check_rows()  # after the last step too
                except ReplicaLostError as e:
                    raise self._lose(e) from e
                except Exception as e:
                    agreed = (
                        e is steps.agreed
                        or steps.done
                        or isinstance(
                            e, SplitError | RequestError | LeaseCheckError | AdapterError | AdapterNotFoundError
                        )
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
        raise_first(statuses, LeaseCheckError)
        assert result is not None
        return result


def check_same_partitions(reports: list[rpb.RankReport]) -> None:
    """GeneratorError unless every rank that holds a model holds the same transformer partitions as rank 0."""
    held = {r.rank: sorted(c.name for c in r.components if c.name.startswith("transformer")) for r in reports}
    leader = held.get(0, [])
    for rank, names in held.items():
        if names and leader and names != leader:
            raise GeneratorError(
                f"replica rank {rank} holds the transformer partitions {', '.join(names)} but rank 0 holds "
                f"{', '.join(leader)}: its device had other free memory when --partitions auto chose; give every "
                "rank an equal device, or name --partitions"
            )
