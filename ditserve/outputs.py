"""Where the generate commands put results: `--out` and `--output-type`, the files, and the JSON line's file fields.

- `--out FILE.mp4`, `FILE.zip`, `FILE.safetensors`: one file, whose suffix names the output type (mp4,
  frames_and_wav, latents; `ditcore.media.output_type_for_path`). One request only.
- `--out FILE.other --output-type TYPE`: one file of TYPE under that name (an unknown suffix without --output-type is
  refused).
- `--out DIR` (no suffix, a trailing slash, or an existing directory): `DIR/<request_id>.safetensors|.mp4|.zip`, one
  per request, of each request's output type (--output-type, else the JSONL line's "output_type", else latents).
- No `--out`: nothing is written, and a media output type is refused (it would be decoded for nothing).

`--output-type` naming another type than `--out`'s suffix is refused naming both; so is a JSONL line whose
"output_type" differs from the type `--out` or `--output-type` fixes. Missing directories are created with mode 0700
(`ditruntime.paths.prepare_dir`) at the first result, so a refused run writes nothing; each file is written to a
temporary name beside it and renamed into place, so a failed run leaves no partial file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ditcore.media import OUTPUT_TYPES, SUFFIXES, EncodedMedia, output_type_for_path
from ditcore.request import GenerationRequest
from ditruntime.paths import check_dir, prepare_dir, write_atomically

from .errors import UsageError

if TYPE_CHECKING:
    import torch

LATENTS_SUFFIX = ".safetensors"
_SUFFIX_OF = {**SUFFIXES, "latents": LATENTS_SUFFIX}
_KNOWN = ", ".join(f"{suffix} ({name})" for name, suffix in _SUFFIX_OF.items())


def suffix_for(output_type: str) -> str:
    return _SUFFIX_OF[output_type]


@dataclass(frozen=True)
class OutputTarget:
    """What `--out` and `--output-type` say."""

    out: Path | None
    """--out as given (None: nothing is written)."""
    is_file: bool
    """--out names one file (else a directory of <request_id><suffix>)."""
    output_type: str | None
    """The output type --out's suffix or --output-type fixes for every request (None: each request's own)."""
    fixed_by: str = ""
    """What fixed it, for messages: "--out fox.mp4" or "--output-type mp4"."""

    def path_for(self, request: GenerationRequest) -> Path | None:
        """The file a request's result goes to (None without --out)."""
        if self.out is None:
            return None
        if self.is_file:
            return self.out
        return self.out / f"{request.request_id}{suffix_for(request.output_type)}"

    def check(self, requests: Sequence[GenerationRequest]) -> None:
        """Refuse, before anything runs, requests this target cannot write (UsageError naming the flag)."""
        if self.is_file and len(requests) != 1:
            raise UsageError(
                f"--out {self.out} names one file and {len(requests)} requests would run; give a directory (a path "
                "without a suffix) to write one <request_id> file each"
            )
        for r in requests:
            if self.out is None and r.decodes:
                raise UsageError(
                    f"request {r.request_id!r}: output type {r.output_type} is a file; give --out "
                    f"FILE{suffix_for(r.output_type)} (or --out DIR) to write it"
                )
        if self.out is not None:  # refused now; created (0700) at the first result
            check_dir(self.out.parent if self.is_file else self.out, "--out")


def output_target(out: str | None, output_type: str | None) -> OutputTarget:
    """Resolve --out and --output-type (the module docstring has the rules)."""
    if output_type is not None and output_type not in OUTPUT_TYPES:
        raise UsageError(f"--output-type must be one of {', '.join(OUTPUT_TYPES)}, got {output_type!r}")
    flag = f"--output-type {output_type}" if output_type else ""
    if out is None:
        return OutputTarget(None, False, output_type, flag)
    path = Path(out).expanduser()
    if out.endswith(("/", os.sep)) or path.is_dir() or not path.suffix:
        return OutputTarget(path, False, output_type, flag)
    by_suffix = output_type_for_path(path)
    if by_suffix is None:
        if output_type is None:
            raise UsageError(
                f"--out {out}: unknown suffix {path.suffix!r}; name a file {_KNOWN}, give --output-type to write "
                "this file in that type, or give a directory (a path without a suffix)"
            )
        return OutputTarget(path, True, output_type, flag)
    if output_type is not None and output_type != by_suffix:
        raise UsageError(
            f"--output-type {output_type} conflicts with --out {out}, whose suffix {path.suffix} means {by_suffix}; "
            "drop one of them or make them agree"
        )
    return OutputTarget(path, True, by_suffix, f"--out {out}")


# ---------------------------------------------------------------------------- files
def _write_atomic(path: Path, write: Callable[[Path], object]) -> Path:
    prepare_dir(path.parent, "--out")
    return write_atomically(path, write)


class HeldLatents(Protocol):
    """A latents result as either side holds it: ditcore.generation.GenerationResult (the local side) or
    ditserve.client_results.ClientResult (the client's, whose latents result carries both tensors)."""

    @property
    def video(self) -> torch.Tensor | None: ...
    @property
    def audio(self) -> torch.Tensor | None: ...
    @property
    def sha256(self) -> str: ...


def write_latents(path: Path, result: HeldLatents, request: GenerationRequest) -> Path:
    """A safetensors file with tensors `video` and `audio`; metadata = the request (JSON values) + sha256."""
    from safetensors.torch import save_file  # torch: imported when latents are written (a client starts without it)

    assert result.video is not None and result.audio is not None  # a latents result carries both
    tensors = {"video": result.video.contiguous(), "audio": result.audio.contiguous()}
    meta = {k: json.dumps(v) for k, v in request.to_dict().items()}
    meta["sha256"] = result.sha256
    return _write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def write_media(path: Path, chunks: Iterable[bytes | bytearray]) -> Path:
    """An encoded result file (MP4 or ZIP) as is, written a chunk at a time as `chunks` yields them."""

    def write(tmp: Path) -> None:
        with tmp.open("wb") as out:
            for chunk in chunks:
                out.write(chunk)

    return _write_atomic(path, write)


class HeldMedia(Protocol):
    """An encoded result file held as one buffer (ditserve.client_results.ClientMedia, the client's side)."""

    @property
    def data(self) -> bytes | bytearray: ...
    @property
    def content_type(self) -> str: ...
    @property
    def sha256(self) -> str: ...


MediaFile = EncodedMedia | HeldMedia
"""An encoded result file as either side holds it: the generator's spooled file (ditcore.media.EncodedMedia, read
in chunks, never whole) or the client's bytes."""


def write_output(
    path: Path | None, request: GenerationRequest, media: MediaFile | None, latents: HeldLatents | None
) -> dict[str, Any]:
    """Write one request's result where --out says (`path`, None: nowhere): the media file as is, else the latents;
    returns the JSON line's file fields ({} when nothing is written)."""
    if path is None:
        return {}
    if media is not None:
        if isinstance(media, EncodedMedia):
            write_media(path, media.chunks())
            return file_fields(path, media.size, media.content_type, media.sha256)
        write_media(path, [media.data])
        return file_fields(path, len(media.data), media.content_type, media.sha256)
    assert latents is not None  # a latents result (the caller's output type says which)
    write_latents(path, latents, request)
    return file_fields(path, path.stat().st_size)


def file_fields(path: Path, data_len: int, content_type: str = "", sha256: str = "") -> dict[str, Any]:
    """The JSON line's fields naming a written file: out (absolute path) and bytes; for media also content_type and
    media_sha256 (the file's SHA-256; the line's "sha256" stays the latents')."""
    fields: dict[str, Any] = {"out": str(path.resolve()), "bytes": data_len}
    if content_type:
        fields["content_type"] = content_type
    if sha256:
        fields["media_sha256"] = sha256
    return fields
