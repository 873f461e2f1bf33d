"""Adapters served end to end, beyond tests/test_adapter_client.py: every result of a cached server with adapters
equals a resident server's for the same request and adapter files (resident == diffusers + PEFT is proven in
tests/core/test_core_adapters.py):

- through the real grpcurl (Generate with `adapters`, ListAdapters, an unknown name NOT_FOUND);
- through the /v1/videos facade driven by the real `openai` client with vLLM-Omni's `lora` (an object and a list):
  the job's latents and content hash as a direct Generate of the same request;
- from the host tier: a slab that holds one request's plans, base and adapter requests alternating, every repeat
  swapped in (nothing built) with its own bits;
- under weight updates A -> B -> A -> B -> A while clients alternate base / mod / trunk / mod+trunk: every response
  is its own (weights of the generation it reports, adapters) reference, never mixed;
- fl2va with a modulation adapter and ref2va with `transformer_ref` adapters (modulation only, and all groups).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from jobskit import facade
from refmedia import image_bytes
from servicekit import GENERATOR_SERVICE, Pair, Weights, distinct_plans, png_bytes, updatable, wait_for
from test_e2e_grpcurl import GRPC_ERROR_EXIT, _hash_tensors, run_grpcurl

from ditserve.client import GeneratorClient
from ditserve.jobs_client import JobsClient
from ditserve.openai.config import FacadeConfig

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

BASE: dict[str, Any] = {"prompt": "a red fox", "num_inference_steps": 3, "seed": 7}
"""Two forwards on the default 32 x 32 x 124 canvas: the cheapest request with plans of two keys."""
MOD = [{"name": "mod", "scale": 0.9}]
TRUNK = [{"name": "trunk", "scale": 0.8}]
MOD_TRUNK = [{"name": "mod", "scale": 1.2}, {"name": "trunk", "scale": 0.5}]
ADAPTERS = {  # name: (targets, partition, seed); every one in the diffusers layout
    "trunk": ("trunk", "base", 1),
    "mod": ("modulation", "base", 2),
    "refmod": ("modulation", "ref", 4),
    "refall": ("all", "ref", 5),
}
KEY = "sk-adapter-serving-0123456789"
TIMEOUT = 120.0


# ----------------------------------------------------------------------------- servers
@pytest.fixture(scope="module")
def adapter_dir(weights: Weights, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ditcore.adapter_files import write_adapter

    root = tmp_path_factory.mktemp("serving-adapters")
    for name, (targets, partition, seed) in ADAPTERS.items():
        write_adapter(root / f"{name}.safetensors", weights.a, targets, "diffusers", rank=2, alpha=None, seed=seed,
                      partition=partition)  # fmt: skip
    return root


class Reference:
    """A resident generator on one checkpoint with the adapter dir: the sha256 of each request's result, once."""

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self._seen: dict[str, str] = {}
        self._lock = threading.Lock()

    def sha(self, request: dict[str, Any]) -> str:
        key = repr(sorted((k, v) for k, v in request.items() if k != "request_id"))
        with self._lock:
            if key not in self._seen:
                with GeneratorClient(self.pair.target) as client:
                    self._seen[key] = client.generate({**request, "request_id": "ref"}, timeout=TIMEOUT).sha256
            return self._seen[key]


@pytest.fixture(scope="module")
def resident_a(weights: Weights, adapter_dir: Path) -> Iterator[Reference]:
    with Pair(weights.a, mode="resident", adapter_dir=adapter_dir) as p:
        yield Reference(p.start())


@pytest.fixture(scope="module")
def cached(weights: Weights, adapter_dir: Path) -> Iterator[Pair]:
    """A cached pair on A (generator + sidecar in this process, both reading the adapter dir) with slots wide
    enough for ref2va, serving Jobs (a temporary store)."""
    with Pair(weights.a, adapter_dir=adapter_dir, plan_width=4, gpu_plans=64) as p:
        yield p.start()


def _generate(pair: Pair, request: dict[str, Any], request_id: str) -> Any:
    with GeneratorClient(pair.target) as client:
        return client.generate({**request, "request_id": request_id}, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- 1. grpcurl
@pytest.mark.e2e  # starts grpcurl
def test_grpcurl_generate_with_an_adapter_on_a_cached_server_is_the_resident_result(
    cached: Pair, resident_a: Reference
) -> None:
    """Generate with `"adapters":[{"name":"mod","scale":0.9}]` through the real grpcurl: the bytes grpcurl receives
    hash to the resident server's result (not the base one); ListAdapters through grpcurl shows every adapter with
    the resident server's identities, mod loaded; an unknown name is NotFound naming it."""
    want = resident_a.sha({**BASE, "adapters": MOD})
    assert want != resident_a.sha(BASE)
    gen = ["-plaintext", "-emit-defaults", "-d"]
    data = {**BASE, "request_id": "grpcurl-mod", "adapters": MOD}
    r = run_grpcurl([*gen, json.dumps(data), cached.target, f"{GENERATOR_SERVICE}/Generate"], timeout=TIMEOUT)
    assert r.code == 0, r.text
    out = r.json()
    assert out["adaln_mode"] == "ADALN_MODE_CACHED" and out["request_id"] == "grpcurl-mod"
    assert out["sha256"] == want and _hash_tensors(out["tensors"]) == want

    r = run_grpcurl([*gen, "{}", cached.target, f"{GENERATOR_SERVICE}/ListAdapters"])
    assert r.code == 0, r.text
    listed = {a["name"]: a for a in r.json()["adapters"]}
    assert not r.json()["refused"]
    with GeneratorClient(resident_a.pair.target) as client:
        resident = {a.name: a for a in client.list_adapters().adapters}
    assert set(listed) == set(resident) == set(ADAPTERS)
    assert {n: a["identity"] for n, a in listed.items()} == {n: a.identity for n, a in resident.items()}
    assert {n: a["partition"] for n, a in listed.items()} == {n: p for n, (_, p, _) in ADAPTERS.items()}
    assert listed["mod"]["loaded"] is True

    bad = {**data, "request_id": "grpcurl-nope", "adapters": [{"name": "nope"}]}
    r = run_grpcurl([*gen, json.dumps(bad), cached.target, f"{GENERATOR_SERVICE}/Generate"], timeout=TIMEOUT)
    assert r.code == GRPC_ERROR_EXIT + grpc.StatusCode.NOT_FOUND.value[0], r.text
    assert "Code: NotFound" in r.text and "nope" in r.text


# ----------------------------------------------------------------------------- 2. the OpenAI facade
@pytest.fixture(scope="module")
def videos(cached: Pair) -> Iterator[openai.OpenAI]:
    """The real `openai` client on the /v1/videos facade over the cached pair's Jobs API."""
    with (
        JobsClient(cached.target) as jobs,
        facade(jobs, FacadeConfig(api_key=KEY)) as url,
        pytest.MonkeyPatch.context() as mp,
    ):
        mp.setattr(openai._base_client, "get_platform", lambda: "Linux")  # no `uname -p` process
        yield openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)


@pytest.mark.parametrize(
    ("lora", "uses"),
    [({"name": "mod", "scale": 0.9}, MOD), (MOD_TRUNK, MOD_TRUNK),
     (json.dumps({"name": "mod", "scale": 0.9}), MOD), (json.dumps(MOD_TRUNK), MOD_TRUNK)],
    ids=["object", "list", "object-as-json-text", "list-as-json-text"],
)  # fmt: skip
def test_the_facades_lora_runs_the_adapters_as_generate_does(
    videos: openai.OpenAI, cached: Pair, resident_a: Reference, lora: Any, uses: list[dict[str, Any]]
) -> None:
    """`extra_body={"lora": ...}` through the real openai client: the job lists the adapters, its latents are the
    resident result of the same request with them (not the base one), and its content (the MP4 the client
    downloads) is the bytes a direct Generate of that request returns as MP4 on the same server.

    The openai package sends videos.create as multipart/form-data, a nested `lora` flattened into bracket parts
    (`lora[name]`, `lora[scale]`; a list as `lora[][name]` x N, then `lora[][scale]` x N): the `object` and `list`
    cases are what a user writes; the JSON-text cases are the multipart form docs/openai-api.md names."""
    video = videos.videos.create(prompt=BASE["prompt"], extra_body={"num_inference_steps": BASE["num_inference_steps"],
                                 "seed": BASE["seed"], "lora": lora})  # fmt: skip

    def finished() -> openai.types.Video | None:
        v = videos.videos.retrieve(video.id)
        return v if v.status in ("completed", "failed") else None

    done = wait_for(finished, TIMEOUT, "the video", interval=0.1)
    assert done.status == "completed", done.error
    with JobsClient(cached.target) as jobs:
        job = jobs.get(video.id)
    assert [(a.name, round(a.scale, 6)) for a in job.spec.adapters] == [(u["name"], u["scale"]) for u in uses]
    latents = resident_a.sha({**BASE, "adapters": uses})
    assert job.result.sha256 == latents != resident_a.sha(BASE)

    direct = _generate(cached, {**BASE, "adapters": uses, "output_type": "mp4"}, f"direct-{video.id}")
    assert direct.sha256 == latents and direct.media is not None
    content = videos.videos.download_content(video.id).read()
    sha = hashlib.sha256(content).hexdigest()
    assert sha == (done.model_extra or {})["sha256"] == job.result.content.sha256 == direct.media.sha256


# ----------------------------------------------------------------------------- 3. the host tier
@pytest.fixture(scope="module")
def one_fits_host(weights: Weights, adapter_dir: Path) -> Iterator[Pair]:
    """The bench's `alternating` / one_fits_host arm: a slab of as many slots as one request needs, a host tier."""
    slots = distinct_plans(weights.a, BASE)
    with Pair(weights.a, adapter_dir=adapter_dir, gpu_plans=slots, plan_width=2, host_cache_bytes=20 * 1000**2) as p:
        yield p.start()


def test_adapter_plans_evicted_to_the_host_tier_come_back_from_it(
    one_fits_host: Pair, resident_a: Reference, weights: Weights
) -> None:
    """Base, mod and mod at another scale (three plan sets, one slab's worth each) alternating: after the first
    round every request's plans were evicted by the others', and its repeat swaps them in from the host tier (no
    plan built, none in the slab) with its own resident bits."""
    n = distinct_plans(weights.a, BASE)
    combos = [[], MOD, [{"name": "mod", "scale": 1.3}]]
    want = [resident_a.sha({**BASE, "adapters": uses}) for uses in combos]
    assert len(set(want)) == len(want)
    with GeneratorClient(one_fits_host.target) as client:
        for round_ in range(3):
            for i, uses in enumerate(combos):
                got = client.generate({**BASE, "request_id": f"host-{round_}-{i}", "adapters": uses}, timeout=TIMEOUT)
                assert got.sha256 == want[i], (round_, uses, got.cache)
                c = got.cache
                if round_ == 0:
                    assert c.built_plans == n, (uses, c)
                else:
                    assert (c.built_plans, c.gpu_hit_plans, c.host_hit_plans) == (0, 0, n), (round_, uses, c)
    stats = one_fits_host.state().stats
    assert stats.host_hit_plans == 6 * n and stats.built_plans == 3 * n, stats
    assert stats.slot_evictions >= 8 * n and stats.host_groups >= 3, stats


# ----------------------------------------------------------------------------- 4. weight updates
@pytest.fixture(scope="module")
def resident_b(weights: Weights, adapter_dir: Path) -> Iterator[Reference]:
    with Pair(weights.b, mode="resident", adapter_dir=adapter_dir) as p:
        yield Reference(p.start())


@pytest.fixture(scope="module")
def updatable_pair(weights: Weights, adapter_dir: Path) -> Iterator[Pair]:
    with Pair(weights.a, **updatable(weights, adapter_dir=adapter_dir)) as p:
        yield p.start()


UPDATE_COMBOS: list[list[dict[str, Any]]] = [[], MOD, TRUNK, MOD_TRUNK]
UPDATE_CLIENTS = 2
UPDATES = 4  # A -> B -> A -> B -> A


def test_alternating_adapters_are_never_mixed_with_other_weights_under_updates(
    updatable_pair: Pair, resident_a: Reference, resident_b: Reference, weights: Weights
) -> None:
    """Two clients alternate base / mod / trunk / mod+trunk requests while UpdateWeights cycles A -> B -> A -> B -> A
    (each update once every combination has run on the current generation): every response equals the resident
    result of its adapters on the weights of the generation it reports, a client never sees generations go back,
    and every (weights, adapters) pair was served."""
    refs = {
        (ckpt, i): ref.sha({**BASE, "adapters": uses})
        for ckpt, ref in (("A", resident_a), ("B", resident_b))
        for i, uses in enumerate(UPDATE_COMBOS)
    }
    assert len(set(refs.values())) == len(refs), "every (weights, adapters) pair must have its own output"
    start = updatable_pair.status().generation
    weights_of = {start: "A"}
    stop = threading.Event()
    lock = threading.Lock()
    responses: list[tuple[int, int, int, str]] = []  # (client, combo, generation, sha256)
    seen: collections.Counter[tuple[int, int]] = collections.Counter()  # (generation, combo)
    errors: list[str] = []

    def client_loop(k: int) -> None:
        with GeneratorClient(updatable_pair.target) as client:
            seq = 0
            while not stop.is_set():
                i = (seq + k) % len(UPDATE_COMBOS)
                request = {**BASE, "request_id": f"upd-{k}-{seq}", "adapters": UPDATE_COMBOS[i]}
                try:
                    r = client.generate(request, timeout=TIMEOUT)
                except Exception as e:  # any error fails the test
                    with lock:
                        errors.append(f"client {k} request {seq} {UPDATE_COMBOS[i]}: {type(e).__name__}: {e}")
                    return
                with lock:
                    responses.append((k, i, r.generation, r.sha256))
                    seen[(r.generation, i)] += 1
                seq += 1

    def every_combo_ran(generation: int) -> bool:
        with lock:
            return bool(errors) or all(seen[(generation, i)] for i in range(len(UPDATE_COMBOS)))

    threads = [threading.Thread(target=client_loop, args=(k,), daemon=True) for k in range(UPDATE_CLIENTS)]
    for t in threads:
        t.start()
    current = start
    try:
        for _ in range(UPDATES):
            wait_for(functools.partial(every_combo_ran, current), TIMEOUT, f"every combination on generation {current}")
            if errors:
                break
            target = "B" if weights_of[current] == "A" else "A"
            up = updatable_pair.update(weights.a if target == "A" else weights.b, expected_generation=current)
            assert (up.generation, up.previous_generation) == (current + 1, current)
            current = up.generation
            weights_of[current] = target
        wait_for(lambda: every_combo_ran(current), TIMEOUT, f"every combination on generation {current}")
    finally:
        stop.set()
        for t in threads:
            t.join(TIMEOUT)
    assert not [t for t in threads if t.is_alive()], "a client thread never returned"
    assert not errors, "\n".join(errors)

    mixed = [r for r in responses if r[2] not in weights_of or r[3] != refs[(weights_of[r[2]], r[1])]]
    assert not mixed, f"{len(mixed)} of {len(responses)} responses mixed: {mixed[:5]} (weights {weights_of})"
    for k in range(UPDATE_CLIENTS):
        gens = [g for c, _, g, _ in responses if c == k]
        assert gens == sorted(gens), f"client {k} saw generations go backwards: {gens}"
    assert {(g, i) for g in weights_of for i in range(len(UPDATE_COMBOS))} <= set(seen), dict(seen)
    assert current == start + UPDATES and weights_of[current] == "A"
    state = updatable_pair.state()
    assert state.generation == current and state.leases_held == 0 and state.pending_weights_path == ""


# ----------------------------------------------------------------------------- 5. fl2va and ref2va
FL2VA: dict[str, Any] = {**BASE, "task": "fl2va", "first_frame": png_bytes(48, 32, seed=3)}
REF2VA: dict[str, Any] = {**BASE, "task": "ref2va", "references": [image_bytes(80, 48, seed=1)]}


@pytest.mark.parametrize(
    ("request_", "uses"),
    [(FL2VA, MOD), (REF2VA, [{"name": "refmod", "scale": 0.9}]), (REF2VA, [{"name": "refall", "scale": 0.7}])],
    ids=["fl2va-mod", "ref2va-refmod", "ref2va-refall"],
)
def test_keyframe_and_reference_tasks_with_adapters_in_cached_mode_equal_resident(
    cached: Pair, resident_a: Reference, request_: dict[str, Any], uses: list[dict[str, Any]]
) -> None:
    """fl2va with a base modulation adapter, ref2va with a `transformer_ref` one (modulation only; all groups):
    cached equals resident, differs from the base request, and the repeat hits its plans in the slab."""
    with_adapter = {**request_, "adapters": uses}
    want = resident_a.sha(with_adapter)
    assert want != resident_a.sha(request_)
    got = _generate(cached, with_adapter, "kf-1")
    assert got.sha256 == want, got.cache
    again = _generate(cached, with_adapter, "kf-2")
    assert again.sha256 == want and again.cache.built_plans == 0 and again.cache.gpu_hit_plans > 0, again.cache
    assert _generate(cached, request_, "kf-base").sha256 == resident_a.sha(request_)


def test_an_adapter_of_the_other_partition_is_refused_in_cached_mode(cached: Pair) -> None:
    """A `transformer_ref` adapter on fl2va and a base one on ref2va: INVALID_ARGUMENT naming the adapter."""
    for request_, name in ((FL2VA, "refmod"), (REF2VA, "mod")):
        with pytest.raises(grpc.RpcError) as err:
            _generate(cached, {**request_, "adapters": [{"name": name}]}, f"wrong-{name}")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert name in (err.value.details() or "")
