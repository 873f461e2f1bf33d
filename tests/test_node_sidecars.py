"""NodeSidecars, rank 0's sessions with every node's sidecar (generator_service.backends.node_sidecars), against
scripted node sessions: the join waits for every node and brings a node on other weights to node 0's before anything
is served; a lease is one per node, each of its own node's generation; an update is all or none (a refusal anywhere
aborts everywhere; node 0's commit decides; a node that misses the commit is brought to node 0's weights before the
replica serves again). The real sidecars and ranks: tests/parallel/test_replica_nodes.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from ditcore.plans import PlanKey
from ditcore.report import CacheReport
from generator_service.backends.node_sidecars import NodeLeases, NodeSidecars
from generator_service.backends.sidecar_port import AttachedState, Attachment, Committed, SidecarSession
from generator_service.errors import (
    CommitOutcomeUnknownError,
    NodeWeightsDifferError,
    SidecarError,
    SidecarUnavailableError,
)

KEYS = [PlanKey((1065353216,), "base"), PlanKey((1056964608,), "base")]


class Lease:
    def __init__(self, node: FakeNode, generation: int, slots: list[int]) -> None:
        self.node, self.generation, self.slots, self.keys = node, generation, slots, list(KEYS)
        self.epoch, self.report, self.released = 1, CacheReport(), False

    @property
    def node_leases(self) -> list[tuple[int, list[int]]]:
        return [(self.generation, self.slots)]

    def alive(self) -> bool:
        return self.node.att is not None

    def check_rows(self) -> None:
        self.node.calls.append("check_rows")

    def pages(self, step: int) -> Any:
        return None

    def slab_slots(self) -> Any:
        return None, self.slots

    def release(self) -> None:
        self.released = True
        self.node.calls.append("release")


class FakeNode(SidecarSession):
    """One node's session: records calls; `fail` maps a method name to the error it raises."""

    def __init__(self, node: int, target: str, on_attach: Callable[[Attachment], None], state: AttachedState) -> None:
        self.node, self.target, self.on_attach, self.state = node, target, on_attach, state
        self.calls: list[str] = []
        self.fail: dict[str, Exception] = {}
        self.att: Attachment | None = None
        self.generation, self.path, self.fingerprint = 1, "/w/A", "fp-A"
        self.read_as: dict[str, str] = {"/w/A": "fp-A", "/w/B": "fp-B"}

    # the scripted sidecar
    def connect(self) -> None:
        att = Attachment(1, f"s{self.node}", None, self.generation, self.path, self.fingerprint)
        self.on_attach(att)  # raising keeps this node detached, as SidecarClient
        self.att = att

    def drop(self) -> None:
        self.att = None
        self.state.set_attached(False)

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail[name]

    # SidecarSession
    def start(self) -> None:
        self.calls.append("start")

    def close(self) -> None:
        self.calls.append("close")

    @property
    def attachment(self) -> Attachment | None:
        return self.att

    @property
    def last_error(self) -> str:
        return ""

    def wait_attached(self, timeout_s: float) -> bool:
        return self.att is not None

    def prepare(
        self, keys: Sequence[PlanKey], generation: int, request_id: str, step_bound_s: float = 0.0, adapters: Any = ()
    ) -> Lease:
        self._call(f"prepare@{generation}")
        return Lease(self, generation, [self.node * 10, self.node * 10 + 1])

    def release(self, lease: Any) -> None:
        lease.release()

    def prepare_update(self, from_generation: int, weights_path: str) -> str:
        self._call(f"prepare_update@{from_generation}:{weights_path}")
        return self.read_as[weights_path]

    def commit_update(self, from_generation: int, weights_path: str, timeout_s: float) -> Committed:
        self._call(f"commit@{from_generation}:{weights_path}")
        self.generation, self.path, self.fingerprint = from_generation + 1, weights_path, self.read_as[weights_path]
        return Committed(self.generation, self.fingerprint)

    def abort_update(self, weights_path: str) -> None:
        self.calls.append(f"abort:{weights_path}")

    def adopt(self, generation: int, weights_path: str, fingerprint: str) -> None:
        self.calls.append(f"adopt@{generation}")

    def reattach(self) -> None:
        self.calls.append("reattach")


class State:
    def __init__(self) -> None:
        self.history: list[bool] = []

    def set_attached(self, attached: bool) -> None:
        self.history.append(attached)


def make(
    n: int = 2, on_attach: Callable[[Attachment], None] | None = None
) -> tuple[NodeSidecars, list[FakeNode], State]:
    state, seen = State(), list[Attachment]()
    nodes = NodeSidecars([f"unix:/n{i}.sock" for i in range(n)], FakeNode, on_attach or seen.append, state)
    return nodes, nodes.nodes, state  # type: ignore[return-value]


def joined(n: int = 2) -> tuple[NodeSidecars, list[FakeNode], State]:
    nodes, fakes, state = make(n)
    for fake in fakes:
        fake.connect()
    assert nodes.attachment is not None
    return nodes, fakes, state


def test_the_replica_attaches_once_every_node_has_and_hands_every_session_in_node_order() -> None:
    seen: list[Attachment] = []
    nodes, fakes, state = make(3, seen.append)
    fakes[2].connect()
    fakes[0].connect()
    assert nodes.attachment is None and not seen and state.history == []
    fakes[1].connect()
    att = nodes.attachment
    assert att is not None and seen == [att] and state.history == [True]
    assert [a.session_id for a in att.node_attachments] == ["s0", "s1", "s2"] and att.epoch == 1
    assert nodes.target == "unix:/n0.sock,unix:/n1.sock,unix:/n2.sock"


def test_a_node_leaving_ends_the_join_until_it_is_back_as_a_new_epoch() -> None:
    nodes, fakes, state = joined()
    fakes[1].drop()
    assert nodes.attachment is None and state.history == [True, False]
    with pytest.raises(SidecarUnavailableError, match="not attached"):
        nodes.prepare(KEYS, 1, "r")
    fakes[1].connect()
    assert nodes.attachment is not None and nodes.attachment.epoch == 2 and state.history == [True, False, True]


def test_a_node_on_other_weights_is_brought_to_node_0s_before_the_join() -> None:
    seen: list[Attachment] = []
    _, fakes, _ = make(2, seen.append)
    fakes[1].path, fakes[1].fingerprint, fakes[1].generation = "/w/B", "fp-B", 4
    fakes[0].connect()
    fakes[1].connect()
    assert fakes[1].calls == ["prepare_update@4:/w/A", "commit@4:/w/A", "adopt@5"]
    att = seen[0]
    assert [(a.generation, a.weights_path, a.fingerprint) for a in att.node_attachments] == [
        (1, "/w/A", "fp-A"), (5, "/w/A", "fp-A")
    ]  # fmt: skip


def test_a_node_that_reads_node_0s_path_as_other_files_never_joins() -> None:
    nodes, fakes, _ = make()
    fakes[1].path, fakes[1].fingerprint = "/w/B", "fp-B"
    fakes[1].read_as["/w/A"] = "fp-other"
    fakes[0].connect()
    with pytest.raises(NodeWeightsDifferError, match="copies of the checkpoint differ"):
        fakes[1].connect()
    assert nodes.attachment is None and fakes[1].att is None and "abort:/w/A" in fakes[1].calls
    assert not any(c.startswith("commit") for c in fakes[1].calls)


def test_a_lease_is_one_per_node_each_of_its_own_generation() -> None:
    nodes, fakes, _ = make()
    fakes[1].generation = 7  # its own count (the same weights): each sidecar keeps its own generations
    for fake in fakes:
        fake.connect()
    lease = nodes.prepare(KEYS, 1, "r")
    assert isinstance(lease, NodeLeases)
    assert lease.node_leases == [(1, [0, 1]), (7, [10, 11])] and lease.generation == 1
    assert fakes[0].calls[-1] == "prepare@1" and fakes[1].calls[-1] == "prepare@7"
    assert lease.alive()
    lease.release()
    assert fakes[0].calls[-1] == fakes[1].calls[-1] == "release"


def test_a_lease_refused_on_one_node_releases_the_others() -> None:
    nodes, fakes, _ = joined()
    fakes[1].fail["prepare@1"] = SidecarError("RESOURCE_EXHAUSTED", "NO_FREE_SLOTS", "full")
    with pytest.raises(SidecarError, match="full"):
        nodes.prepare(KEYS, 1, "r")
    assert fakes[0].calls[-1] == "release"


def test_an_update_refused_by_any_node_is_aborted_on_every_node() -> None:
    nodes, fakes, _ = joined(3)
    fakes[2].fail["prepare_update@1:/w/B"] = SidecarError("FAILED_PRECONDITION", "CHECKPOINT_INVALID", "no plans")
    with pytest.raises(SidecarError, match="no plans"):
        nodes.prepare_update(1, "/w/B")
    assert "abort:/w/B" in fakes[0].calls and "abort:/w/B" in fakes[1].calls
    assert not any(c.startswith("commit") for f in fakes for c in f.calls)


def test_nodes_reading_an_update_as_different_files_abort_it_everywhere() -> None:
    nodes, fakes, _ = joined()
    fakes[1].read_as["/w/B"] = "fp-B-other"
    with pytest.raises(NodeWeightsDifferError, match="every node needs the same files"):
        nodes.prepare_update(1, "/w/B")
    assert all("abort:/w/B" in f.calls for f in fakes)


def test_an_update_commits_on_node_0_first_then_on_every_node() -> None:
    nodes, fakes, _ = joined()
    assert nodes.prepare_update(1, "/w/B") == "fp-B"
    done = nodes.commit_update(1, "/w/B", 60)
    nodes.adopt(done.generation, "/w/B", done.fingerprint)
    assert done == Committed(2, "fp-B")
    assert [c for c in fakes[0].calls if c.startswith(("commit", "adopt"))] == ["commit@1:/w/B", "adopt@2"]
    assert [c for c in fakes[1].calls if c.startswith(("commit", "adopt"))] == ["commit@1:/w/B", "adopt@2"]
    att = nodes.attachment
    assert att is not None and {(a.generation, a.fingerprint) for a in att.node_attachments} == {(2, "fp-B")}
    assert not any(c == "reattach" for f in fakes for c in f.calls)


@pytest.mark.parametrize("error", [SidecarError("ABORTED", "GENERATION_MISMATCH", "moved"),
                                   CommitOutcomeUnknownError("DEADLINE_EXCEEDED")])  # fmt: skip
def test_node_0s_commit_decides_no_other_node_commits_when_it_does_not(error: Exception) -> None:
    nodes, fakes, _ = joined()
    nodes.prepare_update(1, "/w/B")
    fakes[0].fail["commit@1:/w/B"] = error
    with pytest.raises(type(error)):
        nodes.commit_update(1, "/w/B", 60)
    assert not any(c.startswith("commit") for c in fakes[1].calls)
    # a refusal aborts the others; an unknown outcome leaves them prepared for the reattach to settle
    assert ("abort:/w/B" in fakes[1].calls) == (not isinstance(error, CommitOutcomeUnknownError))


def test_a_node_that_misses_the_commit_is_reattached_and_brought_to_node_0s_weights() -> None:
    seen: list[Attachment] = []
    nodes, fakes, state = make(2, seen.append)
    for fake in fakes:
        fake.connect()
    nodes.prepare_update(1, "/w/B")
    fakes[1].fail["commit@1:/w/B"] = SidecarError("UNAVAILABLE", "", "gone")
    done = nodes.commit_update(1, "/w/B", 60)  # node 0 committed: the update did
    assert done.generation == 2
    nodes.adopt(done.generation, "/w/B", done.fingerprint)
    assert fakes[1].calls[-1] == "reattach"
    # its session ends and comes back still on A: the join commits B there before the replica serves
    del fakes[1].fail["commit@1:/w/B"]
    fakes[1].drop()
    assert nodes.attachment is None and state.history[-1] is False
    fakes[0].path, fakes[0].fingerprint, fakes[0].generation = "/w/B", "fp-B", 2
    fakes[1].connect()
    assert fakes[1].calls[-3:] == ["prepare_update@1:/w/B", "commit@1:/w/B", "adopt@2"]
    assert {a.fingerprint for a in seen[-1].node_attachments} == {"fp-B"} and state.history[-1] is True
