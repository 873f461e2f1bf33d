"""The job store's schema: the `jobs` and `meta` tables (SQLAlchemy Core, one layout for SQLite and PostgreSQL) and
a row as a `Job`, the durable record the jobs API serves. No grpc here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

SCHEMA_VERSION = 1
"""The `jobs` table's layout; `meta.schema_version` records it so a later release can migrate."""
TERMINAL = ("succeeded", "failed", "cancelled")
STATES = ("queued", "running", *TERMINAL)

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
    sa.Column("idempotency_key", sa.String(256), unique=True),
    sa.Column("request", sa.LargeBinary, nullable=False),  # the serialized GenerateRequest
    sa.Column("request_sha256", sa.String(64), nullable=False),
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
    sa.Index("ix_jobs_state_seq", "state", "seq"),
    sa.Index("ix_jobs_replica", "replica"),
    sa.Index("ix_jobs_content_sha256", "content_sha256"),
    sqlite_autoincrement=True,  # a removed job's seq is never reused: paging and queue order stay true
)


@dataclass(frozen=True)
class Job:
    """A durable job: one row of `jobs`, `spec` and `result` parsed. (The executor's unit of work is a `Run`:
    generator_service.execution.runs.)"""

    seq: int  # global order: queue order and ListJobs' paging
    job_id: str
    idempotency_key: str | None
    request: bytes  # the serialized GenerateRequest
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
    attempts: int
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
        m["spec"] = json.loads(m["spec"])
        m["result"] = json.loads(m["result"]) if m["result"] is not None else None
        m["request"] = bytes(m["request"])
        return cls(**m)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL
