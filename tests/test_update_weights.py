"""UpdateWeights (docs/architecture.md, 'Weight generations and UpdateWeights') on real
in-process servers: a sidecar and a generator over a unix socket.

Checkpoints A (tiny, seed 0) and B (tiny, seed 1) live in the generator's --weights-root.
Every output is compared with ditcore's resident generation of the checkpoint that the
response's generation names; every refused update must leave generation, weights and
outputs exactly as they were.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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
from safetensors.torch import load_file, save_file
from servicekit import (
    NOT_SERVING,
    REPO_ROOT,
    REQ_T2V,
    REQ_T2VA,
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
    updatable,
    wait_for,
)

from ditcore import GenerationRequest, fingerprint, generate, get_preset, load_model, write_checkpoint
from generator_service import executor as executor_mod
from protos.ditserve.generator.v1 import generator_pb2 as gen_pb

INDEX = "model.safetensors.index.json"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
LONG = long_request(20)


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


def snapshot(pair: Pair, req: dict[str, Any] = REQ_T2V) -> Snapshot:
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
    for req in (REQ_T2V, REQ_T2VA):
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


def rewrite_shard(ckpt: Path, shard: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(ckpt / shard))
    edit(tensors)
    save_file(tensors, str(ckpt / shard), metadata={"format": "pt"})


def strip_adaln(ckpt: Path) -> None:
    """Remove every `.adaln_proj.` tensor from the shards and the index."""
    index = json.loads((ckpt / INDEX).read_text())
    for shard in sorted(set(index["weight_map"].values())):
        rewrite_shard(ckpt, shard, lambda t: [t.pop(n) for n in [n for n in t if ".adaln_proj." in n]])
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if ".adaln_proj." not in n}
    (ckpt / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    assert not any(".adaln_proj." in n for n in json.loads((ckpt / INDEX).read_text())["weight_map"])


def truncate_shard(ckpt: Path) -> None:
    p = ckpt / SHARD2
    size = p.stat().st_size
    with open(p, "r+b") as fh:
        fh.truncate(size // 2)


def garbage_header(ckpt: Path) -> None:
    """Keep the 8-byte header length, replace the JSON header with bytes that are not JSON."""
    p = ckpt / SHARD1
    data = bytearray(p.read_bytes())
    hlen = int.from_bytes(data[:8], "little")
    data[8 : 8 + hlen] = b"\xfe" * hlen
    p.write_bytes(bytes(data))


def wrong_shape(ckpt: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["video_embed.bias"] = torch.zeros(t["video_embed.bias"].numel() + 1)

    rewrite_shard(ckpt, SHARD1, edit)


def wrong_dtype(ckpt: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["video_embed.bias"] = t["video_embed.bias"].to(torch.bfloat16)

    rewrite_shard(ckpt, SHARD1, edit)


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


# ----------------------------------------------------------------------------- rejections
@pytest.fixture(scope="module")
def serving_a(weights: Weights) -> Iterator[Pair]:
    """One pair serving A for the whole rejection table: no rejection may change anything."""
    with Pair(weights.a, **updatable(weights)) as pair:
        pair.start().generate(REQ_T2V, request_id="warm")
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


def _small_preset(weights: Weights, tmp: Path) -> str:
    d = Path(tempfile.mkdtemp(prefix="small-", dir=weights.root))
    write_checkpoint(get_preset("small"), d, seed=0)
    return d.name


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
    "truncated-shard": Case(grpc.StatusCode.FAILED_PRECONDITION, _bad_copy(truncate_shard), details_contain=(SHARD2,)),
    "garbage-header": Case(grpc.StatusCode.FAILED_PRECONDITION, _bad_copy(garbage_header), details_contain=(SHARD1,)),
    "wrong-shape": Case(
        grpc.StatusCode.FAILED_PRECONDITION, _bad_copy(wrong_shape), details_contain=("video_embed.bias", "shape")
    ),
    "wrong-dtype": Case(
        grpc.StatusCode.FAILED_PRECONDITION, _bad_copy(wrong_dtype), details_contain=("video_embed.bias", "dtype")
    ),
    "incompatible-config": Case(grpc.StatusCode.FAILED_PRECONDITION, _small_preset, details_contain=("incompatible",)),
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
    assert before.generation == 1 and before.sha == ref_sha(weights.a, REQ_T2V)

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
    assert pair.generate(REQ_T2V, expected_generation=1).sha256 == ref_sha(weights.a, REQ_T2V)
    assert pair.update("B").generation == 2
    with pytest.raises(grpc.RpcError) as ei:
        pair.generate(REQ_T2V, expected_generation=1)
    assert ei.value.code() == grpc.StatusCode.ABORTED
    info = error_info(ei.value)
    assert info is not None and info.reason == "GENERATION_MISMATCH"
    assert info.metadata["current_generation"] == "2"
    r = pair.generate(REQ_T2V, expected_generation=2)
    assert (r.generation, r.sha256) == (2, ref_sha(weights.b, REQ_T2V))


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
    real_generate = executor_mod.generate

    def gated(model: Any, request: GenerationRequest, plans: Any = None, on_step: Any = None) -> Any:
        if not request.request_id.startswith("gated-"):
            return real_generate(model, request, plans, on_step=on_step)

        def step(done: int, total: int) -> None:
            if on_step is not None:
                on_step(done, total)
            if done == 1:
                g.reached.set()
                g.opened.wait(120)

        return real_generate(model, request, plans, on_step=step)

    monkeypatch.setattr(executor_mod, "generate", gated)
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
    queued = background(lambda: pair.generate(REQ_T2V, request_id="after-abort", timeout=120), name="queued")
    wait_for(lambda: pair.status().queue_depth == 2, 10, "the request to queue behind the long one")
    gate.opened.set()
    long_resp = stream.result(120)
    assert (long_resp.generation, long_resp.sha256) == (1, long_ref)
    r = queued.result(120)
    assert (r.generation, r.sha256) == (1, ref_sha(weights.a, REQ_T2V))
    assert_unchanged(pair, before)

    # the aborted update left nothing behind: the same update now succeeds
    assert pair.update("B").generation == 2
    assert_serves(pair, 2, weights.b)


# ----------------------------------------------------------------------------- tensor-pushed updates
BIAS = "final_layer.video_out.bias"
TINY_PATCH = get_preset("tiny").video_patch_numel


def tensor_proto(name: str, t: torch.Tensor) -> gen_pb.Tensor:
    t = t.contiguous()
    return gen_pb.Tensor(name=name, dtype="float32", shape=list(t.shape), data=t.numpy().tobytes())


def test_tensor_update_is_refused_in_cached_mode(pairs: StartPair, weights: Weights) -> None:
    pair = pairs(weights.a)
    before = snapshot(pair)
    new = torch.full((TINY_PATCH,), 0.25)
    with pytest.raises(grpc.RpcError) as ei:
        pair.update("", tensors=[tensor_proto(BIAS, new)])
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION, ei.value.details()
    details = ei.value.details() or ""
    assert "tensor" in details and "refused in cached mode" in details, details
    assert_unchanged(pair, before)


def test_tensor_update_in_resident_mode(pairs: StartPair, weights: Weights) -> None:
    pair = pairs(weights.a, mode="resident")
    r0 = pair.generate(REQ_T2V)
    assert (r0.generation, r0.sha256) == (1, ref_sha(weights.a, REQ_T2V))

    model = load_model(weights.a, "resident")  # a private copy: it gets the new bias too
    new = model.state_dict()[BIAS] + 0.05
    up = pair.update("", tensors=[tensor_proto(BIAS, new)])
    assert (up.generation, up.previous_generation) == (2, 1)
    assert up.fingerprint.startswith("tensors:")

    model.load_state_dict({**model.state_dict(), BIAS: new})
    want = generate(model, GenerationRequest.from_dict({**REQ_T2V, "request_id": "ref"})).sha256
    assert want != ref_sha(weights.a, REQ_T2V)
    r1 = pair.generate(REQ_T2V)
    assert (r1.generation, r1.sha256) == (2, want)
    assert pair.status().generation == 2


# ----------------------------------------------------------------------------- in-place overwrite
def test_overwritten_checkpoint_is_detected_before_rebuild(pairs: StartPair, weights: Weights) -> None:
    served = copy_into_root(weights, weights.a, "acopy-")
    pair = pairs(served)
    r = pair.generate(REQ_T2V)
    assert (r.generation, r.sha256) == (1, ref_sha(weights.a, REQ_T2V))

    # same layout, other bytes: B's shard 2 over the served copy's shard 2
    assert (served / SHARD2).stat().st_size == (weights.b / SHARD2).stat().st_size
    (served / SHARD2).write_bytes((weights.b / SHARD2).read_bytes())

    new_schedule = {**REQ_T2V, "flow_shift": 2.5}  # plans never built: needs a rebuild pass
    with pytest.raises(grpc.RpcError) as ei:
        pair.generate(new_schedule, request_id="after-overwrite")
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION, ei.value.details()
    assert SHARD2 in (ei.value.details() or "")
    assert SHARD1 not in (ei.value.details() or "")

    # from now on every prepare is refused the same way (not UNAVAILABLE: retrying cannot help)
    with pytest.raises(grpc.RpcError) as ei:
        pair.generate({**REQ_T2V, "flow_shift": 1.7}, request_id="after-overwrite-2")
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION, ei.value.details()
    assert SHARD2 in (ei.value.details() or "")

    st = pair.state()
    assert not st.serving
    assert SHARD2 in st.not_serving_reason and SHARD1 not in st.not_serving_reason
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
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("DITSERVE_ADMIN_TOKEN", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "ditserve", *args],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120, check=False,
    )  # fmt: skip


def test_update_weights_cli(pairs: StartPair, weights: Weights) -> None:
    pair = pairs(weights.a)
    bad = _cli("update-weights", "--target", pair.target, "--path", "B", "--token", "wrong-token")
    assert bad.returncode != 0
    assert "failed: PERMISSION_DENIED" in bad.stderr, bad.stderr
    assert bad.stdout.strip() == ""
    assert pair.status().generation == 1

    ok = _cli("update-weights", "--target", pair.target, "--path", "B", "--token", TOKEN)
    assert ok.returncode == 0, ok.stderr
    lines = [json.loads(line) for line in ok.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, ok.stdout
    out = lines[0]
    assert set(out) == {"generation", "previous_generation", "weights_path", "fingerprint", "phase_ms"}
    assert (out["generation"], out["previous_generation"]) == (2, 1)
    assert real(out["weights_path"]) == real(weights.b)
    assert out["fingerprint"] == fingerprint(weights.b)
    assert set(out["phase_ms"]) >= {"validate_ms", "prepare_ms", "drain_ms", "load_ms", "commit_ms"}
    assert all(v >= 0 for v in out["phase_ms"].values())
    assert_serves(pair, 2, weights.b)
