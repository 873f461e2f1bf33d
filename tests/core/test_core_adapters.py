"""Adapters on one model (ditcore.adapters) against the oracle: diffusers' own pipeline with the same files loaded
through `load_lora_weights` and activated with `set_adapters(names, weights)` (unfused), `torch.equal`:

- resident: trunk-only (musubi layout), adaln_proj + norm_out (diffusers layout), time embedder (ai-toolkit), and two
  composed with scales; a ref2va adapter on `transformer_ref`; a base request right after an adapter request equals
  the base oracle;
- cached: a trunk-only adapter on the base plans equals the oracle; an adapter that changes the modulation is
  refused there, nothing loaded;
- the registry: identities, a file changed under its name read again with a new identity, manifests, refusals.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from oracle import adapter_latents
from plankit import BuiltPages, resident_pages
from refmedia import image_bytes

from ditcore import GenerationRequest, generate, load_model
from ditcore.adapter_contract import AdapterContract, AdapterUse, check_uses
from ditcore.adapter_files import write_adapter
from ditcore.adapters import AdapterError, AdapterNotFoundError, AdapterRegistry, read_adapter
from ditcore.references import Reference
from ditcore.request import RequestError

REQUEST = GenerationRequest(request_id="a", prompt="a red fox", num_inference_steps=3, seed=7)
REF2VA = GenerationRequest(request_id="r", task="ref2va", prompt="a red fox", num_inference_steps=3, seed=7,
                           references=(Reference(image_bytes(80, 48, seed=1)),))  # fmt: skip
ADAPTERS = {  # name: (targets, layout, partition)
    "trunk": ("trunk", "musubi", "base"),
    "mod": ("modulation", "diffusers", "base"),
    "time": ("time", "ai-toolkit", "base"),
    "refmod": ("all", "diffusers", "ref"),
}


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, tiny_ckpt: Path) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for seed, (name, (targets, layout, partition)) in enumerate(ADAPTERS.items()):
        write_adapter(root / f"{name}.safetensors", tiny_ckpt, targets, layout, rank=2, alpha=None, seed=seed + 3,
                      partition=partition)  # fmt: skip
    return root


@pytest.fixture(scope="module")
def registry(adapter_dir: Path) -> AdapterRegistry:
    return AdapterRegistry(adapter_dir)


@pytest.fixture(scope="module")
def resident(tiny_ckpt: Path) -> Any:
    return load_model(tiny_ckpt, "resident")


def oracle(repo: Path, request: GenerationRequest, uses: Sequence[tuple[Path, float]]) -> tuple[torch.Tensor, ...]:
    """diffusers' latents with these adapter files loaded and set (names in order, at their scales), unloaded after."""
    return adapter_latents(repo, request, list(uses))


def run(model: Any, request: GenerationRequest, registry: AdapterRegistry, uses: Sequence[tuple[str, float]],
        plans: Any = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    result = generate(model, request, plans, adapters=[(registry.get(n), s) for n, s in uses])
    return result.video, result.audio


@pytest.mark.parametrize(
    "uses",
    [[("trunk", 1.0)], [("mod", 1.0)], [("time", 0.8)], [("mod", 1.3), ("trunk", 0.7)]],
    ids=["trunk", "adaln+norm_out", "time-embedder", "two-composed"],
)
def test_resident_equals_diffusers_with_the_same_adapters(
    uses: list[tuple[str, float]], resident: Any, registry: AdapterRegistry, adapter_dir: Path, tiny_ckpt: Path
) -> None:
    video, audio = run(resident, REQUEST, registry, uses)
    ref_video, ref_audio = oracle(tiny_ckpt, REQUEST, [(adapter_dir / f"{n}.safetensors", s) for n, s in uses])
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)
    base_video, _ = oracle(tiny_ckpt, REQUEST, [])
    assert not torch.equal(video, base_video)  # the adapter did change the output


def test_fl2va_with_adapters_equals_diffusers(resident: Any, registry: AdapterRegistry, adapter_dir: Path,
                                             tiny_ckpt: Path) -> None:  # fmt: skip
    fl2va = GenerationRequest(request_id="f", task="fl2va", prompt="a red fox", num_inference_steps=3, seed=7,
                              first_frame=image_bytes(64, 48, seed=2))  # fmt: skip
    uses = [("mod", 1.1), ("trunk", 0.7)]
    video, audio = run(resident, fl2va, registry, uses)
    ref_video, ref_audio = oracle(tiny_ckpt, fl2va, [(adapter_dir / f"{n}.safetensors", s) for n, s in uses])
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)
    assert not torch.equal(video, oracle(tiny_ckpt, fl2va, [])[0])


def test_a_base_request_after_adapter_requests_is_the_base_model(resident: Any, registry: AdapterRegistry,
                                                                  tiny_ckpt: Path) -> None:  # fmt: skip
    run(resident, REQUEST, registry, [("mod", 1.0), ("trunk", 1.0)])
    video, audio = run(resident, REQUEST, registry, [])
    ref_video, ref_audio = oracle(tiny_ckpt, REQUEST, [])
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)


def test_ref2va_adapter_on_transformer_ref(resident: Any, registry: AdapterRegistry, adapter_dir: Path,
                                           tiny_ckpt: Path) -> None:  # fmt: skip
    assert registry.get("refmod").partition == "ref"
    video, audio = run(resident, REF2VA, registry, [("refmod", 1.0)])
    ref_video, ref_audio = oracle(tiny_ckpt, REF2VA, [(adapter_dir / "refmod.safetensors", 1.0)])
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)
    with pytest.raises(AdapterError, match="targets the ref transformer; this request runs the base one"):
        run(resident, REQUEST, registry, [("refmod", 1.0)])


def test_cached_serves_a_trunk_adapter_on_the_base_plans_and_refuses_a_modulation_one(
    registry: AdapterRegistry, adapter_dir: Path, tiny_ckpt: Path
) -> None:
    cached = load_model(tiny_ckpt, "cached")
    plans = BuiltPages(tiny_ckpt)
    video, audio = run(cached, REQUEST, registry, [("trunk", 1.0)], plans)
    ref_video, ref_audio = oracle(tiny_ckpt, REQUEST, [(adapter_dir / "trunk.safetensors", 1.0)])
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)
    for name in ("mod", "time"):
        with pytest.raises(AdapterError, match=rf"adapter {name} changes the modulation"):
            run(cached, REQUEST, registry, [(name, 1.0)], plans)
    assert [a.name for a in cached.adapter_set.loaded()] == ["trunk"]
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin

    factors = MiniMaxH3LoraLoaderMixin.lora_state_dict(str(adapter_dir / "trunk.safetensors")).values()
    held = cached.adapter_set.loaded_bytes()[registry.get("trunk").identity]
    assert held == sum(t.numel() for t in factors) * 2  # its factors as loaded: in the base layers' bfloat16


# ---------------------------------------------------------------------------- the registry and the rules
def test_identity_targets_and_a_file_changed_under_its_name(adapter_dir: Path, tmp_path: Path, tiny_ckpt: Path) -> None:
    for name in ADAPTERS:
        shutil.copy(adapter_dir / f"{name}.safetensors", tmp_path)
    reg = AdapterRegistry(tmp_path)
    info = reg.get("trunk")
    assert (info.rank, info.partition, info.changes_modulation) == (2, "base", False)
    assert {g: len(m) for g, m in info.targets.items()} == {"trunk": 24, "modulation": 0, "time": 0}
    assert reg.get("mod").changes_modulation and reg.get("time").changes_modulation
    assert reg.get("trunk") is info  # unchanged: not read again
    write_adapter(tmp_path / "trunk.safetensors", tiny_ckpt, "trunk", "musubi", rank=2, alpha=None, seed=99)
    changed = reg.get("trunk")
    assert changed.identity != info.identity
    (tmp_path / "trunk.json").write_text(json.dumps({"steps": [5]}))  # a manifest is part of the identity
    assert reg.get("trunk").identity != changed.identity and reg.get("trunk").contract.steps == (5,)
    (tmp_path / "trunk.json").unlink()
    (tmp_path / "trunk.safetensors").unlink()
    with pytest.raises(AdapterNotFoundError, match=r"no trunk\.safetensors"):
        reg.get("trunk")
    with pytest.raises(AdapterNotFoundError, match="not an adapter name"):
        reg.get("../trunk")


def test_bad_files_are_refused_naming_the_file(tmp_path: Path, tiny_ckpt: Path) -> None:
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match=r"junk\.safetensors: not a safetensors file"):
        read_adapter(tmp_path / "junk.safetensors")
    from safetensors.torch import load_file, save_file

    good = write_adapter(tmp_path / "nan.safetensors", tiny_ckpt, "trunk", "diffusers", rank=2, alpha=None, seed=1)
    tensors = load_file(str(good))
    first = sorted(tensors)[0]
    tensors[first][0, 0] = float("nan")
    save_file(tensors, str(good))
    with pytest.raises(AdapterError, match="holds NaN or Inf"):
        read_adapter(good)
    tensors = load_file(str(write_adapter(tmp_path / "x.safetensors", tiny_ckpt, "trunk", "diffusers", 2, None, 1)))
    save_file({**tensors, "transformer.proj_out.diff": torch.zeros(4, 4)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(AdapterError, match=r"1 key\(s\) name no LoRA factor or full-parameter delta .*proj_out\.diff"):
        read_adapter(tmp_path / "x.safetensors")
    reg = AdapterRegistry(tmp_path)
    found, errors = reg.scan()
    assert not found and set(errors) == {"junk", "nan", "x"}


def test_manifest_contract_and_request_rules() -> None:
    contract = AdapterContract.parse(json.dumps({"steps": [5, 9], "flow_shifts": [5.0], "scale": [0, 1.5],
                                                 "tasks": ["t2va"], "default_steps": 5}), "turbo.json")  # fmt: skip
    contract.check("turbo", 1.0, "t2va", 5, 5.0, 3.0)
    with pytest.raises(RequestError, match=r"num_inference_steps: adapter turbo allows num_inference_steps 5, 9"):
        contract.check("turbo", 1.0, "t2va", 50, 5.0, 3.0)
    with pytest.raises(RequestError, match=r"flow_shift: adapter turbo allows flow_shift 5, got 12"):
        contract.check("turbo", 1.0, "t2va", 5, 12.0, 3.0)
    with pytest.raises(RequestError, match=r"adapters: turbo: scale 2 is outside its range \[0, 1.5\]"):
        contract.check("turbo", 2.0, "t2va", 5, 5.0, 3.0)
    with pytest.raises(RequestError, match=r"task: adapter turbo runs with tasks t2va, not ref2va"):
        contract.check("turbo", 1.0, "ref2va", 5, 5.0, 3.0)
    for bad, message in (({"steps": [1]}, "steps must be a list of integers >= 2"),
                         ({"scale": [2, 1]}, "scale must be"), ({"nope": 1}, "unknown key 'nope'"),
                         ({"steps": [5], "default_steps": 9}, "default_steps 9 is not one of")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            AdapterContract.parse(json.dumps(bad), "m.json")
    check_uses([AdapterUse("a", 1.0), AdapterUse("b", 0.5)], max_count=4)
    for uses, message in (([AdapterUse("a"), AdapterUse("a")], "a is named twice"),
                          ([AdapterUse("../a")], "no path"), ([AdapterUse("a", float("nan"))], "finite"),
                          ([AdapterUse(str(i)) for i in range(5)], "at most 4 adapters")):  # fmt: skip
        with pytest.raises(RequestError, match=message):
            check_uses(uses, max_count=4)


@pytest.fixture(autouse=True)
def _no_leftover(resident: Any) -> Iterator[None]:
    yield
    transformer = resident.transformer_of("base")
    if getattr(transformer, "peft_config", None):  # every test leaves the base model's bits for the next
        assert all(getattr(m, "disable_adapters", True) for m in transformer.modules() if hasattr(m, "lora_A"))


def test_a_lora_of_other_shapes_is_refused_before_anything_loads(resident: Any, tmp_path: Path) -> None:
    """A LoRA trained on other shapes (the `small` preset's, as a pruned checkpoint's would be) fits no module of
    this model: refused when the request is read, naming the module and both shapes; nothing loaded."""
    write_adapter(tmp_path / "other.safetensors", "small", "trunk", "diffusers", rank=2, alpha=None, seed=4)
    reg = AdapterRegistry(tmp_path)
    before = len(resident.adapter_set.loaded())
    request = GenerationRequest(**{**vars(REQUEST), "adapters": (AdapterUse("other"),)})
    resident.adapter_set.registry, saved = reg, resident.adapter_set.registry
    try:
        with pytest.raises(
            AdapterError,
            match=r"adapter other: \S+\.attn\.to_\w+ is 64 -> 64 in this model but its factors are 128 -> 128",
        ):
            generate(resident, request)
    finally:
        resident.adapter_set.registry = saved
    assert len(resident.adapter_set.loaded()) == before


def test_loaded_adapters_are_bounded_by_bytes_least_recently_used_first(tiny_ckpt: Path, tmp_path: Path) -> None:
    """`max_loaded_bytes`: a new adapter deletes the least recently used until it fits; one that alone exceeds the
    bound is refused when the request is read, naming the flag, nothing loaded."""
    for seed, name in enumerate(("a", "b", "c")):
        write_adapter(tmp_path / f"{name}.safetensors", tiny_ckpt, "trunk", "diffusers", 2, None, seed=seed)
    write_adapter(tmp_path / "big.safetensors", tiny_ckpt, "trunk", "diffusers", 8, None, seed=9)
    model = load_model(tiny_ckpt, "resident")
    adapters = model.adapter_set
    adapters.registry = reg = AdapterRegistry(tmp_path)
    one = adapters.load_bytes(reg.get("a"))
    adapters.max_loaded_bytes = 2 * one  # room for two rank-2 adapters
    for name in ("a", "b", "a", "c"):  # "a" used again: "b" is the least recently used when "c" comes
        adapters.load(reg.get(name))
    assert [i.name for i in adapters.loaded()] == ["a", "c"] and adapters.held_bytes() == 2 * one
    with pytest.raises(AdapterError, match=r"adapter big: loading it holds [\d,]+ bytes, more than the [\d,]+ .*"
                                           r"--max-loaded-adapter-mb"):  # fmt: skip
        adapters.resolve(GenerationRequest(**{**vars(REQUEST), "adapters": (AdapterUse("big"),)}))
    assert [i.name for i in adapters.loaded()] == ["a", "c"]


# ---------------------------------------------------------------------------- plans built with adapters
@pytest.mark.parametrize(
    "uses", [[("mod", 1.0)], [("time", 0.8)], [("mod", 1.3), ("time", 0.7), ("trunk", 0.5)]],
    ids=["adaln+norm_out", "time-embedder", "composed"],
)  # fmt: skip
def test_plans_built_with_adapters_are_what_peft_computes(
    uses: list[tuple[str, float]], resident: Any, registry: AdapterRegistry, tiny_ckpt: Path
) -> None:
    """PlanBuilder with the adapters' modulation deltas (whole, and row-sharded 2 ways) equals the resident model's
    PEFT-wrapped modulation modules, bit for bit; the digest names the modulation-changing adapters only."""
    from ditcore.adapter_plans import ModulationDeltas, modulation_digest
    from ditcore.plans import PlanKey
    from ditcore.rebuild import PlanBuilder, Shard

    infos = [(registry.get(n), s) for n, s in uses]
    builder = PlanBuilder(tiny_ckpt / "transformer")
    deltas = ModulationDeltas.load(infos, "base", builder.projection_dtype, builder.time_dtype)
    assert (
        deltas.digest == modulation_digest(infos) != ""
        and set(deltas.terms)
        and not any(m.endswith(("to_q", "to_k", "to_v")) for m in deltas.terms)
    )
    for key in (PlanKey.from_timesteps(0.25), PlanKey.from_timesteps(0.0, 0.5, 0.75)):
        want = resident_pages(resident, key, infos)
        assert torch.equal(builder.build_one(key, deltas), want)
        assert not torch.equal(builder.build_one(key), want)  # the adapter changed the plan
        halves = torch.empty_like(want)
        for index in range(2):
            shard = PlanBuilder(tiny_ckpt / "transformer", shard=Shard(index, 2, "rows"))
            shard.build([key], [halves], deltas)
        assert torch.equal(halves, want)
    assert modulation_digest([(registry.get("trunk"), 1.0)]) == ""  # trunk-only: the base plans


@pytest.mark.parametrize("uses", [[("mod", 1.0)], [("time", 0.8), ("mod", 0.6)]], ids=["adaln+norm_out", "time+mod"])
def test_cached_pages_built_with_a_modulation_adapter_equal_diffusers(
    uses: list[tuple[str, float]], registry: AdapterRegistry, adapter_dir: Path, tiny_ckpt: Path
) -> None:
    """A cached model whose plans are built with the adapters' modulation deltas (no PEFT layer in the model:
    these adapters touch no trunk module) computes diffusers + PEFT's output exactly."""
    from ditcore.adapter_plans import ModulationDeltas

    cached = load_model(tiny_ckpt, "cached")
    infos = [(registry.get(n), s) for n, s in uses]
    plans = BuiltPages(tiny_ckpt)
    builder = plans.builder("base")
    plans.deltas = ModulationDeltas.load(infos, "base", builder.projection_dtype, builder.time_dtype)
    result = generate(cached, REQUEST, plans)
    ref_video, ref_audio = oracle(tiny_ckpt, REQUEST, [(adapter_dir / f"{n}.safetensors", s) for n, s in uses])
    assert torch.equal(result.video, ref_video) and torch.equal(result.audio, ref_audio)


@pytest.mark.parametrize("alpha", [None, 3.0], ids=["alpha-less", "metadata-alpha"])
def test_mixed_rank_adapter_plans_scale_each_module_as_diffusers_loads_it(
    alpha: float | None, resident: Any, tiny_ckpt: Path, tmp_path: Path
) -> None:
    """Published H3 LoRAs mix ranks (64 on attention, 16 on the AdaLN projections): a file whose norm_out factors are
    rank 4 and the rest rank 2, alpha-less or with a `__metadata__` alpha, builds the plans the resident model's
    PEFT layers compute (diffusers pins alpha = each module's rank, or applies the one network alpha to all)."""
    from safetensors.torch import load_file, save_file

    from ditcore.adapter_plans import ModulationDeltas
    from ditcore.plans import PlanKey
    from ditcore.rebuild import PlanBuilder

    two = write_adapter(tmp_path / "r2.safetensors", tiny_ckpt, "modulation", "diffusers", 2, alpha, seed=8)
    four = write_adapter(tmp_path / "r4.safetensors", tiny_ckpt, "modulation", "diffusers", 4, alpha, seed=9)
    tensors = load_file(str(two))
    tensors.update({k: v for k, v in load_file(str(four)).items() if ".norm_out." in k})
    metadata = {"format": "pt", **({"alpha": repr(alpha)} if alpha is not None else {})}
    mixed = tmp_path / "mixed.safetensors"
    save_file(tensors, str(mixed), metadata=metadata)
    reg = AdapterRegistry(tmp_path)
    info = reg.get("mixed")
    assert info.rank == 4
    uses = [(info, 0.9)]
    builder = PlanBuilder(tiny_ckpt / "transformer")
    deltas = ModulationDeltas.load(uses, "base", builder.projection_dtype, builder.time_dtype)
    key = PlanKey.from_timesteps(0.0, 0.5)
    assert torch.equal(builder.build_one(key, deltas), resident_pages(resident, key, uses))
