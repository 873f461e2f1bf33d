"""A replica on 2 CUDA devices with NCCL (skipped without two): ditserve's cached transformer under context parallel
is torch.equal to its resident one at the same degree, on every rank, in the released mixed precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distkit import run_ranks
from rankwork import cuda_cached_vs_resident
from safetensors.torch import load_file

REQUEST = {
    "prompt": "a red fox jumps",
    "num_inference_steps": 4,
    "seed": 3,
    "height": 32,
    "width": 32,
    "num_frames": 124,
}

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason=f"needs 2 CUDA devices ({torch.cuda.device_count()} visible)"
    ),
]


def test_two_gpu_cached_equals_resident_context_parallel(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = run_ranks(cuda_cached_vs_resident, 2, (tiny_ckpt, REQUEST, 2), tmp_path)
    for r in range(2):
        got = load_file(out / f"rank{r}.safetensors")
        assert torch.equal(got["cached_video"], got["resident_video"]), f"rank {r} video"
        assert torch.equal(got["cached_audio"], got["resident_audio"]), f"rank {r} audio"
