"""No lease outlives its session (issue 19, item 2; docs/architecture.md, "The slab and the lease protocol").

A PreparePlans whose session ends while it runs (a generator crash, kill -9, a dropped connection) grants nothing: its
lease is released the moment the cache returns it, and the call fails (SessionError), while the leases the session was
answered keep their grace. A PreparePlans whose answer the caller lost while the session lives on (a client-side
deadline) is released by its request id: ReleasePlans(session, request_id) ends a granted lease at once and makes a
prepare still running (or arriving late) hand out none. After either, a weight update commits.

Driven by events, not timings: a rebuild (or the cache's return) blocks on an Event only the test sets, and the
sidecar's clock is injected, so "the grace ends" is a step of the test; `GUARD_S` only turns a hang into a failure.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from generator_service.backends.sidecar_client import SidecarClient
from generator_service.errors import SidecarUnavailableError
from generator_service.health import ServingState
from plancache_service.app import build_server
from plancache_service.cache import PlanCache
from plancache_service.config import CacheConfig, SidecarConfig
from plancache_service.errors import CacheBusyError, LeaseAbandonedError, SessionError, UnknownLeaseError
from plancache_service.server import SidecarServer
from plancache_service.sidecar import Sidecar

from plancache_helpers import X, Y, MakeCache, check_invariants, keys_of  # isort: skip

GUARD_S = 30  # turns a hang into a failure; never the thing asserted
GRACE_S = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Gate:
    """Wraps a callable: the next call signals `started`, runs it (`where` "before": after the wait; "after": before
    the wait, so the call's effects exist while it has not returned), waits for `go`, and sets `returned`."""

    def __init__(self, fn: Callable[..., Any], where: str) -> None:
        self.fn, self.where = fn, where
        self.started, self.go, self.returned = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            if self.where == "after":
                out = self.fn(*args, **kwargs)
            self.started.set()
            assert self.go.wait(GUARD_S), "the test never let the call go"
            return out if self.where == "after" else self.fn(*args, **kwargs)
        finally:
            self.returned.set()


def slow_rebuild(cache: PlanCache, monkeypatch: pytest.MonkeyPatch) -> Gate:
    """The next rebuild pass waits for the gate (the slot fill of a prepare, under the cache's prepare lock)."""
    tier = cache.tiers[-1]  # the rebuild: the last tier holds every plan
    gate = Gate(tier.fill, "before")
    monkeypatch.setattr(tier, "fill", gate)
    return gate


def slow_return(cache: PlanCache, monkeypatch: pytest.MonkeyPatch) -> Gate:
    """The next `cache.prepare` registers its lease, then waits for the gate before returning it to the sidecar."""
    gate = Gate(cache.prepare, "after")
    monkeypatch.setattr(cache, "prepare", gate)
    return gate


class InThread:
    """Run `fn` on a thread; `join()` returns its value or re-raises."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

        def body() -> None:
            try:
                self.result = fn()
            except BaseException as e:
                self.error = e
            finally:
                self.done.set()

        threading.Thread(target=body, daemon=True).start()

    def join(self) -> Any:
        assert self.done.wait(GUARD_S), "the call never returned"
        if self.error is not None:
            raise self.error
        return self.result


def wait_until(predicate: Callable[[], bool]) -> None:
    end = time.monotonic() + GUARD_S
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


@pytest.fixture
def served(make: MakeCache) -> tuple[Sidecar, Clock]:
    """A sidecar core at generation 1 whose slab holds X and Y, a fake clock, a peer that never looks gone."""
    clock = Clock()
    cache = make(gpu_plans=len(set(keys_of(X) + keys_of(Y))), generation=1)
    return Sidecar(cache, grace_s=GRACE_S, clock=clock, peer_gone=lambda _pid: False), clock


def update_commits(sidecar: Sidecar, repo: Path) -> int:
    """A whole weight update (prepare + commit) of the served generation to `repo`; returns the new generation."""
    generation = sidecar.cache.generation
    sidecar.prepare_update(generation, str(repo))
    new = sidecar.commit_update(generation, str(repo)).generation
    return new


# ============================================================================ the session ends during a prepare
@pytest.mark.parametrize("slow", [slow_rebuild, slow_return], ids=["during-the-rebuild", "before-the-answer"])
def test_a_session_that_ends_during_its_prepare_leaves_no_lease(
    served: tuple[Sidecar, Clock], tiny_ckpt_b: Path, monkeypatch: pytest.MonkeyPatch, slow: Any
) -> None:
    sidecar, clock = served
    cache = sidecar.cache
    session = sidecar.attach("gen-1", peer_pid=4242)
    answered = sidecar.prepare(session.session_id, 1, keys_of(X), request_id="fox#1")  # its kernels may be reading

    gate = slow(cache, monkeypatch)
    pending = InThread(lambda: sidecar.prepare(session.session_id, 1, keys_of(Y), 50.0, request_id="rain#2"))
    assert gate.started.wait(GUARD_S), "the prepare never reached the cache"
    assert sidecar.detach(session.session_id) == 1  # the generator died: only the answered lease is retired
    assert [r.leases for r in sidecar.retired()] == [1]
    sidecar.attach("gen-2")  # its restart attaches while the old prepare still runs

    gate.go.set()
    with pytest.raises(SessionError, match="ended while its PreparePlans ran"):
        pending.join()  # nobody hears this answer: the lease was released at once, before any grace
    assert {lease.lease_id for lease in cache.leases()} == {answered.lease_id}
    assert sidecar.retired()[0].grace_s == GRACE_S  # the unanswered lease's step bound (50 s) counts for nothing
    check_invariants(cache)

    # The retired lease still blocks a commit (its kernels may read its slots) until its grace ends; then it commits.
    sidecar.prepare_update(1, str(tiny_ckpt_b))
    with pytest.raises(CacheBusyError, match="1 lease"):
        sidecar.commit_update(1, str(tiny_ckpt_b))
    clock.now += GRACE_S
    assert sidecar.commit_update(1, str(tiny_ckpt_b))[0] == 2
    assert sidecar.state().leases_held == 0 and cache.stats().slots_leased == 0
    check_invariants(cache)


def test_a_new_session_cannot_release_a_retired_lease(served: tuple[Sidecar, Clock]) -> None:
    """A retired lease ends by its grace (or its peer's exit) only: a lease id is not the next session's to end."""
    sidecar, clock = served
    first = sidecar.attach("gen-1")
    lease = sidecar.prepare(first.session_id, 1, keys_of(X))
    sidecar.detach(first.session_id)
    second = sidecar.attach("gen-2")
    with pytest.raises(UnknownLeaseError, match=f"no live lease {lease.lease_id} of session"):
        sidecar.release(second.session_id, lease.lease_id)
    assert sidecar.state().leases_held == 1
    clock.now += GRACE_S
    assert sidecar.state().leases_held == 0


# ============================================================================ the answer is lost, the session lives
def test_a_lease_whose_answer_was_lost_is_released_by_its_request_id(
    served: tuple[Sidecar, Clock], tiny_ckpt_b: Path
) -> None:
    sidecar, _clock = served
    cache = sidecar.cache
    sid = sidecar.attach("gen").session_id
    sidecar.prepare(sid, 1, keys_of(X), request_id="fox#1")  # granted, but its answer never reaches the caller
    kept = sidecar.prepare(sid, 1, keys_of(Y), request_id="rain#2")

    assert sidecar.release_request(sid, "fox#1") == 1  # the caller's deadline passed: it releases by its tag
    assert {lease.lease_id for lease in cache.leases()} == {kept.lease_id}  # another request's lease is untouched
    assert sidecar.release_request(sid, "fox#1") == 0  # idempotent
    assert sidecar.release_request(sid, "never-sent#3") == 0  # a tag that holds nothing is not an error
    with pytest.raises(LeaseAbandonedError, match="already released"):  # the same call arriving late: nothing
        sidecar.prepare(sid, 1, keys_of(X), request_id="fox#1")
    with pytest.raises(SessionError):
        sidecar.release_request("another-session", "rain#2")
    sidecar.release(sid, kept.lease_id)
    assert cache.stats().leases_held == 0
    assert update_commits(sidecar, tiny_ckpt_b) == 2  # the session is still attached: nothing waits for a grace
    check_invariants(cache)


def test_a_release_by_request_id_during_its_prepare_grants_nothing(
    served: tuple[Sidecar, Clock], tiny_ckpt_b: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sidecar, _clock = served
    cache = sidecar.cache
    sid = sidecar.attach("gen").session_id
    gate = slow_rebuild(cache, monkeypatch)
    pending = InThread(lambda: sidecar.prepare(sid, 1, keys_of(X), request_id="fox#1"))
    assert gate.started.wait(GUARD_S), "the rebuild never started"
    assert sidecar.release_request(sid, "fox#1") == 0  # the client's deadline passed mid-rebuild: nothing granted yet

    gate.go.set()
    with pytest.raises(LeaseAbandonedError, match="while its PreparePlans ran"):
        pending.join()
    assert cache.stats().leases_held == 0 and sidecar.state().session is not None
    again = sidecar.prepare(sid, 1, keys_of(X), request_id="fox#2")  # the retry: a new tag, slot hits
    assert again.report.built_plans == 0
    sidecar.release(sid, again.lease_id)
    assert update_commits(sidecar, tiny_ckpt_b) == 2
    check_invariants(cache)


# ============================================================================ through gRPC, the generator's client
@pytest.fixture
def grpc_sidecar(tiny_ckpt: Path) -> Iterator[SidecarServer]:
    """A started sidecar on a unix socket in a short /tmp dir, its slab in /dev/shm (where a generator maps from)."""
    run_dir = Path(tempfile.mkdtemp(prefix="pls-", dir="/tmp"))
    config = SidecarConfig(
        checkpoint=tiny_ckpt,
        cache=CacheConfig(gpu_plans=8, host_cache_bytes=0, host_reserve_bytes=0),
        address=f"unix:{run_dir}/plancache.sock",
        heartbeat_s=0.2,
    )
    server = build_server(config)
    server.start()
    try:
        yield server
    finally:
        server.stop(grace_s=1.0)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_a_generator_whose_prepare_deadline_passes_releases_by_request_id_and_an_update_commits(
    grpc_sidecar: SidecarServer, tiny_ckpt_b: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = grpc_sidecar.sidecar.cache
    client = SidecarClient(
        grpc_sidecar.address, 0.1, lambda _att: None, ServingState(False, lambda *_: None), prepare_timeout_s=0.5
    )
    client.start()
    try:
        assert client.wait_attached(GUARD_S), client.last_error
        att = client.attachment
        assert att is not None
        gate = slow_rebuild(cache, monkeypatch)  # the rebuild outlasts the client's PreparePlans deadline
        with caplog.at_level("INFO"), pytest.raises(SidecarUnavailableError):
            client.prepare(keys_of(X), att.generation, "it-slow")
        assert not gate.returned.is_set(), "the rebuild ended before the client's deadline: nothing was tested"
        assert "released by its request id" in caplog.text  # the client told the sidecar, by tag "it-slow#1"
        assert "request it-slow#1: released 0 lease(s) by request id" in caplog.text  # the sidecar (same process)

        gate.go.set()  # the rebuild finishes for nobody: its lease must not stay with the live session
        assert gate.returned.wait(GUARD_S)
        wait_until(lambda: cache.stats().prepares == 1 and cache.stats().leases_held == 0)  # granted nothing
        assert cache.stats().leases_held == 0 and client.attachment is att  # same session, no lease left

        client.prepare_update(att.generation, str(tiny_ckpt_b))
        generation = client.commit_update(att.generation, str(tiny_ckpt_b), timeout_s=GUARD_S).generation
        assert generation == att.generation + 1
    finally:
        client.close()
