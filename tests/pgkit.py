"""A real PostgreSQL server for the tests: `pg_url`, a session-scoped fixture (registered by conftest.py).

initdb makes a throwaway cluster (trust auth) in a temp dir; the server listens on 127.0.0.1 on a free port and on a
unix socket in that dir, as the `postgres` OS user when the tests run as root (PostgreSQL refuses root). Without a
PostgreSQL install (.ci/run installs Debian's `postgresql`) or when it cannot start, the tests that use it skip.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

DATABASE = "ditserve_test"
START_TIMEOUT_S = 60
"""pg_ctl start -w gives up after this (a cold start is ~1 s; a loaded CI machine can be much slower)."""
SERVER_OPTIONS = "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=100"
"""Speed over durability: the cluster is thrown away after the session."""


@dataclass(frozen=True)
class PgServer:
    """A running throwaway server."""

    root: Path  # the temp dir: data/, the socket, the log
    port: int
    run_as: tuple[str, ...]  # the command prefix that runs a binary as the cluster's owner
    bindir: Path

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{DATABASE}"

    def pg_ctl(self, *args: str, timeout_s: float = START_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        cmd = [*self.run_as, str(self.bindir / "pg_ctl"), "-D", str(self.root / "data"), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=self.root)


def find_bindir() -> Path | None:
    """The directory holding initdb, pg_ctl and postgres: PATH first, then Debian's /usr/lib/postgresql/*/bin."""
    on_path = shutil.which("initdb")
    candidates = [Path(os.path.realpath(on_path)).parent] if on_path else []
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    candidates += sorted((Path(p) for p in versions), key=lambda p: _version(p.parent.name), reverse=True)
    for d in candidates:
        if all((d / b).is_file() for b in ("initdb", "pg_ctl", "postgres")):
            return d
    return None


def _version(name: str) -> tuple[int, ...]:
    return tuple(int(p) for p in name.split(".") if p.isdigit())


def _run_as() -> tuple[str, ...]:
    """`runuser -u postgres --` when root (initdb and postgres refuse to run as root), else nothing."""
    if os.geteuid() != 0:
        return ()
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError("running as root and there is no `postgres` OS user to run the server as") from None
    runuser = shutil.which("runuser")
    if runuser is None:
        raise RuntimeError("running as root and runuser(1) is missing, so the server cannot run as `postgres`")
    return (runuser, "-u", "postgres", "--")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(bindir: Path) -> PgServer:
    """initdb a cluster in a new temp dir and start it; RuntimeError (naming the step and its output) when that
    fails. The caller stops it with `stop`."""
    run_as = _run_as()
    root = Path(tempfile.mkdtemp(prefix="ditserve-pg-"))  # short: a unix socket path has ~107 characters
    try:
        if run_as:
            shutil.chown(root, "postgres", "postgres")
        init = [*run_as, str(bindir / "initdb"), "-D", str(root / "data"), "-U", "postgres", "--auth=trust"]
        done = subprocess.run([*init, "--no-sync", "-E", "UTF8", "--locale=C"], capture_output=True, text=True,
                              timeout=START_TIMEOUT_S, cwd=root)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {_last_line(done.stderr or done.stdout)}")
        server = PgServer(root, _free_port(), run_as, bindir)
        opts = f"-c listen_addresses=127.0.0.1 -p {server.port} -k {root} {SERVER_OPTIONS}"
        done = server.pg_ctl("start", "-w", "-t", str(START_TIMEOUT_S), "-l", str(root / "server.log"), "-o", opts)
        if done.returncode != 0:
            log = (root / "server.log").read_text(errors="replace") if (root / "server.log").exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {_last_line(log or done.stderr or done.stdout)}")
        _create_database(server)
        return server
    except BaseException:
        _stop_quietly(root, run_as, bindir)
        raise


def _create_database(server: PgServer) -> None:
    import psycopg

    try:
        with psycopg.connect(host="127.0.0.1", port=server.port, user="postgres", dbname="postgres") as conn:
            conn.autocommit = True
            conn.execute(f"CREATE DATABASE {DATABASE}")
    except psycopg.Error as e:
        raise RuntimeError(f"CREATE DATABASE {DATABASE} failed: {_last_line(str(e))}") from e


def stop(server: PgServer) -> None:
    """Stop the server (fast shutdown) and remove its temp dir."""
    _stop_quietly(server.root, server.run_as, server.bindir)


def _stop_quietly(root: Path, run_as: tuple[str, ...], bindir: Path) -> None:
    if (root / "data" / "postmaster.pid").exists():
        with contextlib.suppress(subprocess.TimeoutExpired):
            PgServer(root, 0, run_as, bindir).pg_ctl("stop", "-m", "fast", "-w", timeout_s=30)
    shutil.rmtree(root, ignore_errors=True)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def reset_database(url: str) -> None:
    """Drop every table of the test database (a fresh `public` schema), so each test starts from nothing."""
    import sqlalchemy as sa

    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP SCHEMA public CASCADE")
            conn.exec_driver_sql("CREATE SCHEMA public")
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """`postgresql://postgres@127.0.0.1:PORT/ditserve_test` of a throwaway server for the session (skips the test,
    saying why, when none can be found or started)."""
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL not installed (no initdb on PATH or in /usr/lib/postgresql/*/bin): .ci/run installs "
                    "Debian's postgresql package")  # fmt: skip
    try:
        server = start(bindir)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"PostgreSQL ({bindir}) did not start: {e}")
    try:
        yield server.url
    finally:
        stop(server)
