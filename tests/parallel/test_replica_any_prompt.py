"""`ditserve serve --nproc 2` and `--nproc 3` (gloo) serve any prompt: the README's "a red fox" (455 packed rows on
the demo canvas, not a multiple of 2) and 20 seeded random prompts of 1-300 tokens, each as t2va, fl2va and ref2va,
all through one replica start per world size, each result's sha256 that of its oracle (tests/parallel/rankwork.py's
`oracle_digests`, one process group per world size):

- rows that divide by the ranks: diffusers' own context-parallel loop, `ContextParallelConfig(ulysses_degree=N)`;
- rows that do not (diffusers' equal split asserts): diffusers' own loop with `ulysses_anything=True` (its sharder's
  `tensor_split`, its uneven all-to-all) and its one uneven all-gather, which gloo refuses, done by per-rank
  broadcasts at each share's own size (`gather_by_broadcast`). That is diffusers' math and split exactly, moved by a
  transport independent of ditserve's (padding inside an all_gather), so equal bits say the padding never leaks.

3 ranks need a head count that 3 divides (the rule kept at start): the tiny preset with 6 heads.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from distkit import run_ranks
from rankwork import oracle_digests
from refmedia import image_bytes
from servicekit import free_port, is_serving, short_tmpdir, wait_for

from ditcore.presets import PRESETS, _preset
from ditcore.references import Reference
from ditcore.repo import write_repository
from ditserve.client import GeneratorClient

pytestmark = [pytest.mark.e2e, pytest.mark.processes, pytest.mark.timeout(900)]

CANVAS: dict[str, Any] = {"num_inference_steps": 2, "seed": 5, "height": 32, "width": 32, "num_frames": 124}
WORDS = ("a", "red", "fox", "jumps", "over", "the", "lazy", "dog", "in", "snowy", "forest", "at", "dawn", "while",
         "birds", "sing", "softly", "near", "frozen", "river", "banks", "and", "distant", "mountains", "glow")  # fmt: skip
FIRST, LAST = image_bytes(64, 64, seed=11), image_bytes(64, 64, seed=12)
REFERENCE = Reference(image_bytes(80, 48, seed=1))


def prompts(count: int, seed: int) -> list[str]:
    """`count` prompts of 1 to 90 words drawn from WORDS (~3 tokens a word: 1-300 tokens of the tiny tokenizer), seeded."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 90))) for _ in range(count)]


def requests(seed: int) -> list[dict[str, Any]]:
    """ "a red fox" and 20 random prompts, each as t2va, fl2va (first and last frame) and ref2va (an image)."""
    tasks = {"t2va": {}, "fl2va": {"first_frame": FIRST, "last_frame": LAST}, "ref2va": {"references": (REFERENCE,)}}
    return [{**CANVAS, "request_id": f"{task}-{i}", "prompt": prompt, "task": task, **extra}
            for i, prompt in enumerate(["a red fox", *prompts(20, seed)]) for task, extra in tasks.items()]  # fmt: skip


def six_heads(out: Path) -> Path:
    """The tiny preset with 6 attention heads (1, 2, 3 and 6 ranks divide them), released mixed precision."""
    preset = _preset("tiny-h6", heads=6, layers=3, ffn=128, temb=48, text_dim=32,
                     **{k: getattr(PRESETS["tiny"], k) for k in ("canvas_short_edge", "reference_image_short_edge")})  # fmt: skip
    with mock.patch.dict(PRESETS, {"tiny-h6": preset}):
        return write_repository(out, "tiny-h6", seed=0, dtype="mixed", shards=2)


@contextlib.contextmanager
def serve(checkpoint: Path, nproc: int) -> Iterator[str]:
    """`ditserve serve --nproc N --device cpu` on `checkpoint`; yields its target once SERVING."""
    run_dir = short_tmpdir("dsany-")
    port = free_port()
    argv = [sys.executable, "-m", "ditserve", "serve", "--nproc", str(nproc), "--device", "cpu", "--checkpoint",
            str(checkpoint), "--weights-root", str(checkpoint.parent), "--run-dir", str(run_dir), "--port", str(port),
            "--no-metrics", "--gpu-plans", "512"]  # fmt: skip
    proc = subprocess.Popen(argv, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    target = f"127.0.0.1:{port}"
    try:
        wait_for(lambda: is_serving(target), 300, f"the {nproc}-rank replica serving")
        yield target
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.parametrize("nproc", [2, 3])
def test_replica_serves_any_prompt_equal_to_the_oracle(
    nproc: int, tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tiny_ckpt if nproc == 2 else six_heads(tmp_path / "weights" / "h6")
    batch = requests(seed=nproc)
    started = time.monotonic()
    oracle = json.loads((run_ranks(oracle_digests, nproc, (repo, batch, nproc), tmp_path) / "oracle.json").read_text())
    oracle_s = time.monotonic() - started
    assert all(1 <= o["tokens"] <= 300 for o in oracle.values()), sorted(o["tokens"] for o in oracle.values())
    assert {o["rows"] % nproc for o in oracle.values()} == set(range(nproc)), "every remainder of the rows is served"
    assert oracle["t2va-0"]["rows"] == 455  # "a red fox" on the demo canvas
    started = time.monotonic()
    got: dict[str, str] = {}
    with serve(repo, nproc) as target, GeneratorClient(target) as client:
        for request in batch:
            got[request["request_id"]] = client.generate(request, timeout=300).sha256
    served_s = time.monotonic() - started
    wrong = {rid: oracle[rid] for rid, sha in got.items() if sha != oracle[rid]["sha256"]}
    assert not wrong, f"{len(wrong)} of {len(batch)} differ from the oracle: {wrong}"
    with capsys.disabled():
        kinds = {
            k: sum(o["oracle"] == k for o in oracle.values()) for k in ("diffusers", "diffusers-anything-broadcast")
        }
        print(f"\n{nproc} ranks: {len(batch)} requests, oracle {oracle_s:.0f} s, served {served_s:.0f} s, {kinds}")
