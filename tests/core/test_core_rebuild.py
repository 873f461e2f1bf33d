"""Oracle tests for ditcore.rebuild: one streamed pass builds every key's pages bit for bit as diffusers' fully
loaded MiniMaxH3Transformer3DModel computes its adaln_proj / norm_out rows, reading each plan tensor once and no
tensor outside the plan and the time embedder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ditcore import rebuild, shards
from ditcore.plans import PageLayout, build_pages, is_plan_tensor, plan_inputs
from ditcore.rebuild import PlanBuilder, key_timesteps, plan_tensor_names
from ditcore.repo import write_repository
from ditcore.shards import shard_map

diffusers = pytest.importorskip("diffusers")

DTYPES = {"float32": torch.float32, "mixed": torch.bfloat16}  # repository dtype -> from_pretrained's torch_dtype


def bits(*values: float) -> tuple[int, ...]:
    """A key as the generator makes it: float32 bit patterns read as int32."""
    return tuple(torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist())


# widths 1..4, sorted ascending as torch.unique gives; a mix of bit-pattern keys and tensor keys
KEYS: list[Any] = [
    bits(0.0),
    torch.tensor([0.25, 0.8125]),
    bits(0.1, 0.5, 0.999),
    torch.tensor([0.0, 0.3333, 0.6667, 1.0]),
]


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny seed-3 repositories (the transformer sharded) in float32 and in the released mixed precision."""
    base = tmp_path_factory.mktemp("h3rebuild")
    return {d: write_repository(base / d, "tiny", seed=3, dtype=d) / "transformer" for d in DTYPES}


@pytest.fixture(scope="module")
def resident(repos: dict[str, Path]) -> dict[str, Any]:
    """diffusers' own loading of each transformer: the reference."""
    model_cls = diffusers.MiniMaxH3Transformer3DModel
    return {d: model_cls.from_pretrained(repos[d], torch_dtype=DTYPES[d]).eval() for d in DTYPES}


def one_pass(builder: PlanBuilder, keys: list[Any]) -> list[torch.Tensor]:
    outputs = [
        torch.full((key_timesteps(k).numel(), builder.layout.page_numel), float("nan"), dtype=builder.projection_dtype)
        for k in keys
    ]
    builder.build(keys, outputs)
    return outputs


def module_loader(model: Any) -> Any:
    """build_pages' LayerLoader over the fully loaded model's own projection modules."""

    def load(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        linear = model.get_submodule(prefix)
        return linear.weight, linear.bias

    return load


@torch.no_grad()
def diffusers_page(model: Any, timestep: torch.Tensor) -> torch.Tensor:
    """(T, page_numel) from diffusers' modules' own forwards: each adaln_proj, and norm_out with its linear hooked."""
    temb = plan_inputs(model.time_proj, model.time_embedder, timestep)  # (T, E)
    width = temb.shape[0]
    rows = [torch.stack(b.adaln_proj(temb), dim=1).reshape(width, -1) for b in model.transformer_blocks]  # (T, 18H)
    captured: list[torch.Tensor] = []
    hook = model.norm_out.linear.register_forward_hook(lambda _m, _a, out: captured.append(out))
    try:
        hidden = torch.zeros(1, width, model.config.hidden_size, dtype=model.norm_out.norm.weight.dtype)
        model.norm_out(hidden, temb, torch.arange(width))
    finally:
        hook.remove()
    return torch.cat([*rows, captured[0]], dim=1)  # norm_out: (T, 2H) shift | scale


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_one_pass_equals_diffusers_rows_for_every_key(
    repos: dict[str, Path], resident: dict[str, Any], dtype: str
) -> None:
    model = resident[dtype]
    builder = PlanBuilder(repos[dtype])
    assert builder.layout == PageLayout.from_config(model.config)
    assert builder.projection_dtype == model.transformer_blocks[0].adaln_proj.linear.weight.dtype == DTYPES[dtype]
    outputs = one_pass(builder, KEYS)
    for key, got in zip(KEYS, outputs, strict=True):
        t = key_timesteps(key)
        temb = plan_inputs(model.time_proj, model.time_embedder, t)
        assert torch.equal(got, build_pages(builder.layout, temb, module_loader(model))), (dtype, key)
        assert torch.equal(got, diffusers_page(model, t)), (dtype, key)
        assert not got.isnan().any()


def test_bit_pattern_key_is_the_same_float32(repos: dict[str, Path]) -> None:
    builder = PlanBuilder(repos["float32"])
    t = torch.tensor([0.1, 0.5, 0.999])
    assert torch.equal(key_timesteps(bits(0.1, 0.5, 0.999)), t)
    unsigned = tuple(b & 0xFFFFFFFF for b in bits(-0.5))  # same pattern as uint32
    assert torch.equal(key_timesteps(unsigned), torch.tensor([-0.5]))
    assert torch.equal(builder.build_one(bits(0.1, 0.5, 0.999)), builder.build_one(t))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_one_pass_reads_each_plan_tensor_once(repos: dict[str, Path], dtype: str) -> None:
    builder = PlanBuilder(repos[dtype])
    time_reads = dict(builder.tensor_reads)
    assert time_reads and all(n.startswith("time_embedder.") and c == 1 for n, c in time_reads.items())
    before = builder.bytes_read
    one_pass(builder, KEYS)
    plan_reads = {n: c for n, c in builder.tensor_reads.items() if n not in time_reads}
    names = plan_tensor_names(repos[dtype])
    assert len(names) == 2 * (builder.layout.num_layers + 1)
    assert plan_reads == dict.fromkeys(names, 1)  # each once, however many keys
    itemsize = builder.projection_dtype.itemsize
    assert builder.bytes_read - before == (builder.layout.page_numel * (builder.layout.time_embed_dim + 1)) * itemsize


class RecordingSafeOpen:
    """Wraps safetensors.safe_open; records every tensor whose data is read (get_tensor), not header look-ups."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def __call__(self, path: str, framework: str, **kw: Any) -> Any:
        from safetensors import safe_open

        recorder, handle = self, safe_open(path, framework, **kw)

        class Handle:
            def __enter__(self) -> Handle:
                handle.__enter__()
                return self

            def __exit__(self, *exc: Any) -> None:
                handle.__exit__(*exc)

            def get_tensor(self, name: str) -> torch.Tensor:
                recorder.read.append(name)
                return handle.get_tensor(name)

            def __getattr__(self, attr: str) -> Any:
                return getattr(handle, attr)

        return Handle()


def streamed_tensors(reads: list[tuple[str, int, int]]) -> list[str]:
    """The tensors whose bytes the recorded (path, offset, bytes) reads cover, each as often as it was read; an
    AssertionError if a read takes in a byte of no such tensor (a byte of another tensor, or of the header)."""
    from ditcore.checkpoint_files import read_shard_header

    covered: list[str] = []
    for path, offset, nbytes in reads:
        header = read_shard_header(Path(path))
        start = len(header.header_bytes)
        inside = sorted((start + e.begin, start + e.end, name) for name, e in header.tensors.items()
                        if offset <= start + e.begin and start + e.end <= offset + nbytes)  # fmt: skip
        assert sum(end - begin for begin, end, _ in inside) == nbytes, f"{path} bytes {offset}+{nbytes}: {inside}"
        covered += [name for _, _, name in inside]
    return covered


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "per-tensor"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_builder_reads_only_plan_and_time_embedder_tensors(
    repos: dict[str, Path], dtype: str, streamed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ditcore import plan_stream

    recording = RecordingSafeOpen()
    for module in (rebuild, shards):  # data reads go through shards.read_tensor; header look-ups through rebuild
        monkeypatch.setattr(module, "safe_open", recording)
    preads: list[tuple[str, int, int]] = []  # a streamed pass's reads (PlanStream)
    real = plan_stream.pread_into

    def recording_pread(fd: int, view: memoryview, offset: int, path: str) -> int:
        preads.append((path, offset, len(view)))
        return real(fd, view, offset, path)

    monkeypatch.setattr(plan_stream, "pread_into", recording_pread)
    builder = PlanBuilder(repos[dtype], streamed=streamed)
    one_pass(builder, KEYS)
    all_names = set(shard_map(str(repos[dtype])))
    assert {"proj_in.weight", "transformer_blocks.0.attn.to_q.weight"} <= all_names  # the checkpoint has them
    allowed = {n for n in all_names if is_plan_tensor(n) or n.startswith("time_embedder.")}
    read = recording.read + streamed_tensors(preads)
    assert set(read) == allowed  # every plan and time-embedder tensor, nothing else
    assert len(read) == len(allowed)  # and each once
    assert bool(preads) == streamed and all(is_plan_tensor(n) for n in streamed_tensors(preads))
    assert set(builder.tensor_reads) == allowed
    assert builder.read_bytes == sum(n for _, _, n in preads) if streamed else builder.read_bytes > 0


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ((), "key 1 () is empty"),
        (torch.tensor([]), "is empty"),
        (bits(0.5, float("nan")), "non-finite"),
        (torch.tensor([0.0, float("inf")]), "non-finite"),
        (torch.tensor([0.5], dtype=torch.float64), "float32"),
    ],
)
def test_bad_key_raises_naming_it_before_any_read(repos: dict[str, Path], key: Any, message: str) -> None:
    builder = PlanBuilder(repos["float32"])
    reads = dict(builder.tensor_reads)
    good = torch.empty(1, builder.layout.page_numel)
    bad = torch.empty(max(1, len(key)), builder.layout.page_numel)
    with pytest.raises(ValueError, match="key 1") as err:
        builder.build([bits(0.5), key], [good, bad])
    assert message in str(err.value)
    assert dict(builder.tensor_reads) == reads  # refused before any projection was read


def test_output_shape_and_count_are_checked(repos: dict[str, Path]) -> None:
    builder = PlanBuilder(repos["mixed"])
    numel = builder.layout.page_numel
    with pytest.raises(ValueError, match="2 keys but 1 outputs"):
        builder.build([bits(0.5), bits(0.25)], [torch.empty(1, numel, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match=r"output 0 is torch.float32 .* needs torch.bfloat16"):
        builder.build([bits(0.5)], [torch.empty(1, numel)])
    with pytest.raises(ValueError, match=r"output 0 .* needs torch.bfloat16 \(2, "):
        builder.build([bits(0.25, 0.5)], [torch.empty(1, numel, dtype=torch.bfloat16)])
