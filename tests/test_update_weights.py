"""UpdateWeights (docs/architecture.md, 'Weight generations and UpdateWeights') on real
in-process servers: a sidecar and a generator over a unix socket.

Checkpoints A (tiny MiniMax-H3, seed 0) and B (seed 1), both in the released mixed precision, live in
the generator's --weights-root.
Every output is compared with ditcore's resident generation of the checkpoint that the
response's generation names; every refused update must leave generation, weights and
outputs exactly as they were.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from clikit import CliRunner
from refmedia import image_bytes
from safetensors.torch import load_file, save_file
from servicekit import (
    NOT_SERVING,
    REQ_FOX,
    REQ_RAIN,
    SERVING,
    TOKEN,
    Pair,
    StartPair,
    Weights,
    background,
    error_info,
    gen_request,
    long_request,
    read_state_file,
    ref_sha,
    status_details,
    transformer_shards,
    updatable,
    wait_for,
)

from ditcore import GenerationRequest, fingerprint, generate, load_model, validate_checkpoint, write_repository
from ditcore.plans import is_plan_tensor
from ditcore.shards import INDEX_FILE
from generator_service.execution import runner as runner_mod
from protos.ditserve.generator.v1 import generator_pb2 as gen_pb

INDEX = f"transformer/{INDEX_FILE}"
LONG = long_request(8)


def real(p: Path | str) -> str:
    return os.path.realpath(p)


# ----------------------------------------------------------------------------- snapshots
@dataclass(frozen=True)
class Snapshot:
    generation: int
    weights_path: str
    fingerprint: str
    sidecar_generation: int
    sidecar_weights_path: str
    sidecar_fingerprint: str
    sha: str
    response_generation: int


def snapshot(pair: Pair, req: dict[str, Any] = REQ_FOX) -> Snapshot:
    st, ss = pair.status(), pair.state()
    r = pair.generate(req, request_id="snapshot")
    return Snapshot(
        st.generation, real(st.weights_path), st.fingerprint,
        ss.generation, real(ss.weights_path), ss.fingerprint, r.sha256, r.generation,
    )  # fmt: skip


def assert_unchanged(pair: Pair, before: Snapshot) -> None:
    """Generation, weights and outputs as before; no update left prepared; both services SERVING."""
    after = snapshot(pair)
    assert after == before
    assert pair.state().pending_weights_path == ""
    assert pair.health() == SERVING
    assert pair.sidecar_health() == SERVING


def assert_serves(pair: Pair, generation: int, ckpt: Path) -> None:
    """Both sides agree on `generation` serving `ckpt`, and outputs equal resident `ckpt`'s."""
    st, ss = pair.status(), pair.state()
    fp = fingerprint(ckpt)
    assert (st.generation, real(st.weights_path), st.fingerprint) == (generation, real(ckpt), fp)
    assert (ss.generation, real(ss.weights_path), ss.fingerprint) == (generation, real(ckpt), fp)
    for req in (REQ_FOX, REQ_RAIN):
        r = pair.generate(req, request_id=f"check-{generation}")
        assert r.generation == generation
        assert r.sha256 == ref_sha(ckpt, req)


# ----------------------------------------------------------------------------- checkpoint surgery
def copy_into_root(weights: Weights, src: Path, prefix: str) -> Path:
    """A fresh copy of `src` under the weights root, with a unique name."""
    dst = Path(tempfile.mkdtemp(prefix=prefix, dir=weights.root))
    shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def first_shard(ckpt: Path) -> str:
    """The transformer shard holding the embedders (and no plan tensor)."""
    return transformer_shards(ckpt)[0]


def last_shard(ckpt: Path) -> str:
    """The transformer shard holding `proj_out` (float32: one of diffusers' `_keep_in_fp32_modules`)."""
    return transformer_shards(ckpt)[-1]


def rewrite_shard(ckpt: Path, shard: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(ckpt / shard))
    edit(tensors)
    save_file(tensors, str(ckpt / shard), metadata={"format": "pt"})


def strip_adaln(ckpt: Path) -> None:
    """Remove every plan tensor (`adaln_proj.*`, `norm_out.linear.*`) from the shards and the index: a repository a
    cached generator could serve, but the sidecar cannot build plans from."""
    index = json.loads((ckpt / INDEX).read_text())
    for shard in sorted(set(index["weight_map"].values())):
        rewrite_shard(ckpt, f"transformer/{shard}", lambda t: [t.pop(n) for n in [n for n in t if is_plan_tensor(n)]])
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not is_plan_tensor(n)}
    (ckpt / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    assert validate_checkpoint(ckpt, require_adaln=False).has_adaln is False


def truncate_shard(ckpt: Path) -> None:
    p = ckpt / last_shard(ckpt)
    size = p.stat().st_size
    with open(p, "r+b") as fh:
        fh.truncate(size // 2)


def garbage_header(ckpt: Path) -> None:
    """Keep the 8-byte header length, replace the JSON header with bytes that are not JSON."""
    p = ckpt / first_shard(ckpt)
    data = bytearray(p.read_bytes())
    hlen = int.from_bytes(data[:8], "little")
    data[8 : 8 + hlen] = b"\xfe" * hlen
    p.write_bytes(bytes(data))


def wrong_shape(ckpt: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["proj_out.bias"] = torch.zeros(t["proj_out.bias"].numel() + 1)

    rewrite_shard(ckpt, last_shard(ckpt), edit)


def wrong_dtype(ckpt: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["proj_out.bias"] = t["proj_out.bias"].to(torch.bfloat16)  # diffusers keeps proj_out in float32

    rewrite_shard(ckpt, last_shard(ckpt), edit)


# ----------------------------------------------------------------------------- happy path
def test_update_to_b_and_back_to_a(pairs: StartPair, weights: Weights) -> None:
    pair = pairs(weights.a)
    assert_serves(pair, 1, weights.a)
    assert read_state_file(pair.state_dir)["generation"] == 1

    up = pair.update("B")
    assert (up.generation, up.previous_generation) == (2, 1)
    assert real(up.weights_path) == real(weights.b)
    assert up.fingerprint == fingerprint(weights.b)
    assert set(up.phase_ms) >= {"validate_ms", "prepare_ms", "drain_ms", "load_ms", "commit_ms"}
    assert_serves(pair, 2, weights.b)
    state = read_state_file(pair.state_dir)
    assert (state["generation"], real(state["weights_path"]), state["fingerprint"]) == (
        2, real(weights.b), fingerprint(weights.b),
    )  # fmt: skip

    # back to A, by absolute path inside the root, fenced on the generation we saw
    up = pair.update(weights.a, expected_generation=2)
    assert (up.generation, up.previous_generation) == (3, 2)
    assert real(up.weights_path) == real(weights.a)
    assert_serves(pair, 3, weights.a)
    state = read_state_file(pair.state_dir)
    assert (state["generation"], real(state["weights_path"])) == (3, real(weights.a))
    assert pair.state().pending_weights_path == ""
    assert pair.health() == SERVING and pair.sidecar_health() == SERVING


def test_an_update_that_keeps_transformer_ref_keeps_its_plans(pairs: StartPair, weights: Weights) -> None:
    """C is A with B's transformer/: the update to C reports kept_partitions ["ref"], a warm ref2va request is
    served from the kept plans (nothing built) with the same bits, and t2va serves C's base partition. The update
    on to B keeps the base plans (C's transformer/ is B's) and drops the ref ones."""
    c = copy_into_root(weights, weights.a, "C-")
    shutil.rmtree(c / "transformer")
    shutil.copytree(weights.b / "transformer", c / "transformer")
    ref2va = {**REQ_FOX, "task": "ref2va", "references": [image_bytes(64, 48, seed=7)]}
    pair = pairs(weights.a, plan_width=4)  # ref2va's widths
    before = pair.generate(ref2va)
    assert before.generation == 1 and before.cache.built_plans > 0
    up = pair.update(c.name)
    assert (up.generation, list(up.kept_partitions), up.fingerprint) == (2, ["ref"], fingerprint(c))
    after = pair.generate(ref2va)
    assert (after.generation, after.sha256) == (2, before.sha256)
    assert after.cache.built_plans == 0 and after.cache.gpu_hit_plans > 0
    r = pair.generate(REQ_FOX)
    assert (r.generation, r.sha256) == (2, ref_sha(c, REQ_FOX))
    up = pair.update("B")  # C's transformer/ is B's: the base plans stay, the ref ones go
    assert (up.generation, list(up.kept_partitions)) == (3, ["base"])
    r = pair.generate(REQ_FOX)
    assert (r.generation, r.sha256, r.cache.built_plans) == (3, ref_sha(weights.b, REQ_FOX), 0)
    assert pair.generate(ref2va).cache.built_plans > 0


def test_resident_update_to_b_and_refusals(pairs: StartPair, weights: Weights) -> None:
    """Resident mode validates in process: a repository without native adaln_proj (diffusers' transformer needs it)
    and an incompatible one are refused with nothing changed; B is served under generation 2."""
    pair = pairs(weights.a, mode="resident")
    r = pair.generate(REQ_FOX)
    assert (r.generation, r.sha256) == (1, ref_sha(weights.a, REQ_FOX))
    stripped, small = (
        _bad_copy(strip_adaln)(weights, weights.root),
        _other_repository("small", "mixed")(weights, weights.root),
    )
    for path, parts in ((stripped, ("adaln_proj", "missing tensor")), (small, ("incompatible", "num_layers"))):
        with pytest.raises(grpc.RpcError) as ei:
            pair.update(path)
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION, ei.value.details()
        assert all(p in (ei.value.details() or "") for p in parts), ei.value.details()
        st = pair.status()
        assert (st.generation, real(st.weights_path), st.fingerprint) == (1, real(weights.a), fingerprint(weights.a))
    up = pair.update("B")
    assert (up.generation, up.previous_generation, up.fingerprint) == (2, 1, fingerprint(weights.b))
    st = pair.status()
    assert (st.generation, real(st.weights_path), st.fingerprint) == (2, real(weights.b), fingerprint(weights.b))
    for req in (REQ_FOX, REQ_RAIN):
        r = pair.generate(req)
        assert (r.generation, r.sha256) == (2, ref_sha(weights.b, req))


# ----------------------------------------------------------------------------- rejections
@pytest.fixture(scope="module")
def serving_a(weights: Weights) -> Iterator[Pair]:
    """One pair serving A for the whole rejection table: no rejection may change anything."""
    with Pair(weights.a, **updatable(weights)) as pair:
        pair.start().generate(REQ_FOX, request_id="warm")
        yield pair


@dataclass(frozen=True)
class Case:
    code: grpc.StatusCode
    make_path: Callable[[Weights, Path], str]
    token: str | None = TOKEN
    expected_generation: int | None = None
    details_contain: tuple[str, ...] = ()
    reason: str | None = None


def _bad_copy(surgery: Callable[[Path], None]) -> Callable[[Weights, Path], str]:
    def make(weights: Weights, tmp: Path) -> str:
        ckpt = copy_into_root(weights, weights.b, "bad-")
        surgery(ckpt)
        return ckpt.name

    return make


def _other_repository(preset: str, dtype: str) -> Callable[[Weights, Path], str]:
    """A valid MiniMax-H3 repository under the root that cannot replace A: other shapes or other precision."""

    def make(weights: Weights, tmp: Path) -> str:
        d = Path(tempfile.mkdtemp(prefix=f"{preset}-{dtype}-", dir=weights.root))
        write_repository(d, preset, seed=0, dtype=dtype, shards=2)
        return d.name

    return make


def _outside_ckpt(weights: Weights, tmp: Path) -> Path:
    out = tmp / "outside" / "ckpt"
    shutil.copytree(weights.b, out)  # a perfectly valid checkpoint, only in the wrong place
    return out


def _symlink_out(weights: Weights, tmp: Path) -> str:
    link = Path(tempfile.mkdtemp(prefix="lnk-", dir=weights.root)) / "escape"
    link.symlink_to(_outside_ckpt(weights, tmp), target_is_directory=True)
    return str(link.relative_to(weights.root))


CASES: dict[str, Case] = {
    "missing-adaln": Case(
        grpc.StatusCode.FAILED_PRECONDITION, _bad_copy(strip_adaln), details_contain=("plan cache", "adaln_proj")
    ),
    "truncated-shard": Case(
        grpc.StatusCode.FAILED_PRECONDITION, _bad_copy(truncate_shard), details_contain=("-of-", "truncated")
    ),
    "garbage-header": Case(
        grpc.StatusCode.FAILED_PRECONDITION, _bad_copy(garbage_header), details_contain=("00001-of-", "header")
    ),
    "wrong-shape": Case(
        grpc.StatusCode.FAILED_PRECONDITION, _bad_copy(wrong_shape), details_contain=("proj_out.bias", "shape")
    ),
    "wrong-dtype": Case(
        grpc.StatusCode.FAILED_PRECONDITION, _bad_copy(wrong_dtype), details_contain=("proj_out.bias", "dtype")
    ),
    "incompatible-config": Case(
        grpc.StatusCode.FAILED_PRECONDITION,
        _other_repository("small", "mixed"),
        details_contain=("transformer/config.json", "incompatible", "num_layers"),
    ),
    "other-precision": Case(
        grpc.StatusCode.FAILED_PRECONDITION,
        _other_repository("tiny", "float32"),
        details_contain=("incompatible", "dtype"),
    ),
    "missing-dir": Case(grpc.StatusCode.NOT_FOUND, lambda w, t: "no-such-checkpoint"),
    "dotdot": Case(grpc.StatusCode.PERMISSION_DENIED, lambda w, t: "A/../B", details_contain=("..",)),
    "symlink-escape": Case(grpc.StatusCode.PERMISSION_DENIED, _symlink_out, details_contain=("outside",)),
    "absolute-outside": Case(
        grpc.StatusCode.PERMISSION_DENIED, lambda w, t: str(_outside_ckpt(w, t)), details_contain=("outside",)
    ),
    "nul-byte": Case(grpc.StatusCode.INVALID_ARGUMENT, lambda w, t: "B\x00/x"),
    "no-token": Case(grpc.StatusCode.UNAUTHENTICATED, lambda w, t: "B", token=None),
    "wrong-token": Case(grpc.StatusCode.PERMISSION_DENIED, lambda w, t: "B", token="not-the-token"),
    "stale-expected-generation": Case(
        grpc.StatusCode.ABORTED, lambda w, t: "B", expected_generation=7, reason="GENERATION_MISMATCH"
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_refused_update_changes_nothing(serving_a: Pair, weights: Weights, tmp_path: Path, name: str) -> None:
    case = CASES[name]
    pair = serving_a
    path = case.make_path(weights, tmp_path)
    before = snapshot(pair)
    assert before.generation == 1 and before.sha == ref_sha(weights.a, REQ_FOX)

    with pytest.raises(grpc.RpcError) as ei:
        pair.update(path, token=case.token, expected_generation=case.expected_generation)
    err = ei.value
    assert err.code() == case.code, err.details()
    for part in case.details_contain:
        assert part in (err.details() or ""), err.details()
    info = error_info(err)
    assert info is not None and info.reason, "every refusal carries an ErrorInfo with a reason"
    if case.reason:
        assert info.reason == case.reason
    if case.code == grpc.StatusCode.ABORTED:
        assert info.metadata["current_generation"] == "1"

    assert_unchanged(pair, before)
    assert read_state_file(pair.state_dir)["generation"] == 1


def test_generate_with_stale_expected_generation_is_aborted(pairs: StartPair, weights: Weights) -> None:
    pair = pairs(weights.a)
    assert pair.generate(REQ_FOX, expected_generation=1).sha256 == ref_sha(weights.a, REQ_FOX)
    assert pair.update("B").generation == 2
    with pytest.raises(grpc.RpcError) as ei:
        pair.generate(REQ_FOX, expected_generation=1)
    assert ei.value.code() == grpc.StatusCode.ABORTED
    info = error_info(ei.value)
    assert info is not None and info.reason == "GENERATION_MISMATCH"
    assert info.metadata["current_generation"] == "2"
    r = pair.generate(REQ_FOX, expected_generation=2)
    assert (r.generation, r.sha256) == (2, ref_sha(weights.b, REQ_FOX))


# ----------------------------------------------------------------------------- concurrency with drain
def start_stream(pair: Pair, req: dict[str, Any], request_id: str) -> tuple[Future[Any], threading.Event]:
    """GenerateStream in a thread; the event is set at its first `step` (the request is running)."""
    running = threading.Event()

    def run() -> gen_pb.GenerateResponse:
        header = None
        msg = gen_pb.GenerateStreamRequest(request=gen_request(req, request_id))
        for ev in pair.stub.GenerateStream(msg, timeout=300):
            kind = ev.WhichOneof("event")
            if kind == "step":
                running.set()
            elif kind == "result":
                header = ev.result
        assert header is not None, "the stream ended without a result"
        return header

    return background(run, name=f"stream-{request_id}"), running


class Gate:
    """Holds requests whose id starts with "gated-" after their first denoise step until opened.

    A request that is running (it has leased its plans and stepped once) for as long as the
    test needs, whatever the machine's load: the update under test must wait for it in drain.
    The request is otherwise real: all its steps run and its sha256 is checked.
    """

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.reached = threading.Event()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    real_generate = runner_mod.generate

    def gated(model: Any, request: GenerationRequest, plans: Any = None, on_step: Any = None, **kw: Any) -> Any:
        if not request.request_id.startswith("gated-"):
            return real_generate(model, request, plans, on_step=on_step, **kw)

        def step(done: int, total: int) -> None:
            if on_step is not None:
                on_step(done, total)
            if done == 1:
                g.reached.set()
                g.opened.wait(120)

        return real_generate(model, request, plans, on_step=step, **kw)

    monkeypatch.setattr(runner_mod, "generate", gated)
    try:
        yield g
    finally:
        g.opened.set()


def test_second_update_while_one_drains_is_aborted(pairs: StartPair, weights: Weights, gate: Gate) -> None:
    pair = pairs(weights.a, drain_timeout_s=120)
    long_ref = ref_sha(weights.a, LONG)
    stream, running = start_stream(pair, LONG, "gated-1")
    assert running.wait(60) and gate.reached.is_set(), "the long request never started"

    first = background(lambda: pair.update("B"), name="first-update")
    # the first update is prepared at the sidecar and waits in drain (health NOT_SERVING while updating)
    wait_for(lambda: pair.health() == NOT_SERVING, 30, "the first update to start draining")
    assert real(pair.state().pending_weights_path) == real(weights.b)
    assert not first.done() and not stream.done()

    with pytest.raises(grpc.RpcError) as ei:
        pair.update("A")
    assert ei.value.code() == grpc.StatusCode.ABORTED, ei.value.details()
    info = error_info(ei.value)
    assert info is not None and info.reason == "UPDATE_IN_PROGRESS"
    assert not stream.done() and not first.done()

    gate.opened.set()
    long_resp = stream.result(120)
    assert (long_resp.generation, long_resp.sha256) == (1, long_ref)  # ran entirely on the old weights
    up = first.result(120)
    assert (up.generation, up.previous_generation) == (2, 1)
    assert_serves(pair, 2, weights.b)
    assert pair.state().pending_weights_path == ""


def test_drain_timeout_aborts_and_serving_resumes(pairs: StartPair, weights: Weights, gate: Gate) -> None:
    drain_s = 1.0
    pair = pairs(weights.a, drain_timeout_s=drain_s)
    long_ref = ref_sha(weights.a, LONG)
    before = snapshot(pair)

    stream, running = start_stream(pair, LONG, "gated-2")
    assert running.wait(60) and gate.reached.is_set(), "the long request never started"
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as ei:
        pair.update("B")
    elapsed = time.monotonic() - t0
    assert ei.value.code() == grpc.StatusCode.ABORTED, ei.value.details()
    info = error_info(ei.value)
    assert info is not None and info.reason == "DRAIN_TIMEOUT"
    assert elapsed >= drain_s
    assert not stream.done()

    # serving resumed at once: health back, nothing prepared at the sidecar, a queued request runs
    assert pair.health() == SERVING
    assert pair.state().pending_weights_path == ""
    queued = background(lambda: pair.generate(REQ_FOX, request_id="after-abort", timeout=120), name="queued")
    wait_for(lambda: pair.status().queue_depth == 2, 10, "the request to queue behind the long one")
    gate.opened.set()
    long_resp = stream.result(120)
    assert (long_resp.generation, long_resp.sha256) == (1, long_ref)
    r = queued.result(120)
    assert (r.generation, r.sha256) == (1, ref_sha(weights.a, REQ_FOX))
    assert_unchanged(pair, before)

    # the aborted update left nothing behind: the same update now succeeds
    assert pair.update("B").generation == 2
    assert_serves(pair, 2, weights.b)


# ----------------------------------------------------------------------------- tensor-pushed updates
BIAS = "proj_out.bias"  # float32 (diffusers keeps proj_out in float32)
PLAN_BIAS = "transformer_blocks.0.adaln_proj.linear.bias"  # bfloat16, a plan tensor: resident mode holds it


def tensor_proto(name: str, t: torch.Tensor) -> gen_pb.Tensor:
    t = t.detach().contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    return gen_pb.Tensor(name=name, dtype=dtype, shape=list(t.shape), data=t.view(torch.uint8).numpy().tobytes())


@functools.cache
def _resident_a(ckpt: str) -> Any:
    return load_model(ckpt, "resident")


def pushed(ckpt: Path) -> dict[str, torch.Tensor]:
    """New values for a float32 and a bfloat16 transformer tensor of `ckpt`."""
    state = _resident_a(str(ckpt)).transformer.state_dict()
    return {BIAS: state[BIAS] + 0.05, PLAN_BIAS: (state[PLAN_BIAS].float() * 1.5).to(torch.bfloat16)}


def test_tensor_update_is_refused_in_cached_mode(pairs: StartPair, weights: Weights) -> None:
    pair = pairs(weights.a)
    before = snapshot(pair)
    with pytest.raises(grpc.RpcError) as ei:
        pair.update("", tensors=[tensor_proto(n, t) for n, t in pushed(weights.a).items()])
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION, ei.value.details()
    details = ei.value.details() or ""
    assert "tensor" in details and "refused in cached mode" in details, details
    assert_unchanged(pair, before)


def test_tensor_update_in_resident_mode(pairs: StartPair, weights: Weights) -> None:
    pair = pairs(weights.a, mode="resident")
    r0 = pair.generate(REQ_FOX)
    assert (r0.generation, r0.sha256) == (1, ref_sha(weights.a, REQ_FOX))
    st = pair.status()
    assert (st.adaln_mode, st.model_preset, st.precision) == (gen_pb.ADALN_MODE_RESIDENT, "tiny", "mixed")
    assert st.memory.held_plan_bytes == st.memory.plan_tensor_bytes > 0 and st.memory.saved_fraction == 0.0

    # refused pushes change nothing: every tensor is checked against the transformer's own before any copy
    new = pushed(weights.a)
    bad: dict[str, list[gen_pb.Tensor]] = {
        "unknown name": [tensor_proto("final_layer.video_out.bias", new[BIAS])],
        "wrong shape": [tensor_proto(BIAS, torch.zeros(new[BIAS].numel() + 1))],
        "wrong dtype": [tensor_proto(BIAS, new[BIAS].to(torch.bfloat16))],
        "bad byte count": [gen_pb.Tensor(name=BIAS, dtype="float32", shape=[96], data=b"\0" * 10)],
        "unknown dtype": [gen_pb.Tensor(name=BIAS, dtype="int8", shape=[96], data=b"\0" * 96)],
        "given twice": [tensor_proto(BIAS, new[BIAS]), tensor_proto(BIAS, new[BIAS])],
        "not finite": [tensor_proto(BIAS, torch.full_like(new[BIAS], float("nan")))],
    }
    for why, tensors in bad.items():
        with pytest.raises(grpc.RpcError) as ei:
            pair.update("", tensors=tensors)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (why, ei.value.details())
        _, violations = status_details(ei.value)
        assert [f for f, _ in violations] == ["tensors"], (why, violations)
        assert pair.status().generation == 1
    assert pair.generate(REQ_FOX).sha256 == r0.sha256

    up = pair.update("", tensors=[tensor_proto(n, t) for n, t in new.items()])
    assert (up.generation, up.previous_generation) == (2, 1)
    assert up.fingerprint.startswith("tensors:")

    model = _resident_a(str(weights.a)).with_tensors(new)  # diffusers' transformer with the same tensors
    want = generate(model, GenerationRequest.from_dict({**REQ_FOX, "request_id": "ref"})).sha256
    assert want != ref_sha(weights.a, REQ_FOX)
    r1 = pair.generate(REQ_FOX)
    assert (r1.generation, r1.sha256) == (2, want)
    st = pair.status()
    assert (st.generation, st.fingerprint) == (2, up.fingerprint)
    # the same tensors again: same digest, next generation
    assert pair.update("", tensors=[tensor_proto(n, t) for n, t in new.items()]).fingerprint == up.fingerprint


# ----------------------------------------------------------------------------- in-place overwrite
def test_overwritten_checkpoint_is_detected_before_rebuild(pairs: StartPair, weights: Weights) -> None:
    served = copy_into_root(weights, weights.a, "acopy-")
    pair = pairs(served)
    r = pair.generate(REQ_FOX)
    assert (r.generation, r.sha256) == (1, ref_sha(weights.a, REQ_FOX))

    # same layout, other bytes: B's last transformer shard over the served copy's
    shard, others = last_shard(served), transformer_shards(served)[:-1]
    assert (served / shard).stat().st_size == (weights.b / shard).stat().st_size
    (served / shard).write_bytes((weights.b / shard).read_bytes())

    new_schedule = {**REQ_FOX, "flow_shift": 2.5}  # plans never built: needs a rebuild pass
    with pytest.raises(grpc.RpcError) as ei:
        pair.generate(new_schedule, request_id="after-overwrite")
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION, ei.value.details()
    assert shard in (ei.value.details() or "")
    assert not any(other in (ei.value.details() or "") for other in others)

    # from now on every prepare is refused the same way (not UNAVAILABLE: retrying cannot help)
    with pytest.raises(grpc.RpcError) as ei:
        pair.generate({**REQ_FOX, "flow_shift": 1.7}, request_id="after-overwrite-2")
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION, ei.value.details()
    assert shard in (ei.value.details() or "")

    st = pair.state()
    assert not st.serving
    assert shard in st.not_serving_reason and not any(other in st.not_serving_reason for other in others)
    assert pair.sidecar_health() == NOT_SERVING
    assert pair.status().generation == 1

    up = pair.update("B")
    assert (up.generation, up.previous_generation) == (2, 1)
    st = pair.state()
    assert st.serving and st.not_serving_reason == ""
    assert pair.sidecar_health() == SERVING
    assert_serves(pair, 2, weights.b)
    r = pair.generate(new_schedule, request_id="restored")
    assert (r.generation, r.sha256) == (2, ref_sha(weights.b, new_schedule))


# ----------------------------------------------------------------------------- CLI
def test_update_weights_cli(
    pairs: StartPair, weights: Weights, run_cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ditserve update-weights` (in this process: a fresh interpreter costs seconds of diffusers imports)."""
    monkeypatch.delenv("DITSERVE_ADMIN_TOKEN", raising=False)
    pair = pairs(weights.a)
    bad = run_cli(["update-weights", "--target", pair.target, "--path", "B", "--token", "wrong-token"])
    assert bad.code != 0
    assert "failed: PERMISSION_DENIED" in bad.err, bad.err
    assert bad.out.strip() == ""
    assert pair.status().generation == 1

    ok = run_cli(["update-weights", "--target", pair.target, "--path", "B", "--token", TOKEN])
    assert ok.code == 0, ok.err
    lines = ok.json_lines()
    assert len(lines) == 1, ok.out
    out = lines[0]
    assert set(out) == {"generation", "previous_generation", "weights_path", "fingerprint", "phase_ms",
                        "kept_partitions"}  # fmt: skip
    assert out["kept_partitions"] == []  # B's transformer_ref differs from A's too
    assert (out["generation"], out["previous_generation"]) == (2, 1)
    assert real(out["weights_path"]) == real(weights.b)
    assert out["fingerprint"] == fingerprint(weights.b)
    assert set(out["phase_ms"]) >= {"validate_ms", "prepare_ms", "drain_ms", "load_ms", "commit_ms"}
    assert all(v >= 0 for v in out["phase_ms"].values())
    assert_serves(pair, 2, weights.b)

    token_file = pair.workdir / "admin-token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    back = run_cli(["update-weights", "--target", pair.target, "--path", "A", "--token-file", token_file])
    assert back.code == 0, back.err
    assert back.json_lines()[0]["generation"] == 3


def test_update_weights_cli_keeps_the_token_off_the_network_in_cleartext(
    run_cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before any call (exit 2): a token for a non-loopback target without TLS, a token file others may
    read, and both a token and a token file."""
    monkeypatch.delenv("DITSERVE_ADMIN_TOKEN", raising=False)
    base = ["update-weights", "--path", "B", "--timeout-s", "2"]
    remote = run_cli([*base, "--target", "10.255.255.1:50051", "--token", TOKEN])
    assert remote.code == 2
    assert "refusing to send the admin token in cleartext to 10.255.255.1: give --tls-ca" in remote.err
    monkeypatch.setenv("DITSERVE_ADMIN_TOKEN", TOKEN)  # from the environment too
    assert run_cli([*base, "--target", "10.255.255.1:50051"]).code == 2
    shared = tmp_path / "token"
    shared.write_text(TOKEN)
    shared.chmod(0o644)
    loose = run_cli([*base, "--target", "127.0.0.1:1", "--token-file", shared])
    assert loose.code == 2 and "--token-file" in loose.err and "other users" in loose.err
    both = run_cli([*base, "--target", "127.0.0.1:1", "--token", TOKEN, "--token-file", shared])
    assert both.code == 2 and "give --token or --token-file, not both" in both.err
