"""ditcore.parallel's layout rules: any packed length on Ulysses alone or the ring alone (diffusers' `*_anything`
paths turned on), an even split only for Ulysses x ring, and the head rule kept at start."""

from __future__ import annotations

import pytest

from ditcore.parallel import ParallelError, ParallelSpec, SplitError


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
