"""The gpu-tests check of scripts/gpu_check.py: `pytest -m gpu` on the test files that have `gpu` tests, its
summary line, and the lines of the numbers two of those tests record (syncs-per-step, pinned-bytes)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from gpu_check_common import GIB, ROOT, check, left, line

NAMED_TESTS = {  # summary line -> test-name substring in the gpu test run
    "syncs-per-step": "sync",
    "pinned-bytes": "pins_less_than",
}


def gpu_test_files() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.gpu" in p.read_text()
    )


def _case_properties(case: ET.Element) -> dict[str, str]:
    return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}


def gpu_tests(out: Path, cuda: bool) -> None:
    if not cuda:
        for name in ("gpu-tests", *NAMED_TESTS):
            line("SKIP", name, "needs CUDA")
        return
    xml = out / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}",
           "-o", "junit_family=xunit1", *gpu_test_files()]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=left(170))
    cases = list(ET.parse(xml).getroot().iter("testcase")) if xml.exists() else []
    outcome: dict[str, str] = {}
    props: dict[str, dict[str, str]] = {}
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        outcome[name] = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        props[name] = _case_properties(case)
    counts = {k: sum(v == k for v in outcome.values()) for k in ("passed", "failed", "skipped")}
    detail = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    check("gpu-tests", proc.returncode == 0 and counts["failed"] == 0 and counts["passed"] > 0, detail)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    for label, needle in NAMED_TESTS.items():
        hits = {n: o for n, o in outcome.items() if needle in n}
        if not hits:
            line("FAIL", label, f"no gpu test matching {needle!r}")
            continue
        numbers = "; ".join(_numbers(label, props[n]) for n in hits)
        states = ", ".join(f"{n.rsplit('::', 1)[-1]}: {o}" for n, o in hits.items())
        check(label, all(o == "passed" for o in hits.values()), f"{numbers} ({states})")


def _numbers(label: str, props: dict[str, str]) -> str:
    """The numbers a named test recorded, as one readable phrase."""
    if label == "syncs-per-step" and "syncs_per_step" in props:
        rec = json.loads(props["syncs_per_step"])
        cached, resident = rec.get("cached", []), rec.get("resident", [])

        def summary(xs: list[int]) -> str:
            return f"{min(xs)}..{max(xs)} (total {sum(xs)} in {len(xs)} steps)" if xs else "none counted"

        return (f"syncs per step: cached {summary(cached)}, resident {summary(resident)}, in the plan reads "
                f"{rec.get('plan_reads', '?')}; per step cached {cached}")  # fmt: skip
    if label == "pinned-bytes" and "pinned_bytes" in props:
        p = {k: int(v) for k, v in props.items() if v.lstrip("-").isdigit()}
        return (f"pinned {p['pinned_bytes']} of configured {p.get('configured_bytes')} bytes "
                f"({p['pinned_bytes'] / GIB:.3f} GiB; tier {p.get('tier_bytes')}; torch's power-of-two allocator would "
                f"pin {2 ** math.ceil(math.log2(p.get('configured_bytes', 1))) / GIB:.0f} GiB; its own pinned bytes "
                f"grew by {p.get('torch_pinned_allocator_growth_bytes')}; RSS +{p.get('rss_growth_bytes')} bytes)")  # fmt: skip
    return "no numbers recorded"
