"""The generator's --attention-backend and --decode-dtype (ditcore.model.RunOptions) on real in-process servers and
the CLI: GetStatus reports both, every result's StageTimings names the backend its forwards ran with, a model an
UpdateWeights swaps in runs the same way (resident and cached), and an unknown or unusable backend is refused at start
with the allowed names; `generate-local` takes both flags and prints the backend in its timings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from clikit import CliRunner
from servicekit import REQ_FOX, StartPair, Weights

from ditcore import GenerationRequest, generate, load_model
from ditcore.model import RunOptions
from generator_service.app import build_server
from generator_service.cli import main as generator_main
from generator_service.config import GeneratorConfig

CASES = {
    "resident-math-f32": ("resident", {"attention_backend": "_native_math", "decode_dtype": "float32"}),
    "cached-defaults": ("cached", {}),
}


def local_sha(checkpoint: Path, options: dict[str, Any], req: dict[str, Any]) -> str:
    model = load_model(checkpoint, "resident", options=RunOptions(**options))
    return generate(model, GenerationRequest.from_dict({"request_id": "ref", **req})).sha256


@pytest.mark.parametrize("case", sorted(CASES))
def test_status_and_results_name_the_backend_and_decode_dtype_across_an_update(
    pairs: StartPair, weights: Weights, case: str
) -> None:
    mode, options = CASES[case]
    backend = options.get("attention_backend", "native")  # auto on CPU
    decode_dtype = options.get("decode_dtype", "bfloat16")  # auto: released, for the mixed A and B
    pair = pairs(weights.a, mode=mode, **options)
    for checkpoint, generation in ((weights.a, 1), (weights.b, 2)):
        if generation == 2:
            assert pair.update("B").generation == 2
        st = pair.status()
        assert (st.generation, st.attention_backend, st.decode_dtype) == (generation, backend, decode_dtype)
        r = pair.generate(REQ_FOX)
        assert r.timings.attention_backend == backend
        assert r.sha256 == local_sha(checkpoint, options, REQ_FOX)  # the forwards ran that backend


def test_an_unknown_backend_or_decode_dtype_is_refused_naming_the_allowed_ones(tiny_ckpt: Path) -> None:
    with pytest.raises(ValueError, match=r"--attention-backend: attention backend must be one of auto, .*native"):
        GeneratorConfig(adaln_mode="resident", checkpoint=tiny_ckpt, attention_backend="fastest")
    with pytest.raises(ValueError, match="--decode-dtype must be one of auto, bfloat16, float16, float32"):
        GeneratorConfig(adaln_mode="resident", checkpoint=tiny_ckpt, decode_dtype="float8")


def test_a_backend_that_cannot_run_here_is_refused_at_start_before_any_attach(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Cached mode loads on the first attach; the refusal comes before it (there is no sidecar at all here)."""
    cfg = GeneratorConfig(sidecar=f"unix:{tmp_path / 'none.sock'}", attention_backend="_native_cudnn")
    with pytest.raises(ValueError, match=r"--attention-backend: attention backend '_native_cudnn' does not run on cpu"):
        build_server(cfg)
    code = generator_main(["--sidecar", f"unix:{tmp_path / 'none.sock'}", "--attention-backend", "_native_cudnn"])
    err = capsys.readouterr().err
    assert code == 2 and "does not run on cpu" in err and "usable: auto" in err and "native" in err


def test_generate_local_takes_both_flags_and_prints_the_backend(run_cli: CliRunner, tiny_ckpt: Path) -> None:
    args = ["generate-local", "--checkpoint", tiny_ckpt, "--prompt", "a red fox", "--num-inference-steps", "3"]
    res = run_cli([*args, "--attention-backend", "_native_math", "--decode-dtype", "float32"])
    assert res.code == 0, res.err
    [line] = res.json_lines()
    assert line["timings_ms"]["attention_backend"] == "_native_math"
    req = {"prompt": "a red fox", "num_inference_steps": 3}
    assert line["sha256"] == local_sha(tiny_ckpt, {"attention_backend": "_native_math"}, req)
    refused = run_cli([*args, "--attention-backend", "_native_cudnn"])
    assert refused.code == 2 and "'_native_cudnn' does not run on cpu" in refused.err
    bad = run_cli([*args, "--decode-dtype", "float8"])
    assert bad.code == 2 and "invalid choice: 'float8'" in bad.err
