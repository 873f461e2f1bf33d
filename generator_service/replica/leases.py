"""What every rank hands ditcore's `generate` beside the request: the lockstep step callback and the lease adapters
(rank 0's held lease, a follower's view of it on its own slab). No grpc here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ditcore.generation import StepCallback
from ditcore.plans import PlanKey
from ditcore.replica import Replica
from ditcore.report import CacheReport
from ditruntime.slab import SlabMapping

from ..backends.sidecar_port import check_rows
from .work import RankStoppedError


class Lockstep:
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


class Fixed:
    """A PlanProvider handing out one lease already held."""

    def __init__(self, lease: Any) -> None:
        self.lease = lease

    def acquire(self, keys: Sequence[PlanKey]) -> Any:
        return self.lease


class HeldLease:
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


class RankLease:
    """A rank's view of rank 0's lease: the same slots of its own slab (ditcore.generation.SlabPlanLease)."""

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
