"""The rebuild's read path (ditcore.plan_stream): the plan tensors in large sequential reads into a fixed pool of
buffers, read ahead of the GEMMs. Every page it builds is bitwise the per-tensor path's (safetensors' get_tensor /
get_slice, one tensor at a time) and diffusers' own, whole and row-sharded, with and without adapters (LoRA factors
and full-parameter deltas on the modulation); its memory is the pool (never every plan tensor at once); its reads are
exactly the plan tensors' bytes, reported as the pass's `rebuild_read_bytes` / `rebuild_read_s`; a short read fails
the pass naming the file and leaves no thread behind. On cuda (skipped without): pinned staging buffers and a side
stream give the same pages."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from plancache_helpers import CPU, DiffusersPages, MakeCache, keys_of, prepare, sched

from ditcore.adapter_files import write_adapter
from ditcore.adapter_plans import ModulationDeltas
from ditcore.adapters import AdapterRegistry
from ditcore.plan_stream import (
    ALIGN,
    PAGE,
    PlanStream,
    ProjectionRead,
    ReadConfig,
    Segment,
    TensorSlice,
    projection_reads,
)
from ditcore.plans import PlanKey
from ditcore.rebuild import PlanBuilder, Shard

KEYS = [
    PlanKey.from_timesteps(0.0),
    PlanKey.from_timesteps(0.25, 0.8125),
    PlanKey.from_timesteps(0.1, 0.5, 0.999),
    PlanKey.from_timesteps(0.0, 0.3333, 0.6667, 1.0),
]
SMALL = ReadConfig(staging_bytes=4096, depth=2, buffers=3, threads=2)
"""Many reads per projection, several in flight, three buffers: every hand-off of the pipeline exercised."""


@pytest.fixture(scope="module")
def registry(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> AdapterRegistry:
    root = tmp_path_factory.mktemp("read-path-adapters")
    write_adapter(root / "mod.safetensors", tiny_ckpt, "modulation", "diffusers", rank=2, alpha=None, seed=21,
                  deltas="modulation")  # fmt: skip
    write_adapter(root / "time.safetensors", tiny_ckpt, "time", "diffusers", rank=2, alpha=None, seed=22)
    return AdapterRegistry(root)


def pages(builder: PlanBuilder, deltas: ModulationDeltas | None = None, into: list[torch.Tensor] | None = None) -> Any:
    outs = into if into is not None else [
        torch.full((k.width, builder.layout.page_numel), float("nan"), dtype=builder.projection_dtype,
                   device=builder.device) for k in KEYS
    ]  # fmt: skip
    builder.build(KEYS, outs, deltas)
    return outs


def deltas_of(registry: AdapterRegistry, names: list[str], builder: PlanBuilder) -> ModulationDeltas | None:
    if not names:
        return None
    uses = [(registry.get(n), 0.7 + 0.2 * i) for i, n in enumerate(names)]
    return ModulationDeltas.load(uses, "base", builder.projection_dtype, builder.time_dtype, builder.device)


@pytest.mark.parametrize("adapters", [[], ["mod"], ["mod", "time"]], ids=["base", "modulation", "modulation+time"])
@pytest.mark.parametrize("repo", ["tiny_ckpt", "tiny_ckpt_f32"])
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small-reads"])
def test_streamed_pages_are_the_per_tensor_pages_whole_and_sharded(
    repo: str, adapters: list[str], config: ReadConfig | None, registry: AdapterRegistry,
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    ckpt: Path = request.getfixturevalue(repo)
    transformer = ckpt / "transformer"
    old = PlanBuilder(transformer, streamed=False)
    deltas = deltas_of(registry, adapters, old)
    want = pages(old, deltas)
    assert not any(bool(w.isnan().any()) for w in want)
    assert torch.equal(torch.cat(pages(PlanBuilder(transformer, read_config=config), deltas)), torch.cat(want))
    for count, mode in ((2, "rows"), (2, "projections")):
        new_halves = [torch.full_like(w, float("nan")) for w in want]
        old_halves = [torch.full_like(w, float("nan")) for w in want]
        for index in range(count):
            shard = Shard(index, count, mode)
            pages(PlanBuilder(transformer, shard=shard, read_config=config), deltas, new_halves)
            pages(PlanBuilder(transformer, shard=shard, streamed=False), deltas, old_halves)
        for got, per_tensor in zip(new_halves, old_halves, strict=True):
            assert torch.equal(got, per_tensor), (count, mode)


def test_streamed_pages_equal_diffusers(tiny_ckpt: Path, ref: DiffusersPages) -> None:
    builder = PlanBuilder(tiny_ckpt / "transformer", read_config=SMALL)
    for key, got in zip(KEYS, pages(builder), strict=True):
        assert torch.equal(got, ref.pages(key)), key


def test_a_pass_reads_each_plan_byte_once_into_a_bounded_pool(tiny_ckpt: Path) -> None:
    builder = PlanBuilder(tiny_ckpt / "transformer", read_config=ReadConfig(buffers=2))
    layout, dtype = builder.layout, builder.projection_dtype
    reads = projection_reads(builder.transformer_dir, builder.files, [(p, None) for p, _, _ in layout.projections()])
    assert len(reads) == layout.num_layers + 1
    assert all(len(r.segments) == 1 for r in reads)  # a projection's bias and weight touch in the file: one read
    assert sum(r.read_bytes for r in reads) == layout.plan_tensor_bytes(dtype)
    before = (builder.read_bytes, builder.read_s)
    pages(builder)
    assert builder.read_bytes - before[0] == layout.plan_tensor_bytes(dtype) and builder.read_s > before[1]
    kept = builder._buffers  # the pool it keeps for the next pass: 2 buffers of the largest projection, no more
    assert len(kept) == 2 and all(b.numel() == max(r.nbytes for r in reads) for b in kept)
    assert all(r.nbytes < r.read_bytes + PAGE + ALIGN for r in reads)  # a buffer is its projection's bytes
    assert sum(b.numel() for b in kept) < layout.plan_tensor_bytes(dtype)  # (3 layers here: 24 GiB at H3's 50)
    halves = [projection_reads(builder.transformer_dir, builder.files, [(p, (0, n // 2)), (p, (n // 2, n))])
              for p, _, n in layout.projections()]  # fmt: skip
    assert sum(r.read_bytes for pair in halves for r in pair) == layout.plan_tensor_bytes(dtype)


def test_the_rebuild_reports_its_reads(make: MakeCache) -> None:
    cache = make(gpu_plans=8)
    keys = keys_of(sched(4, 3.0))
    report = prepare(cache, keys).report
    plan_bytes = cache.source.layout.plan_tensor_bytes(cache.source.dtype)
    assert report.built_plans == len(set(keys))
    assert report.rebuild_read_bytes == plan_bytes and 0 < report.rebuild_read_s <= report.rebuild_s
    again = prepare(cache, keys).report  # every plan in its slot: no pass, nothing read
    assert (again.built_plans, again.rebuild_read_bytes, again.rebuild_read_s) == (0, 0, 0.0)


def test_a_two_device_pass_reports_both_devices_reads(tiny_ckpt: Path) -> None:
    from plancache_service.rebuild import RebuildSource

    source = RebuildSource(tiny_ckpt, [CPU, CPU], shard_mode="rows")
    outs = [[torch.empty(k.width, source.page_numel, dtype=source.dtype) for k in KEYS] for _ in range(2)]
    reads = source.build_all(KEYS, outs)
    assert reads.nbytes == source.layout.plan_tensor_bytes(source.dtype) and reads.seconds > 0 and reads.gbps > 0
    assert [b for b, _ in source.read_totals()] == [reads.nbytes // 2] * 2
    assert torch.equal(torch.cat(outs[0]), torch.cat(outs[1]))


def _stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("plan-stream", "plan-read"))]


def test_a_short_read_fails_naming_the_file_and_stops_the_reader(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(256)) * 16)  # 4096 bytes
    good = ProjectionRead("a", (Segment(str(path), 0, 1024, 0),), {"a.w": TensorSlice(0, torch.uint8, (1024,))}, 1024)
    bad = ProjectionRead("b", (Segment(str(path), 3072, 2048, 0),), {"b.w": TensorSlice(0, torch.uint8, (2048,))}, 2048)
    with pytest.raises(OSError, match="truncated") as ei, PlanStream([good, bad, good], CPU, SMALL) as stream:
        first = next(stream)
        assert torch.equal(first["a.w"], torch.arange(256, dtype=torch.uint8).repeat(4))
        next(stream)
    assert ei.value.filename == str(path)
    assert not _stream_threads()


def test_a_builder_error_mid_pass_stops_the_reader(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builder = PlanBuilder(tiny_ckpt / "transformer", read_config=SMALL)
    real = PlanBuilder._read
    calls: list[str] = []

    def flaky(self: PlanBuilder, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        calls.append(name)
        if len(calls) == 3:
            raise OSError(5, "injected", name)
        return real(self, name, rows)

    monkeypatch.setattr(PlanBuilder, "_read", flaky)
    with pytest.raises(OSError, match="injected"):
        pages(builder)
    assert not _stream_threads()
    monkeypatch.setattr(PlanBuilder, "_read", real)
    assert torch.equal(
        torch.cat(pages(builder)), torch.cat(pages(PlanBuilder(tiny_ckpt / "transformer", streamed=False)))
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small-reads"])
def test_cuda_pinned_staging_and_side_stream_give_the_same_pages(
    tiny_ckpt: Path, config: ReadConfig | None, registry: AdapterRegistry
) -> None:
    transformer, cuda = tiny_ckpt / "transformer", torch.device("cuda", torch.cuda.current_device())
    for adapters in ([], ["mod", "time"]):
        old = PlanBuilder(transformer, cuda, streamed=False)
        new = PlanBuilder(transformer, cuda, read_config=config)
        want = pages(old, deltas_of(registry, adapters, old))
        got = pages(new, deltas_of(registry, adapters, new))
        torch.cuda.synchronize()
        assert torch.equal(torch.cat(got), torch.cat(want)), adapters
        assert new.read_bytes == new.layout.plan_tensor_bytes(new.projection_dtype) and new.read_s > 0
    reads = projection_reads(transformer, new.files, [(p, None) for p, _, _ in new.layout.projections()], cuda)
    with PlanStream(reads, cuda, config or ReadConfig.for_device(cuda)) as stream:
        assert all(s.is_pinned() for s in stream._staging) and stream._side != torch.cuda.current_stream(cuda)
        for tensors in stream:
            assert all(t.device == cuda for t in tensors.values())
    assert not _stream_threads()
