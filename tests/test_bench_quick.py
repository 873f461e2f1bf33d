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
    "job_overhead", "replica", "adapters", "read_path", "restart_from_disk", "quality_levels",
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
    read = doc["read_path"]  # the streamed rebuild's pages are the per-tensor path's; every plan byte read once
    assert read["bit_exact"] is True and read["plan_tensor_bytes"] == doc["rebuild_efficiency"]["plan_tensor_bytes"]
    memory = doc["generator_memory"]
    assert memory["met"] is True and memory["ratio"] >= 0.95
    assert memory["cached"]["held_plan_bytes"] == 0
    assert memory["resident"]["held_plan_bytes"] == memory["plan_tensor_bytes"] > 0
    assert memory["cached"]["precision"] == memory["resident"]["precision"] == "mixed"
    # repeat arm: a new 8-point schedule builds its 7 keys (6 once t = 0 is cached); its repeat builds none
    assert [r["cache"]["built_plans"] for r in doc["_requests"] if r["arm"] == "repeat"] == [7, 0, 6, 0]
    # adapters (one cached pair with the host tier): base and a modulation adapter build their own 7 plans in the
    # first round; trunk-only and composed (modulation + trunk: the modulation adapter's plans) requests build none;
    # later rounds build nothing; each kind's output is its own and constant
    adapters = doc["adapters"]
    alt = adapters["alternating"]
    assert alt["rebuilds_after_warmup"] == 0
    assert alt["built_per_request"] == {"base": [7, 0, 0], "modulation": [7, 0, 0], "trunk": [0, 0, 0],
                                        "composed": [0, 0, 0]}  # fmt: skip
    assert all(alt["sha256_constant_per_kind"].values()) and alt["sha256_distinct_across_kinds"] is True
    assert set(alt["latency_ratio"]) == {"modulation", "trunk", "composed"}
    adapter_reqs = [r for r in doc["_requests"] if r["arm"] == "adapters"]
    for kind in ("base", "modulation", "trunk", "composed"):
        shas = {r["sha256"] for r in adapter_reqs if r["label"] == f"A+{kind}"}
        assert len(shas) == 1, kind  # every response equals its own kind's first
    # a new schedule: base builds all but t = 0, a seen modulation adapter as many, a first-seen one every key
    first = adapters["first_seen_build"]
    assert (first["base"]["built_plans"], first["adapter_seen"]["built_plans"]) == (6, 6)
    assert first["adapter_first_seen"]["built_plans"] == 7
    fast = adapters["fast_vs_base"]  # a 5-point few-step adapter MP4 against the 20-point base MP4, plans warm
    assert (fast["fast_points"], fast["base_points"]) == (5, 20)
    assert fast["fast_built_after_warmup"] == fast["base_built_after_warmup"] == 0
    hot = adapters["hot_load"]  # a trunk adapter loads on its first request; builds no plan; same output again
    assert (hot["loaded_before"], hot["loaded_after"], hot["same_sha256"]) == (False, True, True)
    assert hot["built_plans"] == [0, 0]
    assert sum(r["cache"]["built_plans"] for r in adapter_reqs if "trunk" in r["label"].split("+")[-1]) == 0
    plan_bytes = adapters["plan_bytes"]  # released shapes: 50 points 49 keys, 5 points 4; trunk-only adds nothing
    assert plan_bytes["page_bytes"] == 9_698_304
    sets = plan_bytes["schedules"]
    assert (sets["50"]["plan_keys"], sets["5"]["plan_keys"]) == (49, 4)
    assert plan_bytes["added_bytes_per_schedule"]["trunk"] == {"50": 0, "5": 0}
    assert plan_bytes["added_bytes_per_schedule"]["modulation"] == {n: s["bytes"] for n, s in sets.items()}
    assert plan_bytes["run_check"]["modulation_first_built"] == plan_bytes["run_check"]["schedule_distinct_plans"] == 7
    assert "adapters:" in proc.stdout and "(e) plan bytes at h3" in proc.stdout
    quality = doc["quality_levels"]  # lossy levels that skip blocks; their hooks gone after (lossless bits again)
    assert quality["lossless_after_equal"] is True and quality["most_skipped"]["skipped_fraction"] > 0
    assert all(0 <= lv["skipped_fraction"] < 1 for lv in quality["levels"])
    restart = doc["restart_from_disk"]  # every plan of the schedule read back from disk, bit for bit
    assert (
        restart["after_restart"]["disk_hit_plans"] == restart["plans"] and restart["after_restart"]["built_plans"] == 0
    )
    assert restart["first"]["disk_stored_plans"] == restart["plans"] and restart["pages_identical"] is True
    tiers = {r["tier"] for r in doc["_requests"]}
    assert {"built", "host", "slot", "resident"} <= tiers
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    for name in SCENARIOS:
        assert name in proc.stdout
