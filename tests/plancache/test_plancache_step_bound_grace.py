"""A vanished session's slots stay pinned for max(--session-grace-s, --session-grace-steps x the step bound its
leases' PreparePlans carried): the grace scales with the requests, a floor below it. Driven by an injected clock (no
waiting), then over gRPC: the sidecar reads `step_bound_s` off the wire and refuses a bad one, naming the field."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from ditcore.sizing import MAX_STEP_BOUND_S
from ditruntime.rpc_errors import error_info
from plancache_service.errors import InvalidPlanRequestError, SlabBusyError
from plancache_service.sidecar import RetiredSession, Sidecar
from protos.ditserve.plancache.v1 import plancache_pb2 as pb
from protos.ditserve.plancache.v1 import plancache_pb2_grpc as pb_grpc

from plancache_helpers import X, Y, MakeCache, check_invariants, keys_of, pages_needed, running_sidecar  # isort: skip
from servicekit import wait_for  # isort: skip

GUARD_S = 60


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _sidecar(make: MakeCache, grace_s: float, grace_steps: float = 2.0) -> tuple[Sidecar, Clock]:
    """A sidecar whose slab holds exactly one schedule's plans, whose peers never prove gone, on a fake clock."""
    clock = Clock()
    cache = make(gpu_plans=len(set(keys_of(X))))
    return Sidecar(cache, grace_s=grace_s, clock=clock, peer_gone=lambda pid: False, grace_steps=grace_steps), clock


def test_a_step_bound_above_the_floor_pins_the_slots_past_it_and_frees_them_after(make: MakeCache) -> None:
    # a released maximum-canvas step models at ~44 s on an H200: with a 30 s floor, 2 x 44 s is what holds
    sidecar, clock = _sidecar(make, grace_s=30.0)
    cache = sidecar.cache
    first = sidecar.attach("gen-1", peer_pid=4242)
    lease = sidecar.prepare(first.session_id, cache.generation, keys_of(X), step_bound_s=44.0)
    assert sidecar.detach(first.session_id) == 1
    (retired,) = sidecar.retired()
    assert retired.grace_s == 88.0 and retired.deadline == 1000.0 + 88.0

    second = sidecar.attach("gen-2")
    clock.now += 30.0  # the floor alone would have released them here
    assert sidecar.retired() and cache.stats().slots_leased == len(set(lease.slots))
    with pytest.raises(SlabBusyError):  # Y needs the pinned slots
        sidecar.prepare(second.session_id, cache.generation, keys_of(Y))
    clock.now += 57.9
    assert sidecar.retired() and sidecar.state().leases_held == 1
    clock.now += 0.1  # 88 s after the session vanished
    assert sidecar.retired() == [] and sidecar.state().leases_held == 0
    other = sidecar.prepare(second.session_id, cache.generation, keys_of(Y))
    assert set(other.slots) & set(lease.slots)
    check_invariants(cache)


def test_the_floor_holds_below_it_and_released_leases_leave_no_bound(make: MakeCache) -> None:
    sidecar, clock = _sidecar(make, grace_s=30.0)
    cache = sidecar.cache
    session = sidecar.attach("gen")
    big = sidecar.prepare(session.session_id, cache.generation, keys_of(X), step_bound_s=600.0)
    sidecar.release(session.session_id, big.lease_id)  # done: its bound no longer matters
    sidecar.prepare(session.session_id, cache.generation, keys_of(X), step_bound_s=0.5)
    sidecar.detach(session.session_id)
    assert [r.grace_s for r in sidecar.retired()] == [30.0]  # max(30, 2 x 0.5)
    clock.now += 30.0
    assert sidecar.retired() == []

    # no step bound (an older generator sends 0) and no floor: released at once, as before
    sidecar.grace_s = 0.0
    session = sidecar.attach("gen")
    sidecar.prepare(session.session_id, cache.generation, keys_of(X))
    sidecar.detach(session.session_id)
    assert sidecar.retired() == [] and sidecar.state().leases_held == 0


def test_the_largest_bound_of_the_session_s_leases_decides(make: MakeCache) -> None:
    cache = make(gpu_plans=len(set(keys_of(X)) | set(keys_of(Y))))
    sidecar = Sidecar(cache, grace_s=1.0, clock=Clock(), peer_gone=lambda pid: False, grace_steps=3.0)
    session = sidecar.attach("gen")
    sidecar.prepare(session.session_id, cache.generation, keys_of(X), step_bound_s=2.0)
    sidecar.prepare(session.session_id, cache.generation, keys_of(Y), step_bound_s=5.0)
    assert sidecar.detach(session.session_id) == 2
    assert [r.grace_s for r in sidecar.retired()] == [15.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, MAX_STEP_BOUND_S * 2])
def test_a_bad_step_bound_is_refused_naming_the_field(make: MakeCache, bad: float) -> None:
    sidecar, _ = _sidecar(make, grace_s=30.0)
    session = sidecar.attach("gen")
    with pytest.raises(InvalidPlanRequestError, match=r"step_bound_s: must be finite and in \[0, 86400\]") as info:
        sidecar.prepare(session.session_id, sidecar.cache.generation, keys_of(X), step_bound_s=bad)
    assert info.value.field == "step_bound_s" and sidecar.state().leases_held == 0


def test_over_grpc_the_sidecar_takes_the_step_bound_off_the_wire(tiny_ckpt: Path) -> None:
    with running_sidecar(tiny_ckpt, "psb-", pages_needed(keys_of(X)), gpu_plans=8) as server:
        channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.PlanCacheStub(channel)
        stream = stub.Attach(pb.AttachRequest(client_name="step-bound"), timeout=GUARD_S)
        try:
            session = next(stream).session

            def prepare(bound: float) -> pb.PreparePlansResponse:
                req = pb.PreparePlansRequest(
                    session_id=session.session_id, generation=session.generation, request_id="step-bound",
                    plan_keys=[pb.PlanKey(timestep_bits=list(k.bits)) for k in keys_of(X)], step_bound_s=bound,
                )  # fmt: skip
                resp: pb.PreparePlansResponse = stub.PreparePlans(req, timeout=GUARD_S)
                return resp

            with pytest.raises(grpc.RpcError) as ei:
                prepare(float("nan"))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error_info(ei.value)[0] == "INVALID_PLAN_REQUEST" and "step_bound_s" in (ei.value.details() or "")
            prepare(120.0)
        finally:
            stream.cancel()  # the session vanishes holding its lease; this process (its peer) is alive
            channel.close()
        sidecar = server.sidecar
        floor = sidecar.grace_s
        retired = _wait_retired(sidecar)
        assert retired.grace_s == max(floor, sidecar.grace_steps * 120.0) == 240.0
        assert sidecar.state().leases_held == 1


def _wait_retired(sidecar: Sidecar) -> RetiredSession:
    retired = wait_for(sidecar.retired, GUARD_S, "the cancelled session to be retired")
    assert len(retired) == 1
    first: RetiredSession = retired[0]
    return first
