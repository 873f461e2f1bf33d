"""A release never waits on the host tier's store copy (issue 12, item 6).

After a prepare publishes its plans, the host tier books the group under the cache's state lock and copies the pages
out of their slots after dropping it. A copier that blocks on an Event holds one store copy in flight; meanwhile
`cache.release` / the gRPC ReleasePlans of another lease (and GetState) return, the copied slots stay pinned, and once
the copy is let go the stored group equals diffusers' rows and serves a swap-in. A store copy that raises undoes its
booking, unpins, and leaves a retryable prepare.

No timed assertions: the blocked copy is released only by the test (`go`), so "returned while the copy was in
flight" is an ordering of events; the `wait(timeout=...)` calls only turn a hang into a failure.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from ditcore.plans import PlanKey
from plancache_service.cache import Lease, PlanCache
from plancache_service.device import Copier
from plancache_service.errors import RebuildError
from plancache_service.server import SidecarServer
from protos.ditserve.plancache.v1 import plancache_pb2 as pb
from protos.ditserve.plancache.v1 import plancache_pb2_grpc as pb_grpc

from plancache_helpers import (  # isort: skip
    X,
    Y,
    Z,
    DiffusersPages,
    MakeCache,
    assert_host_matches_reference,
    assert_slots_match_reference,
    expect,
    group_of,
    keys_of,
    pages_needed,
    prepare,
    run,
    running_sidecar,
)

GUARD_S = 60  # turns a hang into a failure; never the thing asserted


class BlockingStore:
    """Wraps `copier.copy_rows`: a copy whose destination is a host-tier chunk signals `started`, then waits for
    `go` (or raises `fail`) before copying; every other copy (swap-ins, rebuilds) runs at once."""

    def __init__(self, copier: Copier, host_chunks: list[torch.Tensor], fail: Exception | None = None) -> None:
        self.started = threading.Event()
        self.go = threading.Event()
        self.fail = fail
        self._inner: Callable[..., int] = copier.copy_rows
        self._chunks = {c.data_ptr() for c in host_chunks}

    def __call__(self, dst: torch.Tensor, src: torch.Tensor, pairs: list[tuple[int, int]]) -> int:
        if dst.data_ptr() in self._chunks:
            self.started.set()
            assert self.go.wait(GUARD_S), "the test never let the store copy go"
            if self.fail is not None:
                raise self.fail
        return self._inner(dst, src, pairs)


class InThread:
    """Run `fn` on a thread; `done` is set when it returns or raises."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

        def body() -> None:
            try:
                self.result = fn()
            except BaseException as e:
                self.error = e
            finally:
                self.done.set()

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def join(self) -> Any:
        assert self.done.wait(GUARD_S), "the call never returned"
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result


def blocking_store(cache: PlanCache, monkeypatch: pytest.MonkeyPatch, fail: Exception | None = None) -> BlockingStore:
    blocker = BlockingStore(cache.copier, cache.host.buffer.chunks, fail)
    monkeypatch.setattr(cache.copier, "copy_rows", blocker)
    return blocker


# ============================================================================ the cache core
def test_release_returns_while_the_host_store_copies(
    make: MakeCache, ref: DiffusersPages, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, y = keys_of(X), keys_of(Y)
    cache = make(gpu_plans=7, host_pages=pages_needed(x + y + keys_of(Z)))
    lease_x = prepare(cache, X)  # stored at once (no blocker yet)
    expect(cache, host_groups=[group_of(X)], leases=1)

    blocker = blocking_store(cache, monkeypatch)
    pending = InThread(lambda: prepare(cache, Y))  # builds Y, publishes, then blocks in its store copy
    assert blocker.started.wait(GUARD_S), "the store copy never started"

    # The store copy is in flight (only `go` ends it). Release, release_owner and stats all return meanwhile.
    released = InThread(lambda: cache.release(lease_x.lease_id))
    assert released.join() == lease_x and not blocker.go.is_set() and not pending.done.is_set()
    stats = InThread(cache.stats).join()
    assert not blocker.go.is_set()
    assert stats.leases_held == 0 and stats.host_groups == 2  # Y is booked, its lease not yet handed out
    assert stats.slots_leased == len(set(y)), "the slots being copied from must stay pinned during the copy"
    assert InThread(lambda: cache.release_owner("nobody")).join() == 0 and not blocker.go.is_set()

    blocker.go.set()
    lease_y: Lease = pending.join()
    assert lease_y.report.host_stored and lease_y.report.built_plans == len(set(y)) - 1  # t = 0 was a slot hit
    expect(cache, host_groups=[group_of(X), group_of(Y)], leases={lease_y.lease_id})
    assert_host_matches_reference(cache, ref)  # the stored group is diffusers' rows, bit for bit
    cache.release(lease_y.lease_id)

    # The copied group serves: once Y's slots are evicted, Y comes back from the host tier, not a rebuild.
    run(cache, Z)  # evicts X[1:] (least recent) from the 7 slots
    run(cache, X)  # X from the host tier; evicts Y[1:]
    r = run(cache, Y).report
    assert (r.host_hit_plans, r.built_plans) == (len(set(y)) - 1, 0)
    assert_slots_match_reference(cache, ref)


def test_a_failed_store_copy_undoes_its_booking_and_is_retryable(
    make: MakeCache, ref: DiffusersPages, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = keys_of(X)
    cache = make(gpu_plans=8, host_pages=pages_needed(x))
    blocker = blocking_store(cache, monkeypatch, fail=RuntimeError("copy engine fault"))
    blocker.go.set()
    with pytest.raises(RebuildError, match="copy engine fault"):
        prepare(cache, X)
    # Published plans stay resident and unpinned; the host tier holds nothing; nothing leaked.
    expect(cache, resident=set(x), host_groups=[], leases=0, slots_leased=0, failed_prepares=1, host_used_bytes=0)
    monkeypatch.undo()
    lease = prepare(cache, X)  # the retry: slot hits, stored this time
    assert lease.report.gpu_hit_plans == len(set(x)) and lease.report.host_stored
    expect(cache, host_groups=[group_of(X)], leases=1)
    assert_host_matches_reference(cache, ref)


# ============================================================================ over gRPC
@pytest.fixture
def sidecar(tiny_ckpt: Path) -> Iterator[SidecarServer]:
    """A started sidecar on tiny_ckpt: 8 slots, a host tier holding X and Y."""
    with running_sidecar(tiny_ckpt, "psu-", pages_needed(keys_of(X) + keys_of(Y)), gpu_plans=8) as server:
        yield server


def test_grpc_release_plans_returns_while_the_host_store_copies(
    sidecar: SidecarServer, ref: DiffusersPages, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = sidecar.sidecar.cache
    channel = grpc.insecure_channel(sidecar.address)
    stub = pb_grpc.PlanCacheStub(channel)
    stream = stub.Attach(pb.AttachRequest(client_name="store-unlocked"), timeout=GUARD_S)
    try:
        session = next(stream).session

        def prepare_rpc(keys: list[PlanKey]) -> pb.PreparePlansResponse:
            req = pb.PreparePlansRequest(
                session_id=session.session_id,
                generation=session.generation,
                plan_keys=[pb.PlanKey(timestep_bits=list(k.bits)) for k in keys],
                request_id="store-unlocked",
            )
            resp: pb.PreparePlansResponse = stub.PreparePlans(req, timeout=GUARD_S)
            return resp

        first = prepare_rpc(keys_of(X))
        blocker = blocking_store(cache, monkeypatch)
        pending = InThread(lambda: prepare_rpc(keys_of(Y)))
        assert blocker.started.wait(GUARD_S), "the store copy never started"

        release = pb.ReleasePlansRequest(session_id=session.session_id, lease_id=first.lease_id)
        InThread(lambda: stub.ReleasePlans(release, timeout=GUARD_S)).join()
        state = InThread(lambda: stub.GetState(pb.GetStateRequest(), timeout=GUARD_S)).join()
        assert not blocker.go.is_set() and not pending.done.is_set()
        assert state.leases_held == 0

        blocker.go.set()
        second: pb.PreparePlansResponse = pending.join()
        assert second.report.host_stored
        assert cache.host.groups() == [group_of(X), group_of(Y)]
        assert_host_matches_reference(cache, ref)
        stub.ReleasePlans(pb.ReleasePlansRequest(session_id=session.session_id, lease_id=second.lease_id))
    finally:
        stream.cancel()
        channel.close()
