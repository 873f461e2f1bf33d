"""Attach hygiene at the sidecar: every Attach session gets a slab export of its own, closed when the session ends
(on cuda each export carries its own IPC reference counter; on cpu the export is the shm descriptor), and what the
sidecar hands out passes the same validation the generator applies."""

from __future__ import annotations

import pytest

from ditruntime.slab import validate_descriptor
from plancache_service.errors import SessionError
from plancache_service.sidecar import Sidecar

from plancache_helpers import MakeCache  # isort: skip


def test_one_export_per_attach_session_closed_on_detach(make: MakeCache) -> None:
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
    assert memory.live_exports == 0
    sidecar.detach(first.session_id)  # a second detach of the same session closes nothing twice
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
