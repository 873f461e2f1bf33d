"""ditcore.parallel's layout rules: any packed length on Ulysses alone or the ring alone (diffusers' `*_anything`
paths turned on), an even split only for Ulysses x ring, and the head rule kept at start."""

from __future__ import annotations

import pytest

from ditcore.parallel import ParallelError, ParallelSpec, Ranks, SplitError, default_layout, ranks_from_env


@pytest.mark.parametrize("spec", [ParallelSpec(ulysses_degree=2), ParallelSpec(ulysses_degree=3),
                                  ParallelSpec(ring_degree=4)], ids=["u2", "u3", "r4"])  # fmt: skip
@pytest.mark.parametrize("rows", [455, 456, 457, 605, 7])
def test_ulysses_or_ring_alone_takes_any_rows(spec: ParallelSpec, rows: int) -> None:
    spec.check_rows(rows)


def test_the_config_runs_diffusers_anything_paths_except_on_ulysses_times_ring() -> None:
    u, r, both = ParallelSpec(ulysses_degree=2), ParallelSpec(ring_degree=2), ParallelSpec(2, 2)
    assert (u.context_parallel_config().ulysses_anything, u.context_parallel_config().ring_anything) == (True, False)
    assert (r.context_parallel_config().ulysses_anything, r.context_parallel_config().ring_anything) == (False, True)
    assert (both.context_parallel_config().ulysses_anything, both.context_parallel_config().ring_anything) == (
        False,
        False,
    )


def test_ulysses_times_ring_still_needs_rows_that_divide() -> None:
    spec = ParallelSpec(ulysses_degree=2, ring_degree=2)
    spec.check_rows(456)
    with pytest.raises(SplitError, match=r"455 rows.*multiple of 4.*alone"):
        spec.check_rows(455)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_degree_that_does_not_divide_the_heads_is_refused(backend: str) -> None:
    with pytest.raises(ParallelError, match=r"--ulysses-degree must divide the transformer's 2 attention heads, got 3"):
        ParallelSpec(ulysses_degree=3).check(world_size=3, heads=2, backend=backend)
    ParallelSpec(ulysses_degree=3).check(world_size=3, heads=6, backend=backend)


# ---------------------------------------------------------------------------- nodes (torchrun's environment)
def _env(rank: int, world: int, node: int, per_node: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "GROUP_RANK": str(node),
            "LOCAL_WORLD_SIZE": str(per_node), "LOCAL_RANK": str(rank - node * per_node)}  # fmt: skip


def test_ranks_know_their_node_from_torchruns_environment() -> None:
    ranks = ranks_from_env(_env(rank=11, world=16, node=1, per_node=8))
    assert (ranks.node_rank, ranks.local_rank, ranks.per_node, ranks.nnodes) == (1, 3, 8, 2)
    assert not ranks.leader and not ranks.node_leader
    one = ranks_from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})  # one node, no GROUP_RANK
    assert (one.node_rank, one.nnodes, one.per_node) == (0, 1, 2)


@pytest.mark.parametrize("env", [
    {"RANK": "3", "WORLD_SIZE": "4", "GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"},  # not node by node
    {"RANK": "1", "WORLD_SIZE": "3", "GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"},  # unequal nodes
], ids=["numbering", "unequal"])  # fmt: skip
def test_ranks_not_numbered_node_by_node_on_equal_nodes_are_refused(env: dict[str, str]) -> None:
    with pytest.raises(ParallelError, match=r"numbered node by node.*--node-rank"):
        ranks_from_env(env)


@pytest.mark.parametrize(
    ("nodes", "per_node", "backend", "ulysses", "ring", "expected"),
    [
        (2, 8, "nccl", 0, 0, (8, 2)),  # Ulysses within a node, the ring across nodes
        (1, 4, "nccl", 0, 0, (4, 1)),
        (2, 1, "gloo", 0, 0, (2, 1)),  # no ring on the CPU: Ulysses over every rank
        (2, 8, "nccl", 16, 0, (16, 1)),  # one degree given: the other is the rest
        (2, 8, "nccl", 0, 16, (1, 16)),
        (2, 8, "nccl", 4, 4, (4, 4)),
    ],
)  # fmt: skip
def test_the_default_layout(
    nodes: int, per_node: int, backend: str, ulysses: int, ring: int, expected: tuple[int, int]
) -> None:
    ranks = Ranks(rank=0, world_size=nodes * per_node, local_rank=0, node_rank=0, local_world_size=per_node)
    spec = default_layout(ranks, backend, ulysses, ring)
    assert (spec.ulysses_degree, spec.ring_degree) == expected
