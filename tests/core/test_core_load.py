"""The cached load never reads nor allocates a plan tensor and never builds the full transformer, measured on the
`small` preset in fresh processes (tests/core/load_probe.py: spies on every safetensors read, on
MiniMaxH3Transformer3DModel.from_pretrained and construction; peak RSS). The same spies trip on the resident load,
which loads the plan tensors by design: they can fail."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ditcore.checkpoint_files import read_shard_header
from ditcore.plans import is_plan_tensor
from ditcore.presets import get_preset
from ditcore.repo import write_repository

pytestmark = pytest.mark.processes  # a fresh interpreter measures the load

PROBE = Path(__file__).with_name("load_probe.py")
MODES = ("cached", "resident")


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small preset in the released mixed precision, two transformer shards."""
    return write_repository(tmp_path_factory.mktemp("load") / "small", "small", seed=0, dtype="mixed", shards=2)


@pytest.fixture(scope="module")
def measured(small: Path) -> dict[str, dict[str, Any]]:
    """One probe process per mode, run side by side."""
    procs = {
        mode: subprocess.Popen(
            [sys.executable, str(PROBE), str(small), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for mode in MODES
    }
    out = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-4000:]
        out[mode] = json.loads(stdout.strip().splitlines()[-1])
    return out


def stored_bytes(repo: Path, component: str) -> dict[str, int]:
    """Tensor name -> stored bytes, from the component's safetensors headers (no data read)."""
    sizes: dict[str, int] = {}
    for shard in sorted((repo / component).glob("*.safetensors")):
        sizes.update({n: e.end - e.begin for n, e in read_shard_header(shard).tensors.items()})
    return sizes


def test_cached_load_reads_no_plan_byte_and_never_builds_the_full_transformer(
    measured: dict[str, dict[str, Any]], small: Path
) -> None:
    cached, resident = measured["cached"], measured["resident"]
    stored = stored_bytes(small, "transformer")
    plan = {n: b for n, b in stored.items() if is_plan_tensor(n)}
    assert len(plan) == 2 * (get_preset("small").num_layers + 1)
    ref = stored_bytes(small, "transformer_ref")  # the second partition, loaded the same way
    ref_plan = {n: b for n, b in ref.items() if is_plan_tensor(n)}
    assert cached["bytes_read_by_component"]["transformer_ref"] == sum(ref.values()) - sum(ref_plan.values())
    print(
        f"\nsmall, cached load: {cached['bytes_read']:,} bytes read (transformer "
        f"{cached['bytes_read_by_component']['transformer']:,}), peak RSS +{cached['peak_rss_delta_bytes']:,} "
        f"(resident: {resident['bytes_read']:,} read, +{resident['peak_rss_delta_bytes']:,})"
    )
    assert cached["plan_tensors_read"] == [] and cached["plan_bytes_read"] == 0
    assert cached["transformer_from_pretrained_calls"] == 0
    assert cached["transformers_built"] == 2  # one per partition, each built on meta without plan tensors
    assert cached["plan_tensors_allocated"] == [] and cached["served_plan_tensors"] == []
    # exactly the checkpoint's other transformer tensors, each once
    assert cached["bytes_read_by_component"]["transformer"] == sum(stored.values()) - sum(plan.values())
    assert cached["peak_rss_bytes"] > cached["rss_before_bytes"] > 0


def test_the_spies_trip_on_the_resident_load(measured: dict[str, dict[str, Any]], small: Path) -> None:
    """Resident mode keeps diffusers' from_pretrained transformer (the reference): every plan tensor is read and
    held, so the probe that finds none in the cached load does see them here."""
    resident = measured["resident"]
    stored = {folder: stored_bytes(small, folder) for folder in ("transformer", "transformer_ref")}
    plan = sorted(f"{f}/{n}" for f, names in stored.items() for n in names if is_plan_tensor(n))
    assert resident["transformer_from_pretrained_calls"] == 2  # both partitions
    assert resident["plan_tensors_read"] == plan
    assert resident["plan_bytes_read"] == sum(stored[p.split("/")[0]][p.split("/")[1]] for p in plan)
    assert resident["served_plan_tensors"] == plan
    assert resident["plan_tensors_allocated"] == sorted({p.split("/")[1] for p in plan})
    for folder, sizes in stored.items():
        assert resident["bytes_read_by_component"][folder] == sum(sizes.values())
    cached = measured["cached"]
    assert resident["bytes_read"] - cached["bytes_read"] == resident["plan_bytes_read"]
