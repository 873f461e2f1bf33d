"""Scenario 15: per-request adapters (LoRA) on one cached pair with the host tier (docs/performance.md, docs/adapters.md).

One pair serves a directory of random adapters (`ditcore.adapter_files.write_adapter`, diffusers layout):

- (b) **alternating kinds**: rounds of base / a modulation adapter / a trunk adapter / both composed on one schedule;
  the first round builds (base and the modulation adapter each their own plan set; trunk-only and composed requests
  reuse those), later rounds build nothing. Latency of each adapter kind over the base request's, plans warm.
- (c) **first-seen build**: a new schedule's base plans, then the same schedule's plans of a modulation adapter the
  sidecar has never seen (its factors loaded in the build pass) and of one it has (the same number of plans as the
  base's): the sidecar's rebuild seconds (`CacheReport.rebuild_s`), per plan.
- (a) **a few-step adapter**: a 5-point (4-forward) MP4 request with an adapter on the modulation, time embedder and
  trunk, against the base model's MP4 request of 50 points (20 with --quick); plans warm; the fast request's text
  encode, decode and mux shares (StageTimings `encode_ms`, `decode_ms`, `mux_ms`) of its service time.
- (d) **hot load**: the first request naming a never-loaded trunk adapter against the same request repeated: the
  extra service time, and the extra `encode_ms` (the model loads a request's adapters inside the encode stage).
- (e) **plan bytes at the released shapes** (preset `h3`, bf16 pages; modeled, not measured): a trunk-only adapter
  adds none; a modulation- or time-changing adapter adds one plan set per distinct schedule it is sampled with, as
  large as the base model's set for that schedule (every key of the schedule, its width in pages, times the page).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ditcore import GenerationRequest
from ditcore.plans import PageLayout, PlanKey, distinct_keys
from ditcore.presets import get_preset

from .context import PROMPT, BenchContext
from .harness import Arm, Record, Services

ADAPTERS: dict[str, str] = {  # name -> make-adapter --targets
    "mod": "modulation",  # (b), (c): a modulation adapter
    "trunk": "trunk",  # (b): a trunk adapter
    "few": "all",  # (a): a few-step adapter: modulation, time embedder and trunk
    "mod_first": "modulation",  # (c): never seen before the first-seen build
    "trunk_hot": "trunk",  # (d): never loaded before the hot-load request
}
RANK = 4
KINDS: dict[str, list[str]] = {  # (b)'s request kinds -> their adapters, in order
    "base": [],
    "modulation": ["mod"],
    "trunk": ["trunk"],
    "composed": ["mod", "trunk"],
}
FAST_POINTS = 5
"""The few-step request's sigma points (4 forwards)."""
WARM_RATIO_TARGET = 1.10
"""(b): an adapter request's latency over the base request's, plans warm."""
BUILD_RATIO_TARGET = 1.3
"""(c): a first-seen modulation adapter's rebuild over a first-seen base rebuild of the same schedule, per plan."""
RELEASED = "h3"
MODELED_POINTS = (50, FAST_POINTS)


def write_adapters(ctx: BenchContext) -> Path:
    """The scenario's adapter directory under --out (random factors, seeded by name order; written again each run,
    for the repository served)."""
    from ditcore.adapter_files import write_adapter

    adir = ctx.workdir / "adapters"
    adir.mkdir(exist_ok=True)
    for seed, (name, targets) in enumerate(ADAPTERS.items(), start=1):
        write_adapter(
            adir / f"{name}.safetensors", ctx.checkpoint, targets, "diffusers", rank=RANK, alpha=None, seed=seed
        )
    return adir


def _with(request: dict[str, Any], names: list[str], **fields: Any) -> dict[str, Any]:
    return {**request, **fields, "adapters": [{"name": n, "scale": 1.0} for n in names]}


def _run(ctx: BenchContext, svc: Services, label: str, request: dict[str, Any], rid: str) -> Record:
    rec = svc.run(label, request, f"adapters-{rid}")
    ctx.log(f"    {rec.request_id}: {rec.latency_s:.3f} s, {rec.tier}, {rec.cache}")
    ctx.records.append(rec)
    return rec


def _loaded(svc: Services) -> dict[str, bool]:
    return {a.name: a.loaded for a in svc.generator.list_adapters().adapters}


def adapters(ctx: BenchContext, base_points: int = 50) -> dict[str, Any]:
    """The adapter scenario (module docstring); `base_points`: (a)'s base request's sigma points."""
    t0 = time.perf_counter()
    adir = write_adapters(ctx)
    rounds = max(3, ctx.repeats)  # the first round is the warm-up
    fast_points = min(FAST_POINTS, ctx.num_inference_steps)
    # the slab holds (b), (d) and (c) without evicting (A's base and modulation sets, C's three): every count below is
    # the plans' own; (a)'s sets then evict into the host tier
    gpu_plans = max(5 * ctx.forwards, base_points - 1) + 8
    with ctx.services(Arm("adapters", gpu_plans=gpu_plans, prefetch=False, adapter_dir=adir)) as svc:
        # (b) alternating kinds on schedule A
        runs: dict[str, list[Record]] = {k: [] for k in KINDS}
        for i in range(rounds):
            for kind, names in KINDS.items():
                runs[kind].append(_run(ctx, svc, f"A+{kind}", _with(ctx.request("A"), names), f"{kind}-{i}"))
        # (d) a never-loaded trunk adapter, then the same request again (A's base plans still in slots)
        before = _loaded(svc)
        hot = [_run(ctx, svc, "A+trunk_hot", _with(ctx.request("A"), ["trunk_hot"]), f"hot-{i}") for i in range(2)]
        after = _loaded(svc)
        # (c) first-seen builds of schedule C: base, a seen modulation adapter, a first-seen one
        c_base = _run(ctx, svc, "C", ctx.request("C"), "first-seen-base")
        c_mod = _run(ctx, svc, "C+mod", _with(ctx.request("C"), ["mod"]), "first-seen-mod")
        c_first = _run(ctx, svc, "C+mod_first", _with(ctx.request("C"), ["mod_first"]), "first-seen-mod_first")
        # (a) a few-step adapter request against the base model's long one, both MP4, plans warm
        base_req = {**ctx.request("B"), "num_inference_steps": base_points, "output_type": "mp4"}
        fast_req = _with(ctx.request("B"), ["few"], num_inference_steps=fast_points, output_type="mp4")
        _run(ctx, svc, "B", {**base_req, "output_type": "latents"}, "base-warm")  # its plans
        _run(ctx, svc, "B+few", fast_req, "fast-warm")  # its plans, the adapter loaded, the decoder's first run
        base = _run(ctx, svc, "B", base_req, f"base-{base_points}")
        fast = _run(ctx, svc, "B+few", fast_req, f"fast-{fast_points}")
    out = {
        "alternating": _alternating(runs),
        "first_seen_build": _first_seen(c_base, c_mod, c_first),
        "fast_vs_base": _fast_vs_base(fast, base, fast_points, base_points),
        "hot_load": _hot_load(hot, runs["base"][1:], before, after),
        "plan_bytes": plan_bytes(ctx, runs),
    }
    alt, first = out["alternating"], out["first_seen_build"]
    return {
        "ratio": alt["ratio"],
        "target": f"adapter / base latency, plans warm, max over kinds <= {WARM_RATIO_TARGET}; rebuilds after "
        f"warm-up 0; first-seen modulation adapter's build / base build, per plan <= {BUILD_RATIO_TARGET}",
        "met": bool(alt["met"] and first["met"]),
        **out,
        "adapter_rank": RANK,
        "requests": {"steps": ctx.num_inference_steps, "rounds": rounds, "gpu_plans": gpu_plans, "host_tier": True},
        "seconds": round(time.perf_counter() - t0, 1),  # the scenario's own wall time, its pair's start included
    }


def _service_s(recs: list[Record]) -> float:
    return statistics.median(r.service_s for r in recs)


def _alternating(runs: dict[str, list[Record]]) -> dict[str, Any]:
    warm = {k: rs[1:] for k, rs in runs.items()}
    rebuilds = sum(1 for rs in warm.values() for r in rs if r.cache.built_plans)
    base_s = _service_s(warm["base"])
    ratios = {k: round(_service_s(rs) / base_s, 3) for k, rs in warm.items() if k != "base"}
    worst = max(ratios.values())
    same = {k: len({r.sha256 for r in rs}) == 1 for k, rs in runs.items()}
    distinct = len({rs[0].sha256 for rs in runs.values()}) == len(runs)
    return {
        "ratio": worst, "target": f"rebuilds after warm-up 0; adapter / base latency, plans warm, <= {WARM_RATIO_TARGET}",
        "met": bool(rebuilds == 0 and worst <= WARM_RATIO_TARGET and all(same.values()) and distinct),
        "rebuilds_after_warmup": rebuilds, "latency_ratio": ratios,
        "built_per_request": {k: [r.cache.built_plans for r in rs] for k, rs in runs.items()},
        "tiers": {k: [r.tier for r in rs] for k, rs in runs.items()},
        "warm_service_s": {k: [round(r.service_s, 4) for r in rs] for k, rs in warm.items()},
        "sha256_constant_per_kind": same, "sha256_distinct_across_kinds": distinct,
    }  # fmt: skip


def _per_plan(r: Record) -> float:
    return r.cache.rebuild_s / r.cache.built_plans if r.cache.built_plans else float("nan")


def _first_seen(base: Record, seen: Record, first: Record) -> dict[str, Any]:
    ratio = _per_plan(first) / _per_plan(base)
    return {
        "ratio": round(ratio, 3), "met": ratio <= BUILD_RATIO_TARGET,
        "target": f"first-seen modulation adapter's rebuild / first-seen base rebuild, same schedule, per plan "
        f"<= {BUILD_RATIO_TARGET}",
        "base": {"built_plans": base.cache.built_plans, "rebuild_s": base.cache.rebuild_s},
        "adapter_first_seen": {"built_plans": first.cache.built_plans, "rebuild_s": first.cache.rebuild_s},
        "adapter_seen": {"built_plans": seen.cache.built_plans, "rebuild_s": seen.cache.rebuild_s},
        "total_ratio": round(first.cache.rebuild_s / base.cache.rebuild_s, 3),
        "seen_adapter_ratio": round(seen.cache.rebuild_s / base.cache.rebuild_s, 3),
    }  # fmt: skip


def _fast_vs_base(fast: Record, base: Record, fast_points: int, base_points: int) -> dict[str, Any]:
    ms = fast.service_s * 1000
    share = {s: round(fast.timings_ms.get(f"{s}_ms", 0.0) / ms, 4) for s in ("encode", "decode", "mux", "denoise")}
    return {
        "ratio": round(fast.service_s / base.service_s, 4), "met": None,
        "target": f"reported: {fast_points}-point adapter request / {base_points}-point base request (MP4, plans warm)",
        "fast_points": fast_points, "base_points": base_points,
        "fast_s": round(fast.service_s, 4), "base_s": round(base.service_s, 4), "fast_share": share,
        "fast_timings_ms": {k: v for k, v in fast.timings_ms.items() if isinstance(v, float)},
        "base_timings_ms": {k: v for k, v in base.timings_ms.items() if isinstance(v, float)},
        "fast_built_after_warmup": fast.cache.built_plans, "base_built_after_warmup": base.cache.built_plans,
    }  # fmt: skip


def _hot_load(hot: list[Record], base: list[Record], before: dict[str, bool], after: dict[str, bool]) -> dict[str, Any]:
    first, again = hot
    load_s = first.service_s - again.service_s
    encode_s = (first.timings_ms.get("encode_ms", 0.0) - again.timings_ms.get("encode_ms", 0.0)) / 1000
    base_s = _service_s(base)
    return {
        "ratio": round(load_s / base_s, 4), "met": None,
        "target": "reported: first request with a never-loaded trunk adapter - the same request again, over a warm "
        "base request",
        "load_s": round(load_s, 4), "encode_delta_s": round(encode_s, 4), "base_s": round(base_s, 4),
        "first_s": round(first.service_s, 4), "repeat_s": round(again.service_s, 4),
        "loaded_before": before.get("trunk_hot"), "loaded_after": after.get("trunk_hot"),
        "same_sha256": first.sha256 == again.sha256, "built_plans": [r.cache.built_plans for r in hot],
    }  # fmt: skip


def _set(keys: list[PlanKey], page: int) -> dict[str, int]:
    group = distinct_keys(keys)
    pages = sum(k.width for k in group)
    return {"plan_keys": len(keys), "distinct_plans": len(group), "pages": pages, "bytes": pages * page}


def plan_bytes(ctx: BenchContext, runs: dict[str, list[Record]] | None = None) -> dict[str, Any]:
    """(e): modeled plan bytes per adapter kind at the released shapes (a page of `PageLayout` at preset "h3" in bf16,
    the released projections' dtype) for the released default t2va schedules (flow shifts 12 / 3) of 50 and 5
    points; each schedule's keys from the repository's schedulers (`H3Model.plan_keys`). With `runs` (b's requests),
    also what this run's modulation adapter built first against the distinct plans of its schedule."""
    layout = PageLayout.from_config(get_preset(RELEASED).transformer_kwargs())
    page = layout.page_bytes(torch.bfloat16)
    model = ctx.model()
    sets = {
        str(n): _set(model.plan_keys(GenerationRequest(prompt=PROMPT, num_inference_steps=n)), page)
        for n in MODELED_POINTS
    }
    per_kind = {
        kind: {n: (0 if kind == "trunk" else s["bytes"]) for n, s in sets.items()}
        for kind in ("trunk", "modulation", "time", "modulation+trunk")
    }
    out: dict[str, Any] = {
        "preset": RELEASED, "page_bytes": page, "projection_dtype": "bfloat16", "schedules": sets,
        "added_bytes_per_schedule": per_kind,
        "rule": "trunk-only: 0; modulation/time-changing: one plan set per distinct schedule (and scale), the base set's size",
    }  # fmt: skip
    if runs is not None:
        schedule = distinct_keys(ctx.plan_keys("A"))
        out["run_check"] = {
            "schedule_distinct_plans": len(schedule),
            "modulation_first_built": runs["modulation"][0].cache.built_plans,
            "trunk_built": sum(r.cache.built_plans for r in runs["trunk"]),
        }
    return out


def section(result: dict[str, Any]) -> str:
    """The scenario's numbers, printed after the table."""
    a, b, c = result["fast_vs_base"], result["alternating"], result["first_seen_build"]
    d, e = result["hot_load"], result["plan_bytes"]
    sh = a["fast_share"]
    sets = "; ".join(f"{n}-point {x['distinct_plans']} plans, {x['pages']} pages, {x['bytes']:,} B"
                     for n, x in e["schedules"].items())  # fmt: skip
    lines = [
        "adapters:",
        f"  (a) {a['fast_points']}-point adapter / {a['base_points']}-point base: {a['ratio']} "
        f"({a['fast_s']} s vs {a['base_s']} s); fast request shares: encode {sh['encode']}, decode {sh['decode']}, "
        f"mux {sh['mux']}, denoise {sh['denoise']}",
        f"  (b) rebuilds after warm-up: {b['rebuilds_after_warmup']}; adapter / base, plans warm: "
        + ", ".join(f"{k} {v}" for k, v in b["latency_ratio"].items())
        + f" (max {b['ratio']}, target <= {WARM_RATIO_TARGET}); built per request: {b['built_per_request']}",
        f"  (c) first-seen build per plan, adapter / base: {c['ratio']} (target <= {BUILD_RATIO_TARGET}; "
        f"{c['adapter_first_seen']['built_plans']} plans {c['adapter_first_seen']['rebuild_s']} s vs "
        f"{c['base']['built_plans']} plans {c['base']['rebuild_s']} s; a seen adapter's "
        f"{c['adapter_seen']['built_plans']} plans: {c['seen_adapter_ratio']}x the base)",
        f"  (d) hot load of a trunk adapter: {d['load_s']} s ({d['ratio']}x a base request of {d['base_s']} s; "
        f"encode stage +{d['encode_delta_s']} s)",
        f"  (e) plan bytes at {e['preset']} (page {e['page_bytes']:,} B): {sets}; trunk-only adds 0, a modulation or "
        "time adapter one such set per schedule",
    ]
    return "\n".join(lines)
