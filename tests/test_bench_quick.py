"""`ditserve bench --quick` runs end to end on a tiny MiniMax-H3 repository (so the harness cannot rot) and writes its
outputs. Only the run's structure and its exact effects are asserted, never a timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCENARIOS = {
    "repeat_vs_first_seen", "host_tier", "alternating", "cached_vs_resident",
    "sidecar_overhead", "prepare_latency", "rebuild_efficiency", "rebuild_overlap", "generator_memory",
    "job_overhead", "replica",
}  # fmt: skip


@pytest.mark.e2e
def test_bench_quick_writes_table_json_and_chart(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "ditserve", "bench", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out / "bench.json").read_text())
    assert set(doc) >= SCENARIOS
    for name in SCENARIOS:
        assert {"ratio", "target", "met"} <= set(doc[name]), name
        assert isinstance(doc[name]["met"], bool)
    meta = doc["_meta"]
    assert (meta["preset"], meta["precision"], meta["num_inference_steps"], meta["forwards"]) == ("tiny", "mixed", 8, 7)
    # the quick run still shows the headline effects
    assert doc["alternating"]["rebuilds_after_warmup"]["both_fit"] == 0
    assert doc["alternating"]["rebuilds_after_warmup"]["one_fits_host"] == 0
    assert doc["alternating"]["rebuilds_after_warmup"]["one_fits_no_host"] == 4  # every request after warm-up
    assert doc["alternating"]["sha256_identical"] is True
    assert doc["cached_vs_resident"]["sha256_identical"] is True
    assert doc["job_overhead"]["same_sha256"] is True  # a job's MP4 is Generate's
    replica = doc["replica"]  # a 2-rank replica: its rebuild reads half the plan bytes per rank, pages identical
    assert replica["bytes_read_per_rank_2"] == [replica["bytes_read_1"] // 2] * 2
    assert replica["sharded_pages_identical"] is True and replica["replica_repeat_identical"] is True
    memory = doc["generator_memory"]
    assert memory["met"] is True and memory["ratio"] >= 0.95
    assert memory["cached"]["held_plan_bytes"] == 0
    assert memory["resident"]["held_plan_bytes"] == memory["plan_tensor_bytes"] > 0
    assert memory["cached"]["precision"] == memory["resident"]["precision"] == "mixed"
    # repeat arm: a new 8-point schedule builds its 7 keys (6 once t = 0 is cached); its repeat builds none
    assert [r["cache"]["built_plans"] for r in doc["_requests"] if r["arm"] == "repeat"] == [7, 0, 6, 0]
    tiers = {r["tier"] for r in doc["_requests"]}
    assert {"built", "host", "slot", "resident"} <= tiers
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    for name in SCENARIOS:
        assert name in proc.stdout
