"""The multi-rank oracle: ditserve's cached transformer (plans from the sidecar's builder, no adaln_proj) under
ditcore.parallel on 2 gloo ranks is torch.equal, on every rank, to diffusers' own MiniMax-H3 loop run with
`enable_parallelism(ContextParallelConfig(ulysses_degree=2))` on the same repository and request, in float32 and in
the released mixed precision; so is ref2va on the `transformer_ref` partition (diffusers' own ref2va workflow with
that transformer parallelised), for image references and for a video with its soundtrack. A request whose packed
rows do not divide by 2 (reference rows counted), which diffusers' equal split refuses, runs too: equal on every rank
to diffusers' own `ulysses_anything` loop, its one uneven all-gather (which gloo refuses) done by per-rank broadcasts
(rankwork.gather_by_broadcast), so ditserve's padded gather (ditcore.parallel.gather_rows) returns diffusers' bytes.

Against 1 rank (printed, not required): each rank's attention runs on its half of the heads (Ulysses all-to-all)
and every linear layer on its half of the rows, so the GEMMs' M and the kernels' blocking differ from the 1-rank
run and the bits may too (the seed's lesson). Measured here: float32 differs by a few ulp (max |diff| ~4e-6), the
mixed run happens to be equal (bfloat16 rounding absorbs it). What holds at every degree is cached == diffusers'
resident loop at that degree (this test at 2, tests/test_oracle.py at 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from distkit import run_ranks
from oracle import diffusers_request_latents
from rankwork import cp_latents
from refmedia import image_bytes, video_bytes, wav_bytes
from safetensors.torch import load_file

from ditcore.references import Reference

# 32 x 32 x 124 packs 37 video + 414 audio rows; this prompt is 7 text rows: 458, even
EVEN = {"prompt": "a red fox jumps", "num_inference_steps": 4, "seed": 3, "height": 32, "width": 32, "num_frames": 124}
ODD = {**EVEN, "prompt": "a red fox"}  # 4 text rows: 455
# ref2va on 32 x 32 x 124 with these references: even with this prompt (diffusers' own CP loop asserts it too)
REF2VA = {
    "images": {**EVEN, "task": "ref2va", "num_inference_steps": 3, "references": (
        Reference(image_bytes(80, 48, seed=1)), Reference(image_bytes(40, 60, seed=2, fmt="JPEG")))},
    "video_with_audio": {**EVEN, "task": "ref2va", "num_inference_steps": 3, "references": (
        Reference(video_bytes(frames=30, fps=30, audio_rate=32000, seed=3)),)},
}  # fmt: skip
REF2VA_ODD = {
    **EVEN,
    "task": "ref2va",
    "num_inference_steps": 3,
    "references": (Reference(image_bytes(80, 48, seed=1)), Reference(wav_bytes(1.5, 32000, channels=1, seed=5))),
}  # 605 rows

pytestmark = [pytest.mark.timeout(900), pytest.mark.processes]  # the ranks are processes


@pytest.mark.parametrize("precision", ["float32", "mixed"])
def test_two_rank_cached_equals_diffusers_context_parallel(
    precision: str, tiny_ckpt: Path, tiny_ckpt_f32: Path, tmp_path: Path
) -> None:
    repo = tiny_ckpt_f32 if precision == "float32" else tiny_ckpt
    out = run_ranks(cp_latents, 2, (repo, EVEN, 2), tmp_path)
    ranks = [load_file(out / f"rank{r}.safetensors") for r in range(2)]
    for r, got in enumerate(ranks):
        assert torch.equal(got["ditserve_video"], got["diffusers_video"]), f"rank {r} video"
        assert torch.equal(got["ditserve_audio"], got["diffusers_audio"]), f"rank {r} audio"
        assert torch.equal(got["ditserve_video"], ranks[0]["ditserve_video"]), "ranks return the same latents"
    one_video, one_audio = diffusers_request_latents(repo, EVEN)
    assert one_video.shape == ranks[0]["ditserve_video"].shape and one_audio.shape == ranks[0]["ditserve_audio"].shape
    # stated, not required: see the module docstring
    print(f"{precision}: 2-rank == 1-rank video {torch.equal(one_video, ranks[0]['ditserve_video'])}, "
          f"max |diff| {(one_video.float() - ranks[0]['ditserve_video'].float()).abs().max().item():.3g}")  # fmt: skip


@pytest.mark.parametrize(("precision", "case"), [("float32", "images"), ("float32", "video_with_audio"),
                                                 ("mixed", "video_with_audio")])  # fmt: skip
def test_two_rank_cached_ref2va_equals_diffusers_context_parallel(
    precision: str, case: str, tiny_ckpt: Path, tiny_ckpt_f32: Path, tmp_path: Path
) -> None:
    repo = tiny_ckpt_f32 if precision == "float32" else tiny_ckpt
    out = run_ranks(cp_latents, 2, (repo, REF2VA[case], 2), tmp_path)
    ranks = [load_file(out / f"rank{r}.safetensors") for r in range(2)]
    for r, got in enumerate(ranks):
        assert torch.equal(got["ditserve_video"], got["diffusers_video"]), f"rank {r} video"
        assert torch.equal(got["ditserve_audio"], got["diffusers_audio"]), f"rank {r} audio"
        assert torch.equal(got["ditserve_audio"], ranks[0]["ditserve_audio"]), "ranks return the same latents"


@pytest.mark.parametrize("request_", [ODD, REF2VA_ODD], ids=["t2va-455-rows", "ref2va-605-rows"])
def test_rows_that_do_not_split_equal_diffusers_ulysses_anything(
    request_: dict[str, Any], tiny_ckpt_f32: Path, tmp_path: Path
) -> None:
    out = run_ranks(cp_latents, 2, (tiny_ckpt_f32, request_, 2, True), tmp_path)
    ranks = [load_file(out / f"rank{r}.safetensors") for r in range(2)]
    for r, got in enumerate(ranks):
        assert torch.equal(got["ditserve_video"], got["diffusers_video"]), f"rank {r} video"
        assert torch.equal(got["ditserve_audio"], got["diffusers_audio"]), f"rank {r} audio"
        assert torch.equal(got["ditserve_video"], ranks[0]["ditserve_video"]), "ranks return the same latents"
    one_video, one_audio = diffusers_request_latents(tiny_ckpt_f32, request_)  # not vacuous: the 1-rank run, to ulp
    assert torch.allclose(one_video, ranks[0]["ditserve_video"], atol=1e-4)
    assert torch.allclose(one_audio, ranks[0]["ditserve_audio"], atol=1e-4)
