"""A rebuild sharded across devices (ditcore.rebuild.Shard): each shard reads only its 1/N of the plan tensors'
bytes, writes only its own page columns, and the columns of all shards together are the unsharded pages: always
bitwise in "projections" mode (whole projections round-robin: the unsharded GEMMs themselves), and in "rows" mode
(each projection's output features split N ways) exactly where `row_split_is_exact` says so, which is what
`shard_mode` picks by (on CPU the tiny preset's float32 norm_out split 3 ways is not)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ditcore.plans import PageLayout, is_plan_tensor
from ditcore.rebuild import PlanBuilder, Shard, row_split_is_exact, shard_mode
from ditcore.repo import write_repository

KEYS = [torch.tensor([0.0]), torch.tensor([0.25, 0.8125]), torch.tensor([0.1, 0.5, 0.999])]


@pytest.fixture(scope="module", params=["float32", "mixed"])
def transformer_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp(f"sharded-{request.param}")
    return write_repository(base / "ckpt", "tiny", seed=5, dtype=request.param, shards=2) / "transformer"


def build(builder: PlanBuilder, fill: float) -> list[torch.Tensor]:
    outs = [torch.full((k.numel(), builder.layout.page_numel), fill, dtype=builder.projection_dtype) for k in KEYS]
    builder.build(KEYS, outs)
    return outs


@pytest.mark.parametrize("mode", ["rows", "projections"])
@pytest.mark.parametrize("count", [2, 3])
def test_shards_together_are_the_unsharded_pages(transformer_dir: Path, mode: str, count: int) -> None:
    whole = PlanBuilder(transformer_dir)
    expected = build(whole, 0.0)
    assembled = [torch.full_like(e, float("nan")) for e in expected]
    covered = torch.zeros(whole.layout.page_numel, dtype=torch.int64)
    total, row_bytes = 0, (whole.layout.time_embed_dim + 1) * whole.projection_dtype.itemsize
    for index in range(count):
        shard = Shard(index, count, mode)
        builder = PlanBuilder(transformer_dir, shard=shard)
        outs = build(builder, float("nan"))
        written = torch.zeros(whole.layout.page_numel, dtype=torch.bool)
        for start, stop in shard.columns(builder.layout):
            written[start:stop] = True
            covered[start:stop] += 1
            for out, into in zip(outs, assembled, strict=True):
                into[:, start:stop] = out[:, start:stop]
        for out in outs:  # only its own columns were written
            assert bool(out[:, written].isfinite().all()) and bool(out[:, ~written].isnan().all())
        total += builder.plan_bytes_read
        if mode == "rows":  # 1/N of every plan tensor, to within a row of each projection (N need not divide)
            slack = count * sum(1 for _ in builder.layout.projections()) * row_bytes
            assert abs(builder.plan_bytes_read * count - whole.plan_bytes_read) <= slack
    assert total == whole.plan_bytes_read, "the shards together read each plan byte once"
    assert bool((covered == 1).all()), "every page column is computed by exactly one shard"
    exact = mode == "projections" or row_split_is_exact(whole.layout, whole.projection_dtype, count)
    assert all(torch.equal(got, want) for got, want in zip(assembled, expected, strict=True)) == exact
    if not exact:  # a few ulp, never other values
        assert all(
            torch.allclose(got, want, rtol=1e-5, atol=1e-6) for got, want in zip(assembled, expected, strict=True)
        )
    if mode == "rows":
        assert shard_mode(whole.layout, whole.projection_dtype, count) == ("rows" if exact else "projections")


def test_rows_shard_reads_a_slice_of_each_tensor(transformer_dir: Path) -> None:
    whole = PlanBuilder(transformer_dir)
    build(whole, 0.0)
    half = PlanBuilder(transformer_dir, shard=Shard(1, 2))
    build(half, 0.0)
    plan_names = {n for n in whole.tensor_reads if is_plan_tensor(n)}
    assert plan_names and all(half.tensor_reads[n] == 1 for n in plan_names)
    assert half.plan_bytes_read == whole.plan_bytes_read // 2
    assert whole.bytes_read - whole.plan_bytes_read == half.bytes_read - half.plan_bytes_read  # the time embedder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_split_is_exact_on_cpu_at_released_shapes(dtype: torch.dtype) -> None:
    # H3's released layout (hidden 5376, E 2688): what decides "rows" vs "projections" on this device
    assert row_split_is_exact(PageLayout(num_layers=1, hidden=5376, time_embed_dim=2688), dtype, 4)


def test_bad_shards_are_refused() -> None:
    with pytest.raises(ValueError, match=r"shard index must lie in \[0, 2\)"):
        Shard(2, 2)
    with pytest.raises(ValueError, match="shard mode must be one of"):
        Shard(0, 2, "layers")
