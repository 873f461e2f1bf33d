"""Full-parameter deltas (`.diff` / `.diff_b`, as FastH3 ships for its time embedder) against the oracle: diffusers'
own pipeline whose parameters are changed as the deltas' producers define it (parameter + scale x delta, read here
straight from a diffusers-layout file's keys), with the file's LoRA factors loaded through `load_lora_weights` and set
with `set_adapters`, `torch.equal`:

- the layouts agree: ai-toolkit's and kohya's original names (fused QKV split, fused SwiGLU halves swapped) decode to
  the deltas a diffusers-layout file names directly;
- resident: LoRA on the trunk + deltas on the time embedder (FastH3's shape), deltas alone on adaln_proj + norm_out,
  deltas on the trunk, and two composed; every parameter is the very tensor it was after each request;
- cached: plans built with the deltas (whole and row-sharded) equal the resident model's modules, and a cached model
  (trunk deltas in the model, the rest in its plans) equals the oracle;
- refusals: deltas of other shapes, a delta on a module ditserve does not serve, NaN deltas; nothing loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from oracle import adapter_latents
from plankit import BuiltPages, resident_pages

from ditcore import GenerationRequest, generate, load_model
from ditcore.adapter_files import write_adapter
from ditcore.adapters import AdapterError, AdapterRegistry, read_deltas

REQUEST = GenerationRequest(request_id="d", prompt="a red fox", num_inference_steps=3, seed=7)
ADAPTERS = {  # name: (LoRA targets, deltas, layout)
    "fast": ("trunk", "time", "diffusers"),  # FastH3's shape: LoRA on the trunk, deltas on the time embedder
    "dmod": ("none", "modulation", "diffusers"),
    "dtrunk": ("none", "trunk", "diffusers"),
}


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, tiny_ckpt: Path) -> Path:
    root = tmp_path_factory.mktemp("delta-adapters")
    for seed, (name, (targets, deltas, layout)) in enumerate(ADAPTERS.items()):
        write_adapter(root / f"{name}.safetensors", tiny_ckpt, targets, layout, rank=2, alpha=None, seed=seed + 11,
                      deltas=deltas)  # fmt: skip
    return root


@pytest.fixture(scope="module")
def registry(adapter_dir: Path) -> AdapterRegistry:
    return AdapterRegistry(adapter_dir)


@pytest.fixture(scope="module")
def resident(tiny_ckpt: Path) -> Any:
    return load_model(tiny_ckpt, "resident")


def file_deltas(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """A diffusers-layout file's deltas by its own keys: `transformer.MODULE.diff` / `.diff_b`."""
    from safetensors.torch import load_file

    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in load_file(str(path)).items():
        if key.endswith((".diff", ".diff_b")):
            module, _, suffix = key.removeprefix("transformer.").rpartition(".")
            out.setdefault(module, {})["weight" if suffix == "diff" else "bias"] = value
    return out


def oracle(repo: Path, request: GenerationRequest, uses: Sequence[tuple[Path, float]]) -> tuple[torch.Tensor, ...]:
    """diffusers' latents with each file's deltas added to its modules' parameters (in order) and its LoRA factors
    loaded and set; everything put back after (tests/oracle.adapter_latents)."""
    return adapter_latents(repo, request, list(uses))


def test_every_delta_layout_decodes_to_the_diffusers_names(tiny_ckpt: Path, tmp_path: Path) -> None:
    want = file_deltas(write_adapter(tmp_path / "d.safetensors", tiny_ckpt, "none", "diffusers", 2, None, seed=5,
                                     deltas="all"))  # fmt: skip
    assert any(m.endswith("attn.to_k") for m in want) and any(m.endswith("ff.net.0.proj") for m in want)
    assert "time_embedder.linear_1" in want and "norm_out.linear" in want
    for layout in ("ai-toolkit", "kohya"):
        path = write_adapter(tmp_path / f"{layout}.safetensors", tiny_ckpt, "all", layout, 2, None, 5, deltas="all")
        got, partitions, stray = read_deltas(path)
        assert partitions == {"base"} and not stray
        assert set(got) == set(want)
        for module, params in want.items():
            for param, delta in params.items():
                assert torch.equal(got[module][param], delta), (layout, module, param)
    info = AdapterRegistry(tmp_path).get("kohya")
    assert info.rank == 2 and set(info.deltas) == set(want) and info.changes_modulation


@pytest.mark.parametrize(
    "uses",
    [[("fast", 1.0)], [("dmod", 0.8)], [("dtrunk", 1.0)], [("fast", 0.7), ("dmod", 1.2)]],
    ids=["lora-trunk+time-deltas", "modulation-deltas", "trunk-deltas", "two-composed"],
)
def test_resident_applies_deltas_as_their_producers_define_them(
    uses: list[tuple[str, float]], resident: Any, registry: AdapterRegistry, adapter_dir: Path, tiny_ckpt: Path
) -> None:
    def snapshot() -> dict[str, tuple[int, torch.Tensor]]:  # PEFT's wrapping renames x.weight x.base_layer.weight
        transformer = resident.transformer_of("base")
        return {n.replace(".base_layer", ""): (p.data_ptr(), p.detach().clone())
                for n, p in transformer.named_parameters() if ".lora_" not in n}  # fmt: skip

    before = snapshot()
    result = generate(resident, REQUEST, adapters=[(registry.get(n), s) for n, s in uses])
    ref_video, ref_audio = oracle(tiny_ckpt, REQUEST, [(adapter_dir / f"{n}.safetensors", s) for n, s in uses])
    assert torch.equal(result.video, ref_video) and torch.equal(result.audio, ref_audio)
    base_video, _ = oracle(tiny_ckpt, REQUEST, [])
    assert not torch.equal(result.video, base_video)  # the deltas did change the output
    after = snapshot()
    assert after.keys() == before.keys()
    for name, (ptr, value) in after.items():  # the very tensor it held, unchanged
        assert ptr == before[name][0] and torch.equal(value, before[name][1]), name


@pytest.mark.parametrize("uses", [[("fast", 0.9)], [("dmod", 1.1), ("fast", 0.6)]], ids=["time", "composed"])
def test_plans_built_with_deltas_are_what_the_resident_model_computes(
    uses: list[tuple[str, float]], resident: Any, registry: AdapterRegistry, tiny_ckpt: Path
) -> None:
    from ditcore.adapter_plans import ModulationDeltas
    from ditcore.plans import PlanKey
    from ditcore.rebuild import PlanBuilder, Shard

    infos = [(registry.get(n), s) for n, s in uses]
    builder = PlanBuilder(tiny_ckpt / "transformer")
    deltas = ModulationDeltas.load(infos, "base", builder.projection_dtype, builder.time_dtype)
    assert deltas.diffs and deltas.digest
    key = PlanKey.from_timesteps(0.0, 0.5, 0.75)
    want = resident_pages(resident, key, infos)
    assert torch.equal(builder.build_one(key, deltas), want)
    assert not torch.equal(builder.build_one(key), want)
    halves = torch.empty_like(want)
    for index in range(2):
        PlanBuilder(tiny_ckpt / "transformer", shard=Shard(index, 2, "rows")).build([key], [halves], deltas)
    assert torch.equal(halves, want)
    assert torch.equal(builder.build_one(key), builder.build_one(key))  # the time embedder is put back


def test_cached_with_deltas_equals_diffusers(registry: AdapterRegistry, adapter_dir: Path, tiny_ckpt: Path) -> None:
    """Trunk deltas in the cached model itself, time and modulation deltas in the plans built with them."""
    from ditcore.adapter_plans import ModulationDeltas

    cached = load_model(tiny_ckpt, "cached")
    cached.adapter_set.modulation_plans = True
    uses = [("dtrunk", 0.9), ("fast", 1.0), ("dmod", 0.5)]
    infos = [(registry.get(n), s) for n, s in uses]
    plans = BuiltPages(tiny_ckpt)
    builder = plans.builder("base")
    plans.deltas = ModulationDeltas.load(infos, "base", builder.projection_dtype, builder.time_dtype)
    result = generate(cached, REQUEST, plans, adapters=infos)
    ref_video, ref_audio = oracle(tiny_ckpt, REQUEST, [(adapter_dir / f"{n}.safetensors", s) for n, s in uses])
    assert torch.equal(result.video, ref_video) and torch.equal(result.audio, ref_audio)


def test_bad_deltas_are_refused_naming_the_module(resident: Any, tiny_ckpt: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    write_adapter(tmp_path / "other.safetensors", "small", "none", "diffusers", 2, None, 4, deltas="time")
    reg = AdapterRegistry(tmp_path)
    saved, before = resident.adapter_set.registry, len(resident.adapter_set.loaded())
    resident.adapter_set.registry = reg
    try:
        with pytest.raises(AdapterError, match=r"adapter other: time_embedder\.linear_\d is \d+ -> \d+ in this model"):
            resident.adapter_set.resolve(GenerationRequest(**{**vars(REQUEST), "adapters": (_use("other"),)}))
    finally:
        resident.adapter_set.registry = saved
    assert len(resident.adapter_set.loaded()) == before
    good = write_adapter(tmp_path / "nan.safetensors", tiny_ckpt, "none", "ai-toolkit", 2, None, 1, deltas="time")
    tensors = load_file(str(good))
    tensors["diffusion_model.time_embedder.proj_in.diff_b"][0] = float("inf")
    save_file(tensors, str(good))
    with pytest.raises(AdapterError, match=r"the bias delta of time_embedder\.linear_1 holds NaN or Inf"):
        reg.get("nan")
    tensors = load_file(str(write_adapter(tmp_path / "x.safetensors", tiny_ckpt, "none", "kohya", 2, None, 1,
                                          deltas="modulation")))  # fmt: skip
    save_file({**tensors, "final_layer.video_out.diff": torch.zeros(2, 2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(AdapterError, match=r"final_layer\.video_out\.diff"):
        reg.get("x")


def _use(name: str) -> Any:
    from ditcore.adapter_contract import AdapterUse

    return AdapterUse(name)


def test_a_cached_model_checks_modulation_shapes_at_admission(tiny_ckpt: Path, tmp_path: Path) -> None:
    """A cached model holds no adaln_proj, norm_out or time embedder, yet a modulation LoRA or delta of other shapes
    (a pruned checkpoint's) is refused when the request is read, naming the module and both shapes, not when the
    sidecar builds its plans."""
    cached = load_model(tiny_ckpt, "cached")
    cached.adapter_set.modulation_plans = True
    write_adapter(tmp_path / "lora.safetensors", "small", "modulation", "diffusers", 2, None, 4)
    write_adapter(tmp_path / "delta.safetensors", "small", "none", "diffusers", 2, None, 4, deltas="time")
    cached.adapter_set.registry = AdapterRegistry(tmp_path)
    for name, module in (("lora", r"(transformer_blocks\.\d+\.adaln_proj|norm_out)\.linear"),
                         ("delta", r"time_embedder\.linear_\d")):  # fmt: skip
        request = GenerationRequest(**{**vars(REQUEST), "adapters": (_use(name),)})
        with pytest.raises(AdapterError, match=rf"adapter {name}: {module} is \d+ -> \d+ in this model but its"):
            cached.adapter_set.resolve(request)
    assert not cached.adapter_set.loaded()
