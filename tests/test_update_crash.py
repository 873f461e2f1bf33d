"""Crash consistency of UpdateWeights (docs/architecture.md, 'Weight generations and
UpdateWeights') with real processes and kill -9.

A sidecar (`python -m plancache_service --state-dir ...`) and a generator (`python -m
generator_service --weights-root ... --admin-token ...`) serve checkpoint A (generation 1);
an update is interrupted by SIGKILL of one of them at each phase (the DITSERVE_FAULT
test hook, or os.kill while the generator stalls at a phase). Whichever died is restarted
with the same flags, state dir and socket. Then both sides must agree on one generation,
every request must return the resident sha256 of the checkpoint that generation names
(odd generations A, even B), the generation must never have gone backwards, and a further
update must work. Kills at successive phases are chained on one pair (each restart is the
next phase's faulty start): a process start costs seconds of diffusers imports.
"""

from __future__ import annotations

import ast
import os
import re
import signal
from collections.abc import Iterator

import grpc
import pytest
from servicekit import (
    NOT_SERVING,
    REQ_FOX,
    REQ_RAIN,
    Pair,
    ProcessGroup,
    ServiceProcess,
    Weights,
    background,
    process_group,
    read_state_file,
    ref_sha,
    updatable,
)

from ditcore import fingerprint

pytestmark = pytest.mark.e2e

STALL_S = 3.0


def real(p: object) -> str:
    return os.path.realpath(str(p))


def assert_consistent(c: Pair, weights: Weights, expected: int, floor: int) -> None:
    """Both sides agree on `expected`; outputs equal the resident reference of its checkpoint."""
    st, ss = c.status(), c.state()
    assert st.serving and ss.serving, (st, ss)
    assert st.generation == ss.generation, f"generator serves {st.generation}, sidecar {ss.generation}"
    assert ss.generation >= floor, f"the sidecar's generation went backwards: {ss.generation} < {floor}"
    assert st.generation == expected
    ckpt = weights.ckpt_of(expected)
    assert real(st.weights_path) == real(ss.weights_path) == real(ckpt)
    assert st.fingerprint == ss.fingerprint == fingerprint(ckpt)
    assert ss.pending_weights_path == ""
    state = read_state_file(c.state_dir)
    assert (state["generation"], real(state["weights_path"])) == (expected, real(ckpt))
    for i, req in enumerate((REQ_FOX, REQ_RAIN)):
        r = c.generate(req, request_id=f"after-{i}")
        assert r.generation == expected
        assert r.sha256 == ref_sha(weights.ckpt_of(r.generation), req)


def assert_updates(c: Pair, weights: Weights, current: int) -> None:
    """One more update (to the other checkpoint) commits and serves."""
    up = c.update(weights.ckpt_of(current + 1))
    assert (up.generation, up.previous_generation) == (current + 1, current)
    assert_consistent(c, weights, current + 1, floor=current + 1)


def assert_recovers(c: Pair, weights: Weights, expected: int, floor: int = 1) -> None:
    """After agreement, one more update (to the other checkpoint) commits and serves."""
    assert_consistent(c, weights, expected, floor=floor)
    assert_updates(c, weights, expected)


@pytest.fixture(scope="module")
def module_procs(request: pytest.FixtureRequest) -> Iterator[ProcessGroup]:
    with process_group(request) as group:
        yield group


@pytest.fixture(scope="module")
def crash_pair(module_procs: ProcessGroup, weights: Weights) -> Pair:
    """A sidecar and a generator as processes (not started) serving A, set up for updates (drain 30 s), shared by
    the module: every test leaves both sides agreeing on a generation, which the next one starts from."""
    return module_procs.pair(weights.a, **updatable(weights, drain_timeout_s=30.0))


def started_with(side: ServiceProcess) -> str | None:
    """The DITSERVE_FAULT of the side's last start (its log opens every start with it)."""
    starts = re.findall(r"=== start #\d+ \(DITSERVE_FAULT=(.*?)\):", side.log())
    return ast.literal_eval(starts[-1]) if starts else None


def serving(c: Pair, weights: Weights, sidecar_fault: str | None = None, gen_fault: str | None = None) -> int:
    """Both sides SERVING and agreeing, each started with the given fault (None: none): a side that is not running,
    or runs with another fault, is (re)started. Returns the generation they serve."""
    for side, fault, start in (
        (c.sidecar, sidecar_fault, c.start_sidecar),
        (c.generator, gen_fault, c.start_generator),
    ):
        if not side.running() or started_with(side) != fault:
            side.stop()
            start(fault, wait=False)
    c.wait_sidecar()
    c.wait_generator()
    generation = int(c.state().generation)
    assert_consistent(c, weights, generation, floor=generation)
    return generation


# ----------------------------------------------------------------------------- generator killed
# (point, whether the update has committed when the process dies there). One sidecar serves the whole chain: the
# generator restarted after each kill is started with the next point's fault (a fault fires only during an update),
# so every point costs one generator start (a process start imports diffusers: seconds).
GENERATOR_POINTS = [
    ("update:after_prepare", False),
    ("update:during_drain", False),
    ("update:after_swap", False),
    ("update:before_commit", False),
    ("update:after_commit", True),
]
SIDECAR_POINTS = [("sidecar:before_commit", False), ("sidecar:after_persist", True)]


def test_generator_killed_at_every_update_phase(crash_pair: Pair, weights: Weights) -> None:
    c = crash_pair
    generation = serving(c, weights, gen_fault=GENERATOR_POINTS[0][0])
    for i, (point, commits) in enumerate(GENERATOR_POINTS):
        log_at = len(c.generator.log())
        with pytest.raises(grpc.RpcError) as ei:
            c.update(weights.ckpt_of(generation + 1))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, (point, ei.value.details())
        assert c.generator.wait_exit(30) == -signal.SIGKILL, point
        assert re.search(rf"fault hook: killing this process at {re.escape(point)}\b", c.generator.log()[log_at:])
        assert c.sidecar.running()
        generation += commits
        assert c.state().generation == generation, point  # the sidecar alone decides

        # same flags, same socket; it loads whatever the sidecar names
        c.start_generator(GENERATOR_POINTS[i + 1][0] if i + 1 < len(GENERATOR_POINTS) else None)
        assert_consistent(c, weights, generation, floor=generation)
    assert_updates(c, weights, generation)


# ----------------------------------------------------------------------------- sidecar killed
def test_sidecar_killed_during_commit(crash_pair: Pair, weights: Weights) -> None:
    c = crash_pair
    generation = serving(c, weights, sidecar_fault=SIDECAR_POINTS[0][0])
    for i, (point, commits) in enumerate(SIDECAR_POINTS):
        log_at = len(c.sidecar.log())
        with pytest.raises(grpc.RpcError) as ei:
            c.update(weights.ckpt_of(generation + 1))
        # the commit's outcome is unknown to the generator: it must not claim success
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, (point, ei.value.details())
        assert c.sidecar.wait_exit(30) == -signal.SIGKILL, point
        assert re.search(rf"fault hook: killing this process at {re.escape(point)}\b", c.sidecar.log()[log_at:])
        generation += commits
        persisted = read_state_file(c.state_dir)["generation"]
        assert persisted == generation, point

        # same flags (--checkpoint A), same state dir: the state file wins; the next point's fault, if any
        c.start_sidecar(SIDECAR_POINTS[i + 1][0] if i + 1 < len(SIDECAR_POINTS) else None)
        c.wait_generator()
        assert_consistent(c, weights, generation, floor=persisted)
    assert_updates(c, weights, generation)


# The sidecar is restarted either at once (the generator usually reattaches while it is still
# stalled; its commit then finds no prepared update: ABORTED) or only after the update has
# returned (the commit found no sidecar: outcome unknown, UNAVAILABLE, and the generator
# serves nothing until it reattaches). Each case costs ~10-14 s of process starts, so only the
# one that exercises the most (new weights swapped in, commit into a dead sidecar, rollback,
# NOT_SERVING until reattached) runs by default; the other seven are marked slow.
STALL_CASES = [
    pytest.param("update:before_commit", "after_update"),
    pytest.param("update:after_prepare", "at_once", marks=pytest.mark.slow),
    pytest.param("update:during_drain", "after_update", marks=pytest.mark.slow),
    pytest.param("update:after_swap", "at_once", marks=pytest.mark.slow),
    pytest.param("update:after_prepare", "after_update", marks=pytest.mark.slow),
    pytest.param("update:during_drain", "at_once", marks=pytest.mark.slow),
    pytest.param("update:after_swap", "after_update", marks=pytest.mark.slow),
    pytest.param("update:before_commit", "at_once", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("point", "restart"), STALL_CASES)
def test_sidecar_killed_while_generator_is_at(crash_pair: Pair, weights: Weights, point: str, restart: str) -> None:
    c = crash_pair
    generation = serving(c, weights, gen_fault=f"{point}=sleep:{STALL_S}")
    log_at = len(c.generator.log())
    update = background(lambda: c.update(weights.ckpt_of(generation + 1)), name="update")
    c.generator.wait_log(rf"fault hook: stalling \S+ s at {re.escape(point)}\b", 60, since=log_at)
    c.sidecar.kill9()
    if restart == "at_once":
        c.start_sidecar()  # the generator may reattach before or after it resumes

    err = update.exception(120)
    # the prepared update died with the sidecar: the update cannot have committed
    assert isinstance(err, grpc.RpcError), f"the update returned {update.result()!r}"
    if restart == "at_once":
        assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED), err.details()
    else:
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
        # no sidecar to ask: the generator serves nothing (and says so) until it reattaches
        assert c.health() == NOT_SERVING
        assert not c.status().serving
        with pytest.raises(grpc.RpcError) as ei:
            c.generate(REQ_FOX, request_id="while-detached")
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value.details()
        c.start_sidecar()
    assert c.generator.running()
    c.wait_generator()
    assert_recovers(c, weights, generation, floor=generation)


# ----------------------------------------------------------------------------- generator killed during a rebuild
def test_generator_killed_during_a_rebuild_leaves_no_lease_and_an_update_commits(
    crash_pair: Pair, weights: Weights
) -> None:
    """kill -9 of the generator while its PreparePlans rebuilds (the sidecar stalled there): the lease the rebuild
    grants after the session ended is released at once, so the next weight update commits (it used to fail
    CacheBusyError until the sidecar restarted)."""
    c = crash_pair
    generation = serving(c, weights, sidecar_fault=f"sidecar:during_rebuild=sleep:{STALL_S}")
    log_at = len(c.sidecar.log())
    never_built = {**REQ_RAIN, "num_inference_steps": 5, "flow_shift": 7.25}  # a schedule no test has built
    request = background(lambda: c.generate(never_built, request_id="orphan", timeout=60), name="orphan")
    c.sidecar.wait_log(r"fault hook: stalling \S+ s at sidecar:during_rebuild\b", 60, since=log_at)
    c.generator.kill9()
    assert isinstance(request.exception(60), grpc.RpcError)
    c.sidecar.wait_log(r"lease \d+ \(request orphan#\d+\) released at once", 30, since=log_at)
    st = c.state()
    assert st.leases_held == 0 and st.stats.slots_leased == 0, st
    c.start_generator()
    result = c.update(weights.ckpt_of(generation + 1))
    assert result.generation == generation + 1
    assert_consistent(c, weights, generation + 1, floor=generation + 1)
