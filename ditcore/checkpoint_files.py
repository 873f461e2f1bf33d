"""A MiniMax-H3 repository's files as ditcore reads them: model_index.json and its transformer partitions, the files
under each component, safetensors shard headers (parsed and bounds-checked, no tensor data read); every fault is a
`CheckpointError` naming the file. Also `pread_into`, the positioned read (short reads continued, `ShortReadError` at
an early end) with which the plan-tensor stream and the plan packs read bytes into buffers of their own."""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
_ST_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class ShortReadError(OSError):
    """A file that ended before the bytes asked for (errno EIO): shorter than its header says, or truncated while
    being read."""


def pread_into(fd: int, view: memoryview, offset: int, path: str) -> int:
    """Fill `view` from `offset` of the open file (short reads continued); ShortReadError naming `path` at an early
    end. The plan-tensor stream and the plan packs read with it."""
    got, total = 0, len(view)
    while got < total:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise ShortReadError(
                errno.EIO,
                f"unexpected end of file at byte {offset + got} ({total - got} bytes short: truncated?)",
                path,
            )
        got += n
    return got


class CheckpointError(Exception):
    """A checkpoint is missing, unreadable, corrupt or incompatible; the message names the file (and tensor)."""


class CheckpointNotFoundError(CheckpointError):
    """The checkpoint directory (or its model_index.json) does not exist."""


# ---------------------------------------------------------------------------- headers
@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class ShardHeader:
    file: str
    size: int
    header_bytes: bytes
    tensors: dict[str, TensorEntry]


def read_shard_header(path: Path) -> ShardHeader:
    """Parse and bounds-check one safetensors header; errors name the file and tensor."""
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{name}: truncated shard: {size} bytes, no header length")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > _MAX_HEADER_BYTES or 8 + hlen > size:
                raise CheckpointError(f"{name}: corrupt header: declares {hlen} header bytes in a {size}-byte file")
            raw = fh.read(hlen)
    except OSError as e:
        raise CheckpointError(f"{name}: cannot read shard: {e.strerror or e}") from e
    try:
        meta = json.loads(raw.decode("utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("header is not an object")
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{name}: corrupt header: not valid safetensors JSON ({e})") from e
    data_len = size - 8 - hlen
    tensors: dict[str, TensorEntry] = {}
    for tname, info in meta.items():
        if tname == "__metadata__":
            continue
        tensors[tname] = _parse_entry(name, tname, info, data_len)
    return ShardHeader(file=name, size=size, header_bytes=head + raw, tensors=tensors)


def _parse_entry(file: str, tname: str, info: Any, data_len: int) -> TensorEntry:
    try:
        dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        begin, end = int(begin), int(end)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: tensor '{tname}': corrupt header entry ({e})") from e
    if dtype not in _ST_BYTES or any(d < 0 for d in shape) or not 0 <= begin <= end:
        raise CheckpointError(f"{file}: tensor '{tname}': corrupt header entry {info!r}")
    if end - begin != math.prod(shape) * _ST_BYTES[dtype]:
        raise CheckpointError(
            f"{file}: tensor '{tname}': data length {end - begin} does not match {dtype}{list(shape)}"
        )
    if end > data_len:
        raise CheckpointError(
            f"{file}: tensor '{tname}': truncated shard: data ends at byte {end} but only {data_len} data bytes exist"
        )
    return TensorEntry(dtype=dtype, shape=shape, begin=begin, end=end)


# ---------------------------------------------------------------------------- repositories
MODEL_INDEX = "model_index.json"
TRANSFORMER = "transformer"
TRANSFORMER_REF = "transformer_ref"
TRANSFORMER_CLASS = "MiniMaxH3Transformer3DModel"
BASE, REF = "base", "ref"
PARTITIONS: dict[str, str] = {BASE: TRANSFORMER, REF: TRANSFORMER_REF}
"""Partition name -> its folder (and diffusers component name): "base" serves t2va / fl2va, "ref" serves ref2va."""
PARTITION_TASKS: dict[str, tuple[str, ...]] = {BASE: ("t2va", "fl2va"), REF: ("ref2va",)}
"""The tasks each partition's transformer runs (diffusers' workflows)."""


def partition_of_task(task: str) -> str:
    """The partition whose transformer runs `task`; ValueError for an unknown task."""
    for name, tasks in PARTITION_TASKS.items():
        if task in tasks:
            return name
    raise ValueError(f"unknown task {task!r}; tasks: {[t for ts in PARTITION_TASKS.values() for t in ts]}")


def check_partition(name: str) -> str:
    """`name` if it is a partition name; ValueError listing them otherwise."""
    if name not in PARTITIONS:
        raise ValueError(f"unknown partition {name!r}; partitions: {list(PARTITIONS)}")
    return name


def read_json(root: Path, rel: str) -> Any:
    """`rel` (relative to the repository `root`) parsed; CheckpointError naming it when unreadable or not JSON."""
    try:
        return json.loads((root / rel).read_text())
    except OSError as e:
        raise CheckpointError(f"{rel}: cannot read: {e.strerror or e}") from e
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{rel}: not valid JSON ({e})") from e


def read_model_index(root: Path) -> dict[str, Any]:
    """model_index.json as parsed; CheckpointNotFoundError when the directory or the file is missing."""
    if not root.is_dir():
        raise CheckpointNotFoundError(f"repository directory not found: {root}")
    if not (root / MODEL_INDEX).is_file():
        raise CheckpointNotFoundError(f"{MODEL_INDEX}: missing from repository {root}")
    index = read_json(root, MODEL_INDEX)
    if not isinstance(index, dict):
        raise CheckpointError(f"{MODEL_INDEX}: expected an object of component -> [library, class]")
    return index


def repository_files(root: Path, components: Iterable[str]) -> list[str]:
    """model_index.json plus every regular file under the components' folders, as sorted relative paths."""
    files = [MODEL_INDEX]
    for comp in components:
        for f in sorted((root / comp).rglob("*")):
            if f.is_file() and not f.name.startswith("."):
                files.append(f.relative_to(root).as_posix())
    return files


def is_repository_dir(path: str | Path) -> bool:
    """True if `path` looks like a diffusers repository (has model_index.json); no validation."""
    return (Path(path) / MODEL_INDEX).is_file()
