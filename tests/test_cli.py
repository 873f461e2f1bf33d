"""The `ditserve` command line: make-checkpoint, inspect, generate-local, and bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from clikit import CliRunner, copy_ckpt
from safetensors import safe_open

from ditcore import GenerationRequest, generate, latents_sha256, load_model, validate_checkpoint
from ditcore.checkpoint import read_shard_header

CACHE_KEYS = {"gpu_hit_plans", "host_hit_plans", "built_plans", "rebuild_s", "swap_in_s", "host_stored"}
SMALL = ["--steps", "4", "--height", "32", "--width", "32", "--frames", "5", "--audio-length", "8"]


def _err_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    return lines[-1]


# ----------------------------------------------------------------------------- make-checkpoint
def test_make_checkpoint_writes_and_prints_fingerprint(run_cli: CliRunner, tmp_path: Path, tiny_ckpt: Path) -> None:
    out = tmp_path / "ck"
    res = run_cli(["make-checkpoint", "--preset", "tiny", "--seed", "0", "--shards", "2", "--out", out])
    assert res.code == 0, res.err
    [line] = res.json_lines()
    assert line["preset"] == "tiny"
    assert line["checkpoint"] == str(out)
    info = validate_checkpoint(out)
    assert line["fingerprint"] == info.fingerprint
    # same preset, seed and shards as the session fixture: the same checkpoint
    assert line["fingerprint"] == validate_checkpoint(tiny_ckpt).fingerprint
    res_b = run_cli(["make-checkpoint", "--preset", "tiny", "--seed", "1", "--shards", "2", "--out", tmp_path / "b"])
    assert res_b.code == 0
    assert res_b.json_lines()[0]["fingerprint"] != line["fingerprint"]


def test_make_checkpoint_dtype_override(run_cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "ck"
    res = run_cli(["make-checkpoint", "--preset", "tiny", "--dtype", "bfloat16", "--out", out])
    assert res.code == 0, res.err
    assert validate_checkpoint(out).config.dtype == "bfloat16"


def test_make_checkpoint_refuses_non_empty_out(run_cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "ck"
    assert run_cli(["make-checkpoint", "--preset", "tiny", "--seed", "0", "--out", out]).code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    res = run_cli(["make-checkpoint", "--preset", "tiny", "--seed", "1", "--out", out])
    assert res.code == 2
    assert "--force" in res.err and str(out) in res.err
    assert res.out == ""
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # --force overwrites an existing checkpoint
    res = run_cli(["make-checkpoint", "--preset", "tiny", "--seed", "1", "--out", out, "--force"])
    assert res.code == 0, res.err
    assert {p.name: p.read_bytes() for p in out.iterdir()} != before
    assert res.json_lines()[0]["fingerprint"] == validate_checkpoint(out).fingerprint


def test_make_checkpoint_force_refuses_non_checkpoint_dir(run_cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "precious"
    out.mkdir()
    (out / "thesis.txt").write_text("do not delete")
    res = run_cli(["make-checkpoint", "--preset", "tiny", "--out", out, "--force"])
    assert res.code == 2
    assert "not a checkpoint directory" in res.err
    assert (out / "thesis.txt").read_text() == "do not delete"


def test_make_checkpoint_refuses_h3(run_cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "h3"
    res = run_cli(["make-checkpoint", "--preset", "h3", "--out", out])
    assert res.code == 2
    assert "h3" in res.err
    assert not out.exists()


def test_make_checkpoint_unknown_preset(run_cli: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "x"
    res = run_cli(["make-checkpoint", "--preset", "huge", "--out", out])
    assert res.code == 2
    msg = _err_line(res.err)
    assert "'huge'" in msg
    for name in ("tiny", "small", "bench", "h3"):
        assert name in msg
    assert not out.exists()


@pytest.mark.parametrize(("flag", "value"), [("--shards", "0"), ("--seed", "-1")])
def test_make_checkpoint_bad_numbers(run_cli: CliRunner, tmp_path: Path, flag: str, value: str) -> None:
    out = tmp_path / "x"
    res = run_cli(["make-checkpoint", "--preset", "tiny", flag, value, "--out", out])
    assert res.code == 2
    assert flag in res.err
    assert not out.exists()


# ----------------------------------------------------------------------------- inspect
def test_inspect_checkpoint_json(run_cli: CliRunner, tiny_ckpt: Path) -> None:
    res = run_cli(["inspect", tiny_ckpt, "--json"])
    assert res.code == 0, res.err
    data = json.loads(res.out)
    info = validate_checkpoint(tiny_ckpt)
    assert data["fingerprint"] == info.fingerprint
    assert data["preset"] == "tiny"
    assert data["source"] == str(tiny_ckpt)
    assert data["config"] == info.config.to_dict()
    assert data["page_numel"] == info.config.page_numel
    assert data["page_bytes"] == info.config.page_numel * 4
    p = data["params"]
    assert p["total"] == p["adaln_proj"] + p["resident"]
    state = load_model(info).state_dict()
    assert p["total"] == sum(t.numel() for t in state.values())
    assert p["adaln_proj"] == sum(t.numel() for n, t in state.items() if ".adaln_proj." in n)


def test_inspect_preset_h3(run_cli: CliRunner) -> None:
    res = run_cli(["inspect", "--preset", "h3", "--json"])
    assert res.code == 0, res.err
    data = json.loads(res.out)
    assert data["dtype"] == "bfloat16"
    assert data["page_bytes"] == 9_698_304
    assert round(data["page_mib"], 2) == 9.25
    assert 24.2 <= data["adaln_gib"] < 24.3
    assert data["adaln_gib"] == pytest.approx(24.29, abs=0.01)
    assert 0.35 <= data["adaln_share"] <= 0.45
    assert data["fingerprint"] is None

    human = run_cli(["inspect", "--preset", "h3"])
    assert human.code == 0
    assert "adaln_proj share" in human.out
    assert "9.25 MiB" in human.out
    assert "24.29 GiB" in human.out
    assert "9,698,304" in human.out


def test_inspect_preset_bench(run_cli: CliRunner) -> None:
    res = run_cli(["inspect", "--preset", "bench", "--json"])
    assert res.code == 0, res.err
    data = json.loads(res.out)
    assert 0.35 <= data["adaln_share"] <= 0.45
    assert data["dtype"] == "float32"
    f32 = data["page_bytes"]
    res = run_cli(["inspect", "--preset", "bench", "--dtype", "bfloat16", "--json"])
    assert json.loads(res.out)["page_bytes"] * 2 == f32


def test_inspect_human_checkpoint(run_cli: CliRunner, tiny_ckpt: Path) -> None:
    res = run_cli(["inspect", tiny_ckpt])
    assert res.code == 0, res.err
    assert "adaln_proj share" in res.out
    assert validate_checkpoint(tiny_ckpt).fingerprint in res.out


@pytest.mark.parametrize("argv", [["inspect"], ["inspect", "DIR", "--preset", "tiny"], ["inspect", "--preset", "huge"]])
def test_inspect_usage_errors(run_cli: CliRunner, tiny_ckpt: Path, argv: list[str]) -> None:
    res = run_cli([str(tiny_ckpt) if a == "DIR" else a for a in argv])
    assert res.code == 2
    assert "error" in res.err


def test_inspect_corrupt_checkpoint(run_cli: CliRunner, tmp_path: Path, tiny_ckpt: Path) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    (root / "config.json").unlink()
    res = run_cli(["inspect", root])
    assert res.code == 2
    assert "config.json" in res.err


# ----------------------------------------------------------------------------- generate-local
def _gen(run_cli: CliRunner, ckpt: Path, *args: Any) -> list[dict[str, Any]]:
    res = run_cli(["generate-local", "--checkpoint", ckpt, *args])
    assert res.code == 0, res.err
    return res.json_lines()


@pytest.mark.parametrize("task", ["t2v", "t2va"])
def test_generate_local_both_modes(run_cli: CliRunner, tiny_ckpt: Path, task: str) -> None:
    args = [*SMALL, "--task", task, "--prompt", "a cat", "--audio-flow-shift", "3", "--request-id", "r1"]
    [resident] = _gen(run_cli, tiny_ckpt, "--adaln-mode", "resident", *args)
    [cached] = _gen(run_cli, tiny_ckpt, "--adaln-mode", "cached", *args)
    for line, mode in ((resident, "resident"), (cached, "cached")):
        assert line["request_id"] == "r1"
        assert line["task"] == task
        assert line["steps"] == 4
        assert line["adaln_mode"] == mode
        assert isinstance(line["sha256"], str) and len(line["sha256"]) == 64
        assert isinstance(line["timings_ms"], dict) and "total" in line["timings_ms"]
        assert line["video_shape"] == [4, 2, 4, 4]
        assert line["audio_shape"] == ([4, 8] if task == "t2va" else None)
    assert "cache" not in resident
    assert set(cached["cache"]) == CACHE_KEYS
    assert cached["cache"]["built_plans"] == 4
    assert cached["sha256"] == resident["sha256"]
    # and equal to the library's result for the same request
    req = GenerationRequest(
        request_id="r1", task=task, prompt="a cat", audio_flow_shift=3.0, steps=4, height=32, width=32, audio_length=8
    )
    assert generate(load_model(tiny_ckpt), req).sha256 == resident["sha256"]


def test_generate_local_default_request_id(run_cli: CliRunner, tiny_ckpt: Path) -> None:
    [line] = _gen(run_cli, tiny_ckpt, *SMALL)
    assert line["request_id"] == "req-0"


def test_generate_local_requests_file_defaults(run_cli: CliRunner, tmp_path: Path, tiny_ckpt: Path) -> None:
    jsonl = tmp_path / "reqs.jsonl"
    lines = [
        {"request_id": "explicit", "steps": 3, "prompt": "a boat"},
        {"request_id": "defaulted", "prompt": "a boat"},  # steps from --steps 3
        {"request_id": "four", "steps": 4, "prompt": "a boat"},
        {"prompt": "a boat", "task": "t2va", "audio_flow_shift": 2.0},  # request_id defaults to req-<index>
    ]
    jsonl.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n" + "\n".join(json.dumps(x) for x in lines[2:]))
    out = _gen(
        run_cli,
        tiny_ckpt,
        "--requests",
        jsonl,
        "--steps",
        "3",
        "--height",
        "32",
        "--width",
        "32",
        "--prompt",
        "ignored default",
        "--adaln-mode",
        "cached",
    )
    assert [x["request_id"] for x in out] == ["explicit", "defaulted", "four", "req-3"]
    by_id = {x["request_id"]: x for x in out}
    assert by_id["defaulted"]["steps"] == 3
    assert by_id["defaulted"]["sha256"] == by_id["explicit"]["sha256"]
    assert by_id["four"]["sha256"] != by_id["explicit"]["sha256"]  # steps does matter
    assert by_id["req-3"]["task"] == "t2va"
    assert by_id["req-3"]["video_shape"] == [4, 2, 4, 4]  # --height/--width defaults applied
    # per-line values beat flags; flag defaults fill the rest
    [single] = _gen(run_cli, tiny_ckpt, "--steps", "3", "--height", "32", "--width", "32", "--prompt", "a boat")
    assert single["sha256"] == by_id["explicit"]["sha256"]


@pytest.mark.parametrize("task", ["t2v", "t2va"])
def test_generate_local_out_files(run_cli: CliRunner, tmp_path: Path, tiny_ckpt: Path, task: str) -> None:
    out_dir = tmp_path / "out"
    jsonl = tmp_path / "reqs.jsonl"
    jsonl.write_text(
        json.dumps({"request_id": "a", "seed": 1}) + "\n" + json.dumps({"request_id": "b.2", "seed": 2}) + "\n"
    )
    lines = _gen(run_cli, tiny_ckpt, *SMALL, "--task", task, "--requests", jsonl, "--out", out_dir)
    assert sorted(p.name for p in out_dir.iterdir()) == ["a.safetensors", "b.2.safetensors"]
    for line in lines:
        path = out_dir / f"{line['request_id']}.safetensors"
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in keys}
        assert keys == ({"video", "audio"} if task == "t2va" else {"video"})
        assert list(tensors["video"].shape) == line["video_shape"]
        assert tensors["video"].dtype == torch.float32
        assert meta["sha256"] == line["sha256"]
        assert latents_sha256(tensors["video"], tensors.get("audio")) == line["sha256"]
        assert json.loads(meta["request_id"]) == line["request_id"]
        assert json.loads(meta["task"]) == task
        assert json.loads(meta["steps"]) == 4
        assert json.loads(meta["seed"]) == (1 if line["request_id"] == "a" else 2)
        assert json.loads(meta["height"]) == 32
    assert lines[0]["sha256"] != lines[1]["sha256"]


def test_generate_local_subprocess(run_cli_proc: CliRunner, run_cli: CliRunner, tiny_ckpt: Path) -> None:
    args = ["generate-local", "--checkpoint", tiny_ckpt, *SMALL, "--adaln-mode", "cached", "--seed", "5"]
    proc = run_cli_proc(args)
    assert proc.code == 0, proc.err
    inproc = run_cli(args)
    assert proc.json_lines()[0]["sha256"] == inproc.json_lines()[0]["sha256"]


def test_version_and_help(run_cli: CliRunner) -> None:
    res = run_cli(["--version"])
    assert res.code == 0 and "ditserve" in res.out
    res = run_cli(["generate-local", "--help"])
    assert res.code == 0 and "--adaln-mode" in res.out


# ----------------------------------------------------------------------------- bad input
# (id, extra argv, JSONL lines or None, expected substrings of the error line)
LONG = "x" * 33  # tiny's text_len is 32 bytes
BAD_INPUT: list[tuple[str, list[str], list[str] | None, list[str]]] = [
    ("steps-0", ["--steps", "0"], None, ["steps", "[1, 1000]"]),
    ("steps-1001", ["--steps", "1001"], None, ["steps", "[1, 1000]", "1001"]),
    ("flow_shift-nan", ["--flow-shift", "nan"], None, ["flow_shift", "(0, 1000]"]),
    ("flow_shift-inf", ["--flow-shift", "inf"], None, ["flow_shift", "(0, 1000]"]),
    ("flow_shift-0", ["--flow-shift", "0"], None, ["flow_shift", "(0, 1000]"]),
    ("flow_shift-neg", ["--flow-shift", "-1"], None, ["flow_shift", "(0, 1000]"]),
    ("audio_flow_shift-nan", ["--task", "t2va", "--audio-flow-shift", "nan"], None, ["audio_flow_shift", "(0, 1000]"]),
    ("task-t2x", ["--task", "t2x"], None, ["task", "t2x", "t2v, t2va"]),
    ("height-65", ["--height", "65"], None, ["height", "multiple of 16", "[16, 64]"]),
    ("height-1024", ["--height", "1024"], None, ["height", "[16, 64]", "1024"]),
    ("width-0", ["--width", "0"], None, ["width", "[16, 64]"]),
    ("frames-6", ["--frames", "6"], None, ["frames", "4*k+1", "[1, 17]"]),
    ("frames-999", ["--frames", "999"], None, ["frames", "[1, 17]", "999"]),
    ("audio_length-0", ["--task", "t2va", "--audio-length", "0"], None, ["audio_length", "[1, 32]"]),
    ("prompt-too-long", ["--prompt", LONG], None, ["prompt", "33 bytes", "32 bytes"]),
    ("prompt-utf8-bytes", ["--prompt", "é" * 17], None, ["prompt", "34 bytes", "32 bytes"]),
    ("negative_prompt-too-long", ["--negative-prompt", LONG], None, ["negative_prompt", "32 bytes"]),
    ("guidance_scale-nan", ["--guidance-scale", "nan"], None, ["guidance_scale", "[0, 100]"]),
    ("seed-neg", ["--seed", "-1"], None, ["seed", "[0, 2^63-1]"]),
    ("request_id-bad", ["--request-id", "a/b"], None, ["request_id"]),
    (
        "jsonl-bad-line",
        [],
        ['{"request_id": "ok1"}', '{"request_id": "bad", "steps": 0}', '{"request_id": "ok2"}'],
        ["steps", "[1, 1000]"],
    ),
    (
        "jsonl-bad-line-last",
        [],
        ['{"request_id": "ok1"}', '{"request_id": "ok2"}', '{"request_id": "bad", "height": 24}'],
        ["height", "[16, 64]"],
    ),
    ("jsonl-unknown-key", [], ['{"request_id": "ok1"}', '{"request_id": "x", "stpes": 4}'], ["stpes", ":2:"]),
    (
        "jsonl-invalid-json",
        [],
        ['{"request_id": "ok1"}', '{"request_id": "x", "steps": 4'],
        ["requests", ":2:", "JSON"],
    ),
    ("jsonl-not-object", [], ['{"request_id": "ok1"}', "[1, 2]"], ["requests", ":2:"]),
    ("jsonl-wrong-type", [], ['{"request_id": "ok1", "steps": "4"}'], ["steps", "type"]),
    (
        "jsonl-duplicate-ids",
        [],
        ['{"request_id": "same"}', '{"request_id": "same", "seed": 2}'],
        ["request_id", "same"],
    ),
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
    argv: list[Any] = ["generate-local", "--checkpoint", tiny_ckpt, "--adaln-mode", mode, *SMALL, "--out", out_dir]
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
    res = run_cli(
        ["generate-local", "--checkpoint", tiny_ckpt, "--requests", tmp_path / "nope.jsonl", "--out", out_dir]
    )
    assert res.code == 2
    assert "requests" in res.err and "nope.jsonl" in res.err
    assert not out_dir.exists()


def test_out_is_a_file(run_cli: CliRunner, tmp_path: Path, tiny_ckpt: Path) -> None:
    target = tmp_path / "out"
    target.write_text("not a directory")
    res = run_cli(["generate-local", "--checkpoint", tiny_ckpt, *SMALL, "--out", target])
    assert res.code == 2, res.err
    msg = _err_line(res.err)
    assert "--out" in msg and str(target) in msg
    assert res.out == ""
    assert target.read_text() == "not a directory"


@pytest.mark.parametrize("mode", ["resident", "cached"])
def test_corrupt_checkpoint_exit_2(run_cli: CliRunner, tmp_path: Path, tiny_ckpt: Path, mode: str) -> None:
    root = copy_ckpt(tiny_ckpt, tmp_path)
    shard = "model-00002-of-00002.safetensors"
    hdr = read_shard_header(root / shard)
    last = max(hdr.tensors, key=lambda n: hdr.tensors[n].end)
    (root / shard).write_bytes((root / shard).read_bytes()[:-64])
    out_dir = tmp_path / "out"
    res = run_cli(["generate-local", "--checkpoint", root, "--adaln-mode", mode, *SMALL, "--out", out_dir])
    assert res.code == 2
    msg = _err_line(res.err)
    assert shard in msg
    assert f"'{last}'" in msg
    assert res.out == ""
    assert not out_dir.exists()
    # inspect reports the same corruption
    res = run_cli(["inspect", root])
    assert res.code == 2 and shard in res.err and last in res.err


def test_missing_checkpoint_exit_2(run_cli: CliRunner, tmp_path: Path) -> None:
    res = run_cli(["generate-local", "--checkpoint", tmp_path / "nope", *SMALL])
    assert res.code == 2
    assert "not found" in res.err


@pytest.mark.parametrize(
    "argv",
    [
        ["generate-local", "--checkpoint", "X", "--adaln-mode", "sideways"],
        ["generate-local", "--checkpoint", "X", "--steps", "four"],
        ["generate-local"],
        ["no-such-command"],
    ],
)
def test_argparse_errors_exit_2(run_cli: CliRunner, tiny_ckpt: Path, argv: list[str]) -> None:
    res = run_cli([str(tiny_ckpt) if a == "X" else a for a in argv])
    assert res.code == 2
    assert "error" in res.err
