"""A vanished session's slots stay unusable until its peer process is known to be gone or a bounded grace period
passed (docs/architecture.md, "The slab and the lease protocol"): its kernels may still read them.

Driven by events, not timings: the sidecar's clock and its peer-liveness probe are injected, so "the grace period
ends" and "the process is gone" are steps of the test. Slots of a retired lease are never evicted nor refilled
(a prepare that would need them is refused as SLAB_BUSY), stay readable as slot hits, and are reused afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from plancache_service.config import SidecarConfig
from plancache_service.errors import CacheBusyError, SlabBusyError
from plancache_service.sidecar import DEFAULT_SESSION_GRACE_S, Sidecar, process_gone

from plancache_helpers import X, Y, MakeCache, check_invariants, keys_of  # isort: skip


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _sidecar(make: MakeCache, grace_s: float = 30.0) -> tuple[Sidecar, Clock, set[int]]:
    """A sidecar whose slab holds exactly one schedule's plans, a fake clock and a set of pids that are gone."""
    clock, gone = Clock(), set()
    cache = make(gpu_plans=len(set(keys_of(X))))
    sidecar = Sidecar(cache, grace_s=grace_s, clock=clock, peer_gone=gone.__contains__)
    return sidecar, clock, gone


def test_dropped_sessions_slots_are_not_reused_before_the_grace_period_ends(make: MakeCache) -> None:
    sidecar, clock, _ = _sidecar(make, grace_s=30.0)
    cache = sidecar.cache
    first = sidecar.attach("gen-1")
    lease = sidecar.prepare(first.session_id, cache.generation, keys_of(X))
    slots = set(lease.slots)
    assert sidecar.detach(first.session_id) == 1  # vanished holding its lease
    assert [r.session_id for r in sidecar.retired()] == [first.session_id]
    assert sidecar.state().leases_held == 1 and cache.stats().slots_leased == len(slots)

    second = sidecar.attach("gen-2")
    hit = sidecar.prepare(second.session_id, cache.generation, keys_of(X))  # slot hits: reading them is fine
    assert set(hit.slots) == slots and hit.report.built_plans == 0
    sidecar.release(second.session_id, hit.lease_id)
    with pytest.raises(SlabBusyError, match="free of live leases"):  # Y needs slots: every one is still pinned
        sidecar.prepare(second.session_id, cache.generation, keys_of(Y))
    with pytest.raises(CacheBusyError):  # nor can the slab be invalidated under the retired lease
        cache.invalidate()
    check_invariants(cache)

    clock.now += 29.9
    assert sidecar.retired() and sidecar.state().leases_held == 1
    clock.now += 0.1  # the grace period ends
    assert sidecar.retired() == [] and sidecar.state().leases_held == 0
    other = sidecar.prepare(second.session_id, cache.generation, keys_of(Y))  # now the slots are reused
    assert set(other.slots) & slots and other.report.built_plans == len(set(keys_of(Y)) - set(keys_of(X))) > 0
    check_invariants(cache)


def test_slots_end_as_soon_as_the_peer_process_is_gone(make: MakeCache) -> None:
    sidecar, _clock, gone = _sidecar(make, grace_s=3600.0)
    cache = sidecar.cache
    session = sidecar.attach("gen", peer_pid=4242)
    sidecar.prepare(session.session_id, cache.generation, keys_of(X))
    sidecar.detach(session.session_id)
    assert sidecar.retired()[0].peer_pid == 4242 and sidecar.state().leases_held == 1
    gone.add(4242)  # the process exited (its context, and every kernel it queued, are gone)
    assert sidecar.retired() == [] and sidecar.state().leases_held == 0

    # the pid may also be learned only at detach (the transport's credentials)
    session = sidecar.attach("gen")
    sidecar.prepare(session.session_id, cache.generation, keys_of(X))
    gone.add(777)
    assert sidecar.detach(session.session_id, peer_pid=777) == 1
    assert sidecar.state().leases_held == 0


def test_zero_grace_and_a_session_without_leases_end_at_once(make: MakeCache) -> None:
    sidecar, _, _ = _sidecar(make, grace_s=0.0)
    session = sidecar.attach("gen")
    sidecar.prepare(session.session_id, sidecar.cache.generation, keys_of(X))
    sidecar.detach(session.session_id)
    assert sidecar.state().leases_held == 0
    session = sidecar.attach("gen")
    assert sidecar.detach(session.session_id) == 0 and sidecar.retired() == []


@pytest.mark.processes
def test_process_gone_probe_and_the_flag() -> None:
    assert not process_gone(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_gone(child.pid)  # reaped: no such process
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie issues no work
    assert process_gone(zombie.pid)
    zombie.wait()
    default = SidecarConfig.__dataclass_fields__["session_grace_s"]
    assert default.default == DEFAULT_SESSION_GRACE_S and default.metadata
