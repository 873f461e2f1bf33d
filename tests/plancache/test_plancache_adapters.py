"""The sidecar's AdapterPlans (plancache_service.adapters) refuses what a lying or mistaken PreparePlans says about
its adapters, naming the rule, and remembers nothing of a refused call: a name it does not hold (NOT_FOUND), an
identity that is not its file's (the generator read another file), adapters that are not the keys' digest, adapters
named for keys without a digest, keys of two digests, and adapter plans asked of a sidecar without --adapter-dir."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ditcore.adapter_contract import AdapterError, AdapterNotFoundError
from ditcore.adapter_files import write_adapter
from ditcore.adapter_plans import modulation_digest
from ditcore.adapters import AdapterRegistry
from ditcore.plans import PlanKey
from plancache_service.adapters import AdapterPlans
from plancache_service.errors import InvalidPlanRequestError


def spec(name: str, identity: str, scale: float = 1.0) -> SimpleNamespace:
    return SimpleNamespace(name=name, identity=identity, scale=scale)


@pytest.fixture(scope="module")
def registry(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> AdapterRegistry:
    root = tmp_path_factory.mktemp("sidecar-adapters")
    write_adapter(root / "mod.safetensors", tiny_ckpt, "modulation", "diffusers", rank=2, alpha=None, seed=2)
    write_adapter(root / "time.safetensors", tiny_ckpt, "time", "diffusers", rank=2, alpha=None, seed=3)
    return AdapterRegistry(root)


def keys_of(digest: str) -> list[PlanKey]:
    return [PlanKey.from_timesteps(0.5).with_adapters(digest), PlanKey.from_timesteps(0.25).with_adapters(digest)]


def test_a_well_formed_call_is_remembered_and_builds_with_its_adapters(registry: AdapterRegistry) -> None:
    plans = AdapterPlans(registry)
    mod = registry.get("mod")
    digest = modulation_digest([(mod, 0.5)])
    plans.register([spec("mod", mod.identity, 0.5)], keys_of(digest))
    builder = SimpleNamespace(projection_dtype=torch.bfloat16, time_dtype=torch.float32, device="cpu")
    deltas = plans.deltas(digest, "base", builder)
    assert deltas is not None and deltas.digest == digest and set(deltas.terms)
    assert plans.deltas("", "base", builder) is None  # the base weights' plans
    plans.register([], [PlanKey.from_timesteps(0.5)])  # no adapters, no digest: nothing to check


def test_every_lie_is_refused_naming_the_rule_and_nothing_is_remembered(registry: AdapterRegistry) -> None:
    plans = AdapterPlans(registry)
    mod, time = registry.get("mod"), registry.get("time")
    digest = modulation_digest([(mod, 1.0)])
    cases = [
        ([spec("nope", "0" * 64)], keys_of(digest), AdapterNotFoundError, "no nope.safetensors"),
        ([spec("mod", "f" * 64)], keys_of(digest), AdapterError, "both must read the same file"),
        ([spec("time", time.identity)], keys_of(digest), InvalidPlanRequestError, "not the adapters of the plan keys"),
        ([spec("mod", mod.identity)], [PlanKey.from_timesteps(0.5)], InvalidPlanRequestError, "no plan key carries"),
        ([spec("mod", mod.identity)], [*keys_of(digest), *keys_of("a" * 64)], InvalidPlanRequestError, "different"),
    ]
    for specs, keys, error, message in cases:
        with pytest.raises(error, match=message):
            plans.register(specs, keys)
    builder = SimpleNamespace(projection_dtype=None, time_dtype=None, device="cpu")
    with pytest.raises(AdapterError, match="no adapters are known"):
        plans.deltas(digest, "base", builder)  # none of those calls left its digest behind
    with pytest.raises(AdapterError, match="start it with --adapter-dir"):
        AdapterPlans(None).register([spec("mod", mod.identity)], keys_of(digest))
