"""The client's result side: ClientResult and ClientMedia, and the checks on what arrived: a response's inline
bytes (`result_from_response`), or a streamed result received in place chunk by chunk (`ResultAssembly`), its media
optionally written to a file as it arrives (`MediaFile`)."""

from __future__ import annotations

import hashlib
import math
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ditcore.report import CacheReport
from ditruntime.convert import from_proto
from ditruntime.paths import write_atomically
from protos.ditserve.generator.v1 import generator_pb2 as pb

from .client_requests import OUTPUT_NAMES

if TYPE_CHECKING:
    import torch

MEDIA_CHUNK = "media"
"""The ResultChunk name of an encoded file's bytes."""


class IntegrityError(RuntimeError):
    """What arrived is not what the server described: chunks out of order or of an unknown name, a byte count or a
    sha256 that does not match, or another output type than the one asked for."""


@dataclass(frozen=True)
class ClientMedia:
    """An encoded result file (its bytes checked against the server's size and sha256)."""

    output_type: str
    """"mp4" or "frames_and_wav"."""
    content_type: str
    """"video/mp4" or "application/zip"."""
    data: bytes | bytearray
    """The file's bytes (a streamed result's are the buffer its chunks were received into); empty when the file was
    written to `path` as it arrived."""
    sha256: str
    filename: str
    """The server's suggested name, "<request_id>.mp4" or "<request_id>.zip"."""
    path: Path | None = None
    """Where the file was written as it arrived (`GeneratorClient.generate(..., media_path=...)`), else None."""
    size_bytes: int = -1
    """The file's size (-1: len(data))."""

    @property
    def size(self) -> int:
        return self.size_bytes if self.size_bytes >= 0 else len(self.data)

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the file to `path` (through a temporary file in the same directory, renamed into place)."""
        if self.path is not None:
            source = self.path
            return write_atomically(path, lambda tmp: tmp.write_bytes(source.read_bytes()))
        return write_atomically(path, lambda tmp: tmp.write_bytes(self.data))


@dataclass
class ClientResult:
    request_id: str
    generation: int
    sha256: str
    """SHA-256 of the final latents (also for media results, whose latents stay on the server)."""
    video: torch.Tensor | None
    """Final video latents (1, 24, F_latent, H/16, W/16) float32, as diffusers returns them (latents results)."""
    audio: torch.Tensor | None
    """Final audio latents (2, 32, N) float32 (latents results)."""
    cache: CacheReport
    timings_ms: dict[str, float]
    adaln_mode: str = ""
    events: list[tuple[str, Any]] = field(default_factory=list)
    output_type: str = "latents"
    media: ClientMedia | None = None
    """The encoded file (output types "mp4" and "frames_and_wav")."""
    quality: str = "lossless"
    """The quality level it ran (ditcore.quality)."""
    blocks_skipped: list[float] = field(default_factory=list)
    """Per step, the block forwards the level's step cache skipped (empty for lossless)."""
    quality_warning: str = ""
    """Why its level served it unaudited (the level's policy "warn")."""


def _timings(t: pb.StageTimings) -> dict[str, float]:
    return {f.name: getattr(t, f.name) for f in pb.StageTimings.DESCRIPTOR.fields}


def _dtype(t: pb.Tensor) -> torch.dtype:
    from ditcore.plans import DTYPES  # torch: imported by a latents result only (a client starts without it)

    if t.dtype not in DTYPES:
        raise IntegrityError(f"tensor {t.name!r} has dtype {t.dtype!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[t.dtype]


def _tensor(t: pb.Tensor, data: bytes | bytearray) -> torch.Tensor:
    """The tensor `t` describes, over `data`: a view of a bytearray (a streamed part: no copy), else over a copy."""
    import torch

    dtype = _dtype(t)
    buffer = data if isinstance(data, bytearray) else bytearray(data)  # torch.frombuffer needs a writable buffer
    try:
        flat = torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)
        return flat.reshape(tuple(t.shape))
    except (RuntimeError, ValueError) as e:  # a byte count that does not hold the shape
        raise IntegrityError(f"tensor {t.name!r}: {len(data)} bytes do not hold {t.dtype}{list(t.shape)}") from e


def _media(
    resp: pb.GenerateResponse, output_type: str, data: bytes | bytearray, file: MediaFile | None = None
) -> ClientMedia:
    """The media `resp` describes, checked: `data` (the bytes) or `file` (written as it arrived; `data` empty)."""
    rid, m = resp.request_id, resp.media
    size = file.size if file is not None else len(data)
    if size != m.size_bytes:
        raise IntegrityError(f"request {rid}: received {size} media bytes, the server said {m.size_bytes}")
    got = file.digest.hexdigest() if file is not None else hashlib.sha256(data).hexdigest()
    if got != m.sha256:
        raise IntegrityError(f"request {rid}: the received media hashes to {got}, the server said {m.sha256}")
    if file is not None:
        return ClientMedia(output_type, m.content_type, b"", m.sha256, m.filename, file.target, size)
    return ClientMedia(output_type, m.content_type, data, m.sha256, m.filename)


def result_from_response(
    resp: pb.GenerateResponse, data: Mapping[str, bytes | bytearray] | None = None, media_file: MediaFile | None = None
) -> ClientResult:
    """The checked result of a Generate response (`data`: the streamed bytes by chunk name; None: inline bytes;
    `media_file`: where a streamed media result was written instead)."""
    output_type = OUTPUT_NAMES.get(resp.output_type)
    if output_type is None:
        raise IntegrityError(f"request {resp.request_id}: unknown output type enum value {resp.output_type}")
    result = ClientResult(
        request_id=resp.request_id,
        generation=resp.generation,
        sha256=resp.sha256,
        video=None,
        audio=None,
        cache=from_proto(resp.cache, CacheReport),
        timings_ms=_timings(resp.timings),
        adaln_mode=pb.AdalnMode.Name(resp.adaln_mode),
        quality=resp.quality or "lossless",
        blocks_skipped=[round(float(b), 3) for b in resp.blocks_skipped],
        quality_warning=resp.quality_warning,
        output_type=output_type,
    )
    if output_type != "latents":
        if not resp.HasField("media"):
            raise IntegrityError(f"request {resp.request_id}: a {output_type} result carries no media")
        inline = data.get(MEDIA_CHUNK, b"") if data is not None else resp.media.data
        result.media = _media(resp, output_type, inline, media_file)
        return result
    received = {t.name: data.get(t.name, b"") if data is not None else t.data for t in resp.tensors}
    tensors = {t.name: _tensor(t, received[t.name]) for t in resp.tensors}
    missing = sorted({"video", "audio"} - set(tensors))
    if missing:
        raise IntegrityError(f"request {resp.request_id}: the result carries no {' or '.join(missing)} tensor")
    result.video, result.audio = tensors["video"], tensors["audio"]
    # the tensors hold exactly the received bytes (views of them, or copies): hashed as received, in place, which
    # is ditcore.generation.latents_sha256's digest of the tensors
    digest = hashlib.sha256(received["video"])
    digest.update(received["audio"])
    got = digest.hexdigest()
    if got != result.sha256:
        raise IntegrityError(
            f"request {result.request_id}: received latents hash to {got}, server said {result.sha256}"
        )
    return result


def check_output_type(resp: pb.GenerateResponse, asked: str) -> pb.GenerateResponse:
    got = OUTPUT_NAMES.get(resp.output_type, f"enum value {resp.output_type}")
    if got != asked:
        raise IntegrityError(
            f"request {resp.request_id}: asked for output type {asked}, the server returned {got} "
            "(a server older than output types?)"
        )
    return resp


class MediaFile:
    """A streamed media result written to `target` as it arrives: into a temporary file beside it (same directory,
    so same filesystem), hashed as written, renamed into place by `commit` once the result checks out; `discard`
    removes what is left otherwise."""

    def __init__(self, target: str | os.PathLike[str]) -> None:
        self.target = Path(target)
        self.tmp = self.target.with_name(f".{self.target.name}.partial-{uuid.uuid4().hex[:12]}")
        self.size = 0
        self.digest = hashlib.sha256()
        self._file: IO[bytes] | None = None

    def write(self, data: bytes) -> None:
        if self._file is None:
            self._file = self.tmp.open("xb")
        self._file.write(data)
        self.digest.update(data)
        self.size += len(data)

    def commit(self) -> Path:
        self._close()
        if not self.tmp.exists():  # an empty file: no chunk came
            self.tmp.touch()
        os.replace(self.tmp, self.target)
        return self.target

    def discard(self) -> None:
        self._close()
        self.tmp.unlink(missing_ok=True)

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class ResultAssembly:
    """The streamed result: its header, then each named part's chunks in order, checked against the header. Each
    part is received in place: a buffer of the size the header gives it (a tensor's shape and dtype, the media's
    size_bytes), allocated once and filled chunk by chunk (never a list of chunks joined, nor a growing buffer
    copied), or, for the media with a `media_file`, that file."""

    def __init__(self, header: pb.GenerateResponse, media_file: MediaFile | None = None) -> None:
        self.header = header
        self.media_file = media_file if header.HasField("media") else None
        self.sizes = {t.name: math.prod(t.shape) * _dtype(t).itemsize for t in header.tensors}
        if header.HasField("media"):
            self.sizes[MEDIA_CHUNK] = header.media.size_bytes
        parts, total = sum(self.sizes.values()), header.total_bytes
        if total and parts != total:
            than = f"more than the header's total_bytes, {total}" if parts > total else f"the header said {total}"
            raise IntegrityError(f"request {header.request_id}: the result header's parts hold {parts} bytes, {than}")
        in_file = MEDIA_CHUNK if self.media_file is not None else None
        self.parts: dict[str, bytearray] = {n: bytearray(size) for n, size in self.sizes.items() if n != in_file}
        self.filled = dict.fromkeys(self.sizes, 0)
        self.received = 0

    def add(self, chunk: pb.ResultChunk) -> None:
        name = chunk.name
        if name not in self.sizes:
            raise IntegrityError(f"a chunk of {name!r}, which the result header does not name")
        start = self.filled[name]
        if chunk.offset != start:
            raise IntegrityError(f"chunk of {name} at offset {chunk.offset}, expected {start}")
        end = start + len(chunk.data)
        if end > self.sizes[name]:
            raise IntegrityError(
                f"chunk of {name} runs to byte {end}, past the {self.sizes[name]} bytes the result header gives it"
            )
        if name in self.parts:
            memoryview(self.parts[name])[start:end] = chunk.data
        else:
            assert self.media_file is not None
            self.media_file.write(chunk.data)
        self.filled[name] = end
        self.received += len(chunk.data)

    def result(self) -> ClientResult:
        total = self.header.total_bytes
        media = self.header.HasField("media") or OUTPUT_NAMES.get(self.header.output_type, "latents") != "latents"
        if (total or media) and self.received != total:
            raise IntegrityError(
                f"request {self.header.request_id}: the stream carried {self.received} result bytes, the header "
                f"said {total}"
            )
        for name, size in self.sizes.items():
            if self.filled[name] != size:
                raise IntegrityError(
                    f"request {self.header.request_id}: the stream carried {self.filled[name]} bytes of {name}, the "
                    f"result header gives it {size}"
                )
        return result_from_response(self.header, self.parts, self.media_file)
