"""Admin LoadAdapter / UnloadAdapter and the adapter contract's defaults, end to end on one resident generator with an
--adapter-dir and an admin token: load (ListAdapters then shows it loaded), the identity fence (a wrong or stale
identity is refused, nothing changes), unload (a later request loads it again, same bits), the admin guard (the codes
UpdateWeights gives), INVALID_ARGUMENT naming `name` / `identity`, the CLI verbs; and a request's unset
num_inference_steps taking its adapter's `default_steps` (Generate, GenerateStream and a job's spec, its idempotent
retry included), a set one kept, and two adapters defaulting it differently refused naming both."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from clikit import run_cli_inprocess
from servicekit import Pair, error_info, status_details

from ditcore.adapter_contract import AdapterContract, contract_defaults
from ditcore.request import RequestError
from ditruntime.auth import bearer_metadata
from ditserve.client import GeneratorClient
from ditserve.jobs_client import JobsClient
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

TOKEN = "adapter-admin-token-0123456789"
ADMIN = bearer_metadata(TOKEN)


@pytest.fixture(scope="module")
def admin_pair(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A resident generator on the tiny repository with an admin token and trunk adapters: style (no contract),
    fenced, changing, and fast / slow (default_steps 3 / 4)."""
    from ditcore.adapter_files import write_adapter

    adir = tmp_path_factory.mktemp("admin-adapters")
    for seed, name in enumerate(("style", "fenced", "changing", "fast", "slow"), start=1):
        write_adapter(adir / f"{name}.safetensors", tiny_ckpt, "trunk", "diffusers", rank=2, alpha=None, seed=seed)
    (adir / "fast.json").write_text('{"default_steps": 3}')
    (adir / "slow.json").write_text('{"default_steps": 4}')
    with Pair(tiny_ckpt, mode="resident", adapter_dir=adir, admin_token=TOKEN) as p:
        yield p.start()


@pytest.fixture(scope="module")
def stub(admin_pair: Pair) -> Iterator[pb_grpc.GeneratorStub]:
    with grpc.insecure_channel(admin_pair.target) as channel:
        yield pb_grpc.GeneratorStub(channel)


def _listed(stub: pb_grpc.GeneratorStub) -> dict[str, pb.Adapter]:
    return {a.name: a for a in stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters}


def _refused(call: object, *args: object, **kwargs: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kwargs)  # type: ignore[operator]
    return err.value


# ----------------------------------------------------------------------------- LoadAdapter / UnloadAdapter
def test_load_then_list_shows_it_loaded(admin_pair: Pair, stub: pb_grpc.GeneratorStub) -> None:
    assert not _listed(stub)["style"].loaded
    with GeneratorClient(admin_pair.target) as client:
        done = client.load_adapter("style", token=TOKEN, timeout=60)
        a = done.adapter
        assert a.name == "style" and a.loaded and a.loaded_bytes > 0 and a.rank == 2 and len(a.identity) == 64
        assert not done.already_loaded and not done.replaced_identities
        listed = _listed(stub)["style"]
        assert listed.loaded and listed.identity == a.identity and listed.loaded_bytes == a.loaded_bytes
        again = client.load_adapter("style", identity=a.identity, token=TOKEN, timeout=60)
        assert again.already_loaded and again.adapter.identity == a.identity


def test_a_wrong_identity_is_refused_naming_both_and_nothing_changes(stub: pb_grpc.GeneratorStub) -> None:
    identity = _listed(stub)["fenced"].identity
    err = _refused(stub.LoadAdapter, pb.LoadAdapterRequest(name="fenced", identity="0" * 64), metadata=ADMIN)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    assert identity in (err.details() or "") and "0" * 64 in (err.details() or "")
    info = error_info(err)
    assert info is not None and info.reason == "ADAPTER_IDENTITY_MISMATCH" and info.metadata["identity"] == identity
    assert not _listed(stub)["fenced"].loaded
    done = stub.LoadAdapter(pb.LoadAdapterRequest(name="fenced", identity=identity), metadata=ADMIN, timeout=60)
    assert done.adapter.loaded and done.adapter.identity == identity


def test_unload_then_a_request_loads_it_again_with_the_same_bits(admin_pair: Pair, stub: pb_grpc.GeneratorStub) -> None:
    request = {
        "prompt": "a red fox",
        "num_inference_steps": 3,
        "seed": 7,
        "adapters": [{"name": "style", "scale": 0.8}],
    }
    with GeneratorClient(admin_pair.target) as client:
        first = client.generate(request, timeout=120).sha256
        identity = _listed(stub)["style"].identity
        gone = client.unload_adapter("style", token=TOKEN, timeout=60)
        assert gone.was_loaded and list(gone.identities) == [identity]
        assert not _listed(stub)["style"].loaded
        assert client.generate(request, timeout=120).sha256 == first  # loaded again at its first use
        assert _listed(stub)["style"].loaded
        for name in ("nope", "slow"):  # unknown to the directory; known but not loaded: nothing to delete
            resp = client.unload_adapter(name, token=TOKEN, timeout=60)
            assert not resp.was_loaded and not resp.identities


def test_the_admin_rpcs_are_guarded_as_update_weights_is(stub: pb_grpc.GeneratorStub) -> None:
    for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED),
                           (bearer_metadata("wrong-token-0123456789"), grpc.StatusCode.PERMISSION_DENIED)):  # fmt: skip
        weights = _refused(stub.UpdateWeights, pb.UpdateWeightsRequest(weights_path="x"), metadata=metadata)
        assert weights.code() == code
        for call, req in ((stub.LoadAdapter, pb.LoadAdapterRequest(name="slow")),
                          (stub.UnloadAdapter, pb.UnloadAdapterRequest(name="slow"))):  # fmt: skip
            err = _refused(call, req, metadata=metadata)
            assert err.code() == code, err.details()
            assert error_info(err).reason == error_info(weights).reason  # type: ignore[union-attr]
    assert not _listed(stub)["slow"].loaded


@pytest.mark.parametrize(
    ("request_", "field"),
    [(pb.LoadAdapterRequest(name="../x"), "name"), (pb.LoadAdapterRequest(name=""), "name"),
     (pb.LoadAdapterRequest(name="style", identity="ABC"), "identity"), (pb.UnloadAdapterRequest(name="a/b"), "name")],
)  # fmt: skip
def test_bad_names_and_identities_are_invalid_argument_naming_the_field(
    stub: pb_grpc.GeneratorStub, request_: object, field: str
) -> None:
    call = stub.LoadAdapter if isinstance(request_, pb.LoadAdapterRequest) else stub.UnloadAdapter
    err = _refused(call, request_, metadata=ADMIN)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert [f for f, _ in status_details(err)[1]] == [field]


def test_an_unknown_adapter_is_not_found(stub: pb_grpc.GeneratorStub) -> None:
    err = _refused(stub.LoadAdapter, pb.LoadAdapterRequest(name="nope"), metadata=ADMIN)
    assert err.code() == grpc.StatusCode.NOT_FOUND and "nope" in (err.details() or "")


def test_a_file_changed_under_its_name_is_never_loaded_under_its_old_identity(
    admin_pair: Pair, stub: pb_grpc.GeneratorStub, tiny_ckpt: Path
) -> None:
    from ditcore.adapter_files import write_adapter

    path = Path(admin_pair.generator_config.adapter_dir) / "changing.safetensors"
    old = stub.LoadAdapter(pb.LoadAdapterRequest(name="changing"), metadata=ADMIN, timeout=60).adapter.identity
    fresh = path.with_name("changing.tmp")
    write_adapter(fresh, tiny_ckpt, "trunk", "diffusers", rank=2, alpha=None, seed=99)
    os.replace(fresh, path)  # a new file under the same name
    err = _refused(stub.LoadAdapter, pb.LoadAdapterRequest(name="changing", identity=old), metadata=ADMIN)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and old in (err.details() or "")
    new = _listed(stub)["changing"]
    assert new.identity != old and not new.loaded  # the old identity still loaded is not the name's any more
    done = stub.LoadAdapter(pb.LoadAdapterRequest(name="changing", identity=new.identity), metadata=ADMIN, timeout=60)
    assert done.adapter.identity == new.identity and list(done.replaced_identities) == [old]
    gone = stub.UnloadAdapter(pb.UnloadAdapterRequest(name="changing"), metadata=ADMIN, timeout=60)
    assert list(gone.identities) == [new.identity]


def test_the_cli_loads_and_unloads(admin_pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    target = admin_pair.target
    monkeypatch.setenv("DITSERVE_ADMIN_TOKEN", TOKEN)  # as update-weights reads it
    res = run_cli_inprocess(["adapters", "load", "slow", "--target", target])
    assert res.code == 0, res.err
    data = json.loads(res.out)
    assert data["adapter"]["name"] == "slow" and data["adapter"]["loaded"]
    res = run_cli_inprocess(["adapters", "load", "slow", "--target", target, "--identity", "f" * 64])
    assert res.code == 1 and "FAILED_PRECONDITION" in res.err
    res = run_cli_inprocess(["adapters", "unload", "slow", "--target", target])
    assert res.code == 0 and json.loads(res.out)["was_loaded"], res.err
    listed = run_cli_inprocess(["adapters", "--target", target, "--json"])
    assert listed.code == 0 and not {a["name"]: a for a in json.loads(listed.out)["adapters"]}["slow"]["loaded"]
    assert run_cli_inprocess(["adapters", "load", "--target", target]).code == 2  # NAME missing
    assert run_cli_inprocess(["adapters", "load", "../x", "--target", target]).code == 2  # INVALID_ARGUMENT
    monkeypatch.delenv("DITSERVE_ADMIN_TOKEN")
    res = run_cli_inprocess(["adapters", "unload", "slow", "--target", target])
    assert res.code == 1 and "UNAUTHENTICATED" in res.err


# ----------------------------------------------------------------------------- contract defaults
def test_contract_defaults_first_wins_equal_agree_different_conflict() -> None:
    a, b = AdapterContract(default_steps=3, default_flow_shift=5.0), AdapterContract(default_steps=3)
    fields = ("num_inference_steps", "flow_shift", "audio_flow_shift")
    assert contract_defaults([("a", a), ("b", b)], fields) == {"num_inference_steps": 3, "flow_shift": 5.0}
    assert contract_defaults([("a", a)], ("audio_flow_shift",)) == {}  # a field the request set takes none
    with pytest.raises(RequestError) as err:
        contract_defaults([("a", a), ("c", AdapterContract(default_flow_shift=7.0))], fields)
    assert err.value.field == "flow_shift" and "a default_flow_shift 5" in str(err.value) and "c " in str(err.value)


def _fast(**fields: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="a red fox", seed=7, adapters=[pb.AdapterUse(name="fast")], **fields)  # type: ignore[arg-type]


def test_an_unset_steps_takes_the_adapters_default_and_a_set_one_is_kept(stub: pb_grpc.GeneratorStub) -> None:
    resp = stub.Generate(_fast(request_id="dflt"), timeout=120)
    assert resp.num_inference_steps == 3 and resp.flow_shift == 12.0 and resp.audio_flow_shift == 3.0
    explicit = stub.Generate(_fast(request_id="set3", num_inference_steps=3), timeout=120)
    assert explicit.sha256 == resp.sha256 and explicit.num_inference_steps == 3
    events = list(stub.GenerateStream(pb.GenerateStreamRequest(request=_fast(num_inference_steps=4)), timeout=120))
    assert {e.step.total for e in events if e.WhichOneof("event") == "step"} == {3}  # 4 points: 3 forwards
    assert next(e.result for e in events if e.WhichOneof("event") == "result").num_inference_steps == 4


def test_a_jobs_spec_shows_the_default_and_its_retry_means_the_same(admin_pair: Pair) -> None:
    with JobsClient(admin_pair.target, metadata=ADMIN) as jobs:
        job, created = jobs.create(_fast(), idempotency_key="fast-default")
        assert created and job.spec.num_inference_steps == 3
        again, created = jobs.create(_fast(), idempotency_key="fast-default")
        assert not created and again.job_id == job.job_id
        same, created = jobs.create(_fast(num_inference_steps=3), idempotency_key="fast-default")
        assert not created and same.job_id == job.job_id  # the same meaning: what runs
        err = _refused(jobs.create, _fast(num_inference_steps=5), idempotency_key="fast-default")
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS


def test_two_adapters_defaulting_a_field_differently_are_refused_naming_both(admin_pair: Pair,
                                                                             stub: pb_grpc.GeneratorStub) -> None:  # fmt: skip
    both = pb.GenerateRequest(prompt="a red fox", adapters=[pb.AdapterUse(name="fast"), pb.AdapterUse(name="slow")])
    err = _refused(stub.Generate, both, timeout=60)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in status_details(err)[1]] == ["num_inference_steps"]
    assert "fast" in (err.details() or "") and "slow" in (err.details() or "")
    with JobsClient(admin_pair.target, metadata=ADMIN) as jobs:
        assert _refused(jobs.create, both).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_request_to_proto_leaves_unset_what_the_caller_left_unset_on_a_request_with_adapters() -> None:
    from ditcore import GenerationRequest
    from ditcore.request import AdapterUse
    from ditserve.client_requests import request_to_proto

    named = {"prompt": "p", "adapters": [{"name": "fast"}]}
    msg = request_to_proto(named)
    assert not msg.HasField("num_inference_steps") and not msg.HasField("flow_shift")
    assert request_to_proto({**named, "num_inference_steps": 50}).num_inference_steps == 50  # given: sent
    assert request_to_proto({"prompt": "p"}).HasField("num_inference_steps")  # no adapters: H3's default, sent
    req = GenerationRequest(prompt="p", adapters=(AdapterUse("fast"),))
    assert request_to_proto(req).HasField("num_inference_steps")  # a whole request says every value
    assert not request_to_proto(req, unset={"num_inference_steps"}).HasField("num_inference_steps")


def test_the_client_and_the_cli_leave_unset_steps_to_the_adapters_default(admin_pair: Pair, tiny_ckpt: Path,
                                                                          tmp_path: Path) -> None:  # fmt: skip
    """`ditserve generate --adapter fast` (no --num-inference-steps), the Python client given a mapping without it,
    and `generate-local --adapter-dir` all run fast's default_steps (3); a given value is kept."""
    three = GeneratorClient(admin_pair.target).generate(_fast_dict(num_inference_steps=3)).sha256
    with GeneratorClient(admin_pair.target) as client:
        assert client.generate(_fast_dict()).sha256 == three
        assert client.generate_unary(_fast_dict()).sha256 == three
        assert client.generate(_fast_dict(num_inference_steps=4)).sha256 != three
    argv = ["--prompt", "a red fox", "--seed", "7", "--adapter", "fast"]
    res = run_cli_inprocess(["generate", "--target", admin_pair.target, *argv])
    assert res.code == 0, res.err
    assert res.json_lines()[0]["sha256"] == three
    lines = tmp_path / "r.jsonl"
    lines.write_text('{"request_id": "a"}\n{"request_id": "b", "num_inference_steps": 4}\n')
    res = run_cli_inprocess(["generate", "--target", admin_pair.target, *argv, "--requests", lines])
    assert res.code == 0, res.err
    shas = [line["sha256"] for line in res.json_lines()]
    assert shas[0] == three and shas[1] != three  # a line's own value is kept
    local = ["generate-local", "--checkpoint", tiny_ckpt, "--adapter-dir", admin_pair.generator_config.adapter_dir]
    res = run_cli_inprocess([*local, *argv])
    assert res.code == 0, res.err
    assert res.json_lines()[0]["sha256"] == three


def _fast_dict(**fields: object) -> dict[str, object]:
    return {"prompt": "a red fox", "seed": 7, "adapters": [{"name": "fast"}], **fields}
