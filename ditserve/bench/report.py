"""Benchmark output: the table, bench.json and the per-request chart (PNG)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .harness import Record

STAGES = ("queue_ms", "prepare_ms", "encode_ms", "denoise_ms")
TIER_COLORS = {"built": "#d62728", "host": "#ff7f0e", "slot": "#2ca02c", "resident": "#1f77b4"}


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [("scenario", "ratio", "target", "met")]
    for name, r in results.items():
        rows.append((name, str(r["ratio"]), str(r["target"]), _met(r["met"])))
        # a scenario's parts with their own ratio and target (e.g. adapters' fast_vs_base), one row each
        rows += [(f"  {name}.{k}", str(v["ratio"]), str(v["target"]), _met(v.get("met")))
                 for k, v in r.items() if isinstance(v, dict) and {"ratio", "target"} <= set(v)]  # fmt: skip
    w = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(row)) for row in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def _met(met: bool | None) -> str:
    """yes / NO, or "-" for a number that is reported without a target."""
    return "-" if met is None else "yes" if met else "NO"


def write_json(path: Path, results: dict[str, Any], records: list[Record], meta: dict[str, Any]) -> None:
    doc = {**results, "_meta": meta, "_requests": [r.to_dict() for r in records]}
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def chart(path: Path, records: list[Record]) -> None:
    """Per-request latency by stage (stacked), colored edge = cache tier, grouped by arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 0.42 * len(records) + 2), 5.5))
    colors = {"queue_ms": "#c7c7c7", "prepare_ms": "#9467bd", "encode_ms": "#8c564b", "denoise_ms": "#17becf"}
    labels = []
    for i, r in enumerate(records):
        bottom = 0.0
        for s in STAGES:
            v = r.timings_ms.get(s, 0.0) / 1000
            ax.bar(i, v, bottom=bottom, color=colors[s], label=s if i == 0 else None, width=0.8)
            bottom += v
        other = max(0.0, r.latency_s - bottom)
        ax.bar(
            i,
            other,
            bottom=bottom,
            color="#ffffff",
            edgecolor="#999999",
            label="other (rpc, transfer)" if i == 0 else None,
            width=0.8,
        )
        ax.text(
            i,
            r.latency_s,
            r.tier,
            ha="center",
            va="bottom",
            fontsize=7,
            rotation=90,
            color=TIER_COLORS.get(r.tier, "k"),
        )
        labels.append(f"{r.arm}:{r.label}")
    ax.set_xticks(range(len(records)))
    ax.set_xticklabels(labels, rotation=75, fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title("ditserve bench: per-request latency by stage; label = cache tier (built / host / slot / resident)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
