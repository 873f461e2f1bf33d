"""Who is on the other end of a unix socket: `SO_PEERCRED`, checked before gRPC sees a byte.

grpc's Python server exposes neither the accepted fd nor the peer's credentials (its auth
context for a unix socket, even with local credentials, says only "local"). So the public
socket belongs to `UdsRelay`: it accepts, reads the peer's (pid, uid, gid) from the kernel,
closes the connection at once unless the uid is this process's, and otherwise splices the bytes
to the gRPC server's private socket, in a 0700 directory of this user's beside the public socket
(`.<name>.d/grpc.sock`; a fresh temp directory when that path would be too long for a socket). Each spliced
connection reaches the gRPC server from its own abstract address `ditserve-peer-<token>`, which
grpc reports as the call's `context.peer()`; `UdsRelay.peer(context.peer())` maps it back to the
credentials the kernel gave (and a call that did not come through the relay maps to None).

Cost: one extra local hop (two small copies per message), tens of microseconds per RPC.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import shutil
import socket
import stat
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from .errors import ServiceError

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # struct ucred: pid_t pid, uid_t uid, gid_t gid
PEER_PREFIX = "ditserve-peer-"
_CHUNK = 256 * 1024


@dataclass(frozen=True)
class PeerCred:
    """The connecting process as the kernel recorded it at connect(), in this process's namespaces
    (pid 0: the peer's pid namespace is not visible from here, so its pid is unknown)."""

    pid: int
    uid: int
    gid: int


class PeerRefusedError(ServiceError):
    """A peer that is not this service's user, or a call that bypassed the checked socket."""

    reason = "PEER_REFUSED"
    grpc_code = "PERMISSION_DENIED"


def peer_cred(sock: socket.socket) -> PeerCred:
    """The credentials of a connected AF_UNIX socket's peer (Linux `SO_PEERCRED`)."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return PeerCred(pid, uid, gid)


def check_peer(cred: PeerCred, uid: int) -> None:
    """Refuse (PeerRefusedError) a peer whose uid is not `uid`, the service's own."""
    if cred.uid != uid:
        raise PeerRefusedError(
            f"peer pid {cred.pid} runs as uid {cred.uid}; only uid {uid} (this service's user) may connect"
        )


_SUN_PATH_MAX = 107  # sockaddr_un.sun_path less its NUL


def private_dir(public: Path) -> Path:
    """The directory of the gRPC server's private socket: `.<name>.d` beside `public`, created 0700,
    and refused unless it is a real directory of this user's (forced to 0700); a fresh temp dir when
    a socket path inside it would be too long."""
    d = public.parent / f".{public.name}.d"
    if len(os.fsencode(d / "grpc.sock")) > _SUN_PATH_MAX:
        return Path(tempfile.mkdtemp(prefix="ditserve-grpc-"))
    with contextlib.suppress(FileExistsError):
        os.mkdir(d, 0o700)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(f"{d}: not a directory of this user's; remove it (it holds the sidecar's private socket)")
    os.chmod(d, 0o700)
    return d


class _Splice:
    """One accepted connection and its upstream twin; two pump threads, closed when both end."""

    def __init__(self, relay: UdsRelay, down: socket.socket, up: socket.socket, key: str) -> None:
        self.relay, self.down, self.up, self.key = relay, down, up, key
        self._open = 2
        self._lock = threading.Lock()

    def start(self) -> None:
        for src, dst, name in ((self.down, self.up, "in"), (self.up, self.down, "out")):
            threading.Thread(target=self._pump, args=(src, dst), name=f"uds-relay-{name}", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    break
                dst.sendall(data)
        except OSError:
            self.abort()  # one side is gone: end the other too
        finally:
            with self._lock:
                self._open -= 1
                done = self._open == 0
            if done:
                self._close()

    def abort(self) -> None:
        for s in (self.down, self.up):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def _close(self) -> None:
        self.down.close()
        self.up.close()
        self.relay._forget(self)


class UdsRelay:
    """The public unix socket at `public`: peers of another uid are refused at accept; the others
    are spliced to a gRPC server listening on `backend_address` (see the module docstring)."""

    def __init__(self, public: Path, uid: int | None = None) -> None:
        self.public = public
        self.uid = os.getuid() if uid is None else uid
        self.refused = 0
        """Connections closed at accept because the peer's uid was not ours."""
        self._private_dir = private_dir(public)
        self.backend = self._private_dir / "grpc.sock"
        if self.backend.exists() or self.backend.is_symlink():
            self.backend.unlink()  # left by a sidecar that was killed
        self._lock = threading.Lock()
        self._peers: dict[str, PeerCred] = {}
        self._splices: dict[str, _Splice] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if public.exists() or public.is_symlink():
                public.unlink()  # a stale socket from a crashed sidecar
            self._listener.bind(str(public))
            self._listener.listen(64)
        except BaseException:
            self._cleanup()
            raise
        self._thread = threading.Thread(target=self._accept_loop, name="uds-relay-accept", daemon=True)

    @property
    def backend_address(self) -> str:
        """Where the gRPC server listens: 'unix:<private dir>/grpc.sock'."""
        return f"unix:{self.backend}"

    def start(self) -> None:
        self._thread.start()

    def peer(self, grpc_peer: str) -> PeerCred | None:
        """The checked credentials behind a call's `context.peer()`; None if it did not come through us."""
        with self._lock:
            return self._peers.get(grpc_peer)

    def close(self) -> None:
        """Stop accepting, cut every spliced connection, remove the sockets and the private dir."""
        self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            splices = list(self._splices.values())
        for s in splices:
            s.abort()
        self._cleanup()

    def _cleanup(self) -> None:
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        shutil.rmtree(self._private_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.public.unlink()

    def _accept_loop(self) -> None:
        while True:
            ready, _, _ = select.select([self._listener, self._wake_r], [], [])
            if self._wake_r in ready:
                return
            try:
                down, _ = self._listener.accept()
            except OSError as e:
                log.warning("unix socket accept failed: %s", e)
                continue
            try:
                self._admit(down)
            except Exception as e:
                log.warning("connection on %s dropped: %s", self.public, e)
                down.close()

    def _admit(self, down: socket.socket) -> None:
        cred = peer_cred(down)
        try:
            check_peer(cred, self.uid)
        except PeerRefusedError as e:
            self.refused += 1
            log.warning("refused a connection on %s: %s", self.public, e)
            down.close()
            return
        name = f"{PEER_PREFIX}{secrets.token_hex(12)}"
        key = f"unix-abstract:{name}"
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.bind(b"\0" + name.encode())
            with self._lock:
                self._peers[key] = cred  # known before the gRPC server can see the connection
            up.connect(str(self.backend))
        except BaseException:
            with self._lock:
                self._peers.pop(key, None)
            up.close()
            raise
        splice = _Splice(self, down, up, key)
        with self._lock:
            self._splices[key] = splice
        splice.start()

    def _forget(self, splice: _Splice) -> None:
        with self._lock:
            self._splices.pop(splice.key, None)
            self._peers.pop(splice.key, None)
