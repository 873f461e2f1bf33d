"""Moving a job store to this release's schema (generator_service.jobs.schema), once, at open, inside the open's
write transaction (so a crash leaves the old layout whole). No grpc here.

1 -> 2: jobs gain an owner (every old job: "anonymous"), idempotency keys become unique per owner, requests' large
parts move to `blobs` (old rows keep their whole request, `request_parts` empty: the dispatcher reads them as
before; retention removes them in time). SQLite cannot drop a column's UNIQUE, so the table is rebuilt: renamed,
created anew, copied, dropped; PostgreSQL's `seq` sequence is moved past the copied rows."""

from __future__ import annotations

import logging

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .schema import SCHEMA_VERSION, metadata

log = logging.getLogger(__name__)

V1_COLUMNS = (
    "seq", "job_id", "idempotency_key", "request", "request_sha256", "spec", "state", "stage", "steps_done",
    "steps_total", "created_at", "started_at", "finished_at", "updated_at", "attempts", "replica",
    "claim_expires_at", "cancel_requested", "deleted", "error_code", "error_reason", "error_message", "result",
    "content_sha256", "content_type", "content_filename", "content_bytes", "content_available",
)  # fmt: skip
"""The schema-1 `jobs` columns, all kept by schema 2."""
V1_INDEXES = ("ix_jobs_state_seq", "ix_jobs_replica", "ix_jobs_content_sha256")


def migrate(conn: Connection, found: int) -> None:
    """Bring a store at schema `found` to SCHEMA_VERSION (in the caller's transaction)."""
    if found == 1:
        _v1_to_v2(conn)
        found = 2
    if found != SCHEMA_VERSION:
        raise ValueError(f"no migration from job store schema {found} to {SCHEMA_VERSION}")


def _v1_to_v2(conn: Connection) -> None:
    dialect = conn.dialect.name
    n = conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one()
    conn.execute(sa.text("ALTER TABLE jobs RENAME TO jobs_v1"))
    for name in V1_INDEXES:  # index names are per schema (database): the new table's take them
        conn.execute(sa.text(f"DROP INDEX IF EXISTS {name}"))
    metadata.create_all(conn)
    cols = ", ".join(V1_COLUMNS)
    conn.execute(sa.text(f"INSERT INTO jobs ({cols}) SELECT {cols} FROM jobs_v1"))
    conn.execute(sa.text("DROP TABLE jobs_v1"))
    if dialect == "postgresql":
        conn.execute(
            sa.text(
                "SELECT setval(pg_get_serial_sequence('jobs', 'seq'), COALESCE((SELECT max(seq) FROM jobs), 0) + 1, false)"
            )
        )
    log.info("job store: schema 1 -> 2 (%d jobs kept, owner anonymous)", n)
