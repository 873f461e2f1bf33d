"""Uploaded ref2va references: the files UploadReference receives as client streams, held in memory for a while so
that a GenerateRequest (or a job) can name them by `upload_id` instead of carrying their bytes. No gRPC here.

An upload is probed when it completes (ditcore.references.probe_reference against the server's limits), so a bad file
is refused at upload time with the rule that breaks; a request naming it is checked again with the rest of its
references. The store holds at most `max_bytes` in all: expired uploads are dropped first, then an upload that would
not fit is refused (UploadCapacityError, RESOURCE_EXHAUSTED). A request resolves its upload ids at admission (the
bytes are copied into the request), so an upload that expires later never affects an admitted request or a job.
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


class UploadStore:
    """Uploads by id, oldest first; thread-safe."""

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._uploads: OrderedDict[str, Upload] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            self._expire()
            return sum(len(u.reference.data) for u in self._uploads.values())

    def put(self, chunks: Iterable[tuple[bytes, str]], limits: ReferenceLimits) -> Upload:
        """Store the file `chunks` carry ((bytes, kind) per message: the first message's kind counts), probed
        against `limits`. RequestError naming `chunk` / `kind` for a bad file, UploadCapacityError when the store is
        full; nothing is stored then."""
        if self.max_bytes <= 0:
            raise UploadCapacityError("uploads are off on this server (--max-upload-mb 0)")
        parts: list[bytes] = []
        size, kind, first = 0, "", True
        for data, chunk_kind in chunks:
            if first:
                kind, first = chunk_kind, False
            size += len(data)
            if size > limits.max_bytes:
                raise RequestError("chunk", f"the upload exceeds {limits.max_bytes:,} bytes (one reference's limit)")
            parts.append(data)
        if first or size == 0:
            raise RequestError("chunk", "the upload holds no bytes: stream the file's bytes in one or more chunks")
        reference = Reference(b"".join(parts), kind)
        try:
            probe = probe_reference(reference, limits)
        except MediaError as e:
            raise RequestError("chunk", e.description) from e
        with self._lock:
            self._expire()
            used = sum(len(u.reference.data) for u in self._uploads.values())
            if used + size > self.max_bytes:
                raise UploadCapacityError(
                    f"the upload of {size:,} bytes would take the stored uploads to {used + size:,} bytes; this "
                    f"server holds at most {self.max_bytes:,} (--max-upload-mb); retry when earlier uploads expire"
                )
            upload = Upload(
                ID_PREFIX + secrets.token_hex(16),
                reference,
                hashlib.sha256(reference.data).hexdigest(),
                probe.kind,
                self._clock() + self.ttl_s,
            )
            self._uploads[upload.upload_id] = upload
            return upload

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
            del self._uploads[upload_id]
