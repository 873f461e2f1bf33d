"""Content-addressed result files of jobs: `<root>/<sha256[:2]>/<sha256>`, written whole or not at all.

A write streams into a temp file in `root` named for its writer (`.tmp-<writer>-...`, hashing as it copies), then
`os.replace`s it under its final name, so a crash leaves no half file there; the temp files this writer's crash left
are removed on open (another replica's only once a day old: it may be writing them now). Equal content is kept once:
a write that finds its file there already refreshes its time. Readers and writers in this process are counted
(`reading`, `stored`): `remove` keeps a file while one holds it; across processes a file younger than the grace
period is never removed as an orphan. No grpc here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..errors import GeneratorError

CHUNK_BYTES = 1 << 20
"""Copy and hash 1 MiB at a time: big enough for the disk, small enough to never hold a result in memory."""
TEMP_PREFIX = ".tmp-"
"""Names of the files being written (in `root` itself, so `os.replace` stays on one filesystem)."""
STALE_TEMP_S = 24 * 3600.0
"""Another writer's temp file this old is a crash's leftover (no result takes a day to write)."""
_SHA256 = re.compile(r"[0-9a-f]{64}")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.]")


class ContentMissingError(GeneratorError):
    """A job's result file is gone from the results directory (removed by retention, `--results-max-gb`, or by
    hand) although its record says it is available. ErrorInfo metadata `sha256`."""

    reason = "CONTENT_UNAVAILABLE"
    grpc_code = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class ContentRef:
    """A stored result file."""

    sha256: str
    """Hex sha256 of the bytes (64 lowercase hex digits): also the file's name."""
    size: int
    """Bytes."""
    content_type: str
    """MIME type, e.g. "video/mp4"."""
    filename: str
    """A name to download it as, e.g. "<request_id>.mp4"."""


def check_sha256(sha256: str) -> str:
    """`sha256` if it is 64 lowercase hex digits (so no name can leave the results directory), else ValueError."""
    if not isinstance(sha256, str) or _SHA256.fullmatch(sha256) is None:
        raise ValueError(f"sha256: must be 64 lowercase hex digits, got {sha256!r:.80}")
    return sha256


class ResultStore:
    """The results directory. Thread-safe; several processes may share it (their readers are not counted here)."""

    def __init__(self, root: Path, writer: str = "local") -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._readers: dict[str, int] = {}  # sha256 -> readers and writers in this process; guarded by _lock
        self._temp_prefix = f"{TEMP_PREFIX}{_UNSAFE.sub('_', writer)[:64]}-"
        cutoff = time.time() - STALE_TEMP_S
        for stale in self.root.glob(f"{TEMP_PREFIX}*"):
            with contextlib.suppress(FileNotFoundError):
                if stale.name.startswith(self._temp_prefix) or stale.stat().st_mtime < cutoff:
                    stale.unlink()  # a write of ours a crash interrupted, or anyone's long dead one

    def path(self, sha256: str) -> Path:
        sha = check_sha256(sha256)
        return self.root / sha[:2] / sha

    # ---------------------------------------------------------------- writing
    def put_file(self, src: BinaryIO, content_type: str, filename: str) -> ContentRef:
        """Copy `src` (from its current position to its end) into the store."""
        return self.put_bytes(iter(lambda: src.read(CHUNK_BYTES), b""), content_type, filename)

    def put_bytes(self, data: bytes | Iterable[bytes], content_type: str, filename: str) -> ContentRef:
        """Store `data` (one bytes object, or chunks in order)."""
        with self.stored(data, content_type, filename) as ref:
            return ref

    @contextlib.contextmanager
    def stored(self, data: bytes | Iterable[bytes], content_type: str, filename: str) -> Iterator[ContentRef]:
        """Store `data` and hold the file (as a reader does) until the caller has recorded it: a `remove` racing the
        write (another job with the same bytes deleted meanwhile) cannot take it away in between."""
        chunks: Iterable[bytes] = (data,) if isinstance(data, bytes) else data
        fd, tmp_name = tempfile.mkstemp(prefix=self._temp_prefix, dir=self.root)
        tmp = Path(tmp_name)
        try:
            digest, size = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    view = memoryview(chunk)  # pieces without copying the chunk
                    for i in range(0, len(view), CHUNK_BYTES):
                        piece = view[i : i + CHUNK_BYTES]
                        digest.update(piece)
                        out.write(piece)
                        size += len(piece)
                out.flush()
                os.fsync(out.fileno())
            sha = digest.hexdigest()
            final = self.path(sha)
            with self._lock:  # placed (or found) and held in one step: no remove of ours in between
                if not _refresh(final, size):
                    os.chmod(tmp, 0o644)  # mkstemp makes it 0600; other replicas sharing the directory read it
                    _place(tmp, final)
                self._readers[sha] = self._readers.get(sha, 0) + 1
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        tmp.unlink(missing_ok=True)  # the same content was there already: that one is kept
        try:
            yield ContentRef(sha, size, content_type, filename)
        finally:
            self._release(sha)

    # ---------------------------------------------------------------- reading
    def open(self, sha256: str) -> BinaryIO:
        """The file, open for reading; ContentMissingError when it is gone."""
        try:
            return self.path(sha256).open("rb")
        except FileNotFoundError:
            raise self._missing(sha256) from None

    @contextlib.contextmanager
    def reading(self, sha256: str) -> Iterator[None]:
        """Counts as a reader of `sha256` while inside: `remove` keeps the file meanwhile."""
        check_sha256(sha256)
        with self._lock:
            self._readers[sha256] = self._readers.get(sha256, 0) + 1
        try:
            yield
        finally:
            self._release(sha256)

    def _release(self, sha256: str) -> None:
        with self._lock:
            left = self._readers[sha256] - 1
            if left:
                self._readers[sha256] = left
            else:
                del self._readers[sha256]

    def readers(self, sha256: str) -> int:
        """Readers of `sha256` in this process now."""
        with self._lock:
            return self._readers.get(check_sha256(sha256), 0)

    def size(self, sha256: str) -> int:
        """The file's bytes; ContentMissingError when it is gone."""
        try:
            return self.path(sha256).stat().st_size
        except FileNotFoundError:
            raise self._missing(sha256) from None

    def total_bytes(self) -> int:
        """Bytes of every result file (a directory scan, so files other replicas wrote count too)."""
        return sum(size for _, size, _ in self._files())

    def _files(self) -> Iterator[tuple[str, int, float]]:
        """(sha256, bytes, mtime) of every result file."""
        for shard in os.scandir(self.root):
            if len(shard.name) != 2 or not shard.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(shard.path):
                if _SHA256.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                        st = entry.stat(follow_symlinks=False)
                        yield entry.name, st.st_size, st.st_mtime

    def remove_orphans(self, named: Callable[[list[str]], set[str]], grace_s: float) -> tuple[int, int]:
        """Remove the files no record names (`named`: which of these shas some record names), unless younger than
        `grace_s` (a result being recorded, maybe by another replica) or held here; (files, bytes) removed."""
        cutoff = time.time() - grace_s
        old = [(sha, size) for sha, size, mtime in self._files() if mtime < cutoff]
        files = n_bytes = 0
        for i in range(0, len(old), 500):
            batch = old[i : i + 500]
            keep = named([sha for sha, _ in batch])
            for sha, size in batch:
                if sha not in keep and self._remove_if_old(sha, cutoff):
                    files, n_bytes = files + 1, n_bytes + size
        return files, n_bytes

    # ---------------------------------------------------------------- removing
    def remove(self, sha256: str) -> bool:
        """Remove the file: False (and the file stays) while this process holds it; True once it is gone."""
        return self._remove_if_old(sha256, None)

    def _remove_if_old(self, sha256: str, cutoff: float | None) -> bool:
        """Remove the file unless held here, or (with a `cutoff`) modified at or after it."""
        path = self.path(sha256)
        with self._lock:
            if self._readers.get(sha256):
                return False
            try:
                if cutoff is not None and path.stat().st_mtime >= cutoff:
                    return False
                path.unlink()
            except FileNotFoundError:
                pass
        with contextlib.suppress(OSError):  # not empty (another file, or another writer): it stays
            path.parent.rmdir()
        return True

    def _missing(self, sha256: str) -> ContentMissingError:
        return ContentMissingError(
            f"result {sha256} is no longer stored (removed by retention, --results-max-gb, or by hand)",
            {"sha256": sha256},
        )


def _refresh(final: Path, size: int) -> bool:
    """True when `final` holds `size` bytes already (its time refreshed, so no orphan sweep takes it now)."""
    try:
        if final.stat().st_size != size:
            return False
        os.utime(final)
        return True
    except FileNotFoundError:
        return False


def _place(tmp: Path, final: Path, tries: int = 3) -> None:
    """Rename `tmp` to `final` (atomic), making its shard directory; again if a `remove` took the directory away
    between the two."""
    for attempt in range(tries):
        final.parent.mkdir(exist_ok=True)
        try:
            os.replace(tmp, final)
            return
        except FileNotFoundError:
            if attempt == tries - 1 or not tmp.exists():
                raise
