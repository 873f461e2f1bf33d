"""The durable job records under the Jobs API: one `jobs` table in SQLite (embedded, WAL) or PostgreSQL (shared by
replicas), through SQLAlchemy Core. No grpc here.

Life of a record: `create` (queued) -> `claim_next` (a replica holds it for `lease_s`, renewed by `renew_claims`;
still queued) -> `mark_running` -> `update_progress`... -> `finish` (succeeded | failed | cancelled). Every change is
one short transaction and a conditional UPDATE checked by its rowcount, so two replicas never hold one job and a
cancel never loses to a concurrent claim. A claim that expired (its replica died) is taken by the next
`claim_next`, running or not: the job runs again from the start. A cancel-requested job nobody holds is cancelled by
the next `claim_next`. Deleted records (`mark_deleted`) are invisible to `get`/`list` but hold their idempotency
key until `remove`: a create with that key is IdempotencyConflictError ("being deleted") until then.

Owners: every job has one; `get`/`list`/`find_key` take the caller's (None: an admin, who sees all) and a job of
another owner is as unknown. Idempotency keys are unique per owner. A request's large parts are `blobs` (stored once
by content, named through `job_blobs`); `remove` drops a job's links and every blob no job names any more, in one
transaction. Reads of records never load a request (`request_of` does, for the dispatcher).

Every database error leaves as JobStoreUnavailableError (UNAVAILABLE, retryable), its SQL and addresses logged here,
never sent to a client.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event, func
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine, make_url

from ..errors import IdempotencyConflictError, JobAttemptsExhaustedError, JobQueueFullError, JobStoreUnavailableError
from .migrate import migrate
from .results import ContentRef
from .schema import (
    ANONYMOUS,
    RECORD_COLUMNS,
    SCHEMA_VERSION,
    STATES,
    TERMINAL,
    Job,
    blobs,
    job_blobs,
    jobs,
    meta_table,
    metadata,
)  # fmt: skip

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 10_000
"""How long a SQLite writer waits for another's (short) transaction before failing: far above any of ours."""
_WRITE = "ditserve_write"  # execution option: this transaction writes (SQLite: BEGIN IMMEDIATE)
STORE_RETRY_AFTER_S = 1.0
"""What a client refused with JobStoreUnavailableError is told to wait before retrying."""
c = jobs.c
_LIVE = c.state.not_in(TERMINAL)


class JobStore:
    """The job records. Thread-safe (a connection pool); every method is one short transaction."""

    def __init__(self, engine: Engine, display_url: str, clock: Callable[[], float]) -> None:
        self._engine, self.url_for_display, self._clock = engine, display_url, clock
        self.dialect: str = engine.dialect.name

    @classmethod
    def open(
        cls, url: str, clock: Callable[[], float] = time.time, busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS
    ) -> JobStore:
        """Open (creating the tables if needed) `sqlite:///PATH` or `postgresql://...` (psycopg 3). `clock` stamps
        `updated_at` for the methods that take no `now`."""
        engine = _engine(url, busy_timeout_ms)
        store = cls(engine, make_url(url).render_as_string(hide_password=True), clock)
        try:
            store._auto_vacuum()
            store._create_schema()
        except BaseException:
            engine.dispose()
            raise
        return store

    def close(self) -> None:
        self._engine.dispose()

    @contextmanager
    def _tx(self, write: bool = False) -> Iterator[Connection]:
        try:
            with self._engine.connect() as conn:
                if write:
                    conn.execution_options(**{_WRITE: True})
                with conn.begin():
                    yield conn
        except sa.exc.IntegrityError:
            raise  # a constraint said no: the caller knows what that means
        except (sa.exc.DBAPIError, sa.exc.TimeoutError) as e:  # locked, gone, out of space, pool exhausted
            log.warning("job store %s: %s", self.url_for_display, e)
            raise JobStoreUnavailableError(
                f"the job store is unavailable ({_kind(e)}); retry shortly", STORE_RETRY_AFTER_S
            ) from None

    def _create_schema(self) -> None:
        with self._tx(write=True) as conn:
            if self.dialect == "postgresql":  # replicas starting together: one creates, the others wait
                conn.execute(sa.select(func.pg_advisory_xact_lock(0x6469747365727665)))
            metadata.create_all(conn)
            found = conn.execute(sa.select(meta_table.c.value).where(meta_table.c.key == "schema_version")).scalar()
            if found is None:
                conn.execute(meta_table.insert().values(key="schema_version", value=str(SCHEMA_VERSION)))
            elif int(found) > SCHEMA_VERSION:
                raise ValueError(
                    f"--job-store {self.url_for_display}: schema_version {found} is newer than this release's "
                    f"({SCHEMA_VERSION}); run the release that wrote it"
                )
            elif int(found) < SCHEMA_VERSION:
                migrate(conn, int(found))
                conn.execute(
                    meta_table.update().where(meta_table.c.key == "schema_version").values(value=str(SCHEMA_VERSION))
                )

    def _auto_vacuum(self) -> None:
        """SQLite: free pages go back to the file system (`reclaim`); a file made without it is rebuilt once."""
        if self.dialect != "sqlite":
            return
        if self._pragma("PRAGMA auto_vacuum") != 2:  # 2: INCREMENTAL
            self._pragma("PRAGMA auto_vacuum = INCREMENTAL")
            self._pragma("VACUUM")  # takes effect for the whole file

    def reclaim(self) -> None:
        """Give the space of removed rows and blobs back (SQLite: incremental vacuum; PostgreSQL's autovacuum makes
        it reusable by itself)."""
        if self.dialect != "sqlite":
            return
        try:
            with self._engine.connect() as conn:
                # executescript steps the pragma to its end (execute would free one page per call)
                conn.connection.dbapi_connection.executescript("PRAGMA incremental_vacuum;")  # type: ignore[union-attr]
        except (sa.exc.DBAPIError, sqlite3.OperationalError) as e:  # busy: the next pass frees the pages
            log.info("job store: incremental vacuum deferred: %s", e)

    def _pragma(self, statement: str) -> Any:
        """SQLite: `statement` (PRAGMA ... / VACUUM) outside any transaction; its first value."""
        with self._engine.connect() as conn:
            cur = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
            try:
                cur.execute(statement)
                rows = cur.fetchall()
            finally:
                cur.close()
            return rows[0][0] if rows else None

    # ---------------------------------------------------------------- creating and reading
    def create(
        self, *, job_id: str, request: bytes, request_sha256: str, idempotency_key: str | None, spec: dict[str, Any],
        steps_total: int, now: float, max_queued: int, owner: str = ANONYMOUS, parts: Mapping[str, bytes] = {},
    ) -> tuple[Job, bool]:  # fmt: skip
        """A new queued record of `owner` (True); or, for a key `owner` used and the same request (`request_sha256`:
        of its meaning), the existing one (False). IdempotencyConflictError for another request under the key;
        JobQueueFullError at `max_queued` queued jobs (on PostgreSQL concurrent creates may pass it by their number:
        the count is not locked). `request` is the request without its `parts` (name -> bytes), which are stored
        once each by content."""
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in parts.items()}
        row = dict(
            job_id=job_id, owner=owner, idempotency_key=idempotency_key, request=request,
            request_parts=json.dumps(digests, sort_keys=True), request_sha256=request_sha256,
            spec=json.dumps(spec, sort_keys=True), state="queued", stage="queued", steps_done=0,
            steps_total=steps_total, created_at=now, updated_at=now, attempts=0, interruptions=0,
            cancel_requested=False, deleted=False, content_available=False,
        )  # fmt: skip
        try:
            with self._tx(write=True) as conn:
                if idempotency_key is not None:
                    existing = _one(conn, _keyed(owner, idempotency_key))
                    if existing is not None:
                        return idempotent_retry(existing, idempotency_key, request_sha256), False
                queued = conn.execute(sa.select(func.count()).where(c.state == "queued", ~c.deleted)).scalar_one()
                if queued >= max_queued:
                    raise JobQueueFullError(
                        f"the job queue holds {queued} queued jobs, the most --max-queued-jobs allows "
                        f"({max_queued}); retry later",
                        {"queued": str(queued), "max_queued": str(max_queued)},
                    )
                self._put_blobs(conn, {digests[n]: data for n, data in parts.items()}, now)
                conn.execute(jobs.insert().values(**row))
                if digests:
                    conn.execute(job_blobs.insert(), [{"job_id": job_id, "sha256": d} for d in set(digests.values())])
                return _must(_one(conn, c.job_id == job_id)), True
        except sa.exc.IntegrityError:
            if idempotency_key is None:
                raise
            existing = self.find_key(owner, idempotency_key)  # a concurrent create with the same key won
            if existing is None:
                raise
            return idempotent_retry(existing, idempotency_key, request_sha256), False

    def _put_blobs(self, conn: Connection, by_sha: Mapping[str, bytes], now: float) -> None:
        """Each blob stored unless it is there already (a concurrent writer of the same bytes is no conflict)."""
        if not by_sha:
            return
        have = set(conn.execute(sa.select(blobs.c.sha256).where(blobs.c.sha256.in_(list(by_sha)))).scalars())
        insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        for sha, data in by_sha.items():
            if sha not in have:
                values = dict(sha256=sha, size=len(data), data=data, created_at=now)
                conn.execute(insert(blobs).values(**values).on_conflict_do_nothing(index_elements=["sha256"]))

    def find_key(self, owner: str, idempotency_key: str) -> Job | None:
        """`owner`'s job under `idempotency_key`, deleted or not; None when the key is free."""
        with self._tx() as conn:
            return _one(conn, _keyed(owner, idempotency_key))

    def get(self, job_id: str, owner: str | None = None) -> Job | None:
        """The job; None when unknown, deleted, or not `owner`'s (None: anyone's)."""
        record = self.get_any(job_id)
        if record is None or record.deleted or (owner is not None and record.owner != owner):
            return None
        return record

    def get_any(self, job_id: str) -> Job | None:
        """The job, deleted or not, whoever owns it; None when unknown."""
        with self._tx() as conn:
            return _one(conn, c.job_id == job_id)

    def request_of(self, job_id: str) -> tuple[bytes, dict[str, bytes]] | None:
        """The job's stored request and its parts (name -> bytes); None when unknown. (Only the dispatcher reads
        these: a record never carries them.)"""
        with self._tx() as conn:
            row = conn.execute(sa.select(c.request, c.request_parts).where(c.job_id == job_id)).first()
            if row is None:
                return None
            digests: dict[str, str] = json.loads(row.request_parts or "{}")
            found = {}
            if digests:
                q = sa.select(blobs.c.sha256, blobs.c.data).where(blobs.c.sha256.in_(set(digests.values())))
                found = {sha: bytes(data) for sha, data in conn.execute(q)}
            missing = sorted(n for n, d in digests.items() if d not in found)
            if missing:
                raise ValueError(f"job {job_id}: the stored parts {', '.join(missing)} are missing")
            return bytes(row.request), {name: found[d] for name, d in digests.items()}

    def list(
        self, *, states: Sequence[str] = (), limit: int, after_seq: int | None = None, oldest_first: bool = False,
        owner: str | None = None,
    ) -> builtins.list[Job]:  # fmt: skip
        """Up to `limit` jobs (not deleted) of `owner` (None: everyone's), newest first (seq descending) or oldest
        first, in `states` (all when empty), after `after_seq` (the previous page's last seq)."""
        q = _records().where(~c.deleted).order_by(c.seq if oldest_first else c.seq.desc()).limit(limit)
        if owner is not None:
            q = q.where(c.owner == owner)
        if states:
            q = q.where(c.state.in_(list(states)))
        if after_seq is not None:
            q = q.where(c.seq > after_seq if oldest_first else c.seq < after_seq)
        with self._tx() as conn:
            return [Job.from_row(r) for r in conn.execute(q)]

    def queue_position(self, job_id: str) -> int | None:
        """Queued jobs (not deleted) before this one; None unless it is queued."""
        with self._tx() as conn:
            me = conn.execute(sa.select(c.seq).where(c.job_id == job_id, c.state == "queued", ~c.deleted)).scalar()
            if me is None:
                return None
            ahead = sa.select(func.count()).where(c.state == "queued", ~c.deleted, c.seq < me)
            return int(conn.execute(ahead).scalar_one())

    # ---------------------------------------------------------------- the owner's side
    def claim_next(self, replica: str, lease_s: float, now: float, max_attempts: int | None = None) -> Job | None:
        """Hold the oldest job nobody holds (queued, or one whose claim expired: queued again, progress reset) for
        `lease_s`; None when there is none. A claim is never taken over by its own holder (`replica` renews its
        claims instead). First cancels the cancel-requested jobs nobody holds. A job whose runs were ended by their
        replica's stop `max_attempts` times is failed (ATTEMPTS_EXHAUSTED) instead, and the next one is taken."""
        free = sa.or_(c.replica.is_(None), sa.and_(c.claim_expires_at < now, c.replica != replica))
        takeable = sa.and_(_LIVE, free, ~c.deleted, ~c.cancel_requested)
        with self._tx(write=True) as conn:
            self._cancel_abandoned(conn, free, now)
            while True:
                # PostgreSQL: rows other claimers hold locked are skipped; SQLite: BEGIN IMMEDIATE serializes them
                pick = sa.select(c.seq, c.state, c.interruptions, c.attempts, c.job_id).where(takeable)
                row = conn.execute(pick.order_by(c.seq).limit(1).with_for_update(skip_locked=True)).first()
                if row is None:
                    return None
                interruptions = row.interruptions + (1 if row.state == "running" else 0)  # its replica died
                if max_attempts is not None and interruptions >= max_attempts:
                    failed = _exhausted(row.job_id, row.attempts, max_attempts, now)
                    conn.execute(jobs.update().where(c.seq == row.seq).values(interruptions=interruptions, **failed))
                    log.warning("job %s failed: %s", row.job_id, failed["error_message"])
                    continue
                claim = dict(replica=replica, claim_expires_at=now + lease_s, updated_at=now)
                reset = dict(state="queued", stage="queued", steps_done=0, started_at=None, interruptions=interruptions)
                # re-checked by the UPDATE itself: a claim that lost a race costs a None, never a shared job
                if conn.execute(jobs.update().where(c.seq == row.seq, takeable).values(**claim, **reset)).rowcount != 1:
                    return None
                return _one(conn, c.seq == row.seq)

    def _cancel_abandoned(self, conn: Connection, free: sa.ColumnElement[bool], now: float) -> None:
        """Cancel every live, cancel-requested job nobody holds (released, or its replica gone)."""
        pick = sa.select(c.seq, c.job_id, c.state).where(_LIVE, free, c.cancel_requested)
        for seq, job_id, state in conn.execute(pick.order_by(c.seq).with_for_update(skip_locked=True)).all():
            how = "while queued" if state == "queued" else "after its replica stopped holding it"
            conn.execute(
                jobs.update().where(c.seq == seq, _LIVE).values(**_cancelled(f"job {job_id} was cancelled {how}", now))
            )

    def mark_running(self, job_id: str, replica: str, now: float) -> bool:
        """Running (stage preparing, attempts + 1) if `replica` holds it and it is not final."""
        return self._held(
            job_id, replica, state="running", stage="preparing", started_at=now, updated_at=now,
            attempts=c.attempts + 1,
        )  # fmt: skip

    def update_progress(self, job_id: str, replica: str, *, stage: str, steps_done: int, steps_total: int) -> None:
        """Record progress if `replica` holds the job and it is not final."""
        self._held(
            job_id, replica, stage=stage, steps_done=steps_done, steps_total=steps_total, updated_at=self._clock()
        )

    def finish(
        self, job_id: str, replica: str, *, state: str, now: float, error: tuple[str, str, str] | None = None,
        result: dict[str, Any] | None = None, content: ContentRef | None = None,
    ) -> Job | None:  # fmt: skip
        """The final state (stage done; `replica` stays as who ran it) if `replica` holds the job and it is not
        final yet; else None (another replica took it over, or it already ended)."""
        if state not in TERMINAL:
            raise ValueError(f"state: must be one of {', '.join(TERMINAL)}, got {state!r}")
        code, reason, message = error if error is not None else (None, None, None)
        values: dict[str, Any] = dict(
            state=state, stage="done", finished_at=now, updated_at=now, claim_expires_at=None, error_code=code,
            error_reason=reason, error_message=message, result=json.dumps(result) if result is not None else None,
        )  # fmt: skip
        if content is not None:
            values.update(
                content_sha256=content.sha256, content_type=content.content_type, content_filename=content.filename,
                content_bytes=content.size, content_available=True,
            )  # fmt: skip
        with self._tx(write=True) as conn:
            done = conn.execute(jobs.update().where(c.job_id == job_id, c.replica == replica, _LIVE).values(**values))
            return _one(conn, c.job_id == job_id) if done.rowcount == 1 else None

    def renew_claims(self, replica: str, lease_s: float, now: float) -> builtins.list[str]:
        """Extend `replica`'s claims on its live jobs; the ids of those whose cancel was requested (seq order)."""
        mine = sa.and_(c.replica == replica, _LIVE)
        with self._tx(write=True) as conn:
            conn.execute(jobs.update().where(mine).values(claim_expires_at=now + lease_s))
            return list(conn.execute(sa.select(c.job_id).where(mine, c.cancel_requested).order_by(c.seq)).scalars())

    def holding(self, replica: str) -> set[str]:
        """The live jobs `replica` holds."""
        with self._tx() as conn:
            return set(conn.execute(sa.select(c.job_id).where(c.replica == replica, _LIVE)).scalars())

    def requeue_owned(self, replica: str) -> builtins.list[str]:
        """On restart: `replica`'s live jobs queued again where they were (their seq), progress reset (a running
        one's run counts as interrupted: `claim_next` fails it at `max_attempts`); their ids in seq order."""
        mine = sa.and_(c.replica == replica, _LIVE)
        with self._tx(write=True) as conn:
            ids = list(conn.execute(sa.select(c.job_id).where(mine).order_by(c.seq)).scalars())
            conn.execute(
                jobs.update()
                .where(mine)
                .values(state="queued", stage="queued", steps_done=0, started_at=None, replica=None,
                        claim_expires_at=None, updated_at=self._clock(),
                        interruptions=c.interruptions + sa.case((c.state == "running", 1), else_=0))
            )  # fmt: skip
        return ids

    def requeue(self, job_id: str, replica: str) -> bool:
        """A job `replica` holds queued again where it was (its seq), progress reset and released: its run ended
        because the backend went away (the sidecar restarting, say). That counts as an interruption (a job that
        keeps taking its sidecar down fails at `max_attempts` too). False when it is not `replica`'s or already
        final."""
        held = sa.and_(c.job_id == job_id, c.replica == replica, _LIVE)
        return self._set(
            held, state="queued", stage="queued", steps_done=0, started_at=None, replica=None, claim_expires_at=None,
            updated_at=self._clock(), interruptions=c.interruptions + 1,
        ) == 1  # fmt: skip

    def unclaim(self, job_id: str, replica: str) -> None:
        """Give back a job `replica` claimed but never started."""
        held = sa.and_(c.job_id == job_id, c.replica == replica, c.state == "queued")
        self._set(held, replica=None, claim_expires_at=None, updated_at=self._clock())

    def _held(self, job_id: str, replica: str, **values: Any) -> bool:
        return self._set(sa.and_(c.job_id == job_id, c.replica == replica, _LIVE), **values) == 1

    def _set(self, where: sa.ColumnElement[bool], **values: Any) -> int:
        """UPDATE jobs SET values WHERE where, in its own transaction; the rows changed."""
        with self._tx(write=True) as conn:
            return int(conn.execute(jobs.update().where(where).values(**values)).rowcount)

    # ---------------------------------------------------------------- cancel and delete
    def request_cancel(self, job_id: str, now: float, replica: str | None = None) -> Job | None:
        """Cancelled now: a queued job nobody holds, or one `replica` (the caller's own) holds but has not started,
        or a live job whose holder's claim expired (its replica is gone). Another live job: `cancel_requested` (its
        holder stops it; if a concurrent claim wins, the claimed job gets that). A final one: unchanged. None when
        unknown."""
        expired = c.claim_expires_at < now
        now_cancellable = sa.or_(
            sa.and_(c.state == "queued", sa.or_(c.replica.is_(None), c.replica == (replica or ""))), expired
        )
        with self._tx(write=True) as conn:
            now_cancelled = _cancelled(f"job {job_id} was cancelled while queued", now)
            q = jobs.update().where(c.job_id == job_id, _LIVE, now_cancellable).values(**now_cancelled)
            if conn.execute(q).rowcount == 0:
                conn.execute(
                    jobs.update().where(c.job_id == job_id, _LIVE).values(cancel_requested=True, updated_at=now)
                )
            return _one(conn, c.job_id == job_id)

    def mark_deleted(self, job_id: str) -> Job | None:
        """Mark the job deleted (and, if live, cancel-requested); None when unknown or already deleted."""
        live = sa.case((_LIVE, sa.true()), else_=c.cancel_requested)
        with self._tx(write=True) as conn:
            q = jobs.update().where(c.job_id == job_id, ~c.deleted)
            if conn.execute(q.values(deleted=True, cancel_requested=live, updated_at=self._clock())).rowcount == 0:
                return None
            return _one(conn, c.job_id == job_id)

    def remove(self, job_id: str) -> Job | None:
        """Delete a final job's row, its blob links and every blob no job names any more; what it was. None when
        unknown or still live (never removed while it runs)."""
        with self._tx(write=True) as conn:
            record = _one(conn, c.job_id == job_id, for_update=True)
            if record is None or not record.terminal:
                return None
            conn.execute(jobs.delete().where(c.job_id == job_id))
            if record.request_parts:
                conn.execute(job_blobs.delete().where(job_blobs.c.job_id == job_id))
                named = sa.select(job_blobs.c.sha256).where(job_blobs.c.sha256 == blobs.c.sha256).exists()
                shas = list(set(record.request_parts.values()))
                conn.execute(blobs.delete().where(blobs.c.sha256.in_(shas), ~named))
            return record

    def blob_bytes(self) -> tuple[int, int]:
        """(blobs, their bytes) the store holds."""
        with self._tx() as conn:
            n, size = conn.execute(sa.select(func.count(), func.coalesce(func.sum(blobs.c.size), 0))).one()
            return int(n), int(size)

    def deleted_terminal(self) -> builtins.list[Job]:
        """Deleted jobs that have stopped: to remove."""
        return self._select(sa.and_(c.deleted, ~_LIVE), c.seq)

    # ---------------------------------------------------------------- retention
    def content_refs(self, content_sha256: str) -> int:
        """Jobs (not deleted) whose available content is that file."""
        q = sa.select(func.count()).where(c.content_sha256 == content_sha256, c.content_available, ~c.deleted)
        with self._tx() as conn:
            return int(conn.execute(q).scalar_one())

    def expired(self, before: float, unsucceeded_before: float | None = None) -> builtins.list[Job]:
        """Final jobs that finished before `before` (epoch seconds); failed and cancelled ones already before
        `unsucceeded_before` when given."""
        done_before = c.finished_at < before
        if unsucceeded_before is not None:
            done_before = sa.or_(done_before, sa.and_(c.state != "succeeded", c.finished_at < unsucceeded_before))
        return self._select(sa.and_(~_LIVE, done_before), c.seq)

    def named_content(self, shas: Sequence[str]) -> set[str]:
        """Which of `shas` some record (deleted or not) names as its content."""
        if not shas:
            return set()
        with self._tx() as conn:
            q = sa.select(c.content_sha256).where(c.content_sha256.in_(list(shas))).distinct()
            return set(conn.execute(q).scalars())

    def content_oldest_first(self) -> builtins.list[Job]:
        """Succeeded jobs (not deleted) with available content, the earliest finished first."""
        return self._select(sa.and_(c.state == "succeeded", c.content_available, ~c.deleted), c.finished_at, c.seq)

    def set_content_unavailable(self, job_id: str) -> None:
        """Retention removed the job's content: the record stays."""
        self._set(c.job_id == job_id, content_available=False, updated_at=self._clock())

    def counts_by_state(self) -> dict[str, int]:
        """Jobs (not deleted) per state, every state named."""
        q = sa.select(c.state, func.count()).where(~c.deleted).group_by(c.state)
        with self._tx() as conn:
            return {s: 0 for s in STATES} | {s: int(n) for s, n in conn.execute(q).all()}

    def content_bytes_total(self) -> int:
        """Bytes of the distinct available content files the records name."""
        files = sa.select(c.content_sha256, c.content_bytes).where(c.content_available).distinct().subquery()
        with self._tx() as conn:
            return int(conn.execute(sa.select(func.coalesce(func.sum(files.c.content_bytes), 0))).scalar_one())

    def _select(self, where: sa.ColumnElement[bool], *order: sa.ColumnElement[Any]) -> builtins.list[Job]:
        with self._tx() as conn:
            return [Job.from_row(r) for r in conn.execute(_records().where(where).order_by(*order))]


def _engine(url: str, busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS) -> Engine:
    """SQLite with WAL, a busy timeout, foreign keys and BEGIN IMMEDIATE for writers; or PostgreSQL via psycopg 3."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres", "postgresql+psycopg"):
        return sa.create_engine(u.set(drivername="postgresql+psycopg"), pool_pre_ping=True)
    if u.drivername != "sqlite":
        raise ValueError(f"--job-store must be a sqlite:///PATH or postgresql:// URL, got {u.drivername}://")
    if not u.database or u.database == ":memory:":
        raise ValueError(f"--job-store {url}: SQLite needs a file path (sqlite:///PATH)")
    Path(u.database).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(u, connect_args={"check_same_thread": False, "timeout": busy_timeout_ms / 1000})

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # the driver's own BEGIN off: _begin says which kind
        cur = dbapi_conn.cursor()
        for pragma in ("journal_mode=WAL", f"busy_timeout={busy_timeout_ms}", "foreign_keys=ON"):
            cur.execute(f"PRAGMA {pragma}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # a writer takes the write lock first: a deferred one that read first could not upgrade (SQLITE_BUSY)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")

    return engine


def _records() -> sa.Select[Any]:
    """SELECT of the record columns (never the request)."""
    return sa.select(*RECORD_COLUMNS)


def _one(conn: Connection, where: sa.ColumnElement[bool], for_update: bool = False) -> Job | None:
    q = _records().where(where)
    row = conn.execute(q.with_for_update() if for_update else q).first()
    return Job.from_row(row) if row is not None else None


def _keyed(owner: str, key: str) -> sa.ColumnElement[bool]:
    return sa.and_(c.owner == owner, c.idempotency_key == key)


def _kind(e: Exception) -> str:
    """A database error's kind for a client: no SQL, no path, no address."""
    if isinstance(e, sa.exc.TimeoutError):
        return "no connection free"
    text = str(getattr(e, "orig", e)).lower()
    for needle, said in (("locked", "database is locked"), ("busy", "database is busy"), ("disk", "disk full"),
                         ("connect", "cannot connect"), ("readonly", "read-only")):  # fmt: skip
        if needle in text:
            return said
    return type(getattr(e, "orig", e)).__name__


def _must(record: Job | None) -> Job:
    assert record is not None, "a row just written is there"
    return record


def idempotent_retry(existing: Job, key: str, request_sha256: str) -> Job:
    """The job a retry under `key` of the request whose meaning is `request_sha256` returns; IdempotencyConflictError
    when the job is being deleted or was made for another request."""
    meta = {"idempotency_key": key, "job_id": existing.job_id}
    if existing.deleted:
        raise IdempotencyConflictError(
            f"idempotency_key {key!r} belongs to job {existing.job_id}, which is being deleted; retry once it is "
            "gone (the key is free then)",
            meta,
        )
    if existing.request_sha256 != request_sha256:
        raise IdempotencyConflictError(
            f"idempotency_key {key!r} was used by job {existing.job_id} for a different request; use a new key",
            meta,
        )
    return existing


def _cancelled(message: str, now: float) -> dict[str, Any]:
    return dict(
        state="cancelled", stage="done", finished_at=now, updated_at=now, claim_expires_at=None,
        error_code="CANCELLED", error_reason="CANCELLED", error_message=message,
    )  # fmt: skip


def _exhausted(job_id: str, attempts: int, max_attempts: int, now: float) -> dict[str, Any]:
    return dict(
        state="failed", stage="done", finished_at=now, updated_at=now, replica=None, claim_expires_at=None,
        error_code=JobAttemptsExhaustedError.grpc_code, error_reason=JobAttemptsExhaustedError.reason,
        error_message=f"job {job_id} was started {attempts} times and each run ended with its generator (killed, "
        f"out of memory or restarted): failed after --job-max-attempts {max_attempts}",
    )  # fmt: skip
