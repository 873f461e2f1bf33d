"""Oracle tests for ditcore.plans: pages equal diffusers' own projection outputs, and diffusers' transformer with
PlanLinear modules (resident copy or loaded without the plan tensors) is bit-identical to the unmodified one."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from ditcore import shards
from ditcore.plans import PageLayout, PlanPages, build_pages, install_plan_modules, is_plan_tensor, plan_inputs
from ditcore.shards import load_transformer_without_adaln, safetensors_layer_loader

diffusers = pytest.importorskip("diffusers")
MiniMaxH3Transformer3DModel = diffusers.MiniMaxH3Transformer3DModel

TINY = dict(
    num_attention_heads=2, attention_head_dim=32, hidden_size=64, num_layers=3, num_refiner_layers=1, ffn_dim=128,
    in_channels=24, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=32, freq_dim=32, time_embed_hidden_dim=64,
    time_embed_dim=48, rope_freq_dim=4,
)  # fmt: skip
PRECISIONS = {"fp32": torch.float32, "mixed": torch.bfloat16}  # torch_dtype given to from_pretrained
WIDTHS = (1, 2, 3, 4)
N_TEXT, N_AUDIO, N_VIDEO = 5, 6, 8  # packed rows: text, audio, video (one 1x2x2 patch of 24 channels = 96 per row)


def tiny_transformer(seed: int) -> Any:
    """Random weights everywhere (default init leaves projections at zero), so that a wrong row or dtype shows."""
    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(**TINY)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.eval()


def to_released_dtype(model: Any) -> Any:
    """bf16 except parameters with a `_keep_in_fp32_modules` entry as a name component (diffusers' loader rule)."""
    keep = model._keep_in_fp32_modules
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not any(k in name.split(".") for k in keep):
                p.data = p.data.to(torch.bfloat16)
    return model


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Sharded transformer directories, float32 and released mixed precision, of the same seeded weights."""
    out = {}
    for label in PRECISIONS:
        model = tiny_transformer(seed=7)
        if label == "mixed":
            to_released_dtype(model)
        path = tmp_path_factory.mktemp(f"h3_{label}") / "transformer"
        model.save_pretrained(path, max_shard_size="100KB")
        out[label] = path
    return out


@pytest.fixture(scope="module")
def resident(repos: dict[str, Path]) -> dict[str, Any]:
    """diffusers' own loading of each repository: the reference."""
    return {
        label: MiniMaxH3Transformer3DModel.from_pretrained(repos[label], torch_dtype=dtype).eval()
        for label, dtype in PRECISIONS.items()
    }


def distinct_timesteps(width: int, seed: int) -> torch.Tensor:
    """(width,) float32, sorted ascending as torch.unique gives; includes a conditioning level at 0.999 when wide."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(width, generator=g)
    if width >= 3:
        t[-1] = 0.999
    return torch.unique(t, sorted=True)


def step_inputs(width: int, seed: int) -> dict[str, torch.Tensor]:
    """One step's transformer kwargs with valid shapes: text rows, then audio, then video, as the pipeline packs them."""
    g = torch.Generator().manual_seed(seed)
    seq = N_TEXT + N_AUDIO + N_VIDEO
    text, audio, video = torch.arange(N_TEXT), torch.arange(N_AUDIO) + N_TEXT, torch.arange(N_VIDEO) + N_TEXT + N_AUDIO
    tags = torch.zeros(seq, dtype=torch.long)
    tags[text], tags[audio] = 1, 2
    idx = torch.randint(0, width, (seq,), generator=g)
    idx[video[:width]] = torch.arange(width)  # every distinct timestep is used
    idx[text] = int(idx[video[0]])  # text rows inherit the video timestep
    return dict(
        hidden_states=torch.randn(1, N_VIDEO, 96, generator=g),
        audio_hidden_states=torch.randn(1, N_AUDIO, 32, generator=g),
        encoder_hidden_states=torch.randn(1, N_TEXT, 32, generator=g),
        timestep=distinct_timesteps(width, seed),
        timestep_indices=idx,
        token_tags=tags,
        position_ids=torch.randint(0, 9, (seq, 3), generator=g).to(torch.float64),
        video_indices=video,
        audio_indices=audio,
        text_indices=text,
    )


def run(model: Any, kwargs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        video, audio = model(**kwargs, return_dict=False)
    return video, audio


def pages_for(model: Any, repo: Path, timestep: torch.Tensor) -> torch.Tensor:
    """What the sidecar computes: temb by the model's time modules, projections streamed from the shards."""
    temb = plan_inputs(model.time_proj, model.time_embedder, timestep)
    return build_pages(PageLayout.from_config(model.config), temb, safetensors_layer_loader(str(repo)))


def diffusers_rows(model: Any, temb: torch.Tensor) -> list[torch.Tensor]:
    """Each projection's (T, numel) output as diffusers' own modules produce it inside the forward."""
    rows = []
    for block in model.transformer_blocks:
        chunks = block.adaln_proj(temb)  # 6 x (3T, H), rows [t0_video, t0_text, t0_audio, t1_video, ...]
        rows.append(torch.stack(chunks, dim=1).reshape(temb.shape[0], -1))  # (T, 18H)
    captured: list[torch.Tensor] = []
    hook = model.norm_out.linear.register_forward_hook(lambda _m, _a, out: captured.append(out))
    try:
        indices = torch.arange(temb.shape[0])
        hidden = torch.ones(1, temb.shape[0], model.config.hidden_size, dtype=model.norm_out.norm.weight.dtype)
        model.norm_out(hidden, temb, indices)
    finally:
        hook.remove()
    rows.append(captured[0])  # (T, 2H): shift | scale
    return rows


@pytest.mark.parametrize("label", PRECISIONS)
@pytest.mark.parametrize("width", WIDTHS)
def test_pages_equal_diffusers_projection_rows(
    resident: dict[str, Any], repos: dict[str, Path], label: str, width: int
):
    model = resident[label]
    timestep = distinct_timesteps(width, seed=width)
    pages = pages_for(model, repos[label], timestep)
    layout = PageLayout.from_config(model.config)
    assert pages.shape == (width, layout.page_numel)
    assert pages.dtype == model.transformer_blocks[0].adaln_proj.linear.weight.dtype
    temb = model.time_embedder(model.time_proj(timestep).to(torch.float32))
    assert temb.dtype == torch.float32  # the time embedder stays float32 in both precisions
    for (name, offset, numel), rows in zip(layout.projections(), diffusers_rows(model, temb), strict=True):
        assert torch.equal(pages[:, offset : offset + numel], rows), name


@pytest.mark.parametrize("label", PRECISIONS)
def test_plan_modules_forward_equals_resident(resident: dict[str, Any], repos: dict[str, Path], label: str):
    reference = resident[label]
    patched, holder = copy.deepcopy(reference), PlanPages()
    install_plan_modules(patched, holder)
    assert not any(is_plan_tensor(n) for n, _ in patched.named_parameters())
    for width in WIDTHS:
        kwargs = step_inputs(width, seed=10 + width)
        holder.set(pages_for(reference, repos[label], kwargs["timestep"]))
        want, got = run(reference, kwargs), run(patched, kwargs)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), width


def test_oracle_sees_one_perturbed_page_value(resident: dict[str, Any], repos: dict[str, Path]):
    reference = resident["mixed"]
    patched, holder = copy.deepcopy(reference), PlanPages()
    install_plan_modules(patched, holder)
    kwargs = step_inputs(2, seed=3)
    pages = pages_for(reference, repos["mixed"], kwargs["timestep"])
    layout = PageLayout.from_config(reference.config)
    pages[1, layout.block_offset(2) + 2 * layout.hidden + 5] += 0.5  # one gate_msa value, video row, last block
    holder.set(pages)
    assert not torch.equal(run(reference, kwargs)[0], run(patched, kwargs)[0])


class RecordingSafeOpen:
    """safe_open that records every tensor read and only lets plan tensors' headers (shape, dtype) be seen."""

    read: ClassVar[list[str]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._cm = REAL_SAFE_OPEN(*args, **kwargs)

    def __enter__(self) -> RecordingSafeOpen:
        self._f = self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self._f.keys())

    def get_tensor(self, name: str) -> torch.Tensor:
        RecordingSafeOpen.read.append(name)
        return self._f.get_tensor(name)

    def get_slice(self, name: str) -> Any:
        sl = self._f.get_slice(name)
        return type("Header", (), {"get_shape": lambda _s: sl.get_shape(), "get_dtype": lambda _s: sl.get_dtype()})()


REAL_SAFE_OPEN = shards.safe_open


@pytest.mark.parametrize("label", PRECISIONS)
def test_load_without_adaln_reads_no_plan_byte(
    resident: dict[str, Any], repos: dict[str, Path], label: str, monkeypatch: pytest.MonkeyPatch
):
    reference = resident[label]
    monkeypatch.setattr(shards, "safe_open", RecordingSafeOpen)
    RecordingSafeOpen.read = []
    holder = PlanPages()
    model, read, skipped = load_transformer_without_adaln(str(repos[label]), holder, PRECISIONS[label])
    monkeypatch.undo()
    stored = {n: p for n, p in reference.named_parameters()}  # from_pretrained keeps the stored dtypes here
    plan_names = sorted(n for n in stored if is_plan_tensor(n))
    assert len(plan_names) == 2 * (TINY["num_layers"] + 1)
    assert sorted(RecordingSafeOpen.read) == sorted(n for n in stored if not is_plan_tensor(n))
    assert skipped == sum(stored[n].numel() * stored[n].element_size() for n in plan_names)
    assert read == sum(p.numel() * p.element_size() for n, p in stored.items() if not is_plan_tensor(n))
    assert not any(is_plan_tensor(n) for n, _ in model.named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == stored[name].dtype, name
    for width in WIDTHS:
        kwargs = step_inputs(width, seed=20 + width)
        holder.set(pages_for(reference, repos[label], kwargs["timestep"]))
        want, got = run(reference, kwargs), run(model, kwargs)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), width


def test_released_config_figures():
    defaults = {
        k: p.default
        for k, p in inspect.signature(MiniMaxH3Transformer3DModel.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    layout = PageLayout.from_config(defaults)
    assert (layout.num_layers, layout.hidden, layout.time_embed_dim) == (50, 5376, 2688)
    assert layout.page_numel == 4_849_152
    assert layout.page_bytes(torch.bfloat16) == 9_698_304
    assert round(layout.page_bytes(torch.bfloat16) / 2**20, 2) == 9.25
    assert layout.adaln_proj_bytes(torch.bfloat16) == 26_020_915_200
    assert round(layout.adaln_proj_bytes(torch.bfloat16) / 2**30, 2) == 24.23
    with torch.device("meta"):  # the real module tree agrees with the layout's arithmetic
        model = MiniMaxH3Transformer3DModel()
    adaln = sum(p.numel() for n, p in model.named_parameters() if ".adaln_proj." in n)
    assert adaln * 2 == layout.adaln_proj_bytes(torch.bfloat16)
    layer0 = [p for n, p in model.named_parameters() if n.startswith("transformer_blocks.0.adaln_proj.linear.weight")]
    assert layer0[0].shape == (layout.block_numel, layout.time_embed_dim)
