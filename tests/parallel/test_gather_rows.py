"""ditcore.parallel.gather_rows on 3 gloo ranks holding 3, 2 and 2 rows (what diffusers' sharder gives 7 rows):
every rank gets the rows in rank order, none of the padding, and gloo's own all_gather refuses the same shares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distkit import run_ranks

pytestmark = [pytest.mark.timeout(300), pytest.mark.processes]  # the ranks are processes


def gather(rank: int, out: Path) -> None:
    import torch.distributed as dist

    from ditcore.parallel import gather_rows, init_process_group

    init_process_group(torch.device("cpu"))
    whole = torch.arange(2 * 7 * 3, dtype=torch.float32).reshape(2, 7, 3) + 0.5  # (B, S, D), no zeros
    mine = whole.tensor_split(3, dim=1)[rank]
    got = gather_rows(mine, 1, dist.group.WORLD)
    try:
        dist.all_gather([torch.empty_like(s) for s in whole.tensor_split(3, dim=1)], mine)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    (out / f"rank{rank}.json").write_text(json.dumps({"equal": torch.equal(got, whole), "refused": refused}))


def test_uneven_shares_gather_whole_on_every_rank(tmp_path: Path) -> None:
    out = run_ranks(gather, 3, (), tmp_path)
    for r in range(3):
        got = json.loads((out / f"rank{r}.json").read_text())
        assert got["equal"], f"rank {r}"
        assert "allgather" in got["refused"], got["refused"]  # why gather_rows pads
