"""The `ditserve` command line on MiniMax-H3 repositories: make-checkpoint, inspect, generate-local, and bad input."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
from clikit import CliRunner, copy_ckpt
from safetensors import safe_open

from ditcore import GenerationRequest, figures, generate, latents_sha256, load_model, validate_checkpoint
from ditcore.checkpoint_files import read_shard_header
from ditcore.shards import INDEX_FILE

CACHE_KEYS = {"gpu_hit_plans", "host_hit_plans", "built_plans", "rebuild_s", "swap_in_s", "host_stored",
              "disk_hit_plans", "disk_read_s", "disk_stored_plans", "rebuild_read_bytes", "rebuild_read_s"}  # fmt: skip
# 4 grid points = 3 transformer forwards on the smallest H3 canvas: a request takes well under a second on tiny
SMALL = ["--num-inference-steps", "4", "--height", "32", "--width", "32", "--num-frames", "124"]
H3_PARAMS = 33_122_992_896
H3_ADALN_BYTES = 26_020_915_200  # bfloat16, as released
H3_PAGE_NUMEL = 4_849_152


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _err_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    return lines[-1]


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- make-checkpoint
def test_make_checkpoint_defaults_are_the_released_precision(
    run_cli: CliRunner, tmp_path: Path, tiny_ckpt: Path, tiny_ckpt_b: Path
) -> None:
    out = tmp_path / "ck"
    res = run_cli(["make-checkpoint", "--preset", "tiny", "--out", out])
    assert res.code == 0, res.err
    assert res.err == ""  # no progress bars: one JSON line, nothing else
    [line] = res.json_lines()
    info = validate_checkpoint(out)
    assert line == {
        "checkpoint": str(out),
        "preset": "tiny",
        "precision": "mixed",
        "seed": 0,
        "fingerprint": info.fingerprint,
        "partitions": {"base": info.partitions["base"].fingerprint, "ref": info.partitions["ref"].fingerprint},
    }
    assert info.precision == "mixed" and info.projection_dtype == torch.bfloat16 and info.has_adaln
    # tiny, seed 0, mixed, 2 shards: the session fixture's repository, file for file
    assert line["fingerprint"] == validate_checkpoint(tiny_ckpt).fingerprint
    seed1 = run_cli(["make-checkpoint", "--preset", "tiny", "--seed", "1", "--out", tmp_path / "b"])
    assert seed1.code == 0, seed1.err
    assert seed1.json_lines()[0]["fingerprint"] == validate_checkpoint(tiny_ckpt_b).fingerprint != line["fingerprint"]


def test_make_checkpoint_float32_and_shards(run_cli: CliRunner, tmp_path: Path, tiny_ckpt_f32: Path) -> None:
    out = tmp_path / "ck"
    res = run_cli(["make-checkpoint", "--preset", "tiny", "--dtype", "float32", "--out", out])
    assert res.code == 0, res.err
    info = validate_checkpoint(out)
    assert info.precision == "float32" and info.projection_dtype == torch.float32
    assert res.json_lines()[0]["fingerprint"] == validate_checkpoint(tiny_ckpt_f32).fingerprint
    one = tmp_path / "one"
    res = run_cli(["make-checkpoint", "--preset", "tiny", "--dtype", "float32", "--shards", "1", "--out", one])
    assert res.code == 0, res.err
    assert len(list((one / "transformer").glob("*.safetensors"))) == 1
    # the same weights in other files: another fingerprint, the same transformer config
    info_one = validate_checkpoint(one)
    assert info_one.fingerprint != info.fingerprint and info.incompatibility(info_one) is None


def test_make_checkpoint_refuses_non_empty_out(run_cli: CliRunner, tmp_path: Path, tiny_ckpt_b: Path) -> None:
    out = tmp_path / "ck"
    assert run_cli(["make-checkpoint", "--preset", "tiny", "--seed", "0", "--out", out]).code == 0
    before = _files(out)
    res = run_cli(["make-checkpoint", "--preset", "tiny", "--seed", "1", "--out", out])
    assert res.code == 2
    msg = _err_line(res.err)
    assert "--force" in msg and str(out) in msg
    assert res.out == ""
    assert _files(out) == before
    # --force overwrites an existing repository
    res = run_cli(["make-checkpoint", "--preset", "tiny", "--seed", "1", "--out", out, "--force"])
    assert res.code == 0, res.err
    assert res.json_lines()[0]["fingerprint"] == validate_checkpoint(out).fingerprint
    assert _mode(out) == 0o700  # removed and created again, like every directory flag
    assert validate_checkpoint(out).fingerprint == validate_checkpoint(tiny_ckpt_b).fingerprint


def test_make_checkpoint_force_refuses_a_directory_that_is_not_a_repository(run_cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "precious"
    out.mkdir()
    (out / "thesis.txt").write_text("do not delete")
    res = run_cli(["make-checkpoint", "--preset", "tiny", "--out", out, "--force"])
    assert res.code == 2
    msg = _err_line(res.err)
    assert "--out" in msg and "not a checkpoint directory" in msg and "model_index.json" in msg
    assert _files(out) == {"thesis.txt": b"do not delete"}


def test_make_checkpoint_refuses_h3(run_cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "h3"
    res = run_cli(["make-checkpoint", "--preset", "h3", "--out", out])
    assert res.code == 2
    msg = _err_line(res.err)
    assert "--preset h3" in msg and "inspect --preset h3" in msg and "tiny, small, bench" in msg
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["--preset", "huge"], ["--preset", "tiny, small, bench", "'huge'"]),
        (["--preset", "tiny", "--shards", "0"], ["--shards", "[1, 1000]", "got 0"]),
        (["--preset", "tiny", "--shards", "1001"], ["--shards", "[1, 1000]", "got 1001"]),
        (["--preset", "tiny", "--seed", "-1"], ["--seed", "[0, 2^63-1]", "got -1"]),
        (["--preset", "tiny", "--seed", str(2**63)], ["--seed", "[0, 2^63-1]"]),
        (["--preset", "tiny", "--dtype", "bfloat16"], ["--dtype", "invalid choice", "'bfloat16'"]),
        (["--preset", "tiny", "--shards", "two"], ["--shards", "invalid int value"]),
    ],
    ids=["preset", "shards-0", "shards-1001", "seed-neg", "seed-big", "dtype", "shards-type"],
)
def test_make_checkpoint_bad_values(run_cli: CliRunner, tmp_path: Path, argv: list[str], expect: list[str]) -> None:
    out = tmp_path / "x"
    res = run_cli(["make-checkpoint", *argv, "--out", out])
    assert res.code == 2
    msg = _err_line(res.err)
    for s in expect:
        assert s in msg, f"{s!r} not in {msg!r}"
    assert not out.exists()


def test_make_checkpoint_creates_out_0700_parents_too(run_cli: CliRunner, tmp_path: Path) -> None:
    """--out follows the directory-flag rule (ditruntime.paths.prepare_dir): missing components are created 0700,
    whatever the umask; a parent that is a file is refused naming the flag, before anything is written."""
    out = tmp_path / "a" / "b" / "ck"
    old = os.umask(0o022)
    try:
        res = run_cli(["make-checkpoint", "--preset", "tiny", "--out", out])
    finally:
        os.umask(old)
    assert res.code == 0, res.err
    assert [_mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", out)] == [0o700] * 3
    assert validate_checkpoint(out).preset == "tiny"
    f = tmp_path / "file"
    f.write_text("x")
    res = run_cli(["make-checkpoint", "--preset", "tiny", "--out", f / "ck"])
    assert res.code == 2
    assert f"--out {f / 'ck'}: its parent {f} exists and is not a directory" in _err_line(res.err)
    assert f.read_text() == "x"


def test_make_checkpoint_out_is_a_file(run_cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "file"
    out.write_text("x")
    res = run_cli(["make-checkpoint", "--preset", "tiny", "--out", out, "--force"])
    assert res.code == 2
    assert "--out" in _err_line(res.err) and "not a directory" in _err_line(res.err)
    assert out.read_text() == "x"


# ----------------------------------------------------------------------------- inspect
def test_inspect_preset_h3_prints_the_released_figures(run_cli: CliRunner) -> None:
    res = run_cli(["inspect", "--preset", "h3", "--json"])
    assert res.code == 0, res.err
    data = json.loads(res.out)
    assert (data["preset"], data["precision"], data["projection_dtype"]) == ("h3", "mixed", "bfloat16")
    assert data["params"]["total"] == H3_PARAMS
    assert data["params"]["adaln_proj"] * 2 == data["adaln_bytes"] == H3_ADALN_BYTES
    assert data["params"]["other"] == H3_PARAMS - data["params"]["adaln_proj"]
    assert data["adaln_gib"] == pytest.approx(24.23, abs=0.005)
    assert 0.39 <= data["adaln_share"] <= 0.40
    assert data["page_numel"] == H3_PAGE_NUMEL and data["page_bytes"] == 2 * H3_PAGE_NUMEL
    assert data["page_mib"] == pytest.approx(9.25, abs=0.005)
    assert data["transformer"] == {
        "num_layers": 50,
        "hidden_size": 5376,
        "num_attention_heads": 56,
        "attention_head_dim": 128,
        "time_embed_dim": 2688,
        "ffn_dim": 14336,
    }
    assert data["fingerprint"] is None and data["has_adaln"] is None

    human = run_cli(["inspect", "--preset", "h3"])
    assert human.code == 0, human.err
    for s in ("33,122,992,896", "adaln_proj share", "39.3%", "26,020,915,200 (24.23 GiB)", "4,849,152"):
        assert s in human.out, s
    assert "9,698,304 (9.25 MiB)" in human.out


def test_inspect_preset_float32_doubles_the_bytes(run_cli: CliRunner) -> None:
    mixed = json.loads(run_cli(["inspect", "--preset", "bench", "--json"]).out)
    f32 = run_cli(["inspect", "--preset", "bench", "--dtype", "float32", "--json"])
    assert f32.code == 0, f32.err
    data = json.loads(f32.out)
    assert data["precision"] == "float32" and data["projection_dtype"] == "float32"
    assert data["params"] == mixed["params"] and data["page_numel"] == mixed["page_numel"]
    assert data["adaln_bytes"] == 2 * mixed["adaln_bytes"] and data["page_bytes"] == 2 * mixed["page_bytes"]


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_ckpt_f32"])
def test_inspect_repository(run_cli: CliRunner, request: pytest.FixtureRequest, fixture: str) -> None:
    ckpt: Path = request.getfixturevalue(fixture)
    res = run_cli(["inspect", ckpt, "--json"])
    assert res.code == 0, res.err
    data = json.loads(res.out)
    info = validate_checkpoint(ckpt)
    assert (data["source"], data["preset"], data["fingerprint"]) == (str(ckpt), "tiny", info.fingerprint)
    assert data["precision"] == info.precision == ("mixed" if fixture == "tiny_ckpt" else "float32")
    assert data["has_adaln"] is True
    size = info.projection_dtype.itemsize
    assert data["page_numel"] == info.layout.page_numel and data["page_bytes"] == info.layout.page_bytes(
        info.projection_dtype
    )
    assert data["adaln_bytes"] == info.layout.adaln_proj_bytes(info.projection_dtype)
    # the tensors in the transformer's shards, counted from their headers
    index = json.loads((ckpt / "transformer" / INDEX_FILE).read_text())["weight_map"]
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in sorted(set(index.values())):
        shapes |= {n: e.shape for n, e in read_shard_header(ckpt / "transformer" / shard).tensors.items()}
    numel = {n: int(torch.Size(s).numel()) for n, s in shapes.items()}
    assert data["params"]["total"] == sum(numel.values())
    assert data["params"]["adaln_proj"] == sum(v for n, v in numel.items() if ".adaln_proj." in n)
    assert data["adaln_bytes"] == data["params"]["adaln_proj"] * size
    # and the preset's arithmetic agrees with the written repository
    f = figures("tiny")
    assert (f.params, f.adaln_params, f.page_numel) == (
        data["params"]["total"],
        data["params"]["adaln_proj"],
        data["page_numel"],
    )


def test_inspect_repository_human(run_cli: CliRunner, tiny_ckpt: Path) -> None:
    res = run_cli(["inspect", tiny_ckpt])
    assert res.code == 0, res.err
    assert "adaln_proj share" in res.out and "mixed (adaln_proj and pages in bfloat16)" in res.out
    assert validate_checkpoint(tiny_ckpt).fingerprint in res.out
    assert "native adaln_proj  yes" in res.out


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["inspect"], "exactly one of"),
        (["inspect", "DIR", "--preset", "tiny"], "exactly one of"),
        (["inspect", "--preset", "huge"], "--preset must be one of tiny, small, bench, h3"),
        (["inspect", "DIR", "--dtype", "float32"], "--dtype goes with --preset"),
        (["inspect", "--preset", "h3", "--dtype", "bfloat16"], "invalid choice"),
    ],
)
def test_inspect_usage_errors(run_cli: CliRunner, tiny_ckpt: Path, argv: list[str], expect: str) -> None:
    res = run_cli([str(tiny_ckpt) if a == "DIR" else a for a in argv])
    assert res.code == 2
    assert expect in _err_line(res.err)
    assert res.out == ""


def test_inspect_corrupt_repository(run_cli: CliRunner, tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    (root / "transformer" / "config.json").unlink()
    res = run_cli(["inspect", root])
    assert res.code == 2
    assert "transformer/config.json" in _err_line(res.err)


# ----------------------------------------------------------------------------- generate-local
def _gen(run_cli: CliRunner, ckpt: Path, *args: Any) -> list[dict[str, Any]]:
    res = run_cli(["generate-local", "--checkpoint", ckpt, *args])
    assert res.code == 0, res.err
    assert res.err == ""
    return res.json_lines()


def test_generate_local_both_modes_equal_the_library(run_cli: CliRunner, tiny_ckpt: Path) -> None:
    args = [*SMALL, "--prompt", "a red fox", "--seed", "7", "--flow-shift", "5", "--audio-flow-shift", "2"]
    [resident] = _gen(run_cli, tiny_ckpt, "--adaln-mode", "resident", *args, "--request-id", "r1")
    [cached] = _gen(run_cli, tiny_ckpt, "--adaln-mode", "cached", *args, "--request-id", "r1")
    req = GenerationRequest(
        request_id="r1", prompt="a red fox", seed=7, flow_shift=5.0, audio_flow_shift=2.0, num_inference_steps=4
    )
    model = load_model(tiny_ckpt, "resident")
    lib = generate(model, req)
    keys = model.plan_keys(req)
    for line, mode in ((resident, "resident"), (cached, "cached")):
        assert line["request_id"] == "r1"
        assert (line["task"], line["num_inference_steps"], line["adaln_mode"]) == ("t2va", 4, mode)
        assert line["sha256"] == lib.sha256
        assert line["video_shape"] == list(lib.video.shape) and line["audio_shape"] == list(lib.audio.shape)
        assert {"encode", "denoise", "total"} <= set(line["timings_ms"])
    assert "cache" not in resident
    assert set(cached["cache"]) == CACHE_KEYS
    assert cached["cache"]["built_plans"] == len(set(keys)) and cached["cache"]["gpu_hit_plans"] == 0


def test_generate_local_defaults(run_cli: CliRunner, tiny_ckpt: Path) -> None:
    """Only a prompt: request id req-0 and GenerationRequest's defaults (H3's shifts, 124 frames, 32 x 32)."""
    [line] = _gen(run_cli, tiny_ckpt, "--prompt", "a red fox", "--num-inference-steps", "3")
    lib = generate(load_model(tiny_ckpt, "resident"), GenerationRequest(prompt="a red fox", num_inference_steps=3))
    assert (line["request_id"], line["adaln_mode"], line["sha256"]) == ("req-0", "resident", lib.sha256)


def test_generate_local_requests_file_defaults(run_cli: CliRunner, tmp_path: Path, tiny_ckpt: Path) -> None:
    jsonl = tmp_path / "reqs.jsonl"
    lines = [
        {"request_id": "explicit", "num_inference_steps": 3, "prompt": "a boat"},
        {"request_id": "defaulted", "prompt": "a boat"},  # num_inference_steps from the flag (3)
        {"request_id": "four", "num_inference_steps": 4, "prompt": "a boat"},
        {"audio_flow_shift": 2.0},  # request_id req-<index>, prompt from the flag
    ]
    text = "\n".join(json.dumps(x) for x in lines[:2]) + "\n\n" + "\n".join(json.dumps(x) for x in lines[2:])
    jsonl.write_text(text)
    flags = ["--num-inference-steps", "3", "--prompt", "a boat", "--adaln-mode", "cached"]
    out = _gen(run_cli, tiny_ckpt, "--requests", jsonl, *flags)
    assert [x["request_id"] for x in out] == ["explicit", "defaulted", "four", "req-3"]
    by_id = {x["request_id"]: x for x in out}
    assert by_id["defaulted"]["num_inference_steps"] == 3
    assert by_id["defaulted"]["sha256"] == by_id["explicit"]["sha256"]
    assert by_id["four"]["sha256"] != by_id["explicit"]["sha256"]  # the grid does matter
    assert by_id["req-3"]["sha256"] != by_id["explicit"]["sha256"]  # so does the audio shift
    # the cache served the repeated schedule from its slab
    assert by_id["defaulted"]["cache"]["built_plans"] == 0 and by_id["defaulted"]["cache"]["gpu_hit_plans"] > 0
    # per-line values beat flags; flag values fill the rest
    [single] = _gen(run_cli, tiny_ckpt, "--num-inference-steps", "3", "--prompt", "a boat")
    assert single["sha256"] == by_id["explicit"]["sha256"]


def test_generate_local_out_files(run_cli: CliRunner, tmp_path: Path, tiny_ckpt: Path) -> None:
    out_dir = tmp_path / "out"
    jsonl = tmp_path / "reqs.jsonl"
    jsonl.write_text(json.dumps({"request_id": "a", "seed": 1}) + "\n" + json.dumps({"request_id": "b.2", "seed": 2}))
    lines = _gen(run_cli, tiny_ckpt, *SMALL, "--prompt", "waves", "--requests", jsonl, "--out", out_dir)
    assert sorted(p.name for p in out_dir.iterdir()) == ["a.safetensors", "b.2.safetensors"]
    for line in lines:
        with safe_open(str(out_dir / f"{line['request_id']}.safetensors"), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        assert set(tensors) == {"video", "audio"}
        assert (
            list(tensors["video"].shape) == line["video_shape"] and list(tensors["audio"].shape) == line["audio_shape"]
        )
        assert tensors["video"].dtype == tensors["audio"].dtype == torch.float32
        assert meta["sha256"] == line["sha256"] == latents_sha256(tensors["video"], tensors["audio"])
        request = {k: json.loads(v) for k, v in meta.items() if k != "sha256"}
        assert request == {
            **GenerationRequest().to_dict(),
            "request_id": line["request_id"],
            "prompt": "waves",
            "num_inference_steps": 4,
            "seed": 1 if line["request_id"] == "a" else 2,
        }
    assert lines[0]["sha256"] != lines[1]["sha256"]


def test_generate_local_out_one_file_of_an_explicit_output_type(
    run_cli: CliRunner, tmp_path: Path, tiny_ckpt: Path
) -> None:
    """--out with a suffix names one file; an unknown suffix takes --output-type's type (here latents)."""
    out = tmp_path / "sub" / "fox.latents"
    [line] = _gen(run_cli, tiny_ckpt, *SMALL, "--prompt", "a fox", "--output-type", "latents", "--out", out)
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["fox.latents"] and _mode(tmp_path / "sub") == 0o700
    with safe_open(str(out), framework="pt") as f:
        assert (f.metadata() or {})["sha256"] == line["sha256"]
        assert latents_sha256(f.get_tensor("video"), f.get_tensor("audio")) == line["sha256"]
    assert (line["out"], line["output_type"], line["bytes"]) == (str(out), "latents", out.stat().st_size)
    assert "media_sha256" not in line and line["video_shape"]


def test_make_checkpoint_then_generate_local_cached_as_documented(run_cli_proc: CliRunner, tmp_path: Path) -> None:
    """The README's two commands, each in a fresh interpreter, every value at its default."""
    made = run_cli_proc(["make-checkpoint", "--preset", "tiny", "--out", "r"], cwd=tmp_path)
    assert made.code == 0, made.err
    res = run_cli_proc(
        ["generate-local", "--checkpoint", "r", "--adaln-mode", "cached", "--prompt", "a red fox"], cwd=tmp_path
    )
    assert res.code == 0, res.err
    [line] = res.json_lines()
    assert (line["request_id"], line["task"], line["num_inference_steps"]) == ("req-0", "t2va", 50)
    assert line["adaln_mode"] == "cached" and set(line["cache"]) == CACHE_KEYS
    assert line["cache"]["built_plans"] >= 1 and line["cache"]["gpu_hit_plans"] == 0
    model = load_model(tmp_path / "r", "cached")
    assert line["cache"]["built_plans"] == len(set(model.plan_keys(GenerationRequest(prompt="a red fox"))))
    assert len(line["sha256"]) == 64


def test_version_and_help(run_cli: CliRunner) -> None:
    res = run_cli(["--version"])
    assert res.code == 0 and "ditserve" in res.out
    res = run_cli(["generate-local", "--help"])
    assert res.code == 0
    for flag in ("--adaln-mode", "--num-inference-steps", "--num-frames", "--audio-flow-shift", "--gpu-plans"):
        assert flag in res.out
    for gone in ("--steps ", "--frames", "--guidance-scale", "--negative-prompt", "--audio-length"):
        assert gone not in res.out


# ----------------------------------------------------------------------------- bad input
# (id, extra argv, JSONL lines or None, expected substrings of the error line)
LONG = "x" * 16385  # MiniMax-H3 takes at most 16384 prompt bytes
BAD_INPUT: list[tuple[str, list[str], list[str] | None, list[str]]] = [
    ("steps-1", ["--num-inference-steps", "1"], None, ["num_inference_steps", "[2, 1000]", "got 1"]),
    ("steps-1001", ["--num-inference-steps", "1001"], None, ["num_inference_steps", "[2, 1000]", "1001"]),
    ("flow_shift-nan", ["--flow-shift", "nan"], None, ["flow_shift", "(0, 1000]"]),
    ("flow_shift-inf", ["--flow-shift", "inf"], None, ["flow_shift", "(0, 1000]"]),
    ("flow_shift-0", ["--flow-shift", "0"], None, ["flow_shift", "(0, 1000]"]),
    ("flow_shift-neg", ["--flow-shift", "-1"], None, ["flow_shift", "(0, 1000]"]),
    ("audio_flow_shift-nan", ["--audio-flow-shift", "nan"], None, ["audio_flow_shift", "(0, 1000]"]),
    ("task-t2v", ["--task", "t2v"], None, ["task", "'t2v'", "allowed: t2va"]),
    ("height-48", ["--height", "48"], None, ["height", "multiple of 32", "[32, 1344]", "got 48"]),
    ("height-1376", ["--height", "1376"], None, ["height", "[32, 1344]", "1376"]),  # the released envelope
    ("area-1344x1344", ["--height", "1344", "--width", "1344"], None, ["width", "at most 1,032,192 pixels"]),
    ("width-0", ["--width", "0"], None, ["width", "multiple of 32", "got 0"]),
    ("aspect-5:1", ["--width", "160"], None, ["width", "aspect ratio", "1:4 and 4:1", "160:32"]),
    ("num_frames-125", ["--num-frames", "125"], None, ["num_frames", "17n + 5", "124, 141, ..., 345", "got 125"]),
    ("num_frames-107", ["--num-frames", "107"], None, ["num_frames", "5 to 15 seconds", "got 107"]),
    ("num_frames-362", ["--num-frames", "362"], None, ["num_frames", "got 362"]),
    ("prompt-empty", ["--prompt", ""], None, ["prompt", "must not be empty"]),
    ("prompt-blank", ["--prompt", "   "], None, ["prompt", "must not be empty"]),
    ("prompt-too-long", ["--prompt", LONG], None, ["prompt", "16385 bytes", "at most 16384 bytes"]),
    ("prompt-utf8-bytes", ["--prompt", "é" * 8193], None, ["prompt", "16386 bytes", "16384 bytes"]),
    ("seed-neg", ["--seed", "-1"], None, ["seed", "[0, 2^63-1]"]),
    ("request_id-bad", ["--request-id", "a/b"], None, ["request_id", "1-128 characters"]),
    (
        "jsonl-bad-line",
        [],
        ['{"request_id": "ok1"}', '{"request_id": "bad", "num_inference_steps": 1}', '{"request_id": "ok2"}'],
        ["num_inference_steps", "[2, 1000]"],
    ),
    (
        "jsonl-bad-line-last",
        [],
        ['{"request_id": "ok1"}', '{"request_id": "ok2"}', '{"request_id": "bad", "height": 40}'],
        ["height", "multiple of 32"],
    ),
    ("jsonl-old-steps", [], ['{"request_id": "ok1"}', '{"steps": 4}'], ["steps", ":2:", "num_inference_steps"]),
    ("jsonl-guidance", [], ['{"guidance_scale": 5}'], ["guidance_scale", ":1:", "unknown field"]),
    ("jsonl-negative", [], ['{"negative_prompt": "blurry"}'], ["negative_prompt", "unknown field"]),
    ("jsonl-invalid-json", [], ['{"request_id": "ok1"}', '{"request_id": "x"'], ["requests", ":2:", "JSON"]),
    ("jsonl-not-object", [], ['{"request_id": "ok1"}', "[1, 2]"], ["requests", ":2:", "JSON object"]),
    ("jsonl-wrong-type", [], ['{"num_inference_steps": "4"}'], ["num_inference_steps", "wrong type"]),
    ("jsonl-bool-seed", [], ['{"seed": true}'], ["seed", "wrong type"]),
    ("jsonl-duplicate-ids", [], ['{"request_id": "same"}', '{"request_id": "same"}'], ["request_id", "'same'"]),
    ("jsonl-empty", [], ["", "   "], ["requests", "no requests"]),
]


@pytest.mark.parametrize("mode", ["resident", "cached"])
@pytest.mark.parametrize(("extra", "jsonl", "expect"), [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input(
    run_cli: CliRunner,
    tmp_path: Path,
    tiny_ckpt: Path,
    mode: str,
    extra: list[str],
    jsonl: list[str] | None,
    expect: list[str],
) -> None:
    out_dir = tmp_path / "out"
    argv: list[Any] = ["generate-local", "--checkpoint", tiny_ckpt, "--adaln-mode", mode, *SMALL]
    argv += ["--prompt", "a red fox", "--out", out_dir]
    if jsonl is not None:
        path = tmp_path / "reqs.jsonl"
        path.write_text("\n".join(jsonl) + "\n")
        argv += ["--requests", path]
    res = run_cli([*argv, *extra])
    assert res.code == 2, (res.out, res.err)
    msg = _err_line(res.err)
    assert msg.startswith("ditserve generate-local: error: ")
    for s in expect:
        assert s in msg, f"{s!r} not in {msg!r}"
    assert res.out == ""  # no result line for any request
    assert not out_dir.exists()


def test_bad_input_missing_requests_file(run_cli: CliRunner, tmp_path: Path, tiny_ckpt: Path) -> None:
    out_dir = tmp_path / "out"
    argv = ["generate-local", "--checkpoint", tiny_ckpt, "--requests", tmp_path / "nope.jsonl", "--out", out_dir]
    res = run_cli(argv)
    assert res.code == 2
    msg = _err_line(res.err)
    assert "requests" in msg and "nope.jsonl" in msg
    assert not out_dir.exists()


def test_out_is_a_file(run_cli: CliRunner, tmp_path: Path, tiny_ckpt: Path) -> None:
    target = tmp_path / "out"
    target.write_text("not a directory")
    res = run_cli(["generate-local", "--checkpoint", tiny_ckpt, *SMALL, "--prompt", "a fox", "--out", target])
    assert res.code == 2, res.err
    msg = _err_line(res.err)
    assert "--out" in msg and str(target) in msg
    assert res.out == ""
    assert target.read_text() == "not a directory"


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        # 9 grid points = 8 distinct plans; a 4-slot slab cannot hold them
        (["--num-inference-steps", "9", "--gpu-plans", "4"], "--gpu-plans"),
        # distinct video and audio shifts make every step after the first two timesteps wide
        (["--plan-width", "1"], "--plan-width"),
    ],
    ids=["gpu-plans", "plan-width"],
)
def test_cached_capacity_refused_before_any_request(
    run_cli: CliRunner, tmp_path: Path, tiny_ckpt: Path, flags: list[str], expect: str
) -> None:
    jsonl = tmp_path / "reqs.jsonl"
    jsonl.write_text(json.dumps({"request_id": "fits", "num_inference_steps": 2}) + "\n" + json.dumps({}) + "\n")
    out_dir = tmp_path / "out"
    argv: list[Any] = ["generate-local", "--checkpoint", tiny_ckpt, "--adaln-mode", "cached", *SMALL]
    res = run_cli([*argv, "--prompt", "a fox", "--requests", jsonl, "--out", out_dir, *flags])
    assert res.code == 2, (res.out, res.err)
    assert expect in _err_line(res.err)
    assert res.out == "" and not out_dir.exists()


@pytest.mark.parametrize("mode", ["resident", "cached"])
def test_corrupt_repository_exit_2(run_cli: CliRunner, tmp_path: Path, tiny_ckpt: Path, mode: str) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    index = json.loads((root / "transformer" / INDEX_FILE).read_text())["weight_map"]
    shard = sorted(set(index.values()))[-1]
    path = root / "transformer" / shard
    hdr = read_shard_header(path)
    last = max(hdr.tensors, key=lambda n: hdr.tensors[n].end)
    path.write_bytes(path.read_bytes()[:-64])
    out_dir = tmp_path / "out"
    argv = ["generate-local", "--checkpoint", root, "--adaln-mode", mode, *SMALL, "--prompt", "a fox"]
    res = run_cli([*argv, "--out", out_dir])
    assert res.code == 2
    msg = _err_line(res.err)
    assert f"transformer/{shard}" in msg and f"'{last}'" in msg and "truncated" in msg
    assert res.out == ""
    assert not out_dir.exists()
    # inspect reports the same corruption
    res = run_cli(["inspect", root])
    assert res.code == 2 and f"transformer/{shard}" in res.err and last in res.err


def test_missing_repository_exit_2(run_cli: CliRunner, tmp_path: Path) -> None:
    res = run_cli(["generate-local", "--checkpoint", tmp_path / "nope", *SMALL, "--prompt", "a fox"])
    assert res.code == 2
    assert "not found" in _err_line(res.err)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate-local", "--checkpoint", "X", "--adaln-mode", "sideways"],
        ["generate-local", "--checkpoint", "X", "--num-inference-steps", "four"],
        ["generate-local", "--checkpoint", "X", "--steps", "4"],
        ["generate-local", "--checkpoint", "X", "--guidance-scale", "5"],
        ["generate-local"],
        ["no-such-command"],
    ],
)
def test_argparse_errors_exit_2(run_cli: CliRunner, tiny_ckpt: Path, argv: list[str]) -> None:
    res = run_cli([str(tiny_ckpt) if a == "X" else a for a in argv])
    assert res.code == 2
    assert "error" in res.err


# ----------------------------------------------------------------------------- generate / update-weights (no server)
@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["generate", "--prompt", "a fox", "--task", "t2v"], ["task", "'t2v'"]),
        (["generate", "--prompt", "a fox", "--num-frames", str(2**40)], ["num_frames", "does not fit"]),
        (["generate", "--prompt", "a fox", "--expected-generation", "-1"], ["--expected-generation", ">= 0"]),
        (["update-weights", "--path", "B", "--timeout-s", "0"], ["--timeout-s", "> 0"]),
        (["update-weights", "--path", "B", "--expected-generation", "-2"], ["--expected-generation", ">= 0"]),
        (["--log-level", "chatty", "inspect", "--preset", "tiny"], ["--log-level", "invalid choice"]),
    ],
    ids=["task", "frames-int32", "generation", "timeout", "update-generation", "log-level"],
)
def test_client_values_refused_before_any_call(run_cli: CliRunner, argv: list[str], expect: list[str]) -> None:
    """Nothing listens on the target: each of these must fail on its own value, with exit code 2."""
    if argv[0] != "--log-level":
        argv = [argv[0], "--target", "127.0.0.1:1", *argv[1:]]
    res = run_cli(argv)
    assert res.code == 2, (res.out, res.err)
    msg = _err_line(res.err)
    for s in expect:
        assert s in msg, f"{s!r} not in {msg!r}"
    assert res.out == ""


def test_generate_against_nothing_exits_1(run_cli: CliRunner) -> None:
    res = run_cli(["generate", "--target", "127.0.0.1:1", "--prompt", "a fox", "--request-id", "lost"])
    assert res.code == 1
    assert "request lost failed: UNAVAILABLE" in _err_line(res.err)
