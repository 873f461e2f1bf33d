"""Uploaded ref2va references: the files UploadReference receives as client streams, held in memory for a while so
that a GenerateRequest (or a job) can name them by `upload_id` instead of carrying their bytes. No gRPC here.

An upload is probed when it completes (ditcore.references.probe_reference against the server's limits), so a bad file
is refused at upload time with the rule that breaks; a request naming it is checked again with the rest of its
references. The store holds at most `max_bytes` in all, the bytes of uploads still being received counted with the
stored ones: each chunk is reserved as it arrives (expired uploads are dropped first), and the chunk that would take
stored + receiving over `max_bytes` is refused (UploadCapacityError, RESOURCE_EXHAUSTED); a completed upload's
reservation becomes its stored bytes, a refused, failed or abandoned one's is freed. So concurrent uploads can never
together hold more than `max_bytes`. A request resolves its upload ids at admission (the bytes are copied into the
request), so an upload that expires later never affects an admitted request or a job.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ditcore import RequestError
from ditcore.keyframes import MediaError
from ditcore.references import Reference, ReferenceLimits, probe_reference

from ..errors import GeneratorError

ID_PREFIX = "upl_"


class UploadCapacityError(GeneratorError):
    """An upload would take the store over `--max-upload-mb` (or uploads are off)."""

    reason = "UPLOAD_CAPACITY"
    grpc_code = "RESOURCE_EXHAUSTED"


@dataclass(frozen=True)
class Upload:
    """One stored upload."""

    upload_id: str
    reference: Reference
    sha256: str
    kind: str
    """What it probed as: "image", "video" or "audio"."""
    expires_at: float
    """Wall-clock time (time.time()) it is dropped at."""


@dataclass
class _Reserved:
    """One upload's bytes counted in its store's `receiving_bytes` while it is received."""

    size: int = 0


class UploadStore:
    """Uploads by id, oldest first, and the bytes of those still being received; thread-safe."""

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._uploads: OrderedDict[str, Upload] = OrderedDict()
        self._stored = 0  # bytes of `_uploads`
        self._receiving = 0  # bytes reserved by uploads still being received
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        """Bytes of the stored uploads."""
        with self._lock:
            self._expire()
            return self._stored

    @property
    def receiving_bytes(self) -> int:
        """Bytes of the uploads still being received (reserved against `max_bytes` with the stored ones)."""
        with self._lock:
            return self._receiving

    def put(self, chunks: Iterable[tuple[bytes, str]], limits: ReferenceLimits) -> Upload:
        """Store the file `chunks` carry ((bytes, kind) per message: the first message's kind counts), probed
        against `limits`. RequestError naming `chunk` / `kind` for a bad file, UploadCapacityError at the chunk that
        would take the store over `max_bytes`; nothing is stored then, and its reserved bytes are freed."""
        if self.max_bytes <= 0:
            raise UploadCapacityError("uploads are off on this server (--max-upload-mb 0)")
        reserved = _Reserved()  # this upload's bytes counted in `_receiving` (freed unless it is stored)
        try:
            data, kind = self._receive(chunks, limits, reserved)
            reference = Reference(data, kind)
            try:
                probe = probe_reference(reference, limits)
            except MediaError as e:
                raise RequestError("chunk", e.description) from e
            upload = Upload(
                ID_PREFIX + secrets.token_hex(16),
                reference,
                hashlib.sha256(data).hexdigest(),
                probe.kind,
                self._clock() + self.ttl_s,
            )
            with self._lock:  # its reservation becomes stored bytes: the total does not move
                self._receiving -= reserved.size
                reserved.size = 0
                self._stored += len(data)
                self._uploads[upload.upload_id] = upload
            return upload
        finally:
            if reserved.size:
                with self._lock:
                    self._receiving -= reserved.size

    def _receive(
        self, chunks: Iterable[tuple[bytes, str]], limits: ReferenceLimits, reserved: _Reserved
    ) -> tuple[bytes, str]:
        """The file's bytes and kind, each chunk reserved (in `reserved`) as it arrives."""
        parts: list[bytes] = []
        kind, first = "", True
        for data, chunk_kind in chunks:
            if first:
                kind, first = chunk_kind, False
            if reserved.size + len(data) > limits.max_bytes:
                raise RequestError("chunk", f"the upload exceeds {limits.max_bytes:,} bytes (one reference's limit)")
            self._reserve(len(data), reserved)
            parts.append(data)
        if reserved.size == 0:
            raise RequestError("chunk", "the upload holds no bytes: stream the file's bytes in one or more chunks")
        return b"".join(parts), kind

    def _reserve(self, size: int, reserved: _Reserved) -> None:
        with self._lock:
            self._expire()
            held = self._stored + self._receiving
            if held + size > self.max_bytes:
                raise UploadCapacityError(
                    f"this upload's {reserved.size + size:,} bytes so far would take the uploads held to "
                    f"{held + size:,} bytes ({self._stored:,} stored, {self._receiving:,} being received, this one's "
                    f"included); this server holds at most {self.max_bytes:,} (--max-upload-mb); retry when earlier "
                    "uploads expire or finish",
                    {"max_upload_bytes": str(self.max_bytes), "held_bytes": str(held)},
                )
            self._receiving += size
            reserved.size += size

    def get(self, upload_id: str, field: str) -> Upload:
        """The upload `upload_id`; RequestError naming `field` when it is unknown or expired."""
        with self._lock:
            self._expire()
            upload = self._uploads.get(upload_id)
        if upload is None:
            raise RequestError(
                field, f"no upload {upload_id[:80]!r} on this server (unknown, or expired after --upload-ttl-s "
                f"{self.ttl_s:g}); upload the file again with UploadReference"
            )  # fmt: skip
        return upload

    def _expire(self) -> None:
        now = self._clock()
        for upload_id in [i for i, u in self._uploads.items() if u.expires_at <= now]:
            self._stored -= len(self._uploads.pop(upload_id).reference.data)
