"""Content-addressed result files of jobs: `<root>/<sha256[:2]>/<sha256>`, written whole or not at all.

A write streams into a temp file in `root` (hashing as it copies), then `os.replace`s it under its final name, so a
crash leaves no half file there; temp files a crash left are removed on open. Equal content is kept once. Readers
in this process are counted (`reading`): `remove` keeps a file while it is being read. No grpc here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..errors import GeneratorError

CHUNK_BYTES = 1 << 20
"""Copy and hash 1 MiB at a time: big enough for the disk, small enough to never hold a result in memory."""
TEMP_PREFIX = ".tmp-"
"""Names of the files being written (in `root` itself, so `os.replace` stays on one filesystem)."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


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

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._readers: dict[str, int] = {}  # sha256 -> readers in this process; guarded by _lock
        for stale in self.root.glob(f"{TEMP_PREFIX}*"):  # a write a crash interrupted
            stale.unlink(missing_ok=True)

    def path(self, sha256: str) -> Path:
        sha = check_sha256(sha256)
        return self.root / sha[:2] / sha

    # ---------------------------------------------------------------- writing
    def put_file(self, src: BinaryIO, content_type: str, filename: str) -> ContentRef:
        """Copy `src` (from its current position to its end) into the store."""
        return self.put_bytes(iter(lambda: src.read(CHUNK_BYTES), b""), content_type, filename)

    def put_bytes(self, data: bytes | Iterable[bytes], content_type: str, filename: str) -> ContentRef:
        """Store `data` (one bytes object, or chunks in order)."""
        chunks: Iterable[bytes] = (data,) if isinstance(data, bytes) else data
        fd, tmp_name = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=self.root)
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
            final = self.path(digest.hexdigest())
            if final.is_file() and final.stat().st_size == size:
                tmp.unlink()  # the same content is there already: keep that one
            else:
                os.chmod(tmp, 0o644)  # mkstemp makes it 0600; other replicas sharing the directory read it
                _place(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return ContentRef(final.name, size, content_type, filename)

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
        total = 0
        for shard in os.scandir(self.root):
            if len(shard.name) != 2 or not shard.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(shard.path):
                if _SHA256.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                        total += entry.stat(follow_symlinks=False).st_size
        return total

    # ---------------------------------------------------------------- removing
    def remove(self, sha256: str) -> bool:
        """Remove the file: False (and the file stays) while this process reads it; True once it is gone."""
        path = self.path(sha256)
        with self._lock:
            if self._readers.get(sha256):
                return False
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty (another file, or another writer): it stays
            path.parent.rmdir()
        return True

    def _missing(self, sha256: str) -> ContentMissingError:
        return ContentMissingError(
            f"result {sha256} is not in the results directory {self.root} (removed by retention, "
            "--results-max-gb, or by hand)",
            {"sha256": sha256},
        )


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
