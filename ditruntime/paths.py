"""Default locations shared by the CLI and both services (run dir, sidecar socket), and the one
rule for every directory flag: created with mode 0700 if missing (parents too), or refused at
startup with a message naming the flag (`prepare_dir`, `require_dir`).

Only directories created here are chmod-ed. A private directory (the run dir, the socket's
directory) that already exists must already be private: one owned by another user, or with any
group/other permission bit, is refused (naming the flag, the mode and the fix), never changed —
`--socket ~/x.sock` must not chmod $HOME. The other directory flags (`--state-dir`, `--out`) may
be shared directories (a Kubernetes volume's root is group-writable with fsGroup) and are used as
they are.

`write_atomically` is the one way a result file is written: to a temporary name beside it, then renamed into place,
so a reader never sees a partial file and a failed write leaves none."""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

SOCKET_NAME = "plancache.sock"


def default_run_dir() -> Path:
    """Per-user run directory: $XDG_RUNTIME_DIR/ditserve, else <tmp>/ditserve-<uid>."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return Path(base) / "ditserve"
    return Path(tempfile.gettempdir()) / f"ditserve-{os.getuid()}"


class DirectoryFlagError(ValueError):
    """A directory flag whose path cannot be used; the message names the flag, the path and why."""


def check_dir(path: str | Path, flag: str) -> Path:
    """`prepare_dir`'s refusals without creating anything (for a directory made at first write):
    the path, or its nearest existing parent, must be a directory writable by this user."""
    p = Path(path).expanduser()
    q = p
    while not q.exists() and q.parent != q:
        q = q.parent
    if not q.is_dir():
        what = "the path" if q == p else f"its parent {q}"
        raise DirectoryFlagError(f"{flag} {p}: {what} exists and is not a directory")
    if not os.access(q, os.W_OK | os.X_OK):
        what = "the directory" if q == p else f"its parent {q}"
        raise DirectoryFlagError(f"{flag} {p}: {what} is not writable by this user")
    return p


def prepare_dir(path: str | Path, flag: str, *, private: bool = False) -> Path:
    """The directory of `flag`: each missing component (parents too) is created with mode 0700;
    refused (DirectoryFlagError) when the path or a parent is not a directory, a component cannot
    be created, or the directory is not writable. `private` (the run dir and the socket's
    directory): an existing directory must also belong to this user and have no group/other
    permission bit; it is refused otherwise, never chmod-ed (only what this call created is)."""
    p = Path(path).expanduser()
    missing: list[Path] = []
    q = p
    while not q.exists():
        if q.is_symlink():
            raise DirectoryFlagError(f"{flag} {p}: {q} is a dangling symlink")
        missing.append(q)
        if q.parent == q:
            break
        q = q.parent
    if q.exists() and not q.is_dir():
        what = "the path" if q == p else f"its parent {q}"
        raise DirectoryFlagError(f"{flag} {p}: {what} exists and is not a directory")
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            if not d.is_dir():
                raise DirectoryFlagError(f"{flag} {p}: {d} exists and is not a directory") from None
        except OSError as e:
            raise DirectoryFlagError(f"{flag} {p}: cannot create {d}: {e.strerror}") from e
        else:
            os.chmod(d, 0o700)  # exactly 0700, whatever the umask
    st = p.stat()
    if private:
        if st.st_uid != os.getuid():
            raise DirectoryFlagError(f"{flag} {p}: belongs to uid {st.st_uid}, not to this user")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise DirectoryFlagError(
                f"{flag} {p}: the directory has mode {mode:04o}, open to group/other; it must be private "
                f"(0700): run `chmod 700 {p}` if only this user should use it, or choose another directory"
            )
    if not os.access(p, os.W_OK | os.X_OK):
        raise DirectoryFlagError(f"{flag} {p}: the directory is not writable by this user")
    return p


def require_dir(path: str | Path, flag: str) -> Path:
    """An input directory flag (read, never created): refused unless it is an existing directory."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DirectoryFlagError(f"{flag} {p}: no such directory")
    if not p.is_dir():
        raise DirectoryFlagError(f"{flag} {p}: exists and is not a directory")
    return p


def ensure_private_dir(path: str | Path, flag: str = "--run-dir") -> Path:
    """Create `path` (mode 0700, parents too), or check that an existing one is ours and private (no
    group/other permission bit); refused otherwise, never chmod-ed."""
    return prepare_dir(path, flag, private=True)


def default_socket(run_dir: str | Path | None = None) -> Path:
    return Path(run_dir or default_run_dir()) / SOCKET_NAME


def grpc_target(address: str) -> str:
    """A gRPC target from 'unix:/path', '/path/to.sock' or 'host:port'."""
    if address.startswith("unix:") or (":" in address and not address.startswith("/")):
        return address
    return f"unix:{address}"


def write_atomically(path: str | os.PathLike[str], write: Callable[[Path], object]) -> Path:
    """Call `write(tmp)` on a temporary file beside `path` (same directory, so same filesystem), then rename it to
    `path`; the temporary file is removed if anything fails. The directory must exist."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def hold_lock(path: str | Path, what: str) -> IO[str]:
    """An exclusive advisory lock on `path` (created), held while the returned file stays open (the process's life:
    the kernel drops it when the process dies, `kill -9` included). DirectoryFlagError naming `what` and the
    holder's pid when another process holds it."""
    f = open(path, "a+")  # noqa: SIM115 - held open on purpose
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise DirectoryFlagError(f"{what} is in use by pid {holder}: give each process its own") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f
