"""A replica across nodes: rank 0's sessions with every node's plan-cache sidecar, held as the one `SidecarSession`
the cached backend talks to (`NodeSidecars`). No grpc here: each node's session is a SidecarSession of its own
(sidecar_client.SidecarClient), built by the factory the assembly passes in.

Every node runs one sidecar that owns its node's slabs (one per device of that node). Rank 0 is the one client of
every node's sidecar: node 0's session maps its slab (rank 0 reads it); another node's is leased and updated only,
its slabs mapped by that node's own ranks (from the replica's Attach work item, generator_service.replica.link).

    attached   only while every node's session is live and every node serves node 0's weights (the same
               fingerprint). A node whose weights differ (its sidecar restarted from an older state dir, or it missed
               a commit) is brought to node 0's weights first (its own prepare + commit): node 0's sidecar is the
               replica's record of what is served. The replica's epoch counts these joins; any node's session ending
               ends the join (NOT_SERVING) until every node is back.
    prepare    one lease per node, prepared concurrently (each sidecar finds or rebuilds its own plans, from its own
               node's copy of the checkpoint), of that node's own generation; any node refusing releases the others.
               Rank 0 reads node 0's lease; the Run hands every node its own slots (`node_leases`).
    update     all or none. Prepare on every node (a refusal anywhere aborts everywhere: nothing changed). Commit on
               node 0 first, the decision; an unknown outcome there stops it (the backend reattaches and node 0's truth
               decides), a refusal there aborts the others. Then every other node commits; one that fails or does not
               answer is behind node 0: its session is dropped (NOT_SERVING), and the join that brings it back brings
               it to node 0's weights before any request runs. No request ever runs on two weight versions: every
               rank checks its node's leased rows (READY, its node's generation, the key) and its own weights'
               fingerprint against rank 0's before the first step and after the last.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ditcore.plans import PlanKey

from ..errors import NodeWeightsDifferError, SidecarUnavailableError
from .sidecar_port import (
    NOT_ATTACHED,
    AdapterSpec,
    AttachedState,
    Attachment,
    Committed,
    NodeState,
    RemoteLease,
    SessionLease,
    SidecarSession,
)

log = logging.getLogger(__name__)

CONVERGE_TIMEOUT_S = 600.0
"""How long a node's commit of node 0's weights may take when the replica joins (a full load at the sidecar)."""


NodeSessionFactory = Callable[[int, str, Callable[[Attachment], None], AttachedState], SidecarSession]
"""(node, target, on_attach, state) -> that node's session: node 0's maps its slab, the others' do not."""


class NodeLeases:
    """One request's leases, one per node, in node order: rank 0 reads node 0's (a ServedLease and PlanLease);
    `node_leases` is what the Run hands every node."""

    def __init__(self, session: NodeSidecars, epoch: int, leases: Sequence[SessionLease]) -> None:
        self._session = session
        self.epoch = epoch
        self._leases = list(leases)
        own = self._leases[0]
        self.keys, self.slots, self.generation, self.report = own.keys, own.slots, own.generation, own.report

    @property
    def node_leases(self) -> list[tuple[int, list[int]]]:
        return [(lease.generation, lease.slots) for lease in self._leases]

    def alive(self) -> bool:
        """False once the join that granted it ended (any node's session)."""
        att = self._session.attachment
        return att is not None and att.epoch == self.epoch and all(lease.alive() for lease in self._leases)

    def check_rows(self) -> None:
        self._leases[0].check_rows()  # the other nodes' rows: checked by their own ranks (the Run)

    def pages(self, step: int) -> torch.Tensor:
        return self._leases[0].pages(step)

    def slab_slots(self) -> tuple[torch.Tensor, list[int]]:
        return self._leases[0].slab_slots()

    def release(self) -> None:
        for lease in self._leases:
            lease.release()


class _NodeState:
    """A node session's AttachedState: its end ends the join."""

    def __init__(self, owner: NodeSidecars, node: int) -> None:
        self.owner, self.node = owner, node

    def set_attached(self, attached: bool) -> None:
        if not attached:
            self.owner._node_detached(self.node)


class NodeSidecars(SidecarSession):
    """Rank 0's sessions with every node's sidecar, as one session (see the module docstring). `on_attach` vets each
    join (CachedWeights.on_attach: every rank maps its node's slab and loads the weights); `state` hears whether the
    replica is attached."""

    def __init__(
        self,
        targets: Sequence[str],
        factory: NodeSessionFactory,
        on_attach: Callable[[Attachment], None],
        state: AttachedState,
        converge_timeout_s: float = CONVERGE_TIMEOUT_S,
    ) -> None:
        if len(targets) < 2:
            raise ValueError("NodeSidecars joins the sidecars of two or more nodes")
        self.target = ",".join(targets)
        self.targets = list(targets)
        self._on_attach = on_attach
        self._state = state
        self.converge_timeout_s = converge_timeout_s
        self._lock = threading.RLock()
        self._node_att: list[Attachment | None] = [None] * len(targets)
        self._att: Attachment | None = None
        self._epoch = 0
        self._behind: list[int] = []  # nodes whose commit failed: reattached after the adopt
        self._committed: dict[int, Committed] = {}
        self.nodes = [
            factory(node, target, self._attach_callback(node), _NodeState(self, node))
            for node, target in enumerate(targets)
        ]

    def _attach_callback(self, node: int) -> Callable[[Attachment], None]:
        return lambda att: self._node_attached(node, att)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        for session in self.nodes:
            session.start()

    def close(self) -> None:
        for session in self.nodes:
            session.close()

    @property
    def attachment(self) -> Attachment | None:
        return self._att

    @property
    def last_error(self) -> str:
        errors = [f"node {n}: {s.last_error}" for n, s in enumerate(self.nodes) if s.last_error]
        return "; ".join(errors)

    def node_states(self) -> list[NodeState]:
        states = []
        for node, (session, known) in enumerate(zip(self.nodes, self._node_att, strict=True)):
            att = known if session.attachment is not None else None
            states.append(NodeState(node, self.targets[node], att is not None, att.generation if att else 0,
                                    att.weights_path if att else "", att.fingerprint if att else ""))  # fmt: skip
        return states

    def wait_attached(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while self._att is None and time.monotonic() < end:
            time.sleep(0.02)
        return self._att is not None

    # ---------------------------------------------------------------- the join
    def _node_attached(self, node: int, att: Attachment) -> None:
        """Node `node`'s session is live (called on its session's thread; raising keeps it detached, and it retries)."""
        with self._lock:
            self._node_att[node] = att
            self._att = None
            missing = [n for n, a in enumerate(self._node_att) if a is None]
            if missing:
                log.info("node %d's sidecar attached (generation %d); waiting for node(s) %s", node, att.generation,
                         ", ".join(map(str, missing)))  # fmt: skip
                return
            try:
                self._join()
            except BaseException:
                self._node_att[node] = None
                raise

    def _join(self) -> None:
        atts = [a for a in self._node_att if a is not None]
        lead = atts[0]
        for node in range(1, len(atts)):
            if atts[node].fingerprint != lead.fingerprint:
                atts[node] = self._converge(node, atts[node], lead)
                self._node_att[node] = atts[node]
        self._epoch += 1
        joined = dataclasses.replace(lead, epoch=self._epoch, nodes=tuple(atts))
        self._on_attach(joined)  # every rank maps its node's slab and loads the weights; may raise
        self._att = joined
        log.info("attached to the sidecars of %d nodes (replica epoch %d, generations %s)", len(atts), self._epoch,
                 ", ".join(str(a.generation) for a in atts))  # fmt: skip
        self._state.set_attached(True)

    def _converge(self, node: int, att: Attachment, lead: Attachment) -> Attachment:
        """Bring node `node`'s sidecar to node 0's weights (its own prepare + commit); its new attachment."""
        log.warning(
            "node %d's sidecar serves %s (fingerprint %s, generation %d) but node 0's serves %s (%s): committing "
            "node 0's weights on node %d before the replica serves", node, att.weights_path, att.fingerprint[:16],
            att.generation, lead.weights_path, lead.fingerprint[:16], node,
        )  # fmt: skip
        session = self.nodes[node]
        fingerprint = session.prepare_update(att.generation, lead.weights_path)
        if fingerprint != lead.fingerprint:
            session.abort_update(lead.weights_path)
            raise NodeWeightsDifferError(
                f"node {node} reads {lead.weights_path} as fingerprint {fingerprint[:16]}, node 0 as "
                f"{lead.fingerprint[:16]}: the nodes' copies of the checkpoint differ",
            )  # fmt: skip
        done = session.commit_update(att.generation, lead.weights_path, self.converge_timeout_s)
        session.adopt(done.generation, lead.weights_path, done.fingerprint)
        return dataclasses.replace(att, generation=done.generation, weights_path=lead.weights_path,
                                   fingerprint=done.fingerprint)  # fmt: skip

    def _node_detached(self, node: int) -> None:
        with self._lock:
            self._node_att[node] = None
            if self._att is not None:
                self._att = None
                log.warning("node %d's sidecar session ended: the replica serves nothing until every node is back",
                            node)  # fmt: skip
                self._state.set_attached(False)

    def _require(self) -> Attachment:
        att = self._att
        if att is None:
            raise SidecarUnavailableError(NOT_ATTACHED)
        return att

    # ---------------------------------------------------------------- leases
    def prepare(
        self,
        keys: Sequence[PlanKey],
        generation: int,
        request_id: str,
        step_bound_s: float = 0.0,
        adapters: Sequence[AdapterSpec] = (),
    ) -> NodeLeases:
        att = self._require()
        nodes = att.node_attachments
        gens = [generation, *(a.generation for a in nodes[1:])]  # node 0's is the replica's (checked by node 0)
        with ThreadPoolExecutor(len(self.nodes), thread_name_prefix="node-prepare") as pool:
            futures = [
                pool.submit(s.prepare, keys, g, request_id, step_bound_s, adapters)
                for s, g in zip(self.nodes, gens, strict=True)
            ]
        leases, errors = [], []
        for future in futures:
            try:
                leases.append(future.result())
            except Exception as e:
                errors.append(e)
        if errors:
            for lease in leases:
                lease.release()
            raise errors[0]
        return NodeLeases(self, att.epoch, leases)

    def release(self, lease: RemoteLease) -> None:
        lease.release()

    # ---------------------------------------------------------------- weight updates
    def prepare_update(self, from_generation: int, weights_path: str) -> str:
        att = self._require()
        gens = [from_generation, *(a.generation for a in att.node_attachments[1:])]
        prepared: list[SidecarSession] = []
        fingerprints = []
        try:
            for session, gen in zip(self.nodes, gens, strict=True):
                fingerprints.append(session.prepare_update(gen, weights_path))
                prepared.append(session)
            if len(set(fingerprints)) > 1:
                raise NodeWeightsDifferError(
                    f"the nodes read {weights_path} as different checkpoints (fingerprints "
                    f"{', '.join(f[:16] for f in fingerprints)}): every node needs the same files",
                )  # fmt: skip
        except BaseException:
            for session in prepared:
                session.abort_update(weights_path)
            raise
        return fingerprints[0]

    def commit_update(self, from_generation: int, weights_path: str, timeout_s: float) -> Committed:
        att = self._require()
        gens = [a.generation for a in att.node_attachments]
        try:
            done = self.nodes[0].commit_update(from_generation, weights_path, timeout_s)  # the decision
        except SidecarUnavailableError:
            raise  # an unknown outcome: the backend reattaches every node and node 0's truth decides
        except BaseException:
            for session in self.nodes[1:]:
                session.abort_update(weights_path)
            raise
        self._committed, self._behind = {0: done}, []
        for node in range(1, len(self.nodes)):
            try:
                self._committed[node] = self.nodes[node].commit_update(gens[node], weights_path, timeout_s)
            except Exception as e:
                log.error("node %d's sidecar did not commit %s (%s): node 0 did, so node %d is brought to it before "
                          "the replica serves again", node, weights_path, e, node)  # fmt: skip
                self._behind.append(node)
        return done

    def abort_update(self, weights_path: str) -> None:
        for session in self.nodes:
            session.abort_update(weights_path)

    def adopt(self, generation: int, weights_path: str, fingerprint: str) -> None:
        """The committed update, on every node that committed it (node 0's `generation`, the others' own)."""
        with self._lock:
            committed = {node: done for node, done in self._committed.items() if node}
            committed[0] = Committed(generation, fingerprint)
            for node, done in committed.items():
                self.nodes[node].adopt(done.generation, weights_path, done.fingerprint)
                known = self._node_att[node]
                if known is not None:  # what the next join starts from, too
                    self._node_att[node] = dataclasses.replace(
                        known, generation=done.generation, weights_path=weights_path, fingerprint=done.fingerprint
                    )
            att = self._att
            if att is not None:
                nodes = tuple(
                    self._node_att[n] or a if n in committed else a for n, a in enumerate(att.node_attachments)
                )
                self._att = dataclasses.replace(att, generation=generation, weights_path=weights_path,
                                                fingerprint=fingerprint, nodes=nodes)  # fmt: skip
            behind, self._behind, self._committed = self._behind, [], {}
        for node in behind:  # its reattach converges it to node 0's weights before the replica serves
            self.nodes[node].reattach()

    def reattach(self) -> None:
        for session in self.nodes:
            session.reattach()
