"""ditcore.adapter_files against diffusers' own MiniMax-H3 LoRA loader: every layout x targets pair it writes loads
through `MiniMaxH3ModularPipeline.load_lora_weights` (the mixin's `lora_state_dict` and converter) into exactly the
targeted modules, at the written rank and alpha, with the factors it generated (the converter's QKV split, SwiGLU
swap, DiffSynth de-interleave and alpha fold undo the layout exactly), and changes the transformer's output; every
pair it refuses is one diffusers cannot load; `ditserve make-adapter` writes the same files.

The pipeline is built here (transformer and transformer_ref only, the released bfloat16 recipe), not taken from
tests/oracle.py's cached `_pipeline`: loading adapters mutates it, and the oracle's copy is shared with other tests.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from clikit import CliRunner

from ditcore.adapter_files import (
    LAYOUTS,
    TARGETS,
    AdapterError,
    adapter_modules,
    alpha_key,
    check_adapter,
    encode,
    groups_of,
    random_factors,
    transformer_config,
    write_adapter,
)

diffusers = pytest.importorskip("diffusers")
peft_lora = pytest.importorskip("peft.tuners.lora")
LoraLayer = peft_lora.LoraLayer
MiniMaxH3LoraLoaderMixin = diffusers.loaders.lora_pipeline.MiniMaxH3LoraLoaderMixin

RANK = 2
ALPHA = 3.0
# the module names of each group, written out here rather than taken from the code under test
GROUP_PATTERNS = {
    "trunk": r"(transformer_blocks|token_refiner\.refiner_blocks)\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))",
    "modulation": r"transformer_blocks\.\d+\.adaln_proj\.linear|norm_out\.linear",
    "time": r"time_embedder\.linear_[12]",
}
TINY_GROUP_SIZES = {"trunk": 24, "modulation": 4, "time": 2}  # (3 blocks + 1 refiner block) x 6; 3 adaln + norm_out
SUPPORTED_TINY = {
    "diffusers": {"trunk", "modulation", "time", "all"},
    "ai-toolkit": {"trunk", "modulation", "time", "all"},
    "musubi": {"trunk", "modulation", "time", "all"},
    "kohya": {"trunk", "modulation", "all"},  # an unprefixed time-only file is not recognized
    "diffsynth": {"modulation"},  # + no time-only; trunk needs the released 128-wide heads (tiny: 32)
}
FOLDED = {"musubi", "kohya"}  # `.alpha` tensors, folded into the factors by the converter (PEFT scale 1.0)
CASES = [(layout, targets) for layout in LAYOUTS for targets in TARGETS if targets in SUPPORTED_TINY[layout]]
REFUSED = [(layout, targets) for layout in LAYOUTS for targets in TARGETS if targets not in SUPPORTED_TINY[layout]]
# a transformer with the released 128-wide heads (tiny otherwise), for the DiffSynth fused QKV
WIDE_HEADS = dict(
    num_attention_heads=2, attention_head_dim=128, hidden_size=64, num_layers=2, num_refiner_layers=1, ffn_dim=64,
    in_channels=24, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=32, freq_dim=32, time_embed_hidden_dim=64,
    time_embed_dim=48, rope_freq_dim=4,
)  # fmt: skip
N_TEXT, N_AUDIO, N_VIDEO = 3, 4, 6


def group_members(model: torch.nn.Module, group: str) -> set[str]:
    return {
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and re.fullmatch(GROUP_PATTERNS[group], name)
    }


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def step_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """One step's transformer kwargs: text rows, then audio, then video, two distinct timesteps."""
    g = torch.Generator().manual_seed(seed)
    seq = N_TEXT + N_AUDIO + N_VIDEO
    text, audio, video = torch.arange(N_TEXT), torch.arange(N_AUDIO) + N_TEXT, torch.arange(N_VIDEO) + N_TEXT + N_AUDIO
    tags = torch.zeros(seq, dtype=torch.long)
    tags[text], tags[audio] = 1, 2
    idx = torch.zeros(seq, dtype=torch.long)
    idx[video[::2]] = 1
    return dict(
        hidden_states=torch.randn(1, N_VIDEO, 96, generator=g),
        audio_hidden_states=torch.randn(1, N_AUDIO, 32, generator=g),
        encoder_hidden_states=torch.randn(1, N_TEXT, 32, generator=g),
        timestep=torch.tensor([0.25, 0.999]),
        timestep_indices=idx,
        token_tags=tags,
        position_ids=torch.randint(0, 9, (seq, 3), generator=g).to(torch.float64),
        video_indices=video,
        audio_indices=audio,
        text_indices=text,
    )


def forward(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        video, audio = model(**step_inputs(), return_dict=False)
    return torch.cat([video.float().flatten(), audio.float().flatten()])


def expected_deltas(config: Mapping[str, Any], targets: str, seed: int) -> dict[str, torch.Tensor]:
    """{diffusers module: lora_B @ lora_A} of the generated factors, before any alpha."""
    deltas = {}
    for unit in adapter_modules(config, groups_of(targets)):
        down, up = random_factors(unit, RANK, seed)
        ups = up.chunk(3, dim=0) if unit.kind == "qkv" else (up,)
        deltas.update({target: part @ down for target, part in zip(unit.targets, ups, strict=True)})
    return deltas


def check_loaded(
    model: torch.nn.Module, members: Mapping[str, set[str]], config: Mapping[str, Any], layout: str, targets: str,
    alpha: float | None, seed: int,
) -> None:  # fmt: skip
    """`model` holds adapter "a" on exactly `targets`' modules, at RANK, scaled as `alpha` says, with the factors
    write_adapter generated."""
    layers = lora_layers(model)
    want = set().union(*(members[g] for g in groups_of(targets)))
    assert set(layers) == want
    assert {layer.r["a"] for layer in layers.values()} == {RANK}
    scale = 1.0 if alpha is None else alpha / RANK
    folded = alpha is not None and layout in FOLDED
    assert {layer.scaling["a"] for layer in layers.values()} == {1.0 if folded else scale}
    # diffusers may keep the factors in the base layer's dtype (bfloat16 here): the products agree to its rounding,
    # where a misplaced row block (a wrong QKV split, SwiGLU swap or de-interleave) would be off by ~100%
    deltas = expected_deltas(config, targets, seed)
    for name, layer in layers.items():
        a, b = layer.lora_A["a"].weight.detach().float(), layer.lora_B["a"].weight.detach().float()
        delta = scale * deltas[name]
        error = (layer.scaling["a"] * (b @ a) - delta).norm() / delta.norm()
        assert error < 1e-2, (name, float(error))


# ----------------------------------------------------------------------------- the pipeline, loaded once
@pytest.fixture(scope="module")
def pipe(tiny_ckpt: Path) -> Any:
    p = diffusers.MiniMaxH3ModularPipeline(
        blocks=diffusers.MiniMaxH3Blocks(), pretrained_model_name_or_path=str(tiny_ckpt)
    )
    p.load_components(names=["transformer", "transformer_ref"], dtype=torch.bfloat16)  # the released recipe
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def members(pipe: Any) -> dict[str, set[str]]:
    """Each group's modules in the (adapter-less) tiny transformer."""
    found = {group: group_members(pipe.transformer, group) for group in GROUP_PATTERNS}
    assert {group: len(names) for group, names in found.items()} == TINY_GROUP_SIZES
    return found


@pytest.fixture(scope="module")
def base_outputs(pipe: Any) -> dict[str, torch.Tensor]:
    return {name: forward(getattr(pipe, name)) for name in ("transformer", "transformer_ref")}


@pytest.fixture
def clean_pipe(pipe: Any, members: dict[str, set[str]], base_outputs: dict[str, torch.Tensor]) -> Iterator[Any]:
    """The module's pipeline, its adapters unloaded after the test (and checked gone)."""
    yield pipe
    pipe.unload_lora_weights()
    for name in ("transformer", "transformer_ref"):
        assert lora_layers(getattr(pipe, name)) == {}


# ----------------------------------------------------------------------------- every supported pair loads
@pytest.mark.parametrize("alpha", [None, ALPHA], ids=["no-alpha", "alpha"])
@pytest.mark.parametrize(("layout", "targets"), CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_an_adapter_loads_into_exactly_its_targets(
    clean_pipe: Any, members: dict[str, set[str]], base_outputs: dict[str, torch.Tensor], tmp_path: Path,
    layout: str, targets: str, alpha: float | None,
) -> None:  # fmt: skip
    path = write_adapter(tmp_path / "a.safetensors", "tiny", targets, layout, RANK, alpha, seed=7)
    clean_pipe.load_lora_weights(str(path), adapter_name="a")
    check_loaded(clean_pipe.transformer, members, transformer_config("tiny"), layout, targets, alpha, seed=7)
    assert lora_layers(clean_pipe.transformer_ref) == {}
    out = forward(clean_pipe.transformer)
    assert torch.isfinite(out).all()
    assert not torch.equal(out, base_outputs["transformer"])


def test_a_ref_adapter_loads_into_transformer_ref_only(
    clean_pipe: Any, members: dict[str, set[str]], base_outputs: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    path = write_adapter(tmp_path / "ref.safetensors", "tiny", "all", "diffusers", RANK, ALPHA, 3, partition="ref")
    clean_pipe.load_lora_weights(str(path), adapter_name="a")
    assert lora_layers(clean_pipe.transformer) == {}
    check_loaded(clean_pipe.transformer_ref, members, transformer_config("tiny"), "diffusers", "all", ALPHA, seed=3)
    assert torch.equal(forward(clean_pipe.transformer), base_outputs["transformer"])
    out = forward(clean_pipe.transformer_ref)
    assert torch.isfinite(out).all() and not torch.equal(out, base_outputs["transformer_ref"])


def test_diffsynth_trunk_at_the_released_head_width(tmp_path: Path) -> None:
    """The DiffSynth fused QKV (per-head interleaved) comes back as the generated to_q / to_k / to_v factors."""
    torch.manual_seed(0)
    model = diffusers.MiniMaxH3Transformer3DModel(**WIDE_HEADS).eval()
    members = {group: group_members(model, group) for group in GROUP_PATTERNS}
    base = forward(model)
    path = write_adapter(tmp_path / "ds.safetensors", WIDE_HEADS, "all", "diffsynth", RANK, ALPHA, seed=5)
    # what the mixin's load_lora_weights does for `transformer.` keys
    state_dict, metadata = MiniMaxH3LoraLoaderMixin.lora_state_dict(str(path), return_lora_metadata=True)
    model.load_lora_adapter(state_dict, prefix="transformer", adapter_name="a", metadata=metadata)
    check_loaded(model, members, WIDE_HEADS, "diffsynth", "all", ALPHA, seed=5)
    out = forward(model)
    assert torch.isfinite(out).all() and not torch.equal(out, base)


# ----------------------------------------------------------------------------- refusals
def test_the_support_table(tmp_path: Path) -> None:
    config = transformer_config("tiny")
    for layout in LAYOUTS:
        for targets in TARGETS:
            if targets in SUPPORTED_TINY[layout]:
                check_adapter(config, targets, layout, RANK, None, "base")
                continue
            with pytest.raises(AdapterError, match=rf"layout '{layout}' cannot carry group '(trunk|{targets})'") as e:
                check_adapter(config, targets, layout, RANK, None, "base")
            assert e.value.params == ("layout", "targets")
    for layout in LAYOUTS[1:]:
        with pytest.raises(AdapterError, match=rf"layout '{layout}' cannot target partition 'ref'"):
            check_adapter(config, "modulation", layout, RANK, None, "ref")
    with pytest.raises(AdapterError, match="rank must be an integer >= 1"):
        write_adapter(tmp_path / "a.safetensors", "tiny", "all", "diffusers", 0, None, 0)
    assert not (tmp_path / "a.safetensors").exists()


@pytest.mark.parametrize(("layout", "targets"), REFUSED, ids=[f"{a}-{b}" for a, b in REFUSED])
def test_a_refused_pair_is_one_diffusers_cannot_load(clean_pipe: Any, layout: str, targets: str) -> None:
    """The refusals are diffusers' limits, not ours: the same keys, written past the check, fail to load."""
    config = transformer_config("tiny")
    state_dict: dict[str, torch.Tensor] = {}
    for unit in adapter_modules(config, groups_of(targets)):
        down, up = random_factors(unit, RANK, 0)
        state_dict.update(encode(unit, down, up, layout, "base", int(config["attention_head_dim"])))
        if layout in FOLDED:
            state_dict[alpha_key(unit, layout)] = torch.tensor(ALPHA)
    with pytest.raises(ValueError):
        clean_pipe.load_lora_weights(state_dict, adapter_name="a")


def test_the_same_seed_writes_the_same_adapter(tmp_path: Path) -> None:
    """The same tensors and metadata (safetensors writes its `__metadata__` map in no fixed order, so not the same
    bytes)."""
    from safetensors import safe_open

    def read(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())  # noqa: SIM118

    a, b, c = (tmp_path / f"{n}.safetensors" for n in "abc")
    write_adapter(a, "tiny", "all", "musubi", RANK, ALPHA, seed=1)
    write_adapter(b, "tiny", "all", "musubi", RANK, ALPHA, seed=1)
    write_adapter(c, "tiny", "all", "musubi", RANK, ALPHA, seed=2)
    (ta, ma), (tb, mb), (tc, _) = read(a), read(b), read(c)
    assert ma == mb and ta.keys() == tb.keys() == tc.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not all(torch.equal(ta[k], tc[k]) for k in ta)


# ----------------------------------------------------------------------------- the command line
def test_make_adapter_writes_a_loadable_file(
    run_cli_proc: CliRunner, clean_pipe: Any, members: dict[str, set[str]], tiny_ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "sub" / "lora.safetensors"
    argv = ["make-adapter", "--checkpoint", tiny_ckpt, "--targets", "all", "--layout", "musubi", "--rank", RANK]
    result = run_cli_proc([*argv, "--alpha", 4, "--seed", 9, "--out", out])
    assert result.code == 0, result.err
    (line,) = result.json_lines()
    assert line["adapter"] == str(out) and line["layout"] == "musubi"
    assert line["tensors"] == 3 * 22  # (16 trunk + 4 modulation + 2 time modules) x down, up, alpha
    clean_pipe.load_lora_weights(str(out), adapter_name="a")
    check_loaded(clean_pipe.transformer, members, transformer_config(tiny_ckpt), "musubi", "all", 4.0, seed=9)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--layout", "diffusers", "--targets", "all", "--rank", "0"], ["--rank must be >= 1, got 0"]),
        (["--layout", "kohya", "--targets", "time", "--rank", "2"], ["--layout kohya --targets time", "alone"]),
        (["--layout", "diffsynth", "--targets", "trunk", "--rank", "2"], ["--layout diffsynth --targets trunk"]),
        (["--layout", "musubi", "--targets", "all", "--rank", "2", "--partition", "ref"], ["--partition ref"]),
        (["--layout", "lycoris", "--targets", "all", "--rank", "2"], ["--layout", "invalid choice"]),
        (["--layout", "musubi", "--targets", "adaln", "--rank", "2"], ["--targets", "invalid choice"]),
        (["--layout", "musubi", "--targets", "all", "--rank", "2", "--alpha", "0"], ["--alpha"]),
        (
            ["--layout", "musubi", "--targets", "trunk", "--deltas", "time", "--rank", "2"],
            ["--layout musubi --deltas time", "carries no full-parameter deltas"],
        ),
        (["--layout", "diffusers", "--targets", "none", "--rank", "2"], ["--targets none --deltas none", "nothing"]),
    ],
    ids=[
        "rank-0",
        "kohya-time",
        "diffsynth-trunk",
        "musubi-ref",
        "unknown-layout",
        "unknown-targets",
        "alpha-0",
        "musubi-deltas",
        "nothing",
    ],
)
def test_make_adapter_refusals_name_the_flag(
    run_cli: CliRunner, tmp_path: Path, flags: list[str], named: list[str]
) -> None:
    out = tmp_path / "x" / "lora.safetensors"
    result = run_cli(["make-adapter", "--preset", "tiny", *flags, "--out", out])
    assert result.code == 2
    for text in named:
        assert text in result.err
    assert not out.parent.exists()


def test_make_adapter_writes_fasth3_style_deltas(run_cli: CliRunner, tiny_ckpt: Path, tmp_path: Path) -> None:
    """`--targets trunk --deltas time` (FastH3's shape): LoRA factors on the trunk, `.diff` / `.diff_b` on the time
    embedder's two linears in the original names."""
    from safetensors import safe_open

    out = tmp_path / "fast.safetensors"
    argv = ["make-adapter", "--checkpoint", tiny_ckpt, "--targets", "trunk", "--deltas", "time", "--layout"]
    result = run_cli([*argv, "ai-toolkit", "--rank", 2, "--out", out])
    assert result.code == 0, result.err
    assert result.json_lines()[0]["deltas"] == "time"
    with safe_open(str(out), "pt") as f:
        keys = set(f.keys())
    assert {k for k in keys if ".diff" in k} == {f"diffusion_model.time_embedder.{p}.{s}" for p in ("proj_in", "proj_out")
                                                 for s in ("diff", "diff_b")}  # fmt: skip
    assert len(keys) == 4 + 2 * 16  # the 16 trunk modules' down and up


def test_make_adapter_refuses_a_preset_that_is_not_the_checkpoint_s(
    run_cli: CliRunner, tiny_ckpt: Path, tmp_path: Path
) -> None:
    argv = ["make-adapter", "--preset", "small", "--checkpoint", tiny_ckpt, "--targets", "all", "--layout", "kohya"]
    result = run_cli([*argv, "--rank", 2, "--out", tmp_path / "a.safetensors"])
    assert result.code == 2 and "preset 'tiny', not --preset small" in result.err
    assert not (tmp_path / "a.safetensors").exists()
