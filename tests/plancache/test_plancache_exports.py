"""Attach hygiene at the sidecar: every Attach session gets a slab export of its own (on cuda each export carries its
own IPC reference counter; on cpu the export is the shm descriptor), which the sidecar's bookkeeping retires when the
session ends (`live_exports`: at most one per live session; torch keeps each CUDA export's counter slot and event on
the slab until the slab is freed, see SlabMemory.export); what the sidecar hands out passes the same validation the
generator applies. A cuda sidecar refuses an allocator configuration whose memory CUDA IPC cannot share (expandable
segments, in either PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF) at startup, before it reads the checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from clikit import run_cli_inprocess

from ditruntime.slab import validate_descriptor
from plancache_service.device import check_ipc_allocator
from plancache_service.errors import SessionError
from plancache_service.sidecar import Sidecar

from plancache_helpers import MakeCache  # isort: skip


def test_one_export_per_attach_session_retired_from_the_books_on_detach(make: MakeCache) -> None:
    cache = make(gpu_plans=4)
    sidecar = Sidecar(cache)
    memory = cache.memory
    assert memory.live_exports == 0
    first = sidecar.attach("gen-1")
    assert memory.live_exports == 1 and first.slab == memory.descriptor  # cpu: the shm descriptor, no IPC fields
    assert first.slab.cuda_ipc is None and validate_descriptor(first.slab) == cache.slab.dtype
    with pytest.raises(SessionError):
        sidecar.attach("gen-2")  # refused: no second export is made
    assert memory.live_exports == 1
    sidecar.detach(first.session_id)
    assert memory.live_exports == 0  # bookkeeping: no session holds an export (torch's registration stays on cuda)
    sidecar.detach(first.session_id)  # a second detach of the same session retires nothing twice
    second = sidecar.attach("gen-1 again")
    assert memory.live_exports == 1 and second.session_id != first.session_id
    sidecar.detach(second.session_id)
    assert memory.live_exports == 0


def test_closing_the_slab_closes_a_live_export(make: MakeCache) -> None:
    cache = make(gpu_plans=4)
    export = cache.memory.export()
    assert not export.closed and cache.memory.live_exports == 1
    cache.memory.close()
    assert export.closed and cache.memory.live_exports == 0
    export.close()  # idempotent


@pytest.mark.parametrize(
    ("var", "value", "refused"),
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", True),
        ("PYTORCH_ALLOC_CONF", "expandable_segments:True", True),
        ("PYTORCH_ALLOC_CONF", "max_split_size_mb:128, expandable_segments : true", True),
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False", False),
        ("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.6,max_split_size_mb:64", False),
        ("PYTORCH_ALLOC_CONF", "", False),
    ],
)
def test_expandable_segments_are_refused_in_either_variable(var: str, value: str, refused: bool) -> None:
    env = {var: value}
    if refused:
        with pytest.raises(
            ValueError, match=rf"^{var}={re.escape(value)}: expandable_segments:True .*CUDA IPC; unset it"
        ):
            check_ipc_allocator(env)
    else:
        check_ipc_allocator(env)
    check_ipc_allocator({})


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_a_cuda_sidecar_refuses_expandable_segments_at_startup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, var: str
) -> None:
    """Before the checkpoint is read (it does not exist here) and before any CUDA call (none on this machine)."""
    monkeypatch.setenv(var, "expandable_segments:True")
    res = run_cli_inprocess(
        ["plancache", "--checkpoint", tmp_path / "absent", "--device", "cuda", "--socket", tmp_path / "r" / "s.sock"]
    )
    assert res.code == 2 and f"ditserve plancache: error: {var}=expandable_segments:True" in res.err, res.err
    assert not (tmp_path / "r" / "s.sock").exists()
    monkeypatch.delenv(var)
    res = run_cli_inprocess(
        ["plancache", "--checkpoint", tmp_path / "absent", "--device", "cuda", "--socket", tmp_path / "r" / "s.sock"]
    )
    # the next refusal is the checkpoint's
    assert res.code == 2 and "expandable" not in res.err and "absent" in res.err, res.err
