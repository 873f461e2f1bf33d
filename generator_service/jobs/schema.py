"""The job store's schema: the `jobs`, `blobs`, `job_blobs` and `meta` tables (SQLAlchemy Core, one layout for
SQLite and PostgreSQL) and a row as a `Job`, the durable record the jobs API serves. No grpc here.

A job row is slim: the request's large parts (keyframes, reference files) are `blobs`, stored once by their sha256
and named by the jobs that use them (`job_blobs`); the row keeps the request without them (`request`, read only by
the dispatcher) and which part is which blob (`request_parts`). `Job` never carries the request: reading, listing
and watching jobs load no request bytes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

SCHEMA_VERSION = 2
"""The tables' layout; `meta.schema_version` records it (1: before owners and blobs; generator_service.jobs.migrate
moves a store from 1 to 2)."""
TERMINAL = ("succeeded", "failed", "cancelled")
STATES = ("queued", "running", *TERMINAL)
ANONYMOUS = "anonymous"
"""The owner of every job while authentication is off (and of every job a schema-1 store held)."""

metadata = sa.MetaData()
meta_table = sa.Table(
    "meta", metadata, sa.Column("key", sa.String(64), primary_key=True), sa.Column("value", sa.Text, nullable=False)
)
_Seq = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # sqlite: the rowid itself
jobs = sa.Table(
    "jobs",
    metadata,
    sa.Column("seq", _Seq, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(40), nullable=False, unique=True),
    sa.Column("owner", sa.String(256), nullable=False, server_default=ANONYMOUS),
    sa.Column("idempotency_key", sa.String(256)),  # unique per owner (uq_jobs_owner_key)
    sa.Column("request", sa.LargeBinary, nullable=False),  # the serialized GenerateRequest, its parts taken out
    sa.Column("request_parts", sa.Text, nullable=False, server_default="{}"),  # JSON {part name: blob sha256}
    sa.Column("request_sha256", sa.String(64), nullable=False),  # of the request's meaning (idempotency)
    sa.Column("spec", sa.Text, nullable=False),  # JSON
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("stage", sa.String(16), nullable=False),
    sa.Column("steps_done", sa.Integer, nullable=False, default=0),
    sa.Column("steps_total", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Double, nullable=False),  # epoch seconds, all four
    sa.Column("started_at", sa.Double),
    sa.Column("finished_at", sa.Double),
    sa.Column("updated_at", sa.Double, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("interruptions", sa.Integer, nullable=False, server_default="0"),  # runs a stop of their replica ended
    sa.Column("replica", sa.String(256)),
    sa.Column("claim_expires_at", sa.Double),
    sa.Column("cancel_requested", sa.Boolean, nullable=False, default=False),
    sa.Column("deleted", sa.Boolean, nullable=False, default=False),
    sa.Column("error_code", sa.String(64)),
    sa.Column("error_reason", sa.String(128)),
    sa.Column("error_message", sa.Text),
    sa.Column("result", sa.Text),  # JSON
    sa.Column("content_sha256", sa.String(64)),
    sa.Column("content_type", sa.String(256)),
    sa.Column("content_filename", sa.Text),
    sa.Column("content_bytes", sa.BigInteger),
    sa.Column("content_available", sa.Boolean, nullable=False, default=False),
    sa.UniqueConstraint("owner", "idempotency_key", name="uq_jobs_owner_key"),
    sa.Index("ix_jobs_state_seq", "state", "seq"),
    sa.Index("ix_jobs_owner_seq", "owner", "seq"),
    sa.Index("ix_jobs_replica", "replica"),
    sa.Index("ix_jobs_content_sha256", "content_sha256"),
    sqlite_autoincrement=True,  # a removed job's seq is never reused: paging and queue order stay true
)
blobs = sa.Table(
    "blobs",
    metadata,
    sa.Column("sha256", sa.String(64), primary_key=True),
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Column("created_at", sa.Double, nullable=False),
)
job_blobs = sa.Table(
    "job_blobs",
    metadata,
    sa.Column("job_id", sa.String(40), primary_key=True),
    sa.Column("sha256", sa.String(64), primary_key=True),
    sa.Index("ix_job_blobs_sha256", "sha256"),
)
RECORD_COLUMNS = tuple(col for col in jobs.c if col.name != "request")
"""What a `Job` is read from: every column but the request."""


@dataclass(frozen=True)
class Job:
    """A durable job: one row of `jobs` (but its request), `spec`, `result` and `request_parts` parsed. (The
    executor's unit of work is a `Run`: generator_service.execution.runs.)"""

    seq: int  # global order: queue order and ListJobs' paging
    job_id: str
    owner: str  # the principal that created it
    idempotency_key: str | None
    request_parts: dict[str, str]  # part name -> blob sha256
    request_sha256: str
    spec: dict[str, Any]  # the request's resolved values
    state: str  # STATES
    stage: str  # "queued", "preparing", "denoising", "decoding", "muxing", "storing", "done"
    steps_done: int
    steps_total: int
    created_at: float
    started_at: float | None
    finished_at: float | None
    updated_at: float
    attempts: int  # runs started
    interruptions: int  # runs that ended because their replica stopped (a crash, a kill, a restart)
    replica: str | None  # who holds (or ran) it
    claim_expires_at: float | None
    cancel_requested: bool
    deleted: bool
    error_code: str | None
    error_reason: str | None
    error_message: str | None
    result: dict[str, Any] | None
    content_sha256: str | None
    content_type: str | None
    content_filename: str | None
    content_bytes: int | None
    content_available: bool

    @classmethod
    def from_row(cls, row: sa.Row[Any]) -> Job:
        m = dict(row._mapping)
        m.pop("request", None)
        m["spec"] = json.loads(m["spec"])
        m["result"] = json.loads(m["result"]) if m["result"] is not None else None
        m["request_parts"] = json.loads(m["request_parts"] or "{}")
        return cls(**m)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL
