"""Where a replica's ranks run (generator_service.replica.work.node_sidecars): every node names its own sidecar,
as rank 0 reaches it; a node whose ranks disagree, two nodes naming one sidecar, a node naming none (cached mode) or
ranks not numbered node by node are refused when the replica forms, naming the rule."""

from __future__ import annotations

import pytest

from generator_service.replica.work import node_sidecars
from protos.ditserve.replica.v1 import replica_pb2 as rpb


def places(*sidecars: str, per_node: int = 2) -> list[rpb.RankPlace]:
    """One place per rank, rank r on node r // per_node naming sidecars[r]."""
    return [rpb.RankPlace(rank=r, node_rank=r // per_node, local_rank=r % per_node, sidecar=s)
            for r, s in enumerate(sidecars)]  # fmt: skip


def test_each_nodes_sidecar_in_node_order() -> None:
    got = node_sidecars(places("unix:/a.sock", "unix:/a.sock", "h1:50052", "h1:50052"), per_node=2)
    assert got == ["unix:/a.sock", "h1:50052"]


@pytest.mark.parametrize(
    ("sidecars", "message"),
    [
        (("unix:/a.sock", "unix:/b.sock", "h1:1", "h1:1"), r"node 0's ranks name different sidecars"),
        (("unix:/a.sock", "unix:/a.sock", "unix:/a.sock", "unix:/a.sock"), r"nodes 0 and 1 both name the sidecar"),
        (("unix:/a.sock", "unix:/a.sock", "", ""), r"node 1 names no --sidecar"),
    ],
    ids=["disagree", "shared", "none"],
)
def test_a_misnamed_sidecar_is_refused(sidecars: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        node_sidecars(places(*sidecars), per_node=2)


def test_ranks_not_numbered_node_by_node_are_refused() -> None:
    bad = [rpb.RankPlace(rank=0, node_rank=0, local_rank=0, sidecar="s0"),
           rpb.RankPlace(rank=1, node_rank=1, local_rank=1, sidecar="s1")]  # fmt: skip
    with pytest.raises(ValueError, match=r"numbered node by node"):
        node_sidecars(bad, per_node=1)
