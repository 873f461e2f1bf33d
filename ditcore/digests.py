"""What a repository's files digest to: each file's digest (whole bytes, or a shard's size, header and data samples),
the repository's and each partition's fingerprint, and the files edited in place since a validation."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from .checkpoint_files import (
    PARTITIONS,
    CheckpointError,
    ShardHeader,
    check_partition,
    read_model_index,
    read_shard_header,
    repository_files,
)

if TYPE_CHECKING:
    from .checkpoint import CheckpointInfo

_FP_SAMPLE_BYTES = 4096


def data_samples(path: Path, hdr: ShardHeader) -> bytes:
    """The first and last (up to) 4 KiB of every tensor's data, in tensor-name order.

    Headers alone are identical for every checkpoint of one config (same names, dtypes,
    shapes, offsets), so the fingerprint must see some data to tell weights apart.
    """
    base = len(hdr.header_bytes)
    parts: list[bytes] = []
    try:
        with open(path, "rb") as fh:
            for tname in sorted(hdr.tensors):
                e = hdr.tensors[tname]
                spans = {
                    (e.begin, min(e.end, e.begin + _FP_SAMPLE_BYTES)),
                    (max(e.begin, e.end - _FP_SAMPLE_BYTES), e.end),
                }
                for begin, end in sorted(spans):
                    fh.seek(base + begin)
                    parts.append(fh.read(end - begin))
    except OSError as e:
        raise CheckpointError(f"{path.name}: cannot read shard: {e.strerror or e}") from e
    return b"".join(parts)


def combine_digests(digests: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{k}\0{v}\n" for k, v in sorted(digests.items())).encode()).hexdigest()


def changed_files(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Files whose digest differs, appeared or disappeared between two `file_digests`."""
    return sorted(f for f in set(old) | set(new) if old.get(f) != new.get(f))


def file_digest(root: Path, rel: str, hdr: ShardHeader | None) -> str:
    """The digest of one file: whole bytes for small files; size, header and data samples for shards."""
    if hdr is None:
        return hashlib.sha256((root / rel).read_bytes()).hexdigest()
    h = hashlib.sha256(f"{hdr.size}\0".encode() + hdr.header_bytes)
    h.update(data_samples(root / rel, hdr))
    return h.hexdigest()


def partition_fingerprint(digests: Mapping[str, str], name: str) -> str:
    """The digest of partition `name`'s own files among a repository's per-file `digests`."""
    prefix = PARTITIONS[check_partition(name)] + "/"
    return combine_digests({rel: d for rel, d in digests.items() if rel.startswith(prefix)})


def file_digests(path: str | Path) -> dict[str, str]:
    """Per-file digests of the repository as it is now (the files `CheckpointInfo.digests` covers).

    Lenient, so a damaged file shows up as changed rather than raising: a safetensors file whose header no longer
    parses is digested by its error message.
    """
    root = Path(path)
    components = sorted(k for k in read_model_index(root) if not k.startswith("_") and (root / k).is_dir())
    out: dict[str, str] = {}
    for rel in repository_files(root, components):
        hdr: ShardHeader | None = None
        if rel.endswith(".safetensors"):
            try:
                hdr = read_shard_header(root / rel)
            except CheckpointError as e:
                out[rel] = "corrupt:" + hashlib.sha256(str(e).encode()).hexdigest()
                continue
        out[rel] = file_digest(root, rel, hdr)
    return out


def changed_since(info: CheckpointInfo) -> list[str]:
    """Relative paths whose digest differs, appeared or disappeared since `info` was validated (in-place edits)."""
    return changed_files(info.digests, file_digests(info.path))


def fingerprint(path: str | Path) -> str:
    """The fingerprint `validate_repository` would report, without validating (for a quick identity check)."""
    return combine_digests(file_digests(path))
