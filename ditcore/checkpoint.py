"""Checkpoint format: `config.json`, sharded `*.safetensors`, `model.safetensors.index.json`.

Owns writing (deterministic random init), validation (every error names the file and the
tensor), the cheap fingerprint, and per-tensor streaming reads with `safe_open`.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ConfigError, DiTConfig, is_adaln_name, param_shapes

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
_ST_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class CheckpointError(Exception):
    """A checkpoint is corrupt or incompatible; the message names the file and tensor."""


class CheckpointNotFoundError(CheckpointError):
    """The checkpoint directory (or its config) does not exist."""


# ---------------------------------------------------------------------------- writing
def _init_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Deterministic init: unit norms, small biases, fan-in scaled weights."""
    if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("norm.weight"):
        return 1.0 + 0.02 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        return 0.02 * torch.randn(shape, generator=gen)
    if name == "text_embed.weight":
        return torch.randn(shape, generator=gen) * 0.5
    std = 1.0 / math.sqrt(shape[-1])
    if is_adaln_name(name):
        std *= 0.5  # modulation around 0: scale/shift/gate of a few tenths
    return torch.randn(shape, generator=gen) * std


def _shard_plan(names: list[str], sizes: dict[str, int], shards: int) -> list[list[str]]:
    """Split names (in order) into `shards` contiguous runs of roughly equal bytes."""
    total = sum(sizes.values())
    target = total / shards
    out: list[list[str]] = [[]]
    acc = 0
    for n in names:
        if acc >= target * len(out) and len(out) < shards:
            out.append([])
        out[-1].append(n)
        acc += sizes[n]
    while len(out) < shards:  # more shards than tensors worth splitting: keep K files anyway
        out.append([])
    return out


def write_checkpoint(config: DiTConfig, out_dir: str | Path, seed: int, shards: int = 1) -> Path:
    """Write a random-init checkpoint; the same (config, seed, shards) gives the same bytes."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shapes = param_shapes(config)
    dtype = config.torch_dtype
    gen = torch.Generator().manual_seed(seed)
    names = list(shapes)
    sizes = {n: math.prod(s) * config.dtype_bytes for n, s in shapes.items()}
    weight_map: dict[str, str] = {}
    plan = _shard_plan(names, sizes, shards)
    for k, group in enumerate(plan):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {n: _init_tensor(n, shapes[n], gen).to(dtype).contiguous() for n in group}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
        del tensors
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (out / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")
    return out


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


# ---------------------------------------------------------------------------- validation
@dataclass(frozen=True)
class CheckpointInfo:
    """A validated checkpoint: where it is, its config, tensor -> shard map, fingerprint."""

    path: Path
    config: DiTConfig
    weight_map: dict[str, str]
    fingerprint: str
    has_adaln: bool


def load_config(path: str | Path) -> DiTConfig:
    root = Path(path)
    cfg = root / CONFIG_FILE
    if not root.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory not found: {root}")
    if not cfg.is_file():
        raise CheckpointNotFoundError(f"{CONFIG_FILE} not found in checkpoint directory {root}")
    try:
        return DiTConfig.from_dict(json.loads(cfg.read_text()))
    except (ValueError, TypeError, ConfigError) as e:
        raise CheckpointError(f"{CONFIG_FILE}: {e}") from e


def _load_index(root: Path) -> dict[str, str]:
    idx = root / INDEX_FILE
    if not idx.is_file():
        raise CheckpointError(f"{INDEX_FILE}: missing from {root}")
    try:
        data = json.loads(idx.read_text())
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError("weight_map must map tensor names to shard file names")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{INDEX_FILE}: corrupt index ({e})") from e
    for tname, fname in weight_map.items():
        if fname != Path(fname).name or not fname.endswith(".safetensors"):
            raise CheckpointError(f"{INDEX_FILE}: tensor '{tname}' names an invalid shard file {fname!r}")
    return weight_map


def validate_checkpoint(path: str | Path, require_adaln: bool = True) -> CheckpointInfo:
    """Check config, index <-> shards, every expected tensor's presence, dtype and shape.

    `require_adaln=False` is the cached-mode check: adaln_proj tensors may be absent (they
    are never read), but any that are present must still be well-formed.
    """
    root = Path(path)
    config = load_config(root)
    weight_map = _load_index(root)
    headers: dict[str, ShardHeader] = {}
    for fname in sorted(set(weight_map.values())):
        first = next(t for t, f in weight_map.items() if f == fname)
        if not (root / fname).is_file():
            raise CheckpointError(f"{INDEX_FILE}: tensor '{first}' points to missing shard {fname}")
        try:
            headers[fname] = read_shard_header(root / fname)
        except CheckpointError as e:
            if "tensor '" in str(e):
                raise
            # A shard-level error (unreadable or garbage header): name a tensor the index puts here.
            raise CheckpointError(f"{e} (the index places tensor '{first}' in this shard)") from e
    want = _ST_DTYPES[config.dtype]
    shapes = param_shapes(config)
    has_adaln = all(n in weight_map for n in shapes if is_adaln_name(n))
    for tname, shape in shapes.items():
        if tname not in weight_map:
            if is_adaln_name(tname) and not require_adaln:
                continue
            raise CheckpointError(f"{INDEX_FILE}: missing tensor '{tname}' (expected {want}{list(shape)})")
        fname = weight_map[tname]
        entry = headers[fname].tensors.get(tname)
        if entry is None:
            raise CheckpointError(f"{fname}: missing tensor '{tname}' (the index says it is here)")
        if entry.dtype != want:
            raise CheckpointError(f"{fname}: tensor '{tname}': wrong dtype {entry.dtype}, expected {want}")
        if entry.shape != shape:
            raise CheckpointError(f"{fname}: tensor '{tname}': wrong shape {list(entry.shape)}, expected {list(shape)}")
    for tname in weight_map:
        if tname not in shapes:
            raise CheckpointError(f"{weight_map[tname]}: unexpected tensor '{tname}' for this config")
    return CheckpointInfo(root, config, dict(weight_map), _fingerprint(root, headers), has_adaln)


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


def _file_digests(root: Path, headers: dict[str, ShardHeader]) -> dict[str, str]:
    digests = {}
    for fname in (CONFIG_FILE, INDEX_FILE):
        digests[fname] = hashlib.sha256((root / fname).read_bytes()).hexdigest()
    for fname in sorted(headers):
        hdr = headers[fname]
        h = hashlib.sha256(f"{hdr.size}\0".encode() + hdr.header_bytes)
        h.update(data_samples(root / fname, hdr))
        digests[fname] = h.hexdigest()
    return digests


def combine_digests(digests: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{k}\0{v}\n" for k, v in sorted(digests.items())).encode()).hexdigest()


def _fingerprint(root: Path, headers: dict[str, ShardHeader]) -> str:
    return combine_digests(_file_digests(root, headers))


def file_digests(path: str | Path) -> dict[str, str]:
    """Per-file parts of the fingerprint (config, index, each shard): names what changed."""
    root = Path(path)
    weight_map = _load_index(root)
    headers = {f: read_shard_header(root / f) for f in sorted(set(weight_map.values()))}
    return _file_digests(root, headers)


def fingerprint(path: str | Path) -> str:
    """Cheap identity of a checkpoint: config + index + shard sizes + header bytes + the
    first and last 4 KiB of every tensor's data (edits confined to the interior of a large
    tensor are not seen; different weights, truncation and re-sharding are)."""
    return combine_digests(file_digests(path))


def changed_files(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Files whose digest differs, appeared or disappeared between two `file_digests`."""
    return sorted(f for f in set(old) | set(new) if old.get(f) != new.get(f))


# ---------------------------------------------------------------------------- reading
class CheckpointReader:
    """Per-tensor reads through `safe_open` (memory-mapped); one open handle per shard."""

    def __init__(self, info: CheckpointInfo) -> None:
        self.info = info
        self._handles: dict[str, Any] = {}

    def _handle(self, fname: str) -> Any:
        if fname not in self._handles:
            try:
                self._handles[fname] = safe_open(str(self.info.path / fname), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{fname}: cannot open shard: {e}") from e
        return self._handles[fname]

    def get(self, name: str) -> torch.Tensor:
        fname = self.info.weight_map.get(name)
        if fname is None:
            raise CheckpointError(f"{INDEX_FILE}: missing tensor '{name}'")
        try:
            return self._handle(fname).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{fname}: tensor '{name}': read failed: {e}") from e

    def tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {n: self.get(n) for n in names}

    def adaln_layer(self, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, bias) of one adaln_proj, e.g. prefix 'blocks.3.adaln_proj'."""
        return self.get(f"{prefix}.weight"), self.get(f"{prefix}.bias")

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def checkpoint_files(path: str | Path) -> list[str]:
    """Names of the files that make up a checkpoint (config, index, shards)."""
    root = Path(path)
    return [CONFIG_FILE, INDEX_FILE, *sorted(set(_load_index(root).values()))]


def is_checkpoint_dir(path: str | Path) -> bool:
    root = Path(path)
    return (root / CONFIG_FILE).is_file() and (root / INDEX_FILE).is_file()


__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "changed_files",
    "checkpoint_files",
    "combine_digests",
    "file_digests",
    "fingerprint",
    "is_checkpoint_dir",
    "load_config",
    "read_shard_header",
    "validate_checkpoint",
    "write_checkpoint",
]
