"""Ranks 1..N-1 of a replica: `Follower` handles rank 0's work items until told to stop, and `follow` is such a
rank's main loop (the protocol: generator_service.replica.link). No grpc here."""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

from ditcore import GenerationRequest, H3Model, RequestError, RequestLimits, generate, load_model, validate_checkpoint
from ditcore.adapter_contract import AdapterError, AdapterNotFoundError
from ditcore.model import RunOptions
from ditcore.parallel import SplitError
from ditcore.pipeline import quiet_block_errors
from ditcore.replica import Replica, ReplicaLostError
from ditruntime.slab import SlabMapping, descriptor_from_proto
from protos.ditserve.plancache.v1 import plancache_pb2 as cpb
from protos.ditserve.replica.v1 import replica_pb2 as rpb

from ..backends.placement import StartPlacement
from ..errors import LeaseCheckError
from .leases import Fixed, Lockstep, RankLease
from .work import (
    EXIT_REPLICA_LOST,
    RankStoppedError,
    keys_from_work,
    rank_report,
    request_from_work,
    step_cache_from_work,
)

log = logging.getLogger(__name__)


@dataclass
class _Served:
    model: H3Model | None = None
    staged: H3Model | None = None
    previous: H3Model | None = None


class Follower:
    """A rank other than 0: handles rank 0's work items until told to stop (see generator_service.replica.link)."""

    def __init__(
        self,
        replica: Replica,
        mode: str,
        options: RunOptions,
        limits: RequestLimits,
        checkpoint: Any = None,
        placement: StartPlacement | None = None,
    ) -> None:
        if replica.leader:
            raise ValueError("rank 0 serves; Follower is for the other ranks")
        self.replica = replica
        self.mode = mode
        self.options = options
        self.placement = placement
        """rank 0's rule on this rank's free memory: the same partitions on equal devices (ditcore.placement)."""
        self.limits = limits
        self.served = _Served()
        self.mapping: SlabMapping | None = None
        self.epoch = -1
        quiet_block_errors(RankStoppedError)  # rank 0 stopping a request is no block's error: rank 0 logs it
        if mode == "resident":  # rank 0 loads the same checkpoint at start (ResidentBackend)
            self.served.model = self._load(validate_checkpoint(checkpoint, require_adaln=True))

    def _load(self, info: Any) -> H3Model:
        options = self.placement.resolve(info, self.options) if self.placement is not None else self.options
        return load_model(info, self.mode, self.replica.device, options, self.replica)

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
        sessions = list(msg.node_sessions)
        if len(sessions) != self.replica.nnodes:
            raise ValueError(f"{len(sessions)} sidecar session(s) for a replica of {self.replica.nnodes} node(s)")
        session = cpb.Session.FromString(sessions[self.replica.node_rank])  # this node's sidecar
        desc = descriptor_from_proto(session.slabs[self.replica.local_rank])
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

    def _ready(self, msg: rpb.Run, request: GenerationRequest) -> tuple[H3Model, Any, list[Any]]:
        """The model, lease and adapters a Run needs, or the reason this rank cannot run it."""
        model = self.served.model
        if model is None:
            raise LeaseCheckError("no weights loaded on this rank")
        if model.info.fingerprint != msg.fingerprint:
            raise LeaseCheckError(
                f"this rank serves weights {model.info.fingerprint[:16]}, rank 0 runs {msg.fingerprint[:16]}"
            )
        uses = model.adapter_set.resolve(request)  # this rank's --adapter-dir, by the same names
        for (info, _), sent in zip(uses, msg.request.adapters, strict=True):
            if info.identity != sent.identity:
                raise LeaseCheckError(
                    f"adapter {info.name} is {info.identity[:16]} on this rank but {sent.identity[:16]} on rank 0: "
                    "every rank must read the same adapter files"
                )
        if self.mode == "resident":
            return model, None, uses
        if self.mapping is None or msg.epoch != self.epoch:
            raise LeaseCheckError(f"the lease is of session epoch {msg.epoch}, this rank mapped {self.epoch}")
        mine = msg.nodes[self.replica.node_rank]  # this node's own lease on its own sidecar
        lease = RankLease(self.mapping, keys_from_work(msg), list(mine.slots), mine.generation)
        lease.check_rows()
        return model, lease, uses

    def _run(self, msg: rpb.Run) -> None:
        request = request_from_work(msg.request)
        try:
            model, lease, uses = self._ready(msg, request)
            status = ""
        except Exception as e:
            status = f"{type(e).__name__}: {e}"
        if any(self.replica.gather_status(status)):
            return  # some rank cannot run it: none does
        try:
            generate(model, request, Fixed(lease) if lease is not None else None, Lockstep(self.replica, None),
                     self.limits, adapters=uses, step_cache=step_cache_from_work(msg.request))  # fmt: skip
            if lease is not None:
                lease.check_rows()
            status = ""
        except (RankStoppedError, SplitError, RequestError, LeaseCheckError, AdapterError, AdapterNotFoundError) as e:
            # every rank stops there (an adapter: every rank reads the same files before the first collective)
            status = "" if isinstance(e, RankStoppedError) else f"{type(e).__name__}: {e}"
        except ReplicaLostError:
            raise
        except Exception:
            log.exception("replica rank %d: request %s failed on this rank alone", self.replica.rank,
                          request.request_id)  # fmt: skip
            raise
        self.replica.gather_status(status)


def follow(follower: Follower) -> int:
    """A rank's main loop: exit 0 on Stop, EXIT_REPLICA_LOST when the group broke or this rank failed alone.

    SIGINT and SIGTERM (a terminal's Ctrl-C, torchrun's agent passing one on) reach every rank at once: this one keeps
    following until rank 0, which stops on them, sends Stop; if rank 0 is gone first, the broken group is that stop,
    not a failure (one line, exit 0)."""
    signalled = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: signalled.set())
    try:
        return follower.serve()
    except Exception as e:
        if signalled.is_set():
            log.info("replica rank %d: stopped with rank 0 (%s)", follower.replica.rank, type(e).__name__)
            return 0
        log.exception("replica rank %d: the replica broke; exiting for a restart as a unit", follower.replica.rank)
        logging.shutdown()
        os._exit(EXIT_REPLICA_LOST)
