"""Fixtures of the plan-cache core tests: one rebuild source and bit-exact reference per test
module over the tiny checkpoint, and a factory of caches closed at teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from plancache_helpers import CPU, MakeCache, Reference, cache_factory

from plancache_service.rebuild import RebuildSource


@pytest.fixture(scope="module")
def source(tiny_ckpt: Path) -> RebuildSource:
    return RebuildSource(tiny_ckpt, CPU)


@pytest.fixture(scope="module")
def ref(tiny_ckpt: Path, source: RebuildSource) -> Reference:
    return Reference(tiny_ckpt, source)


@pytest.fixture
def make(source: RebuildSource, tmp_path: Path) -> Iterator[MakeCache]:
    """make(gpu_plans=..., plan_width=2, host_pages=0, generation=0) -> a cache closed at teardown."""
    with cache_factory(source, tmp_path) as factory:
        yield factory
