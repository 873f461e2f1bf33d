"""Default locations shared by the CLI and both services (run dir, sidecar socket)."""

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


def ensure_private_dir(path: str | Path) -> Path:
    """Create `path` (mode 0700) or check an existing one is ours, then force mode 0700."""
    p = Path(path)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = p.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"run directory {p} belongs to uid {st.st_uid}, not to this user")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(p, 0o700)
    return p


def default_socket(run_dir: str | Path | None = None) -> Path:
    return Path(run_dir or default_run_dir()) / SOCKET_NAME


def grpc_target(address: str) -> str:
    """A gRPC target from 'unix:/path', '/path/to.sock' or 'host:port'."""
    if address.startswith("unix:") or (":" in address and not address.startswith("/")):
        return address
    return f"unix:{address}"
