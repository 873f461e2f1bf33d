"""The durable job records under the Jobs API: one `jobs` table in SQLite (embedded, WAL) or PostgreSQL (shared by
replicas), through SQLAlchemy Core. No grpc here.

Life of a record: `create` (queued) -> `claim_next` (a replica holds it for `lease_s`, renewed by `renew_claims`;
still queued) -> `mark_running` -> `update_progress`... -> `finish` (succeeded | failed | cancelled). Every change is
one short transaction and a conditional UPDATE checked by its rowcount, so two replicas never hold one job and a
cancel never loses to a concurrent claim. A claim that expired (its replica died) is taken by the next
`claim_next`, running or not: the job runs again from the start. A cancel-requested job nobody holds is cancelled by
the next `claim_next`. Deleted records (`mark_deleted`) are invisible to `get`/`list` but hold their idempotency
key until `remove`: a create with that key is IdempotencyConflictError ("being deleted") until then.
"""

from __future__ import annotations

import builtins
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event, func
from sqlalchemy.engine import Connection, Engine, make_url

from ..errors import IdempotencyConflictError, JobQueueFullError
from .results import ContentRef
from .schema import SCHEMA_VERSION, STATES, TERMINAL, Job, jobs, meta_table, metadata

SQLITE_BUSY_TIMEOUT_MS = 10_000
"""How long a SQLite writer waits for another's (short) transaction before failing: far above any of ours."""
_WRITE = "ditserve_write"  # execution option: this transaction writes (SQLite: BEGIN IMMEDIATE)
c = jobs.c
_LIVE = c.state.not_in(TERMINAL)


class JobStore:
    """The job records. Thread-safe (a connection pool); every method is one short transaction."""

    def __init__(self, engine: Engine, display_url: str, clock: Callable[[], float]) -> None:
        self._engine, self.url_for_display, self._clock = engine, display_url, clock
        self.dialect: str = engine.dialect.name

    @classmethod
    def open(cls, url: str, clock: Callable[[], float] = time.time) -> JobStore:
        """Open (creating the tables if needed) `sqlite:///PATH` or `postgresql://...` (psycopg 3). `clock` stamps
        `updated_at` for the methods that take no `now`."""
        engine = _engine(url)
        store = cls(engine, make_url(url).render_as_string(hide_password=True), clock)
        try:
            store._create_schema()
        except BaseException:
            engine.dispose()
            raise
        return store

    def close(self) -> None:
        self._engine.dispose()

    @contextmanager
    def _tx(self, write: bool = False) -> Iterator[Connection]:
        with self._engine.connect() as conn:
            if write:
                conn.execution_options(**{_WRITE: True})
            with conn.begin():
                yield conn

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

    # ---------------------------------------------------------------- creating and reading
    def create(
        self, *, job_id: str, request: bytes, request_sha256: str, idempotency_key: str | None, spec: dict[str, Any],
        steps_total: int, now: float, max_queued: int,
    ) -> tuple[Job, bool]:  # fmt: skip
        """A new queued record (True); or, for a used `idempotency_key` and the same request, the existing one
        (False). IdempotencyConflictError for another request under the key; JobQueueFullError at `max_queued`
        queued jobs (on PostgreSQL concurrent creates may pass it by their number: the count is not locked)."""
        row = dict(
            job_id=job_id, idempotency_key=idempotency_key, request=request, request_sha256=request_sha256,
            spec=json.dumps(spec, sort_keys=True), state="queued", stage="queued", steps_done=0,
            steps_total=steps_total, created_at=now, updated_at=now, attempts=0, cancel_requested=False,
            deleted=False, content_available=False,
        )  # fmt: skip
        try:
            with self._tx(write=True) as conn:
                if idempotency_key is not None:
                    existing = _one(conn, c.idempotency_key == idempotency_key)
                    if existing is not None:
                        return _idempotent(existing, idempotency_key, request_sha256), False
                queued = conn.execute(sa.select(func.count()).where(c.state == "queued", ~c.deleted)).scalar_one()
                if queued >= max_queued:
                    raise JobQueueFullError(
                        f"the job queue holds {queued} queued jobs, the most --max-queued-jobs allows "
                        f"({max_queued}); retry later",
                        {"queued": str(queued), "max_queued": str(max_queued)},
                    )
                conn.execute(jobs.insert().values(**row))
                return _must(_one(conn, c.job_id == job_id)), True
        except sa.exc.IntegrityError:
            if idempotency_key is None:
                raise
            with self._tx() as conn:  # a concurrent create with the same key won: the one row is its
                existing = _one(conn, c.idempotency_key == idempotency_key)
            if existing is None:
                raise
            return _idempotent(existing, idempotency_key, request_sha256), False

    def get(self, job_id: str) -> Job | None:
        """The job; None when unknown or deleted."""
        record = self.get_any(job_id)
        return None if record is None or record.deleted else record

    def get_any(self, job_id: str) -> Job | None:
        """The job, deleted or not; None when unknown."""
        with self._tx() as conn:
            return _one(conn, c.job_id == job_id)

    def list(
        self, *, states: Sequence[str] = (), limit: int, after_seq: int | None = None, oldest_first: bool = False
    ) -> list[Job]:
        """Up to `limit` jobs (not deleted), newest first (seq descending) or oldest first, in `states` (all when
        empty), after `after_seq` (the previous page's last seq)."""
        q = sa.select(jobs).where(~c.deleted).order_by(c.seq if oldest_first else c.seq.desc()).limit(limit)
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
    def claim_next(self, replica: str, lease_s: float, now: float) -> Job | None:
        """Hold the oldest job nobody holds (queued, or one whose claim expired: queued again, progress reset) for
        `lease_s`; None when there is none. First cancels the cancel-requested jobs nobody holds."""
        free = sa.or_(c.replica.is_(None), c.claim_expires_at < now)
        takeable = sa.and_(_LIVE, free, ~c.deleted, ~c.cancel_requested)
        with self._tx(write=True) as conn:
            self._cancel_abandoned(conn, free, now)
            # PostgreSQL: rows other claimers hold locked are skipped; SQLite: BEGIN IMMEDIATE serializes claimers
            pick = sa.select(c.seq).where(takeable).order_by(c.seq).limit(1).with_for_update(skip_locked=True)
            seq = conn.execute(pick).scalar()
            if seq is None:
                return None
            claim = dict(replica=replica, claim_expires_at=now + lease_s, updated_at=now)
            reset = dict(state="queued", stage="queued", steps_done=0, started_at=None)
            # re-checked by the UPDATE itself: a claim that lost a race costs a None, never a shared job
            if conn.execute(jobs.update().where(c.seq == seq, takeable).values(**claim, **reset)).rowcount != 1:
                return None
            return _one(conn, c.seq == seq)

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

    def requeue_owned(self, replica: str) -> builtins.list[str]:
        """On restart: `replica`'s live jobs queued again where they were (their seq), progress reset; their ids in
        seq order."""
        mine = sa.and_(c.replica == replica, _LIVE)
        with self._tx(write=True) as conn:
            ids = list(conn.execute(sa.select(c.job_id).where(mine).order_by(c.seq)).scalars())
            conn.execute(
                jobs.update()
                .where(mine)
                .values(state="queued", stage="queued", steps_done=0, started_at=None, replica=None,
                        claim_expires_at=None, updated_at=self._clock())
            )  # fmt: skip
        return ids

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
    def request_cancel(self, job_id: str, now: float) -> Job | None:
        """A queued job nobody holds: cancelled now. Another live job: `cancel_requested` (its holder stops it; if a
        concurrent claim wins, the claimed job gets that). A final one: unchanged. None when unknown."""
        with self._tx(write=True) as conn:
            unheld = sa.or_(c.replica.is_(None), c.claim_expires_at < now)
            now_cancelled = _cancelled(f"job {job_id} was cancelled while queued", now)
            q = jobs.update().where(c.job_id == job_id, c.state == "queued", unheld).values(**now_cancelled)
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
        """Delete a final job's row; what it was. None when unknown or still live (never removed while it runs)."""
        with self._tx(write=True) as conn:
            record = _one(conn, c.job_id == job_id, for_update=True)
            if record is None or not record.terminal:
                return None
            conn.execute(jobs.delete().where(c.job_id == job_id))
            return record

    def deleted_terminal(self) -> builtins.list[Job]:
        """Deleted jobs that have stopped: to remove."""
        return self._select(sa.and_(c.deleted, ~_LIVE), c.seq)

    # ---------------------------------------------------------------- retention
    def content_refs(self, content_sha256: str) -> int:
        """Jobs (not deleted) whose available content is that file."""
        q = sa.select(func.count()).where(c.content_sha256 == content_sha256, c.content_available, ~c.deleted)
        with self._tx() as conn:
            return int(conn.execute(q).scalar_one())

    def expired(self, before: float) -> builtins.list[Job]:
        """Final jobs that finished before `before` (epoch seconds)."""
        return self._select(sa.and_(~_LIVE, c.finished_at < before), c.seq)

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
            return [Job.from_row(r) for r in conn.execute(sa.select(jobs).where(where).order_by(*order))]


def _engine(url: str) -> Engine:
    """SQLite with WAL, a busy timeout, foreign keys and BEGIN IMMEDIATE for writers; or PostgreSQL via psycopg 3."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres", "postgresql+psycopg"):
        return sa.create_engine(u.set(drivername="postgresql+psycopg"), pool_pre_ping=True)
    if u.drivername != "sqlite":
        raise ValueError(f"--job-store must be a sqlite:///PATH or postgresql:// URL, got {u.drivername}://")
    if not u.database or u.database == ":memory:":
        raise ValueError(f"--job-store {url}: SQLite needs a file path (sqlite:///PATH)")
    Path(u.database).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(u, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # the driver's own BEGIN off: _begin says which kind
        cur = dbapi_conn.cursor()
        for pragma in ("journal_mode=WAL", f"busy_timeout={SQLITE_BUSY_TIMEOUT_MS}", "foreign_keys=ON"):
            cur.execute(f"PRAGMA {pragma}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # a writer takes the write lock first: a deferred one that read first could not upgrade (SQLITE_BUSY)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")

    return engine


def _one(conn: Connection, where: sa.ColumnElement[bool], for_update: bool = False) -> Job | None:
    q = sa.select(jobs).where(where)
    row = conn.execute(q.with_for_update() if for_update else q).first()
    return Job.from_row(row) if row is not None else None


def _must(record: Job | None) -> Job:
    assert record is not None, "a row just written is there"
    return record


def _idempotent(existing: Job, key: str, request_sha256: str) -> Job:
    """The job a retry under `key` returns, or the conflict."""
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
