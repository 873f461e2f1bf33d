"""Default locations shared by the CLI and both services (run dir, sidecar socket), and the one
rule for every directory flag: created with mode 0700 if missing (parents too), or refused at
startup with a message naming the flag (`prepare_dir`, `require_dir`)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

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
    be created, or the directory is not writable. `private`: it must also belong to this user and
    is forced to 0700 (the run dir and the socket's directory)."""
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
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(p, 0o700)
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
    """Create `path` (mode 0700, parents too) or check an existing one is ours, then force mode 0700."""
    return prepare_dir(path, flag, private=True)


def default_socket(run_dir: str | Path | None = None) -> Path:
    return Path(run_dir or default_run_dir()) / SOCKET_NAME


def grpc_target(address: str) -> str:
    """A gRPC target from 'unix:/path', '/path/to.sock' or 'host:port'."""
    if address.startswith("unix:") or (":" in address and not address.startswith("/")):
        return address
    return f"unix:{address}"
