"""The benchmark's in-process parts: its requests and schedules, the baselines it measures against, the memory row's
arithmetic and the report. No timing is asserted (timings are the benchmark's output, not a test's)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ditcore import GenerationRequest, load_model, validate_checkpoint
from ditcore.report import CacheReport
from ditserve.bench import context, report, scenarios
from ditserve.bench.harness import Record, tier_of
from ditserve.bench.measure import PROC_FIELDS, memcpy_bandwidth, process_memory, read_plan_tensors_seconds
from protos.ditserve.generator.v1 import generator_pb2 as pb


def _ctx(ckpt: Path, tmp_path: Path, steps: int = 8) -> context.BenchContext:
    return context.BenchContext(
        checkpoint=ckpt, num_inference_steps=steps, device="cpu", threads=1, workdir=tmp_path,
        repeats=2, records=[], log=lambda m: None,
    )  # fmt: skip


def test_requests_are_valid_h3_requests_with_one_key_per_forward(tiny_ckpt: Path, tmp_path: Path) -> None:
    ctx = _ctx(tiny_ckpt, tmp_path)
    assert ctx.forwards == 7
    keys = {}
    for label in context.SCHEDULES:
        req = ctx.generation_request(label, f"r-{label}").validate()
        assert req.task == "t2va" and req.num_inference_steps == 8
        assert GenerationRequest.from_dict({**ctx.request(label), "request_id": f"r-{label}"}) == req
        keys[label] = ctx.plan_keys(label)
        assert len(keys[label]) == ctx.forwards == len(set(keys[label]))
        assert keys[label][0].width == 1 and all(k.width == 2 for k in keys[label][1:])
    # schedules share only the first step's key (t = 0): a new schedule builds forwards - 1 plans
    labels = list(keys)
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            assert set(keys[a]) & set(keys[b]) == {keys[a][0]}, (a, b)


def test_read_plan_tensors_baseline_and_memcpy(tiny_ckpt: Path) -> None:
    info = validate_checkpoint(tiny_ckpt)
    assert read_plan_tensors_seconds(info) > 0
    assert memcpy_bandwidth(1 << 20) > 0


def test_process_memory_reads_proc_status() -> None:
    mem = process_memory(os.getpid())
    assert set(mem) == set(PROC_FIELDS)
    assert mem["VmRSS"] > 0 and mem["VmHWM"] >= mem["VmRSS"]
    assert mem["RssAnon"] + mem["RssFile"] + mem["RssShmem"] == mem["VmRSS"]


def test_a_cached_model_holds_none_of_the_plan_tensor_bytes(tiny_ckpt: Path) -> None:
    """The ground truth of the memory row, in process: both modes on one repository."""
    info = validate_checkpoint(tiny_ckpt)
    resident, cached = load_model(info, "resident").memory(), load_model(info, "cached").memory()
    # both partitions (transformer/, transformer_ref/: the same layout) are loaded
    assert resident.plan_tensor_bytes == cached.plan_tensor_bytes == 2 * info.layout.plan_tensor_bytes(torch.bfloat16)
    assert resident.held_plan_bytes == resident.plan_tensor_bytes and cached.held_plan_bytes == 0
    saved = resident.transformer_bytes - cached.transformer_bytes
    assert saved / resident.plan_tensor_bytes >= scenarios.MEMORY_TARGET


class _FakeServices:
    """What generator_memory reads from a running pair: GetStatus and /proc."""

    def __init__(self, status: pb.GetStatusResponse, procs: dict[str, dict[str, int]]) -> None:
        self._status, self._procs = status, procs

    def status(self) -> pb.GetStatusResponse:
        return self._status

    def process_memory(self) -> dict[str, dict[str, int]]:
        return self._procs


def _status(transformer: int, held: int, plan: int, slab: bool) -> pb.GetStatusResponse:
    mem = pb.ModelMemory(
        transformer_bytes=transformer, plan_tensor_bytes=plan, held_plan_bytes=held, saved_bytes=plan - held,
        saved_fraction=(plan - held) / plan,
    )  # fmt: skip
    st = pb.GetStatusResponse(memory=mem, model_preset="tiny", precision="mixed")
    if slab:
        st.slab.CopyFrom(pb.SlabGeometry(num_slots=10, width=2, page_bytes=100))
    return st


def _proc(anon: int, shmem: int = 0) -> dict[str, int]:
    return {"VmRSS": anon + 10 + shmem, "VmHWM": anon + 20 + shmem, "RssAnon": anon, "RssFile": 10, "RssShmem": shmem}


def test_generator_memory_row() -> None:
    # the slab the cached generator maps (shared memory) is not its own
    cached = _FakeServices(_status(600, 0, 400, slab=True), {"sidecar": _proc(50), "generator": _proc(1000, 2000)})
    resident = _FakeServices(_status(1000, 400, 400, slab=False), {"generator": _proc(1390)})
    row = scenarios.generator_memory(cached, resident)  # type: ignore[arg-type]
    assert row["ratio"] == 1.0 and row["met"] is True
    assert row["saved_bytes"] == 400 and row["plan_tensor_bytes"] == 400
    assert row["rss_saved_bytes"] == 390 and row["rss_saved_over_plan_bytes"] == 0.975
    assert row["sidecar_slab_bytes"] == 2000
    assert row["cached"]["held_plan_bytes"] == 0 and row["resident"]["precision"] == "mixed"
    # a cached generator that still holds plan bytes misses the target
    leaky = _FakeServices(_status(900, 300, 400, slab=True), {"sidecar": _proc(50), "generator": _proc(1300)})
    row = scenarios.generator_memory(leaky, resident)  # type: ignore[arg-type]
    assert row["ratio"] == 0.25 and row["met"] is False


def _record(arm: str, tier: str, built: int = 0, host: int = 0) -> Record:
    cache = CacheReport(built_plans=built, host_hit_plans=host)
    timings = {"queue_ms": 1.0, "prepare_ms": 2.0, "encode_ms": 3.0, "denoise_ms": 40.0}
    return Record(arm, "A", f"{arm}-0", 0.05, "0" * 64, 0, timings, cache, tier)


def test_tiers_table_json_and_chart(tmp_path: Path) -> None:
    assert tier_of(CacheReport(built_plans=3), "cached") == "built"
    assert tier_of(CacheReport(host_hit_plans=3), "cached") == "host"
    assert tier_of(CacheReport(gpu_hit_plans=3), "cached") == "slot"
    assert tier_of(CacheReport(), "resident") == "resident"
    results: dict[str, dict[str, Any]] = {
        "generator_memory": {"ratio": 1.0, "target": "t", "met": True},
        "rebuild_efficiency": {"ratio": 9.5, "target": "u", "met": False},
    }
    text = report.table(results)
    lines = text.splitlines()
    assert lines[0].split() == ["scenario", "ratio", "target", "met"]
    assert "generator_memory" in lines[2] and lines[2].rstrip().endswith("yes")
    assert lines[3].rstrip().endswith("NO")
    records = [_record("a", "built", built=7), _record("a", "host", host=6), _record("r", "resident")]
    report.write_json(tmp_path / "bench.json", results, records, {"preset": "tiny"})
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["_meta"] == {"preset": "tiny"} and [r["tier"] for r in doc["_requests"]] == ["built", "host", "resident"]
    report.chart(tmp_path / "bench.png", records)
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_flags_default_to_the_bench_preset_in_mixed_precision() -> None:
    import argparse

    from ditserve.bench.runner import add_bench_flags

    p = argparse.ArgumentParser()
    add_bench_flags(p)
    args = p.parse_args([])
    assert (args.preset, args.dtype, args.num_inference_steps, args.quick) == (None, "mixed", None, False)
    args = p.parse_args(["--quick", "--num-inference-steps", "5", "--dtype", "float32"])
    assert (args.quick, args.num_inference_steps, args.dtype) == (True, 5, "float32")
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", "bfloat16"])


def test_cache_core_bench_runs_on_tiny(tiny_ckpt: Path) -> None:
    """tests/bench/bench_plancache.py's run (the cache core alone): A is swapped back in from the host tier."""
    from .bench_plancache import run

    out = run(tiny_ckpt, num_inference_steps=6, prepares=3)
    assert out["plan_keys"] == 5 and out["precision"] == "mixed"
    assert out["swap_in_bytes"] == 4 * 2 * validate_checkpoint(tiny_ckpt).layout.page_bytes(torch.bfloat16)


def test_adapter_plan_bytes_are_modeled_at_the_released_shapes(tiny_ckpt: Path, tmp_path: Path) -> None:
    """(e) of the adapters scenario: a trunk-only adapter adds no plan bytes; a modulation or time adapter adds one
    set per schedule, the base set's size: every distinct key's pages (the first step 1 wide, the rest 2: the
    released default shifts 12 / 3 differ) of a 9,698,304-byte page (PageLayout's docstring)."""
    from ditserve.bench.adapters import plan_bytes

    out = plan_bytes(_ctx(tiny_ckpt, tmp_path))
    assert (out["preset"], out["page_bytes"], out["projection_dtype"]) == ("h3", 9_698_304, "bfloat16")
    assert out["schedules"] == {
        "50": {"plan_keys": 49, "distinct_plans": 49, "pages": 97, "bytes": 97 * 9_698_304},
        "5": {"plan_keys": 4, "distinct_plans": 4, "pages": 7, "bytes": 7 * 9_698_304},
    }
    added = out["added_bytes_per_schedule"]
    assert added["trunk"] == {"50": 0, "5": 0}
    for kind in ("modulation", "time", "modulation+trunk"):
        assert added[kind] == {"50": 97 * 9_698_304, "5": 7 * 9_698_304}, kind
    assert "run_check" not in out


def test_the_table_shows_a_scenarios_parts_and_numbers_without_a_target() -> None:
    results: dict[str, dict[str, Any]] = {
        "adapters": {"ratio": 1.05, "target": "t", "met": True, "plan_bytes": {"page_bytes": 1},
                     "fast_vs_base": {"ratio": 0.2, "target": "reported", "met": None},
                     "first_seen_build": {"ratio": 1.4, "target": "<= 1.3", "met": False}},
    }  # fmt: skip
    lines = report.table(results).splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["adapters", "adapters.fast_vs_base", "adapters.first_seen_build"]
    assert [line.split()[-1] for line in lines[2:]] == ["yes", "-", "NO"]


def test_plain_read_and_page_cache_drop(tiny_ckpt: Path) -> None:
    from ditserve.bench.measure import drop_page_cache, plain_read_seconds

    shard = sorted((tiny_ckpt / "transformer").glob("*.safetensors"))[0]
    assert plain_read_seconds([(str(shard), 8, 4096), (str(shard), 0, 8)], chunk_bytes=1024) > 0
    assert drop_page_cache([str(shard)]) in {"fadvise", "drop_caches", "none"}


def test_read_path_scenario_reports_bits_and_bytes(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Scenario 16's exact effects (never its timings): the streamed pages are the per-tensor path's, every plan
    byte is read once per pass, the swap-in moves every page of the schedule's plans."""
    from ditserve.bench.read_path import read_path

    ctx = _ctx(tiny_ckpt, tmp_path)
    out = read_path(ctx, rounds=1)
    info = validate_checkpoint(tiny_ckpt)
    keys = ctx.plan_keys("A")[1:]
    assert out["bit_exact"] is True and isinstance(out["met"], bool)
    assert out["plan_tensor_bytes"] == info.layout.plan_tensor_bytes(info.projection_dtype)
    assert out["reads"] == info.layout.num_layers + 1 and out["plans"] == len(keys)
    assert {"ratio", "target", "met", "method"} <= set(out["cold"])
    swap = out["swap_in"]
    assert swap["bytes"] == sum(k.width for k in keys) * info.layout.page_bytes(info.projection_dtype)
    assert {"ratio", "target", "met"} <= set(swap)


def test_restart_from_disk_reads_every_plan_back_bit_for_bit(tiny_ckpt: Path, tmp_path: Path) -> None:
    from ditserve.bench.disk_tier import restart_from_disk

    row = restart_from_disk(_ctx(tiny_ckpt, tmp_path))
    assert row["after_restart"]["disk_hit_plans"] == row["plans"] > 0 and row["after_restart"]["built_plans"] == 0
    assert row["first"]["built_plans"] == row["plans"] == row["first"]["disk_stored_plans"]
    assert row["pages_identical"] is True and isinstance(row["met"], bool)
