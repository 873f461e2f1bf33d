"""Test helpers that edit a MiniMax-H3 repository copy (never a session fixture itself)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from ditcore.plans import is_plan_tensor
from ditcore.shards import INDEX_FILE


def strip_plan_tensors(repo: Path) -> Path:
    """Remove every `adaln_proj` and `norm_out.linear` tensor from the transformer's shards and index, as a
    checkpoint published for cached serving only would be. Returns `repo`."""
    transformer = Path(repo) / "transformer"
    for shard in sorted(transformer.glob("*.safetensors")):
        tensors = load_file(shard)
        save_file({n: t for n, t in tensors.items() if not is_plan_tensor(n)}, shard, metadata={"format": "pt"})
    index_path = transformer / INDEX_FILE
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not is_plan_tensor(n)}
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return Path(repo)
