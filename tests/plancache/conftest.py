"""Fixtures of the plan-cache tests: plan keys from the tiny repository's own schedulers, one rebuild source and one
diffusers oracle per module over `tiny_ckpt` (mixed precision), and a factory of caches closed at teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from plancache_helpers import CPU, DiffusersPages, MakeCache, cache_factory, use_schedulers

from plancache_service.rebuild import RebuildSource


@pytest.fixture(scope="session", autouse=True)
def _schedulers(tiny_ckpt: Path) -> None:
    """`Sched.plan_keys()` reads the schedulers of `tiny_ckpt` (every tiny repository has H3's)."""
    use_schedulers(tiny_ckpt)


@pytest.fixture(scope="module")
def source(tiny_ckpt: Path) -> RebuildSource:
    return RebuildSource(tiny_ckpt, CPU)


@pytest.fixture(scope="module")
def ref(tiny_ckpt: Path) -> DiffusersPages:
    return DiffusersPages(tiny_ckpt)


@pytest.fixture
def make(source: RebuildSource, tmp_path: Path) -> Iterator[MakeCache]:
    """make(gpu_plans=..., plan_width=2, host_pages=0, generation=0) -> a cache closed at teardown."""
    with cache_factory(source, tmp_path) as factory:
        yield factory
