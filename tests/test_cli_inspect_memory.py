"""`ditserve inspect` with a canvas: the modeled memory of each component, the slab, the activation peak, the totals
per process (cached and resident) and the step time at the released maximum canvas on one H200; canvas flags are
validated like a request's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clikit import CliRunner

from ditcore import figures

MAX = ["--height", "768", "--width", "1344", "--num-frames", "345"]
GIB = 1024**3


def test_inspect_h3_at_the_released_maximum_canvas(run_cli: CliRunner) -> None:
    # both partitions and the text encoder named on the device: the totals hold all of it (the defaults: next test)
    named = ["--text-encoder-device", "cuda", "--partitions", "base,ref"]
    res = run_cli(["inspect", "--preset", "h3", *MAX, *named, "--json"])
    assert res.code == 0, res.err
    data = json.loads(res.out)
    assert data["params"]["total"] == 33_122_992_896  # the figures are still there
    m = data["memory"]
    assert (m["canvas"]["height"], m["canvas"]["width"], m["canvas"]["num_frames"]) == (768, 1344, 345)
    assert m["tokens"]["total"] == 102 * 24 * 42 + 2 * 575 + 256 == 104_222
    weights = {(w["name"], w["variant"]): w["bytes"] for w in m["weights"]}
    assert set(weights) == {
        ("transformer", "resident"), ("transformer", "cached"), ("text_encoder", "whole"),
        ("text_encoder", "51 layers, no lm_head"), ("vae", "bfloat16"), ("audio_vae", "float32"),
    }  # fmt: skip
    assert m["slab_bytes"] == 128 * 4 * m["page_bytes"] and m["page_bytes"] == 9_698_304
    assert m["placement"]["partitions"] == 2  # the released repository: transformer/ and transformer_ref/
    act = m["activations"]
    assert act["peak"] == max(act["step"], act["text"], act["decode"]) == act["step"]
    for mode, transformer in (("cached", "cached"), ("resident", "resident")):
        total = m["totals"][mode]
        held = 2 * weights["transformer", transformer] + weights["text_encoder", "51 layers, no lm_head"]
        held += weights["vae", "bfloat16"] + weights["audio_vae", "float32"]
        assert total["generator"] == held + act["peak"]
        assert total["device"] == total["generator"] + total["sidecar"]
        assert total["free"] == m["device"]["memory_bytes"] - total["device"] < 0  # two partitions: over one H200
        one = total["device"] - weights["transformer", transformer]  # one partition's server
        assert total["separate"] == 2 * one  # two one-partition servers, on two devices
    one_partition = json.loads(run_cli(["inspect", "--preset", "h3", *MAX, "--partitions", "base", "--json"]).out)
    for mode in ("cached", "resident"):  # one partition fits one H200, as before
        assert one_partition["memory"]["totals"][mode]["free"] > 0
    te_cpu = json.loads(run_cli(["inspect", "--preset", "h3", *MAX, "--text-encoder-device", "cpu", "--json"]).out)
    assert te_cpu["memory"]["totals"]["cached"]["free"] > 0  # both partitions cached, the text encoder on the CPU
    assert m["totals"]["cached"]["sidecar"] == m["slab_bytes"] + m["rebuild_bytes"]
    assert 32 <= m["step_s"] <= 50  # the estimate for one H200
    assert m["request_s"] == pytest.approx(m["encode_s"] + 49 * m["step_s"] + m["decode_s"])

    assert m["choice"]["cached"]["fits"] is False  # named: refused at start, naming what would fit
    for fix in ("--text-encoder-device cpu", "--text-encoder-offload", "--partitions base"):
        assert fix in m["choice"]["cached"]["refusal"], fix

    human = run_cli(["inspect", "--preset", "h3", *MAX, *named])
    assert human.code == 0, human.err
    for part in ("memory model", "104,222 (video 102,816, condition 0, audio 1,150, text 256)",
                 "transformer (cached)", "text_encoder (51 layers, no lm_head)", "slab", "128 x 4 pages of 9.25 MiB",
                 "transformer (cached) x 2", "vs 2 one-partition",
                 "activations", "peak (denoise step)", "total cached", "total resident", "step time",
                 "% attention", "request time"):  # fmt: skip
        assert part in human.out, part


def test_inspect_at_the_defaults_fits_one_h200_and_shows_the_placement(run_cli: CliRunner) -> None:
    """Issue 33's done-when: the released checkpoint at the maximum canvas, every flag at its default, FITS one H200:
    both partitions cached, the text encoder offloaded (on the device it does not fit: 152 GiB)."""
    data = json.loads(run_cli(["inspect", "--preset", "h3", *MAX, "--json"]).out)["memory"]
    cached = data["choice"]["cached"]
    assert (cached["text_encoder"], cached["partitions"], cached["fits"]) == ("offload", ["base", "ref"], True)
    assert cached["free_bytes"] == 139 * GIB and 34 * GIB < cached["left_bytes"] < 35 * GIB  # 104.69 GiB held
    assert data["totals"]["cached"]["free"] == cached["left_bytes"]  # the totals are the cached choice's
    resident = data["choice"]["resident"]  # resident: both partitions fit nowhere; base with the encoder on it
    assert (resident["text_encoder"], resident["partitions"], resident["fits"]) == ("device", ["base"], True)
    human = run_cli(["inspect", "--preset", "h3", *MAX])
    assert human.code == 0, human.err
    for part in ("placement cached", "text encoder offload, partitions base,ref, 1 rank(s)", "FITS, 34.31 GiB left",
                 "rank 0: 104.69 GiB", "placement resident"):  # fmt: skip
        assert part in human.out, part
    assert "DOES NOT FIT" not in human.out.split("placement cached")[1].split("placement resident")[0]


@pytest.mark.parametrize(
    ("layout", "ranks"), [(["--ulysses-degree", "4"], 4), (["--ulysses-degree", "8", "--ring-degree", "2"], 16)]
)
def test_inspect_at_the_defaults_fits_a_replica_per_rank(run_cli: CliRunner, layout: list[str], ranks: int) -> None:
    data = json.loads(run_cli(["inspect", "--preset", "h3", *MAX, *layout, "--json"]).out)["memory"]
    cached = data["choice"]["cached"]
    assert (cached["text_encoder"], cached["partitions"], cached["fits"]) == ("offload", ["base", "ref"], True)
    rank0, others = cached["ranks"]
    assert (rank0["ranks"], others["ranks"]) == ("0", f"1..{ranks - 1}")
    assert others["items"]["text_encoder"] == 0 and others["bytes"] < rank0["bytes"] <= 139 * GIB


def test_inspect_options_change_the_model(run_cli: CliRunner) -> None:
    named = ["--text-encoder-device", "cuda", "--partitions", "base,ref"]
    base = json.loads(run_cli(["inspect", "--preset", "h3", *MAX, *named, "--json"]).out)["memory"]
    whole = run_cli(["inspect", "--preset", "h3", *MAX, *named, "--text-encoder", "whole", "--gpu-plans", "64",
                     "--json"])  # fmt: skip
    other = json.loads(whole.out)["memory"]
    grew = other["totals"]["cached"]["generator"] - base["totals"]["cached"]["generator"]
    assert 13 * GIB < grew < 14 * GIB  # the 13 layers above 51 and lm_head, plus 52 -> 65 kept hidden states
    assert other["slab_bytes"] * 2 == base["slab_bytes"]
    host = run_cli(["inspect", "--preset", "h3", *MAX, "--text-encoder-device", "cpu", "--json"])
    trimmed = next(w["bytes"] for w in base["weights"] if w["variant"] == "51 layers, no lm_head")
    freed = base["totals"]["resident"]["generator"] - json.loads(host.out)["memory"]["totals"]["resident"]["generator"]
    assert freed == trimmed  # its activations (the peak is a denoise step's) stay what they were
    latents = json.loads(run_cli(["inspect", "--preset", "h3", "--num-frames", "124", "--latents", "--json"]).out)
    assert latents["memory"]["activations"]["decode"] == 0 and latents["memory"]["canvas"]["height"] == 768


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["--height", "770"], ["height", "multiple of 32"]),
        (["--num-frames", "346"], ["num_frames", "17n + 5"]),
        (["--height", "256", "--width", "1344"], ["width", "aspect ratio"]),
        (["--height", "4128"], ["height", "[32, 4096]"]),
        (["--keyframes", "3", "--height", "768"], ["--keyframes", "0, 1 or 2"]),
        (["--prompt-tokens", "0", "--height", "768"], ["--prompt-tokens", "[1, 16384]"]),
        (["--device-class", "tpu", "--height", "768"], ["--device-class", "invalid choice"]),
        (["--attention-backend", "fastest", "--height", "768"], ["attention backend must be one of", "_native_math"]),
        (["--decode-dtype", "int8", "--height", "768"], ["--decode-dtype", "invalid choice"]),
    ],
)
def test_inspect_canvas_flags_are_validated_like_requests(
    run_cli: CliRunner, argv: list[str], expect: list[str]
) -> None:
    res = run_cli(["inspect", "--preset", "h3", *argv])
    assert res.code == 2 and res.out == "", (res.code, res.out)
    for part in expect:
        assert part in res.err, (part, res.err)


def test_inspect_a_repository_at_a_canvas(run_cli: CliRunner, tiny_ckpt: Path) -> None:
    res = run_cli(["inspect", str(tiny_ckpt), "--height", "64", "--width", "96", "--num-frames", "141", "--json"])
    assert res.code == 0, res.err
    m = json.loads(res.out)["memory"]
    weights = {(w["name"], w["variant"]): w for w in m["weights"]}
    assert weights["transformer", "resident"]["params"] == figures("tiny").params  # the repository's own config
    assert m["tokens"]["video"] == 42 * 2 * 3  # 141 frames -> 42 latent frames of (64 / 32) x (96 / 32) rows
