"""scripts/gpu_probe.py on the CPU (DITSERVE_GPU_CHECK_DEVICE=cpu): every part runs through the project's code at the
tiny preset's sizes and prints one JSON line saying so, with the released sizes it runs at on an H200; a part past
its cap is a "timeout" line and the probe goes on with the next part."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.processes  # runs scripts/gpu_probe.py

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "scripts" / "gpu_probe.py"


def probe(out: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    res = subprocess.run([sys.executable, str(PROBE), "--out", str(out), *args], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "DITSERVE_GPU_CHECK_DEVICE": "cpu", **env})  # fmt: skip
    records = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    return res, records


def test_every_part_prints_one_json_line_on_the_cpu_at_scaled_sizes(tmp_path: Path) -> None:
    res, records = probe(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert [r["part"] for r in records] == ["slab", "swap", "block", "vae", "rebuild", "disk", "readpath"]
    assert [json.loads(ln) for ln in (tmp_path / "probe.jsonl").read_text().splitlines()] == records
    by = {r["part"]: r for r in records}
    for r in records:
        assert (r["status"], r["device"], r["scaled"]) == ("ok", "cpu", True), r
        assert r["sizes"] != r["full_sizes"]
    # the sizes an H200 runs: the released page (49 x 3 of them) and the released block shape, read from the config
    full_slab = by["slab"]["full_sizes"]
    assert (full_slab["page_numel"], full_slab["page_bytes"], full_slab["slots"], full_slab["width"]) == (
        4_849_152, 9_698_304, 49, 3)  # fmt: skip
    full_block = by["block"]["full_sizes"]
    assert (full_block["hidden"], full_block["heads"], full_block["tokens"]) == (5376, 56, [8192, 32768])
    # slab: read in a second process through SlabMapping, closed there (weak reference expired), freed here
    slab = by["slab"]
    assert slab["pass"] is True and slab["transport"] == "shm"
    assert slab["consumer"]["close_ok"] and slab["consumer"]["weakref_expired"] and slab["consumer"]["read_gbps"] > 0
    assert slab["producer"]["storage_freed"] and slab["producer"]["shm_files_unlinked"]
    # swap: the host tier's fill against a plain copy of the same bytes
    assert by["swap"]["swap_in_gbps"] > 0 and by["swap"]["plain_copy_gbps"] > 0 and by["swap"]["ratio"] > 0
    assert by["swap"]["pinned"] is False  # no CUDA: pageable pages
    # block: native attention runs on the CPU at both token counts; the flash-attn package's backend is not here
    backends = by["block"]["backends"]
    assert all(v["status"] == "ok" and v["ms"] > 0 for v in backends["native"].values())
    assert {v["status"] for v in backends["flash"].values()} <= {"unavailable"}
    assert "native" in by["block"]["usable"]
    # vae: both precisions decoded every frame
    vae = by["vae"]
    assert vae["float32"]["frames"] == vae["bfloat16"]["frames"] == 22
    assert vae["float32"]["per_frame_s"] > 0 and vae["bfloat16"]["per_frame_s"] > 0
    assert 0 < vae["bf16_vs_fp32"]["max_abs_diff"] < 1
    # rebuild: one adaln_proj GEMM against the copy of its weight
    assert by["rebuild"]["gemm_s"] > 0 and by["rebuild"]["copy"]["pageable"]["s"] > 0
    assert "probe: 7 parts on cpu" in res.stdout


def test_a_part_past_its_cap_is_a_timeout_line_and_the_next_part_still_runs(tmp_path: Path) -> None:
    res, records = probe(tmp_path, "--parts", "block,rebuild", DITSERVE_GPU_PROBE_CAP_S="block=0.01")
    assert res.returncode == 1, res.stdout + res.stderr
    assert [(r["part"], r["status"]) for r in records] == [("block", "timeout"), ("rebuild", "ok")], records
    assert "passed its 0.01 s cap" in records[0]["error"]
    assert "not ok: block" in res.stdout.splitlines()[-1]
