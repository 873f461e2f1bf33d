"""Adapters on the client side: GenerateRequest.adapters from a request (names, scales, a name alone), `--adapter
NAME[=SCALE]` and a JSONL line's "adapters", the facade's `lora` (vLLM-Omni's extra field), and end to end on a
resident generator with --adapter-dir: `ditserve adapters` (loaded before / after use), `ditserve generate --adapter`
(a different, deterministic result) and the refusals (NOT_FOUND, INVALID_ARGUMENT)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from clikit import run_cli_inprocess
from servicekit import Pair
from test_client_imports import UNREACHABLE, _run

from ditcore.request import AdapterUse, GenerationRequest, RequestError
from ditserve.cli import _parser
from ditserve.client import GeneratorClient
from ditserve.client_requests import request_to_proto
from ditserve.openai.mapping import ApiError, create_body, parse_json_object
from ditserve.remote import adapters_table
from ditserve.requests_io import parse_adapter, requests_from_args
from protos.ditserve.generator.v1 import generator_pb2 as pb


# ----------------------------------------------------------------------------- the request's proto
def test_request_to_proto_carries_the_adapters_in_order_with_their_scales() -> None:
    req = GenerationRequest(prompt="p", adapters=(AdapterUse("style", 0.5), AdapterUse("motion")))
    msg = request_to_proto(req)
    assert [(a.name, a.scale) for a in msg.adapters] == [("style", 0.5), ("motion", 1.0)]
    assert all(a.HasField("scale") for a in msg.adapters)  # a name alone is sent at scale 1.0
    assert not request_to_proto(GenerationRequest(prompt="p")).adapters


def test_request_to_proto_takes_a_mappings_adapters_as_names_or_objects() -> None:
    msg = request_to_proto({"prompt": "p", "adapters": ["a", {"name": "b", "scale": 2}, {"name": "c"}]})
    assert [(a.name, a.scale) for a in msg.adapters] == [("a", 1.0), ("b", 2.0), ("c", 1.0)]
    assert isinstance(msg.adapters[1].scale, float)


@pytest.mark.parametrize("uses", [(AdapterUse("a", "x"),), (AdapterUse("a", True),), ("a",)])  # type: ignore[arg-type]
def test_request_to_proto_refuses_adapters_it_cannot_carry_naming_the_field(uses: Any) -> None:
    with pytest.raises(RequestError) as err:
        request_to_proto(GenerationRequest(prompt="p", adapters=uses))
    assert err.value.field == "adapters"


# ----------------------------------------------------------------------------- --adapter and JSONL
@pytest.mark.parametrize(
    ("value", "use"),
    [("trunk", AdapterUse("trunk")), ("trunk=0.5", AdapterUse("trunk", 0.5)), ("a.b-c_1=-2", AdapterUse("a.b-c_1", -2.0)),
     ("x=1e-3", AdapterUse("x", 0.001))],
)  # fmt: skip
def test_parse_adapter_reads_name_and_scale(value: str, use: AdapterUse) -> None:
    assert parse_adapter(value) == use


@pytest.mark.parametrize("value", ["", "=0.5", "../x", "a/b", "a=", "a=half", "a=nan", "a=inf", "a=0.5=1", ".x"])
def test_parse_adapter_refuses_bad_forms(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_adapter(value)


def _generate_args(argv: list[str]) -> argparse.Namespace:
    return _parser(declared=("generate",)).parse_args(["generate", "--target", "127.0.0.1:1", *argv])


def test_adapter_flags_are_every_requests_default_and_a_jsonl_line_replaces_them(tmp_path: Path) -> None:
    args = _generate_args(["--prompt", "p", "--adapter", "a=0.5", "--adapter", "b"])
    (req,) = requests_from_args(args)
    assert req.adapters == (AdapterUse("a", 0.5), AdapterUse("b"))
    lines = tmp_path / "r.jsonl"
    lines.write_text(
        "\n".join(json.dumps(d) for d in ({}, {"adapters": [{"name": "c", "scale": 0.25}, "d"]}, {"adapters": None}))
    )
    reqs = requests_from_args(_generate_args(["--prompt", "p", "--adapter", "a", "--requests", str(lines)]))
    assert [r.adapters for r in reqs] == [(AdapterUse("a"),), (AdapterUse("c", 0.25), AdapterUse("d")), ()]


@pytest.mark.parametrize("value", ['"a"', "[1]", '[{"scale": 1}]', '[{"name": "a", "path": "x"}]', "{}"])
def test_a_jsonl_lines_bad_adapters_are_refused_naming_the_line(tmp_path: Path, value: str) -> None:
    lines = tmp_path / "r.jsonl"
    lines.write_text(f'{{"adapters": {value}}}\n')
    with pytest.raises(RequestError) as err:
        requests_from_args(_generate_args(["--prompt", "p", "--requests", str(lines)]))
    assert err.value.field == "adapters" and f"{lines}:1" in str(err.value)


def test_bad_adapter_flags_are_usage_errors_naming_the_flag() -> None:
    res = run_cli_inprocess(["generate", "--target", "127.0.0.1:1", "--prompt", "p", "--adapter", "../x"])
    assert res.code == 2 and "argument --adapter" in res.err and "../x" in res.err
    res = run_cli_inprocess(["generate", "--target", "127.0.0.1:1", "--prompt", "p", "--adapter", "x=big"])
    assert res.code == 2 and "argument --adapter" in res.err and "SCALE" in res.err


def test_generate_local_refuses_an_adapter_without_an_adapter_dir(tiny_ckpt: Path, tmp_path: Path) -> None:
    res = run_cli_inprocess(["generate-local", "--checkpoint", tiny_ckpt, "--prompt", "p", "--adapter", "x"])
    assert res.code == 2 and "--adapter-dir" in res.err and "x" in res.err
    argv = ["generate-local", "--checkpoint", tiny_ckpt, "--prompt", "p", "--adapter-dir", tmp_path / "none"]
    res = run_cli_inprocess(argv)
    assert res.code == 2 and "--adapter-dir" in res.err and "not a directory" in res.err


@pytest.mark.processes  # a fresh interpreter: what it loads
@pytest.mark.parametrize(
    "argv",
    [["adapters", "--target", UNREACHABLE, "--timeout-s", "2"],
     ["generate", "--target", UNREACHABLE, "--prompt", "a red fox", "--adapter", "style=0.8"]],
    ids=lambda argv: argv[0],
)  # fmt: skip
def test_the_adapter_client_commands_run_without_the_model(argv: list[str]) -> None:
    report = _run(f"from ditserve.cli import main\nrc = main({argv!r})", rc="rc")
    assert report == {"rc": 1, "loaded": []}  # 1: it reached the (unreachable) server


# ----------------------------------------------------------------------------- the facade's `lora`
def test_lora_maps_an_object_or_a_list_to_the_requests_adapters() -> None:
    r = create_body({"prompt": "p", "lora": {"name": "style", "scale": 0.5}}).request
    assert [(a.name, a.scale) for a in r.adapters] == [("style", 0.5)]
    r = create_body({"prompt": "p", "lora": [{"name": "a"}, {"name": "b", "scale": 2}]}).request
    assert [(a.name, a.HasField("scale")) for a in r.adapters] == [("a", False), ("b", True)]
    assert r.adapters[1].scale == 2.0  # an unset scale stays unset: the generator's 1.0
    r = create_body({"prompt": "p", "lora": '[{"name": "a", "scale": 0.75}]'}).request  # multipart: JSON text
    assert [(a.name, a.scale) for a in r.adapters] == [("a", 0.75)]
    assert not create_body({"prompt": "p", "lora": None}).request.adapters


@pytest.mark.parametrize(
    "lora",
    ["style", 3, [1], [{"scale": 1}], {"name": ""}, {"name": 5}, {"name": "a", "scale": "big"},
     {"name": "a", "scale": True}, {"name": "a", "weight": 1}, "[{", [{"name": "a"}, "b"]],
)  # fmt: skip
def test_bad_lora_shapes_are_400_naming_lora(lora: Any) -> None:
    with pytest.raises(ApiError) as err:
        create_body({"prompt": "p", "lora": lora})
    assert err.value.status == 400 and err.value.param == "lora" and "lora" in err.value.message


@pytest.mark.parametrize("lora", [{"name": "a", "local_path": "/x/a.safetensors"}, [{"name": "a", "local_path": "y"}]])
def test_a_lora_local_path_is_refused_naming_it(lora: Any) -> None:
    with pytest.raises(ApiError) as err:
        create_body({"prompt": "p", "lora": lora})
    assert err.value.status == 400 and err.value.param == "lora" and "local_path" in err.value.message


def test_a_non_finite_lora_scale_is_refused_naming_lora() -> None:
    with pytest.raises(ApiError) as err:
        create_body(parse_json_object(b'{"prompt": "p", "lora": {"name": "a", "scale": NaN}}'))
    assert err.value.status == 400 and err.value.param == "lora"


def test_the_adapters_table_shows_each_adapter_and_the_refused_files() -> None:
    resp = pb.ListAdaptersResponse(
        adapters=[pb.Adapter(name="trunk", identity="ab" * 32, rank=2, partition="base", loaded=True,
                             targets=pb.AdapterTargets(trunk=12),
                             contract=pb.AdapterContract(scale_min=0, scale_max=4, steps=[5, 9], default_steps=5))],
        refused=[pb.AdapterRefusal(name="bad", message="bad.safetensors: no LoRA factors")],
    )  # fmt: skip
    text = adapters_table(resp)
    row = next(line for line in text.splitlines() if line.startswith("trunk"))
    for part in ("base", "12/0/0", "yes", "abababababab", "scale [0, 4]", "steps 5,9", "steps=5 by default"):
        assert part in row, (part, row)
    assert "refused:" in text and "bad: bad.safetensors: no LoRA factors" in text
    assert "no adapters" in adapters_table(pb.ListAdaptersResponse())


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def adapter_pair(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A resident generator in this process on the tiny repository with an --adapter-dir of a trunk and a modulation
    adapter."""
    from ditcore.adapter_files import write_adapter

    adir = tmp_path_factory.mktemp("adapters")
    write_adapter(adir / "trunk.safetensors", tiny_ckpt, "trunk", "diffusers", rank=2, alpha=None, seed=1)
    write_adapter(adir / "mod.safetensors", tiny_ckpt, "modulation", "diffusers", rank=2, alpha=None, seed=2)
    with Pair(tiny_ckpt, mode="resident", adapter_dir=adir) as p:
        yield p.start()


def _listed(target: str) -> dict[str, dict[str, Any]]:
    res = run_cli_inprocess(["adapters", "--target", target, "--json"])
    assert res.code == 0, res.err
    data = json.loads(res.out)
    assert not data.get("refused")
    return {a["name"]: a for a in data["adapters"]}


def _sha(target: str, *extra: str) -> str:
    argv = ["generate", "--target", target, "--prompt", "a red fox", "--num-inference-steps", "3", "--seed", "7"]
    res = run_cli_inprocess([*argv, *extra])
    assert res.code == 0, res.err
    (line,) = res.json_lines()
    return str(line["sha256"])


def test_adapters_end_to_end(adapter_pair: Pair, tiny_ckpt: Path) -> None:
    from oracle import adapter_latents

    from ditcore.generation import latents_sha256

    target = adapter_pair.target
    listed = _listed(target)
    assert set(listed) == {"trunk", "mod"}
    assert not listed["trunk"]["loaded"] and not listed["mod"]["loaded"]
    assert listed["trunk"]["targets"]["trunk"] > 0 and listed["mod"]["changes_modulation"]
    assert listed["trunk"]["partition"] == "base" and len(listed["trunk"]["identity"]) == 64

    base = _sha(target)
    with_trunk = _sha(target, "--adapter", "trunk=0.8")
    adir = adapter_pair.generator_config.adapter_dir
    request = GenerationRequest(prompt="a red fox", num_inference_steps=3, seed=7)
    assert with_trunk == latents_sha256(*adapter_latents(tiny_ckpt, request, [(adir / "trunk.safetensors", 0.8)]))
    assert with_trunk != base
    assert _sha(target, "--adapter", "trunk=0.8") == with_trunk  # deterministic
    assert _sha(target) == base  # the adapter is off again for a base request
    listed = _listed(target)
    assert listed["trunk"]["loaded"] and not listed["mod"]["loaded"]
    table = run_cli_inprocess(["adapters", "--target", target])
    assert table.code == 0 and "trunk" in table.out and "mod" in table.out

    with GeneratorClient(target) as client:
        for uses in ((AdapterUse("../x"),), (AdapterUse("trunk", math.nan),)):
            with pytest.raises(grpc.RpcError) as err:
                client.generate(GenerationRequest(prompt="a red fox", num_inference_steps=3, adapters=uses))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert "adapters" in (err.value.details() or "")


def test_generate_local_with_the_adapter_dir_matches_the_server(adapter_pair: Pair, tiny_ckpt: Path) -> None:
    """`generate-local --adapter-dir DIR --adapter trunk=0.8` runs the adapter in this process: the server's latents."""
    adir = adapter_pair.generator_config.adapter_dir
    argv = ["generate-local", "--checkpoint", tiny_ckpt, "--adapter-dir", adir, "--prompt", "a red fox",
            "--num-inference-steps", "3", "--seed", "7"]  # fmt: skip
    res = run_cli_inprocess([*argv, "--adapter", "trunk=0.8"])
    assert res.code == 0, res.err
    assert res.json_lines()[0]["sha256"] == _sha(adapter_pair.target, "--adapter", "trunk=0.8")
    res = run_cli_inprocess([*argv, "--adapter", "nope"])
    assert res.code == 2 and "nope" in res.err


def test_an_unknown_adapter_is_not_found_naming_it(adapter_pair: Pair) -> None:
    argv = ["generate", "--target", adapter_pair.target, "--prompt", "a red fox", "--num-inference-steps", "3"]
    res = run_cli_inprocess([*argv, "--adapter", "nope"])
    assert res.code == 1 and "nope" in res.err
    assert "NOT_FOUND" in res.err, res.err


def test_a_job_runs_its_adapters_and_shows_them(adapter_pair: Pair) -> None:
    """The Jobs API takes the same GenerateRequest: the job's result is the direct request's bits, its spec lists
    the adapters, and a job naming an unknown adapter is refused at CreateJob, NOT_FOUND naming it."""

    from ditserve.client import GeneratorClient
    from ditserve.jobs_client import JobsClient
    from protos.ditserve.generator.v1 import generator_pb2 as pb

    request = {
        "prompt": "a red fox",
        "num_inference_steps": 3,
        "seed": 7,
        "adapters": [{"name": "trunk", "scale": 0.8}],
    }
    with GeneratorClient(adapter_pair.target) as client:
        direct = client.generate({**request, "request_id": "direct"}, timeout=120).sha256
    with JobsClient(adapter_pair.target) as jobs:
        job, created = jobs.create({**request, "request_id": "job"})
        assert created and [(a.name, a.scale) for a in job.spec.adapters] == [("trunk", pytest.approx(0.8))]
        done = next(j for j in jobs.watch(job.job_id) if j.state not in (pb.JOB_STATE_QUEUED, pb.JOB_STATE_RUNNING))
        assert done.state == pb.JOB_STATE_SUCCEEDED and done.result.sha256 == direct
        with pytest.raises(grpc.RpcError) as refused:
            jobs.create({**request, "request_id": "bad", "adapters": ["nope"]})
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND and "adapter nope" in (refused.value.details() or "")


@pytest.fixture(scope="module")
def cached_adapters(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pair, Pair, Path]]:
    """A cached pair (generator + sidecar, both reading the --adapter-dir) and a resident one on the same files."""
    from ditcore.adapter_files import write_adapter

    adir = tmp_path_factory.mktemp("cached-adapters")
    write_adapter(adir / "trunk.safetensors", tiny_ckpt, "trunk", "diffusers", rank=2, alpha=None, seed=1)
    write_adapter(adir / "mod.safetensors", tiny_ckpt, "modulation", "diffusers", rank=2, alpha=None, seed=2)
    write_adapter(adir / "all.safetensors", tiny_ckpt, "all", "musubi", rank=2, alpha=3.0, seed=3)
    write_adapter(adir / "fast.safetensors", tiny_ckpt, "trunk", "ai-toolkit", rank=2, alpha=None, seed=4,
                  deltas="time")  # fmt: skip
    with Pair(tiny_ckpt, mode="cached", adapter_dir=adir) as cached, Pair(tiny_ckpt, mode="resident",
                                                                          adapter_dir=adir) as resident:  # fmt: skip
        yield cached.start(), resident.start(), adir


def test_cached_serves_modulation_adapters_on_their_own_plans_as_resident_does(
    cached_adapters: tuple[Pair, Pair, Path],
) -> None:
    """Every adapter kind in cached mode (trunk on the base plans; adaln_proj / norm_out / time embedder on plans the
    sidecar builds with them; FastH3's shape, LoRA on the trunk and full-parameter deltas on the time embedder)
    equals resident mode, request after request alternating, never mixed; a repeat of an
    adapter request hits its plans in the slab."""
    from ditserve.client import GeneratorClient

    cached, resident, _ = cached_adapters
    base = {"prompt": "a red fox", "num_inference_steps": 3, "seed": 7}
    combos: list[list[dict[str, Any]]] = [
        [], [{"name": "mod"}], [{"name": "trunk", "scale": 0.8}], [{"name": "all", "scale": 0.7}],
        [{"name": "mod", "scale": 1.2}, {"name": "trunk", "scale": 0.5}], [{"name": "fast", "scale": 0.9}],
        [{"name": "mod"}],
    ]  # fmt: skip
    with GeneratorClient(cached.target) as c, GeneratorClient(resident.target) as r:
        want = {}
        for i, uses in enumerate(combos):
            request = {**base, "request_id": f"r{i}", "adapters": uses}
            key = repr(uses)
            if key not in want:
                want[key] = r.generate(request, timeout=120).sha256
            got = c.generate(request, timeout=120)
            assert got.sha256 == want[key], (i, uses)
            if i == len(combos) - 1:  # the repeat of [mod]: its plans are in the slab
                assert got.cache.built_plans == 0 and got.cache.gpu_hit_plans > 0, got.cache
        assert len(set(want.values())) == len(want)  # every combination is its own output
