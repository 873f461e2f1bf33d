"""What the generator core needs from its plan-cache sidecar, without gRPC: the session
(`SidecarSession`), what one attachment maps (`Attachment`), and a lease on the mapped slab
(`RemoteLease`). `sidecar_client.SidecarClient` implements the session over gRPC.

Protocol (docs/architecture.md, "The slab and the lease protocol"): a session attaches and maps
the slab; every attachment bumps `epoch`; `prepare` leases one slot per step; the generator
checks each leased row (READY, the lease's generation, its key) before it reads pages, and
`release`s in every outcome; a prepare whose answer was lost is released by its request id. A lease from an older
epoch is dead. The weight-update steps
(`prepare_update`, `commit_update`, `abort_update`, `adopt`) are in "Weight generations and
UpdateWeights". Every failure is a domain error: SidecarUnavailableError when the sidecar is
gone or its answer was lost (CommitOutcomeUnknownError for a commit), GenerationMismatchError,
or SidecarError for any other refusal.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from ditcore.plans import PlanKey
from ditcore.report import CacheReport
from ditruntime.slab import (
    COL_ADAPTERS,
    COL_GENERATION,
    COL_LENGTH,
    COL_PARTITION,
    COL_STATE,
    READY,
    ROW_WORDS,
    SlabDescriptor,
    SlabMapping,
)

from ..errors import LeaseCheckError, SidecarUnavailableError


class AdapterSpec(NamedTuple):
    """A modulation-changing adapter a lease's plans are built with, as the sidecar is told it (it reads the file by
    name from its own --adapter-dir and must find this identity)."""

    name: str
    identity: str
    scale: float


class Committed(NamedTuple):
    """A committed weight update: the new generation, its fingerprint, and the partitions whose plans were kept
    (their `adaln_proj` unchanged: their cached plans were restamped, not dropped; () in resident mode)."""

    generation: int
    fingerprint: str
    kept_partitions: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class Attachment:
    """One live session: its id, the mapped slab and table, and what the sidecar serves.

    The mapping is closed when the session ends (before another slab is mapped); reading a
    closed one is SidecarUnavailableError. A session with another node's sidecar is not mapped here (`mapping`
    None): that node's own ranks map its slabs."""

    epoch: int
    session_id: str
    mapping: SlabMapping | None
    generation: int
    weights_path: str
    fingerprint: str
    slabs: tuple[SlabDescriptor, ...] = ()
    """Every device's slab of the session, in local rank order (a replica's other ranks on the node map slabs[r];
    this mapping is slabs[0]'s)."""
    nodes: tuple[Attachment, ...] = ()
    """A replica across nodes: every node's session, in node order (nodes[0] is this node's own, as above); empty
    on one node."""

    @property
    def node_attachments(self) -> tuple[Attachment, ...]:
        """Every node's session, in node order (this one alone on one node)."""
        return self.nodes or (self,)

    @property
    def descriptor(self) -> SlabDescriptor:
        return self.mapping.descriptor if self.mapping is not None else self.slabs[0]

    def _mapped(self) -> SlabMapping:
        if self.mapping is None:
            raise SidecarUnavailableError(f"the sidecar session {self.session_id} is another node's; not mapped here")
        if self.mapping.closed:
            raise SidecarUnavailableError(f"the sidecar session {self.session_id} ended; its slab is unmapped")
        return self.mapping

    @property
    def slab(self) -> torch.Tensor:
        """(S, W, P) in the model dtype, read-only view."""
        return self._mapped().slab

    @property
    def table(self) -> torch.Tensor:
        """(S, ROW_WORDS + W) int64, read-only view."""
        return self._mapped().table


def check_rows(table: torch.Tensor, keys: Sequence[PlanKey], slots: Sequence[int], generation: int, what: str) -> None:
    """LeaseCheckError naming `what` unless every slot's row of the slot table is READY, of `generation`, holding
    its key, partition included (the lease check every rank of a replica runs on the one table)."""
    for key, slot in zip(keys, slots, strict=True):
        if not 0 <= slot < int(table.shape[0]):
            raise LeaseCheckError(f"{what}: slot {slot} is outside the slab")
        row = table[slot].tolist()
        words = row[ROW_WORDS : ROW_WORDS + key.width]
        if (
            row[COL_STATE] != READY
            or row[COL_GENERATION] != generation
            or row[COL_LENGTH] != key.width
            or row[COL_PARTITION] != key.partition_code
            or row[COL_ADAPTERS] != key.adapters_code
            or tuple(words) != key.bits
        ):
            raise LeaseCheckError(
                f"{what}: slot {slot} row {row[:ROW_WORDS]} does not hold plan {key} of generation {generation}"
            )


class AttachedState(Protocol):
    """What a session reports its attachment to (health.ServingState)."""

    def set_attached(self, attached: bool) -> None: ...


class SessionLease(Protocol):
    """A lease as a session grants it (RemoteLease on one sidecar, node_sidecars.NodeLeases on every node's)."""

    epoch: int
    generation: int
    keys: list[PlanKey]
    slots: list[int]
    report: CacheReport

    @property
    def node_leases(self) -> list[tuple[int, list[int]]]:
        """(generation, slots) of every node's lease, in node order."""
        ...

    def alive(self) -> bool: ...

    def check_rows(self) -> None: ...

    def pages(self, step: int) -> torch.Tensor: ...

    def slab_slots(self) -> tuple[torch.Tensor, list[int]]: ...

    def release(self) -> None: ...


class RemoteLease:
    """A lease on the sidecar's slab; implements ditcore.generation.PlanLease (and ServedLease)."""

    def __init__(
        self,
        session: SidecarSession,
        att: Attachment,
        lease_id: int,
        keys: Sequence[PlanKey],
        slots: Sequence[int],
        report: CacheReport,
        generation: int,
    ) -> None:
        self._session = session
        self.att = att
        self.lease_id = lease_id
        self.keys = list(keys)
        self.slots = list(slots)
        self.report = report
        self.generation = generation
        self._released = False

        self.epoch = att.epoch

    def alive(self) -> bool:
        """False once the session that granted it has ended (a new attachment is a new epoch)."""
        att = self._session.attachment
        return att is not None and att.epoch == self.epoch

    def check_rows(self) -> None:
        """Every leased row must be READY, of this lease's generation, holding its key."""
        check_rows(self.att.table, self.keys, self.slots, self.generation, f"lease {self.lease_id}")

    def pages(self, step: int) -> torch.Tensor:
        """(width, page_numel) pages of step `step`: a view into the slab, no copy (on the slab's device)."""
        return self.att.slab[self.slots[step], : self.keys[step].width]

    def slab_slots(self) -> tuple[torch.Tensor, list[int]]:
        """The mapped slab and every step's slot (ditcore.generation.SlabPlanLease: read by ditcore.plans.SlotReads)."""
        return self.att.slab, self.slots

    @property
    def node_leases(self) -> list[tuple[int, list[int]]]:
        """(generation, slots) of every node's lease, in node order (this one alone on one node)."""
        return [(self.generation, self.slots)]

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._session.release(self)


NOT_ATTACHED = "not attached to the plan-cache sidecar (it is starting, restarting or unreachable); retry shortly"
"""What a caller is told while detached: the sidecar's address and the last error stay in the generator's log."""


class NodeState(NamedTuple):
    """One node's sidecar as rank 0 holds it (GetStatus)."""

    node: int
    target: str
    attached: bool
    generation: int
    weights_path: str
    fingerprint: str


class SidecarSession(ABC):
    """The generator's session with its sidecar; keeps itself attached once started."""

    target: str

    def node_states(self) -> list[NodeState]:
        """Every node's sidecar, in node order (this one's alone on one node)."""
        att = self.attachment
        if att is None:
            return [NodeState(0, self.target, False, 0, "", "")]
        return [NodeState(0, self.target, True, att.generation, att.weights_path, att.fingerprint)]

    # ---------------------------------------------------------------- lifecycle
    @abstractmethod
    def start(self) -> None:
        """Begin attaching (in the background; reattaches by itself after the sidecar goes away)."""

    @abstractmethod
    def close(self) -> None:
        """Idempotent: end the session."""

    @property
    @abstractmethod
    def attachment(self) -> Attachment | None:
        """The live attachment, or None while detached."""

    @property
    @abstractmethod
    def last_error(self) -> str:
        """Why the last attach failed ("" after a successful one)."""

    @abstractmethod
    def wait_attached(self, timeout_s: float) -> bool: ...

    # ---------------------------------------------------------------- leases
    @abstractmethod
    def prepare(
        self,
        keys: Sequence[PlanKey],
        generation: int,
        request_id: str,
        step_bound_s: float = 0.0,
        adapters: Sequence[AdapterSpec] = (),
    ) -> SessionLease:
        """Lease one READY slot per step of `keys`, built for `generation`. `step_bound_s` bounds one denoise step of
        the request (0: unknown): should the session vanish, the sidecar keeps the slots pinned at least that long.
        `request_id` (the request's own) tags the call at the sidecar: a call whose answer is lost (its deadline passed,
        the connection dropped) is released by that tag, so its lease is never left held. `adapters`: the
        modulation-changing adapters the keys with an adapters digest are built with."""

    @abstractmethod
    def release(self, lease: RemoteLease) -> None:
        """Best effort: a lease of a dead session is already gone at the sidecar."""

    # ---------------------------------------------------------------- weight updates
    @abstractmethod
    def prepare_update(self, from_generation: int, weights_path: str) -> str:
        """The sidecar checks the new checkpoint (nothing served changes); returns its fingerprint."""

    @abstractmethod
    def commit_update(self, from_generation: int, weights_path: str, timeout_s: float) -> Committed:
        """The sidecar's commit. Raises CommitOutcomeUnknownError when the answer was lost."""

    @abstractmethod
    def abort_update(self, weights_path: str) -> None:
        """Best effort: drop a prepared update at the sidecar."""

    @abstractmethod
    def adopt(self, generation: int, weights_path: str, fingerprint: str) -> None:
        """The committed update: same session and slab, new generation and weights."""

    @abstractmethod
    def reattach(self) -> None:
        """Drop the session; attach again and learn the sidecar's truth."""
