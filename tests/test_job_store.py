"""generator_service.jobs.store on both backends: SQLite (a temp file) and a real PostgreSQL server (tests/pgkit.py).

Scenario tests with an expected-state helper (`expect`); the concurrency tests race real threads (and, for claims,
two JobStore instances, as two replica processes would) and check the outcome, never the timing.
"""

from __future__ import annotations

import sqlite3
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pgkit import reset_database

from generator_service.errors import IdempotencyConflictError, JobQueueFullError, JobStoreUnavailableError
from generator_service.jobs.results import ContentRef
from generator_service.jobs.schema import Job, jobs
from generator_service.jobs.store import JobStore

T0 = 1000.0  # the tests' clock: epoch seconds, chosen, never read
LEASE_S = 30.0
SHA_A, SHA_B = "a" * 64, "b" * 64


def jid(i: int) -> str:
    return f"job_{i:032x}"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.processes)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state' / 'jobs' / 'jobs.db'}"
    pg: str = request.getfixturevalue("pg_url")
    reset_database(pg)
    return pg


@pytest.fixture
def store(url: str) -> Iterator[JobStore]:
    s = JobStore.open(url, clock=lambda: T0)
    yield s
    s.close()


def add(
    store: JobStore, i: int, *, key: str | None = None, sha: str = SHA_A, now: float = T0, max_queued: int = 1000
) -> tuple[Job, bool]:
    return store.create(
        job_id=jid(i), request=b"\x0a\x03req" + bytes([i % 256]), request_sha256=sha, idempotency_key=key,
        spec={"prompt": f"p{i}", "num_inference_steps": 4}, steps_total=3, now=now + i, max_queued=max_queued,
    )  # fmt: skip


def expect(store: JobStore, job_id: str, **want: Any) -> Job:
    """The record (deleted or not), after checking the named fields."""
    record = store.get_any(job_id)
    assert record is not None, f"{job_id} is gone"
    got = {k: getattr(record, k) for k in want}
    assert got == want, f"{job_id}: {got} != {want}"
    return record


def run_started(store: JobStore, i: int, replica: str = "r1") -> str:
    """Create job i, claim it (it must be the oldest free one) and mark it running."""
    add(store, i)
    claimed = store.claim_next(replica, LEASE_S, T0)
    assert claimed is not None and claimed.job_id == jid(i)
    assert store.mark_running(jid(i), replica, T0 + 1)
    return jid(i)


def race(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """fn(0..n-1) on n threads released together; their results (the first error raised again)."""
    barrier, out, errors = threading.Barrier(n), [None] * n, []

    def body(k: int) -> None:
        try:
            barrier.wait()
            out[k] = fn(k)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=body, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


# ----------------------------------------------------------------------------- records and paging
def test_record_names_every_column() -> None:
    assert {f.name for f in fields(Job)} == set(jobs.c.keys()) - {"request"}  # read only by request_of


def test_create_then_get_returns_the_stored_record(store: JobStore) -> None:
    record, created = add(store, 1, key="k1")
    assert created
    assert record == store.get(jid(1))
    expect(store, jid(1), state="queued", stage="queued", steps_done=0, steps_total=3, attempts=0, replica=None,
           idempotency_key="k1", spec={"prompt": "p1", "num_inference_steps": 4}, owner="anonymous",
           request_parts={}, interruptions=0, created_at=T0 + 1, started_at=None, finished_at=None, cancel_requested=False, deleted=False,
           result=None, content_available=False)  # fmt: skip
    assert store.get(jid(99)) is None
    assert store.request_of(jid(1)) == (b"\x0a\x03req\x01", {})


def test_list_pages_newest_and_oldest_first_and_filters_by_state(store: JobStore) -> None:
    for i in range(5):
        add(store, i)
    done = store.claim_next("r1", LEASE_S, T0)
    assert done is not None and store.finish(done.job_id, "r1", state="failed", now=T0 + 9, error=("A", "B", "C"))

    def pages(**kw: Any) -> list[list[str]]:
        out, after = [], None
        while page := store.list(limit=2, after_seq=after, **kw):
            out.append([r.job_id for r in page])
            after = page[-1].seq
        return out

    assert pages(oldest_first=False) == [[jid(4), jid(3)], [jid(2), jid(1)], [jid(0)]]
    assert pages(oldest_first=True) == [[jid(0), jid(1)], [jid(2), jid(3)], [jid(4)]]
    assert pages(states=["queued"], oldest_first=True) == [[jid(1), jid(2)], [jid(3), jid(4)]]
    assert pages(states=["failed", "running"], oldest_first=False) == [[jid(0)]]


def test_a_removed_jobs_seq_is_never_reused(store: JobStore) -> None:
    add(store, 1)
    last, _ = add(store, 2)
    store.request_cancel(last.job_id, T0)
    assert store.remove(last.job_id) is not None
    newer, _ = add(store, 3)
    assert newer.seq > last.seq  # keyset paging and queue order stay true across removals
    assert [r.job_id for r in store.list(limit=10, after_seq=last.seq, oldest_first=True)] == [jid(3)]


def test_queue_position_counts_queued_jobs_ahead(store: JobStore) -> None:
    for i in range(4):
        add(store, i)
    assert [store.queue_position(jid(i)) for i in range(4)] == [0, 1, 2, 3]
    store.request_cancel(jid(1), T0)  # cancelled at once: ahead of nobody
    assert [store.queue_position(jid(i)) for i in range(4)] == [0, None, 1, 2]
    assert store.claim_next("r1", LEASE_S, T0) is not None  # claimed: still queued, still ahead
    assert store.queue_position(jid(3)) == 2
    assert store.mark_running(jid(0), "r1", T0)
    store.mark_deleted(jid(2))
    assert [store.queue_position(jid(i)) for i in range(4)] == [None, None, None, 0]
    assert store.queue_position(jid(99)) is None


# ----------------------------------------------------------------------------- idempotency and the queue's bound
def test_same_key_same_request_returns_the_first_job(store: JobStore) -> None:
    first, created = add(store, 1, key="retry-me")
    again, created_again = add(store, 2, key="retry-me")
    assert created and not created_again
    assert again == first
    assert store.get(jid(2)) is None and len(store.list(limit=10)) == 1


def test_same_key_other_request_is_already_exists(store: JobStore) -> None:
    add(store, 1, key="k")
    with pytest.raises(IdempotencyConflictError) as e:
        add(store, 2, key="k", sha=SHA_B)
    assert (e.value.grpc_code, e.value.reason) == ("ALREADY_EXISTS", "IDEMPOTENCY_KEY_REUSED")
    assert "idempotency_key 'k'" in str(e.value) and jid(1) in str(e.value)
    assert e.value.metadata == {"idempotency_key": "k", "job_id": jid(1)}


def test_concurrent_creates_with_one_key_make_one_row(store: JobStore) -> None:
    outcomes = race(8, lambda k: add(store, k, key="one"))
    assert sum(created for _, created in outcomes) == 1
    assert len({r.job_id for r, _ in outcomes}) == 1
    assert len(store.list(limit=100)) == 1


def test_queue_full_counts_queued_jobs_only(store: JobStore) -> None:
    add(store, 0, max_queued=2)
    add(store, 1, max_queued=2)
    with pytest.raises(JobQueueFullError) as e:
        add(store, 2, max_queued=2)
    assert (e.value.grpc_code, e.value.reason) == ("RESOURCE_EXHAUSTED", "JOB_QUEUE_FULL")
    assert e.value.metadata == {"queued": "2", "max_queued": "2"}
    assert "--max-queued-jobs" in str(e.value)
    store.request_cancel(jid(0), T0)
    assert add(store, 2, max_queued=2)[1]


# ----------------------------------------------------------------------------- claims
def test_claims_take_the_oldest_free_job_and_skip_held_cancelled_and_deleted(store: JobStore) -> None:
    for i in range(5):
        add(store, i)
    store.request_cancel(jid(0), T0)  # cancelled
    store.mark_deleted(jid(1))
    first = store.claim_next("r1", LEASE_S, T0)
    assert first is not None
    expect(store, jid(2), state="queued", replica="r1", claim_expires_at=T0 + LEASE_S)
    store.request_cancel(jid(3), T0)
    second = store.claim_next("r2", LEASE_S, T0)
    assert (first.job_id, second and second.job_id) == (jid(2), jid(4))
    assert store.claim_next("r2", LEASE_S, T0) is None


def test_concurrent_claims_from_two_stores_take_every_job_exactly_once(store: JobStore, url: str) -> None:
    n_jobs = 40
    for i in range(n_jobs):
        add(store, i)
    other = JobStore.open(url)  # a second engine: another replica's process
    try:
        stores = [store, other]

        def drain(k: int) -> list[str]:
            replica, taken = f"r{k % 2}", []
            while (r := stores[k % 2].claim_next(replica, LEASE_S, T0)) is not None:
                assert r.replica == replica
                taken.append(r.job_id)
            return taken

        taken = [job for got in race(8, drain) for job in got]
    finally:
        other.close()
    assert sorted(taken) == [jid(i) for i in range(n_jobs)]  # every job, none twice


def test_an_expired_claim_is_taken_by_another_replica_and_runs_again(store: JobStore) -> None:
    job = run_started(store, 1, "r1")
    store.update_progress(job, "r1", stage="denoising", steps_done=2, steps_total=3)
    assert store.claim_next("r2", LEASE_S, T0 + LEASE_S - 1) is None  # r1's claim still holds
    taken = store.claim_next("r2", LEASE_S, T0 + LEASE_S + 1)
    assert taken is not None and taken.job_id == job
    expect(store, job, state="queued", stage="queued", steps_done=0, replica="r2", attempts=1, started_at=None)
    assert not store.mark_running(job, "r1", T0)  # r1 lost it: nothing it writes lands
    assert store.finish(job, "r1", state="succeeded", now=T0) is None
    assert store.mark_running(job, "r2", T0 + 40)
    expect(store, job, state="running", attempts=2, started_at=T0 + 40)


def test_renew_keeps_claims_and_names_the_cancel_requested(store: JobStore) -> None:
    a, b = run_started(store, 1), run_started(store, 2)
    store.request_cancel(b, T0)
    assert store.renew_claims("r1", LEASE_S, T0 + 20) == [b]
    expect(store, a, claim_expires_at=T0 + 20 + LEASE_S)
    assert store.claim_next("r2", LEASE_S, T0 + LEASE_S + 1) is None  # renewed: not free
    assert store.renew_claims("r2", LEASE_S, T0) == []


def test_requeue_owned_keeps_order_and_resets_progress(store: JobStore) -> None:
    running = run_started(store, 0)
    store.update_progress(running, "r1", stage="denoising", steps_done=2, steps_total=3)
    add(store, 1)
    add(store, 2)
    assert store.claim_next("r1", LEASE_S, T0) is not None  # job 1 claimed, never started
    assert store.claim_next("r2", LEASE_S, T0) is not None  # job 2: another replica's
    assert store.requeue_owned("r1") == [jid(0), jid(1)]
    expect(store, jid(0), state="queued", stage="queued", steps_done=0, replica=None, started_at=None, attempts=1)
    expect(store, jid(2), replica="r2")
    order = [store.claim_next("r1", LEASE_S, T0 + 1) for _ in range(3)]
    assert [r and r.job_id for r in order] == [jid(0), jid(1), None]


def test_unclaim_gives_the_job_back(store: JobStore) -> None:
    add(store, 1)
    assert store.claim_next("r1", LEASE_S, T0) is not None
    store.unclaim(jid(1), "r2")  # not r2's
    expect(store, jid(1), replica="r1")
    store.unclaim(jid(1), "r1")
    taken = store.claim_next("r2", LEASE_S, T0)
    assert taken is not None and taken.replica == "r2"


# ----------------------------------------------------------------------------- running and finishing
def test_progress_and_running_need_the_holder(store: JobStore) -> None:
    add(store, 1)
    assert not store.mark_running(jid(1), "r1", T0)  # nobody claimed it
    assert store.claim_next("r1", LEASE_S, T0) is not None
    assert not store.mark_running(jid(1), "r2", T0)
    assert store.mark_running(jid(1), "r1", T0 + 2)
    store.update_progress(jid(1), "r2", stage="denoising", steps_done=1, steps_total=3)
    expect(store, jid(1), state="running", stage="preparing", steps_done=0, started_at=T0 + 2, attempts=1)
    store.update_progress(jid(1), "r1", stage="denoising", steps_done=1, steps_total=3)
    expect(store, jid(1), stage="denoising", steps_done=1)


def test_finish_happens_once_and_stores_result_and_content(store: JobStore) -> None:
    job = run_started(store, 1)
    content = ContentRef(SHA_A, 123, "video/mp4", "x.mp4")
    done = store.finish(job, "r1", state="succeeded", now=T0 + 5, result={"sha256": "f" * 64}, content=content)
    assert done is not None
    expect(store, job, state="succeeded", stage="done", finished_at=T0 + 5, replica="r1", claim_expires_at=None,
           result={"sha256": "f" * 64}, content_sha256=SHA_A, content_bytes=123, content_type="video/mp4",
           content_filename="x.mp4", content_available=True, error_code=None)  # fmt: skip
    assert store.finish(job, "r1", state="failed", now=T0 + 6, error=("INTERNAL", "X", "late")) is None
    expect(store, job, state="succeeded", finished_at=T0 + 5)
    with pytest.raises(ValueError, match="state: must be one of"):
        store.finish(job, "r1", state="running", now=T0)


# ----------------------------------------------------------------------------- cancel and delete
def test_cancel_a_queued_job_nobody_holds_ends_it_at_once(store: JobStore) -> None:
    add(store, 1)
    record = store.request_cancel(jid(1), T0 + 3)
    assert record is not None
    expect(store, jid(1), state="cancelled", stage="done", finished_at=T0 + 3, error_code="CANCELLED",
           error_reason="CANCELLED", error_message=f"job {jid(1)} was cancelled while queued")  # fmt: skip
    assert store.claim_next("r1", LEASE_S, T0) is None
    assert store.request_cancel(jid(99), T0) is None


def test_cancel_a_claimed_or_running_job_asks_its_holder(store: JobStore) -> None:
    add(store, 1)
    assert store.claim_next("r1", LEASE_S, T0) is not None
    store.request_cancel(jid(1), T0)
    expect(store, jid(1), state="queued", cancel_requested=True, replica="r1")
    running = run_started(store, 2)
    store.request_cancel(running, T0)
    expect(store, running, state="running", cancel_requested=True)
    assert store.finish(running, "r1", state="cancelled", now=T0 + 1, error=("CANCELLED", "CANCELLED", "m"))


def test_cancel_a_final_job_changes_nothing(store: JobStore) -> None:
    job = run_started(store, 1)
    before = store.finish(job, "r1", state="succeeded", now=T0 + 1)
    assert store.request_cancel(job, T0 + 2) == before


def test_cancel_requested_jobs_nobody_holds_are_cancelled_by_the_next_claim(store: JobStore) -> None:
    add(store, 1)
    claimed = store.claim_next("r1", LEASE_S, T0)
    assert claimed is not None and claimed.job_id == jid(1)
    running = run_started(store, 2, "dead")
    store.request_cancel(jid(1), T0)  # held: cancel_requested only
    store.request_cancel(running, T0)
    store.unclaim(jid(1), "r1")  # r1 let it go without running it
    assert store.claim_next("r2", LEASE_S, T0 + 1) is None
    expect(store, jid(1), state="cancelled", error_message=f"job {jid(1)} was cancelled while queued")
    expect(store, running, state="running", cancel_requested=True)  # "dead" still holds it
    assert store.claim_next("r2", LEASE_S, T0 + LEASE_S + 1) is None  # "dead" never renewed: its claim expired
    expect(store, running, state="cancelled", replica="dead", error_code="CANCELLED",
           error_message=f"job {running} was cancelled after its replica stopped holding it")  # fmt: skip


def test_delete_hides_the_job_then_removes_it_once_stopped(store: JobStore) -> None:
    done = run_started(store, 1)
    store.finish(done, "r1", state="succeeded", now=T0 + 1)
    live = run_started(store, 2)
    assert store.mark_deleted(done) is not None and store.mark_deleted(done) is None
    marked = store.mark_deleted(live)
    assert marked is not None and marked.cancel_requested and marked.deleted
    assert store.get(done) is None and store.get_any(done) is not None
    assert [r.job_id for r in store.list(limit=10)] == []
    assert [r.job_id for r in store.deleted_terminal()] == [done]
    assert store.remove(live) is None  # never while it runs
    store.finish(live, "r1", state="cancelled", now=T0 + 2, error=("CANCELLED", "CANCELLED", "m"))
    assert [r.job_id for r in store.deleted_terminal()] == [done, live]
    removed = store.remove(done)
    assert removed is not None and removed.job_id == done
    assert store.remove(done) is None and store.get_any(done) is None


def test_a_deleted_jobs_key_is_held_until_the_row_is_removed(store: JobStore) -> None:
    add(store, 1, key="k")
    store.request_cancel(jid(1), T0)  # final at once
    store.mark_deleted(jid(1))
    with pytest.raises(IdempotencyConflictError, match="being deleted"):
        add(store, 2, key="k")
    assert store.remove(jid(1)) is not None
    record, created = add(store, 2, key="k")
    assert created and record.job_id == jid(2)


# ----------------------------------------------------------------------------- retention
def finished(store: JobStore, i: int, at: float, content: ContentRef | None = None, state: str = "succeeded") -> str:
    job = run_started(store, i)
    assert store.finish(job, "r1", state=state, now=at, content=content) is not None
    return job


def test_retention_queries(store: JobStore) -> None:
    a, b = ContentRef(SHA_A, 100, "video/mp4", "a.mp4"), ContentRef(SHA_B, 7, "application/zip", "b.zip")
    j1 = finished(store, 1, T0 + 30, a)
    j2 = finished(store, 2, T0 + 10, a)  # the same bytes again: one file
    j3 = finished(store, 3, T0 + 20, b)
    j4 = finished(store, 4, T0 + 5, state="failed")
    add(store, 5)
    assert store.content_refs(SHA_A) == 2 and store.content_refs(SHA_B) == 1 and store.content_refs("c" * 64) == 0
    assert store.content_bytes_total() == 107
    assert [r.job_id for r in store.content_oldest_first()] == [j2, j3, j1]
    assert [r.job_id for r in store.expired(T0 + 20)] == [j2, j4]
    assert store.counts_by_state() == {"queued": 1, "running": 0, "succeeded": 3, "failed": 1, "cancelled": 0}
    store.set_content_unavailable(j2)
    expect(store, j2, content_available=False, content_sha256=SHA_A)
    assert store.content_refs(SHA_A) == 1 and store.content_bytes_total() == 107
    store.mark_deleted(j1)
    assert store.content_refs(SHA_A) == 0
    assert [r.job_id for r in store.content_oldest_first()] == [j3]
    assert store.counts_by_state()["succeeded"] == 2


# ----------------------------------------------------------------------------- the store itself
def test_records_survive_close_and_reopen(url: str) -> None:
    first = JobStore.open(url)
    try:
        add(first, 1, key="k")
        assert first.claim_next("r1", LEASE_S, T0) is not None
    finally:
        first.close()
    again = JobStore.open(url)
    try:
        expect(again, jid(1), state="queued", replica="r1", idempotency_key="k")
        assert add(again, 2, key="k")[1] is False
    finally:
        again.close()


def test_a_newer_schema_is_refused(url: str) -> None:
    JobStore.open(url).close()
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    engine.dispose()
    with pytest.raises(ValueError, match="schema_version 99 is newer"):
        JobStore.open(url)


def test_sqlite_is_in_wal_mode_and_makes_its_directory(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "jobs.db"
    store = JobStore.open(f"sqlite:///{path}")
    try:
        assert store.dialect == "sqlite"
        with sqlite3.connect(path) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
            assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("2",)
    finally:
        store.close()


def test_postgresql_url_shows_no_password(pg_url: str) -> None:
    reset_database(pg_url)
    with_password = pg_url.replace("postgres@", "postgres:s3cret@", 1)  # trust auth: the password is not checked
    store = JobStore.open(with_password)
    try:
        assert store.dialect == "postgresql"
        assert "s3cret" not in store.url_for_display and "***" in store.url_for_display
    finally:
        store.close()


@pytest.mark.parametrize(
    ("url", "message"),
    [("mysql://h/db", "must be a sqlite:///PATH or postgresql:// URL"), ("sqlite://", "needs a file path")],
)
def test_other_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        JobStore.open(url)


# ---------------------------------------------------------------- owners, blobs, attempts, lapsed claims (schema 2)
def test_owners_see_only_their_jobs_and_keys_are_per_owner(store: JobStore) -> None:
    mine, created = store.create(
        job_id=jid(1), request=b"r", request_sha256=SHA_A, idempotency_key="k", spec={}, steps_total=3, now=T0,
        max_queued=10, owner="alice",
    )  # fmt: skip
    theirs, created_too = store.create(
        job_id=jid(2), request=b"r", request_sha256=SHA_B, idempotency_key="k", spec={}, steps_total=3, now=T0,
        max_queued=10, owner="bob",
    )  # fmt: skip
    assert created and created_too and mine.job_id != theirs.job_id  # one key, two owners: two jobs
    assert store.get(jid(1), "alice") is not None and store.get(jid(1), "bob") is None
    assert store.get(jid(1)) is not None  # an admin (no owner) sees every job
    assert [r.job_id for r in store.list(limit=10, owner="bob")] == [jid(2)]
    assert {r.job_id for r in store.list(limit=10)} == {jid(1), jid(2)}
    found = store.find_key("alice", "k")
    assert found is not None and found.job_id == jid(1) and store.find_key("carol", "k") is None


def test_parts_are_stored_once_and_go_with_the_last_job_naming_them(store: JobStore) -> None:
    shared, own = b"S" * 100_000, b"O" * 50_000

    def make(i: int, parts: dict[str, bytes]) -> None:
        store.create(job_id=jid(i), request=b"slim", request_sha256=SHA_A, idempotency_key=None, spec={},
                     steps_total=3, now=T0, max_queued=10, parts=parts)  # fmt: skip

    make(1, {"references[0]": shared, "first_frame": own})
    make(2, {"references[0]": shared, "references[1]": shared})  # the same file twice: one blob, one link
    assert store.blob_bytes() == (2, len(shared) + len(own))
    assert store.request_of(jid(2)) == (b"slim", {"references[0]": shared, "references[1]": shared})
    record = store.get(jid(1))
    assert record is not None and set(record.request_parts) == {"references[0]", "first_frame"}
    for i in (1, 2):
        store.request_cancel(jid(i), T0)  # queued, nobody holds it: cancelled at once, so removable
    assert store.remove(jid(1)) is not None
    assert store.blob_bytes() == (1, len(shared))  # jid(2) still names the shared one
    assert store.remove(jid(2)) is not None
    assert store.blob_bytes() == (0, 0)


def test_a_lapsed_claim_is_never_taken_over_by_its_own_holder(store: JobStore) -> None:
    job = run_started(store, 1, "r1")
    late = T0 + LEASE_S + 100  # r1's retention pass outlasted its claim
    assert store.claim_next("r1", LEASE_S, late) is None  # never its own running job again
    expect(store, job, state="running", replica="r1", interruptions=0)
    assert store.renew_claims("r1", LEASE_S, late) == []  # r1 renews it instead
    assert store.claim_next("r2", LEASE_S, late + 1) is None  # renewed: nobody takes it
    assert store.holding("r1") == {job}


def test_a_job_that_keeps_ending_with_its_replica_fails_after_max_attempts(store: JobStore) -> None:
    job = run_started(store, 1, "r1")
    add(store, 2)
    for attempt in (1, 2):
        store.requeue_owned("r1")  # the generator was killed while it ran
        expect(store, job, state="queued", interruptions=attempt)
        claimed = store.claim_next("r1", LEASE_S, T0 + 10, max_attempts=3)
        assert claimed is not None and claimed.job_id == job  # the oldest: it runs first again
        assert store.mark_running(job, "r1", T0 + 11)
    store.requeue_owned("r1")  # the third run ended the same way
    nxt = store.claim_next("r1", LEASE_S, T0 + 20, max_attempts=3)
    assert nxt is not None and nxt.job_id == jid(2)  # the queue moves on
    expect(store, job, state="failed", error_reason="ATTEMPTS_EXHAUSTED", error_code="ABORTED", attempts=3,
           interruptions=3, replica=None)  # fmt: skip


def test_a_takeover_of_a_dead_replicas_running_job_counts_as_an_interruption(store: JobStore) -> None:
    job = run_started(store, 1, "r1")
    claimed = store.claim_next("r2", LEASE_S, T0 + LEASE_S + 1, max_attempts=1)
    assert claimed is None  # max_attempts 1: the one interrupted run was its last
    expect(store, job, state="failed", error_reason="ATTEMPTS_EXHAUSTED", interruptions=1)


def test_requeue_after_the_backend_went_away_keeps_the_place_and_counts_an_interruption(store: JobStore) -> None:
    job = run_started(store, 1, "r1")
    add(store, 2)
    assert store.requeue(job, "r1")
    expect(store, job, state="queued", replica=None, interruptions=1, steps_done=0, started_at=None)
    assert not store.requeue(job, "r1")  # no longer r1's
    claimed = store.claim_next("r1", LEASE_S, T0 + 5)
    assert claimed is not None and claimed.job_id == job


def test_cancel_ends_at_once_what_no_live_replica_runs(store: JobStore) -> None:
    add(store, 1)
    assert store.claim_next("r1", LEASE_S, T0) is not None  # claimed by r1, not started
    cancelled = store.request_cancel(jid(1), T0 + 1, replica="r1")  # r1 itself asks (it withdrew the run)
    assert cancelled is not None and cancelled.state == "cancelled"
    job = run_started(store, 2, "r2")
    dead = store.request_cancel(job, T0 + LEASE_S + 10)  # r2's claim lapsed: its replica is gone
    assert dead is not None and dead.state == "cancelled"
    assert store.mark_deleted(job) is not None and store.remove(job) is not None


def test_failed_and_cancelled_jobs_expire_sooner(store: JobStore) -> None:
    ok, bad = run_started(store, 1), run_started(store, 2)
    store.finish(ok, "r1", state="succeeded", now=T0 + 10)
    store.finish(bad, "r1", state="failed", now=T0 + 10, error=("INTERNAL", "X", "boom"))
    assert [r.job_id for r in store.expired(T0, T0 + 11)] == [bad]
    assert [r.job_id for r in store.expired(T0 + 11)] == [ok, bad]


def test_a_locked_database_is_unavailable_with_no_sql_in_the_message(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    store = JobStore.open(f"sqlite:///{path}", clock=lambda: T0, busy_timeout_ms=50)
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        with pytest.raises(JobStoreUnavailableError) as err:
            add(store, 1)
        message = str(err.value)
        assert "database is locked" in message and "SQL" not in message and str(tmp_path) not in message
        assert err.value.grpc_code == "UNAVAILABLE" and err.value.retry_after_s > 0
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    add(store, 1)  # nothing was half-written
    assert [r.job_id for r in store.list(limit=10)] == [jid(1)]
    store.close()


def test_list_loads_no_request_blob(store: JobStore) -> None:
    """A page of jobs whose requests hold 64 MiB of parts reads none of them: the peak Python memory of the list
    stays far below one part."""
    part = 8 * 2**20
    for i in range(8):
        store.create(job_id=jid(i), request=b"slim", request_sha256=SHA_A, idempotency_key=None, spec={},
                     steps_total=3, now=T0, max_queued=100, parts={"references[0]": bytes([i]) * part})  # fmt: skip
    tracemalloc.start()
    try:
        page = store.list(limit=100)
        one = store.get(jid(3))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(page) == 8 and one is not None
    assert peak < part // 8, f"list/get peaked at {peak} bytes"


V1_DDL = """
CREATE TABLE meta (key VARCHAR(64) PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE jobs (
    seq {seq}, job_id VARCHAR(40) NOT NULL UNIQUE, idempotency_key VARCHAR(256) UNIQUE, request {blob} NOT NULL,
    request_sha256 VARCHAR(64) NOT NULL, spec TEXT NOT NULL, state VARCHAR(16) NOT NULL, stage VARCHAR(16) NOT NULL,
    steps_done INTEGER NOT NULL, steps_total INTEGER NOT NULL, created_at {dbl} NOT NULL, started_at {dbl},
    finished_at {dbl}, updated_at {dbl} NOT NULL, attempts INTEGER NOT NULL, replica VARCHAR(256),
    claim_expires_at {dbl}, cancel_requested BOOLEAN NOT NULL, deleted BOOLEAN NOT NULL, error_code VARCHAR(64),
    error_reason VARCHAR(128), error_message TEXT, result TEXT, content_sha256 VARCHAR(64),
    content_type VARCHAR(256), content_filename TEXT, content_bytes BIGINT, content_available BOOLEAN NOT NULL
);
CREATE INDEX ix_jobs_state_seq ON jobs (state, seq);
CREATE INDEX ix_jobs_replica ON jobs (replica);
CREATE INDEX ix_jobs_content_sha256 ON jobs (content_sha256);
INSERT INTO meta VALUES ('schema_version', '1');
INSERT INTO jobs (seq, job_id, idempotency_key, request, request_sha256, spec, state, stage, steps_done,
    steps_total, created_at, updated_at, attempts, cancel_requested, deleted, content_available)
VALUES (7, 'job_00000000000000000000000000000007', 'old-key', {request}, '{sha}', '{{}}', 'queued', 'queued', 0, 3,
    1.0, 1.0, 0, FALSE, FALSE, FALSE);
"""


def test_a_schema_1_store_is_migrated_keeping_its_jobs(url: str) -> None:
    """A store an earlier release wrote (schema 1: global idempotency keys, whole requests in the row) opens as
    schema 2: its job kept (owner anonymous, whole request), keys per owner, seq continuing after it."""
    sqlite_url = url.startswith("sqlite")
    ddl = V1_DDL.format(
        seq="INTEGER PRIMARY KEY AUTOINCREMENT" if sqlite_url else "BIGSERIAL PRIMARY KEY",
        blob="BLOB" if sqlite_url else "BYTEA", dbl="FLOAT" if sqlite_url else "DOUBLE PRECISION",
        request="X'0a03726571'" if sqlite_url else "'\\x0a03726571'::bytea", sha=SHA_A,
    )  # fmt: skip
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    if sqlite_url:
        Path(engine.url.database or "").parent.mkdir(parents=True, exist_ok=True)
    with engine.begin() as conn:
        for statement in filter(str.strip, ddl.split(";")):
            conn.exec_driver_sql(statement)
    engine.dispose()
    store = JobStore.open(url, clock=lambda: T0)
    try:
        old = expect(store, jid(7), owner="anonymous", idempotency_key="old-key", state="queued", request_parts={})
        assert store.request_of(old.job_id) == (b"\x0a\x03req", {})
        other, created = store.create(
            job_id=jid(8), request=b"r", request_sha256=SHA_B, idempotency_key="old-key", spec={}, steps_total=3,
            now=T0, max_queued=10, owner="alice",
        )  # fmt: skip
        assert created and other.seq > old.seq  # the key is free for another owner; seq goes on
    finally:
        store.close()
    reopened = JobStore.open(url)  # idempotent: schema 2 opens as it is
    reopened.close()


def test_the_sqlite_file_shrinks_once_its_jobs_are_removed(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    store = JobStore.open(f"sqlite:///{path}", clock=lambda: T0)
    try:
        empty = _db_bytes(path)
        store.create(job_id=jid(1), request=b"slim", request_sha256=SHA_A, idempotency_key=None, spec={},
                     steps_total=3, now=T0, max_queued=10, parts={"references[0]": b"\x07" * 8 * 2**20})  # fmt: skip
        grown = _db_bytes(path)
        assert grown > empty + 8 * 2**20
        store.request_cancel(jid(1), T0)
        assert store.remove(jid(1)) is not None
        store.reclaim()
        assert _db_bytes(path) < empty + 2**20  # the blob's pages went back to the file system
    finally:
        store.close()


def _db_bytes(path: Path) -> int:
    """The database's bytes: the file and its write-ahead log (checkpointed into the file by then, or not)."""
    wal = path.with_name(path.name + "-wal")
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
