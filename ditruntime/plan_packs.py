"""Plan packs: built plans on disk, one file per group, content-addressed by everything that determines their bits.

The sidecar's disk tier (`plancache_service.disk_tier`, `--plan-dir`) writes a pack after a prepare that rebuilt part of
a group and reads plans back from any pack that holds them; `ditserve plans` (ditserve/plans_cli.py) writes packs
ahead of serving and lists, verifies and collects a plan directory with the helpers here. No gRPC, no torch: pages are
bytes here (the tier views them as tensors). See docs/architecture.md, "The disk tier and plan packs".

**Address.** A pack's name is `<address>.pack`, the address the sha256 of the canonical JSON (sorted keys, no
whitespace) of its `PackKey`: the `PackIdentity` of its plans (the partition's weight fingerprint, the partition, the
modulation digest of its adapters and scales, the page dtype and byte order, the page layout, the shard split of the
build, and the builder: device kind and torch version, since a GEMM's bits depend on its kernel) and the group's
ordered timestep keys (float32 bit patterns). A plan is looked up by (identity digest, timestep bits), whichever pack
holds it, so a new weight generation or adapter identity can never match an old pack: it has another identity.

**File layout** (little-endian):

    offset 0   8 bytes   MAGIC b"DITPACK\\0"
           8   u32       FORMAT_VERSION
          12   u32       header length H
          16   32 bytes  sha256 of the header bytes
          48   H bytes   header: canonical JSON {"format", "address", "key", "page_bytes", "plans": [{"bits", "offset",
                         "length", "xxh3_128"}], "payload_bytes", "created"}
               zeros     up to the payload offset: 48 + H rounded up to PAYLOAD_ALIGN (4096)
     payload   N bytes   each plan's pages in header order (width x page_bytes each), `offset` relative to the payload

The file's size must be exactly payload offset + N (shorter: truncated). A plan is verified against its own checksum
when it is read, so a lookup reads one plan, not the pack. The plans' checksum is XXH3-128 (the `xxhash` package, tens
of GB/s on one core): it guards against damage (a flipped bit, a torn write), not against a writer of the directory,
who could write any checksum; sha256 (under 2 GB/s here) would cap a pack's read below an NVMe's speed. Format 1
(sha256 per plan) is read as another version: skipped, never served. A pack is written under a temporary name in the
same directory (`.<name>.partial-<pid>-<n>`), fsynced, renamed, and the directory fsynced: no partial file ever
carries a final name.

**Errors.** `PackCorruptError` (bad magic, header checksum, truncation, a plan's checksum, an unparsable header):
the store deletes the pack (unless read-only) and the caller rebuilds. `PackVersionError` (another format version,
e.g. a newer sidecar sharing the directory): skipped, never deleted.

**Store.** `PackStore` indexes a directory by scanning pack headers (at open, then at most every `rescan_s` on a
miss, so a sidecar reading a shared directory sees packs another one wrote), keeps its packs under `max_bytes` by
evicting the least recently used (last use = the file's mtime, touched on every read), and counts what it did. A
read-only store (a shared directory written by another host) never writes, touches, evicts or deletes: a corrupt
pack there is only left unused.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import itertools
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from ditcore.checkpoint_files import ShortReadError, pread_into
from ditruntime.paths import prepare_dir, require_dir

log = logging.getLogger(__name__)

MAGIC = b"DITPACK\0"
FORMAT_VERSION = 2
PREFIX = struct.Struct("<8sII32s")  # magic, version, header length, header sha256
PAYLOAD_ALIGN = 4096
MAX_HEADER_BYTES = 16 * 1024**2
SUFFIX = ".pack"
PARTIAL = ".partial-"
STALE_PARTIAL_S = 3600.0
"""A temporary file older than this is an interrupted write (a writer killed mid-pack): `gc` and a writable store's
scan remove it."""

Bits = tuple[int, ...]


class PackError(Exception):
    """A pack that cannot be used; `path` names it."""

    def __init__(self, path: str | os.PathLike[str], why: str) -> None:
        super().__init__(f"plan pack {path}: {why}")
        self.path = Path(path)
        self.why = why


class PackCorruptError(PackError):
    """The pack's bytes are not what it was written as (magic, checksums, truncation): delete it and rebuild."""


class PackVersionError(PackError):
    """A pack of another format version: not readable here, and not ours to delete."""


# ---------------------------------------------------------------------------- identity and address
def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@dataclass(frozen=True)
class PackIdentity:
    """What a plan's pages depend on besides its timesteps: two plans of equal timesteps and identity are the same
    bits. Every field is in the address."""

    weights: str
    """The fingerprint of the partition's files as committed (ditcore.digests.partition_fingerprint)."""
    partition: str
    """"base" or "ref"."""
    adapters: str
    """The modulation digest of the adapters and scales its pages are built with ("" : the base weights')."""
    dtype: str
    """The pages' dtype name ("bfloat16", "float32", ...)."""
    num_layers: int
    hidden: int
    time_embed_dim: int
    page_numel: int
    """The page layout (ditcore.plans.PageLayout) and its elements per page."""
    shard_count: int = 1
    shard_mode: str = "whole"
    """How the build was split across devices (pages are whole either way; "rows" splits are used only where exact)."""
    builder: str = ""
    """The device kind and torch version that built the pages (a GEMM's bits depend on its kernel)."""
    byteorder: str = "little"

    def describe(self) -> dict[str, Any]:
        return asdict(self)

    @functools.cached_property
    def digest(self) -> str:
        """sha256 of the canonical description: the namespace plans are looked up in (computed once)."""
        return hashlib.sha256(canonical_json(self.describe())).hexdigest()

    @classmethod
    def from_description(cls, d: dict[str, Any]) -> PackIdentity:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class PackKey:
    """One pack: an identity and a group's ordered timestep keys (distinct, in first-use order)."""

    identity: PackIdentity
    keys: tuple[Bits, ...]

    def describe(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, **self.identity.describe(), "keys": [list(b) for b in self.keys]}

    @property
    def address(self) -> str:
        """sha256 of the canonical description: the pack's file name without its suffix."""
        return hashlib.sha256(canonical_json(self.describe())).hexdigest()

    @property
    def file_name(self) -> str:
        return self.address + SUFFIX

    @classmethod
    def from_description(cls, d: dict[str, Any]) -> PackKey:
        return cls(PackIdentity.from_description(d), tuple(tuple(int(x) for x in b) for b in d["keys"]))


# ---------------------------------------------------------------------------- header
@dataclass(frozen=True)
class PlanEntry:
    """One plan of a pack: its timestep bits and where its pages lie (offset relative to the payload)."""

    bits: Bits
    offset: int
    length: int
    checksum: str
    """XXH3-128 of its pages, hex."""


@dataclass(frozen=True)
class PackHeader:
    """A pack's header, checked: its key, its plans, and where its payload starts."""

    path: Path
    key: PackKey
    page_bytes: int
    plans: tuple[PlanEntry, ...]
    payload_offset: int
    payload_bytes: int
    created: float

    @property
    def address(self) -> str:
        return self.key.address

    @property
    def file_bytes(self) -> int:
        return self.payload_offset + self.payload_bytes


def _align(n: int) -> int:
    return -(-n // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def plan_checksum(data: bytes | memoryview) -> str:
    """A plan's checksum as its pack's header records it (XXH3-128, hex)."""
    return xxhash.xxh3_128_hexdigest(data)


def encode_pack(
    key: PackKey, page_bytes: int, plans: Sequence[tuple[Bits, bytes | memoryview]]
) -> list[bytes | memoryview]:
    """The pack's bytes as chunks (prefix and header, padding, then each plan's pages as given)."""
    if [b for b, _ in plans] != list(key.keys):
        raise ValueError("a pack's plans must be its key's, in its order")
    entries, offset = [], 0
    for bits, data in plans:
        n = len(data) if isinstance(data, bytes) else data.nbytes
        if n != len(bits) * page_bytes:
            raise ValueError(f"plan {bits}: {n} bytes, expected {len(bits)} pages of {page_bytes}")
        entries.append({"bits": list(bits), "offset": offset, "length": n, "xxh3_128": plan_checksum(data)})
        offset += n
    header = canonical_json({
        "format": FORMAT_VERSION, "address": key.address, "key": key.describe(), "page_bytes": page_bytes,
        "plans": entries, "payload_bytes": offset, "created": round(time.time(), 3),
    })  # fmt: skip
    prefix = PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), hashlib.sha256(header).digest())
    head = prefix + header
    return [head, bytes(_align(len(head)) - len(head)), *(d for _, d in plans)]


def parse_header(path: Path, head: bytes, file_bytes: int) -> PackHeader:
    """Check a pack's prefix and header (`head`: at least its first PREFIX.size + H bytes) against its size."""
    if len(head) < PREFIX.size:
        raise PackCorruptError(path, f"truncated: {file_bytes} bytes, shorter than the {PREFIX.size}-byte prefix")
    magic, version, hlen, hsha = PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise PackCorruptError(path, f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise PackVersionError(path, f"format version {version}; this build reads {FORMAT_VERSION}")
    if hlen > MAX_HEADER_BYTES:
        raise PackCorruptError(path, f"header length {hlen} over {MAX_HEADER_BYTES}")
    raw = head[PREFIX.size : PREFIX.size + hlen]
    if len(raw) < hlen:
        raise PackCorruptError(path, f"truncated: {file_bytes} bytes, inside its {hlen}-byte header")
    if hashlib.sha256(raw).digest() != hsha:
        raise PackCorruptError(path, "header checksum mismatch")
    try:
        h = json.loads(raw)
        key = PackKey.from_description(h["key"])
        plans = tuple(PlanEntry(tuple(int(x) for x in p["bits"]), int(p["offset"]), int(p["length"]),
                                str(p["xxh3_128"])) for p in h["plans"])  # fmt: skip
        page_bytes, payload_bytes, created = int(h["page_bytes"]), int(h["payload_bytes"]), float(h["created"])
    except (ValueError, KeyError, TypeError) as e:
        raise PackCorruptError(path, f"unreadable header: {type(e).__name__}: {e}") from e
    if h.get("address") != key.address or path.name != key.file_name:
        raise PackCorruptError(path, f"its key's address {key.address} is not its name")
    if tuple(p.bits for p in plans) != key.keys:
        raise PackCorruptError(path, "its plans are not its key's")
    expect = 0
    for p in plans:
        if p.offset != expect or p.length != len(p.bits) * page_bytes:
            raise PackCorruptError(path, f"plan {p.bits} at offset {p.offset}, {p.length} bytes: not where it belongs")
        expect += p.length
    if expect != payload_bytes:
        raise PackCorruptError(path, f"payload of {payload_bytes} bytes, its plans add up to {expect}")
    payload_offset = _align(PREFIX.size + hlen)
    if file_bytes != payload_offset + payload_bytes:
        what = "truncated" if file_bytes < payload_offset + payload_bytes else "trailing bytes"
        raise PackCorruptError(path, f"{what}: {file_bytes} bytes, expected {payload_offset + payload_bytes}")
    return PackHeader(path, key, page_bytes, plans, payload_offset, payload_bytes, created)


def read_header(path: str | os.PathLike[str]) -> PackHeader:
    """A pack's checked header (no payload read). PackCorruptError / PackVersionError; OSError if unreadable."""
    p = Path(path)
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(PREFIX.size)
        if len(head) == PREFIX.size and head[:8] == MAGIC:
            hlen = PREFIX.unpack_from(head)[2]
            if hlen <= MAX_HEADER_BYTES:
                head += f.read(hlen)
    return parse_header(p, head, size)


def open_pack(header: PackHeader) -> int:
    """A read-only descriptor of the pack, its size checked against the header's (PackCorruptError: truncated or
    grown); the caller closes it. OSError if it cannot be opened (FileNotFoundError: gone)."""
    fd = os.open(header.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size != header.file_bytes:
            raise PackCorruptError(header.path, f"truncated: {size} bytes, expected {header.file_bytes}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_plan_into(header: PackHeader, entry: PlanEntry, out: memoryview, fd: int) -> None:
    """Read one plan's pages from the open pack `fd` into `out` (exactly `entry.length` writable bytes: e.g. the slab's
    own memory, no intermediate copy) and check them against the header's checksum (PackCorruptError on a short read or
    a mismatch: `out` then holds bytes that must not be used)."""
    if out.nbytes != entry.length:
        raise ValueError(f"plan {entry.bits}: a {out.nbytes}-byte buffer for its {entry.length} bytes")
    try:
        pread_into(fd, out, header.payload_offset + entry.offset, os.fspath(header.path))
    except ShortReadError as e:
        raise PackCorruptError(header.path, f"truncated inside plan {entry.bits}") from e
    if plan_checksum(out) != entry.checksum:
        raise PackCorruptError(header.path, f"plan {entry.bits}: checksum mismatch")


def verify_pack(path: str | os.PathLike[str]) -> PackHeader:
    """Read and check a whole pack: its header, the padding and every plan."""
    header = read_header(path)
    with open(header.path, "rb") as f:
        head = os.pread(f.fileno(), header.payload_offset, 0)
    if any(head[PREFIX.size + PREFIX.unpack_from(head)[2] :]):
        raise PackCorruptError(header.path, "non-zero padding before the payload")
    buf = memoryview(bytearray(max((e.length for e in header.plans), default=0)))
    fd = open_pack(header)
    try:
        for entry in header.plans:
            read_plan_into(header, entry, buf[: entry.length], fd)
    finally:
        os.close(fd)
    return header


# ---------------------------------------------------------------------------- writing
_partial_ids = itertools.count()
_os_write = os.write  # every pack byte is written through this (tests stand in a full disk here)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_pack(root: str | os.PathLike[str], key: PackKey, page_bytes: int,
               plans: Sequence[tuple[Bits, bytes | memoryview]]) -> PackHeader:  # fmt: skip
    """Write a pack into `root`: a temporary file beside it, written, fsynced, renamed to `<address>.pack`, the
    directory fsynced. OSError (ENOSPC, EACCES, ...) leaves no file behind."""
    return write_encoded(root, key, encode_pack(key, page_bytes, plans))


def write_encoded(root: str | os.PathLike[str], key: PackKey, chunks: Sequence[bytes | memoryview]) -> PackHeader:
    """`write_pack` of chunks `encode_pack` made."""
    root = Path(root)
    final = root / key.file_name
    tmp = root / f".{key.file_name}{PARTIAL}{os.getpid()}-{next(_partial_ids)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                while view:
                    n = _os_write(fd, view)
                    view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename is durable once the directory is; a failure here loses no data
        _fsync_dir(root)
    return read_header(final)


# ---------------------------------------------------------------------------- directory helpers (the CLI's)
@dataclass(frozen=True)
class PackListing:
    """One file of a plan directory: its header, or why it cannot be used."""

    path: Path
    bytes: int
    mtime: float
    header: PackHeader | None
    error: PackError | None


def pack_files(root: str | os.PathLike[str]) -> Iterator[os.DirEntry[str]]:
    """The `*.pack` entries of `root` (temporary files start with a dot and are not packs)."""
    with os.scandir(root) as it:
        for e in it:
            if e.name.endswith(SUFFIX) and not e.name.startswith(".") and e.is_file(follow_symlinks=False):
                yield e


def list_packs(root: str | os.PathLike[str], verify: bool = False) -> list[PackListing]:
    """Every pack of `root`, least recently used first, each with its checked header (`verify`: every plan read and
    checked too) or its error."""
    out = []
    for e in pack_files(root):
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        header: PackHeader | None = None
        error: PackError | None = None
        try:
            header = verify_pack(e.path) if verify else read_header(e.path)
        except PackError as err:
            error = err
        except OSError as err:
            error = PackCorruptError(e.path, f"unreadable: {err}")
        out.append(PackListing(Path(e.path), st.st_size, st.st_mtime, header, error))
    return sorted(out, key=lambda p: (p.mtime, p.path.name))


def stale_partials(root: str | os.PathLike[str], older_than_s: float = STALE_PARTIAL_S) -> list[Path]:
    """Temporary files of interrupted writes (older than `older_than_s`)."""
    now = time.time()
    out = []
    with os.scandir(root) as it:
        for e in it:
            if e.name.startswith(".") and PARTIAL in e.name:
                with contextlib.suppress(OSError):
                    if now - e.stat(follow_symlinks=False).st_mtime > older_than_s:
                        out.append(Path(e.path))
    return out


@dataclass(frozen=True)
class GcResult:
    removed_corrupt: tuple[Path, ...]
    evicted: tuple[Path, ...]
    removed_partials: tuple[Path, ...]
    kept_bytes: int


def gc(root: str | os.PathLike[str], max_bytes: int, verify: bool = False, dry_run: bool = False) -> GcResult:
    """Remove corrupt packs (not those of another format version), interrupted writes, then the least recently used
    packs until the rest fit `max_bytes`."""
    listing = list_packs(root, verify=verify)
    corrupt = [p.path for p in listing if isinstance(p.error, PackCorruptError)]
    good = [p for p in listing if p.error is None]
    total = sum(p.bytes for p in listing if not isinstance(p.error, PackCorruptError))
    evicted = []
    for p in good:
        if total <= max_bytes:
            break
        evicted.append(p.path)
        total -= p.bytes
    partials = stale_partials(root)
    if not dry_run:
        for path in [*corrupt, *evicted, *partials]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    return GcResult(tuple(corrupt), tuple(evicted), tuple(partials), total)


# ---------------------------------------------------------------------------- the store
@dataclass(frozen=True)
class PlanRef:
    """Where one plan lies: its pack's header and its entry."""

    header: PackHeader
    entry: PlanEntry


@dataclass
class _Pack:
    header: PackHeader
    identity: str
    bytes: int
    last_used: float
    stamp: tuple[int, float] = (0, 0.0)  # (size, mtime) when indexed: a changed file is indexed again


@dataclass
class PackStoreStats:
    """What a store has done since it opened, and what it holds now."""

    capacity_bytes: int = 0
    used_bytes: int = 0
    packs: int = 0
    read_only: bool = False
    stored_plans: int = 0
    written_bytes: int = 0
    evictions: int = 0
    corrupt_packs: int = 0
    write_errors: int = 0


@dataclass
class _Counts:
    stored_plans: int = 0
    written_bytes: int = 0
    evictions: int = 0
    corrupt_packs: int = 0
    write_errors: int = 0
    logged: set[str] = field(default_factory=set)


class PackReader:
    """Reads plans of a `PackStore` into caller buffers (`read_into`), one open descriptor per pack; a context manager
    (leaving it closes them)."""

    def __init__(self, store: PackStore) -> None:
        self.store = store
        self._fds: dict[Path, int] = {}
        self._failed: set[Path] = set()  # packs found corrupt or gone by this reader: their other plans are not read

    def __enter__(self) -> PackReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def read_into(self, ref: PlanRef, out: memoryview) -> None:
        """Read the plan's pages into `out` (its `entry.length` bytes) and check them. A corrupt pack (checksum,
        truncation) is dropped from the index and deleted (unless read-only), then PackCorruptError raised; a pack
        gone meanwhile (evicted, deleted by another process) raises PackError; either way `out` must not be used."""
        path = ref.header.path
        if path in self._failed:
            raise PackError(path, "dropped earlier in this read")
        try:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = open_pack(ref.header)
            read_plan_into(ref.header, ref.entry, out, fd)
        except FileNotFoundError as e:
            self._failed.add(path)
            self.store._drop(path.name)
            raise PackError(path, "gone") from e
        except PackCorruptError as e:
            self._failed.add(path)
            self.store.discard(path, e)
            raise
        except OSError as e:
            self._failed.add(path)
            raise PackError(path, f"unreadable: {e}") from e


class PackStore:
    """A plan directory: its packs indexed by plan (identity digest, timestep bits), bounded by `max_bytes` with LRU
    eviction, or read-only (never written, touched, evicted or deleted). Thread-safe; file I/O runs outside its lock
    except unlinks. `clock` is wall time (mtimes are)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        max_bytes: int,
        *,
        read_only: bool = False,
        rescan_s: float = 2.0,
        flag: str = "--plan-dir",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = require_dir(Path(root), flag) if read_only else prepare_dir(Path(root), flag)
        self.max_bytes = max_bytes
        self.read_only = read_only
        self.rescan_s = rescan_s
        self._clock = clock
        self._lock = threading.Lock()
        self._packs: dict[str, _Pack] = {}  # file name -> pack
        self._plans: dict[tuple[str, Bits], dict[str, PlanEntry]] = {}  # (identity, bits) -> {file name: entry}
        self._bad: dict[str, tuple[int, float]] = {}  # unusable files (read-only, or another version) by their stamp
        self._counts = _Counts()
        self._last_scan = 0.0
        self.scan()
        if not read_only:
            self._evict(protect=None)

    # ---------------------------------------------------------------- queries
    def lookup(self, identity: PackIdentity, bits: Bits) -> PlanRef | None:
        """Where a plan lies, rescanning the directory first on a miss when the last scan is `rescan_s` old."""
        ref = self._find(identity.digest, bits)
        if ref is None and self._clock() - self._last_scan >= self.rescan_s:
            self.scan()
            ref = self._find(identity.digest, bits)
        return ref

    def has_pack(self, key: PackKey) -> bool:
        with self._lock:
            return key.file_name in self._packs

    def stats(self) -> PackStoreStats:
        with self._lock:
            c = self._counts
            return PackStoreStats(
                self.max_bytes, sum(p.bytes for p in self._packs.values()), len(self._packs), self.read_only,
                c.stored_plans, c.written_bytes, c.evictions, c.corrupt_packs, c.write_errors,
            )  # fmt: skip

    def headers(self) -> list[PackHeader]:
        """Indexed packs, least recently used first."""
        with self._lock:
            return [p.header for p in sorted(self._packs.values(), key=lambda p: p.last_used)]

    def _find(self, identity: str, bits: Bits) -> PlanRef | None:
        with self._lock:
            where = self._plans.get((identity, bits))
            if not where:
                return None
            name = max(where, key=lambda n: self._packs[n].last_used)  # the most recently used pack holding it
            return PlanRef(self._packs[name].header, where[name])

    # ---------------------------------------------------------------- reads
    def reader(self) -> PackReader:
        """A reader of plans into caller buffers, keeping each pack it reads open until it is closed (a group's plans
        are read from one descriptor per pack, in the order asked)."""
        return PackReader(self)

    def touch(self, headers: Iterable[PackHeader]) -> None:
        """Mark packs used now (their mtime too, unless read-only, so the order outlives a restart)."""
        now = self._clock()
        names = {h.path.name for h in headers}
        with self._lock:
            for name in names:
                p = self._packs.get(name)
                if p is not None:
                    p.last_used = now
        if not self.read_only:
            for name in names:
                with contextlib.suppress(OSError):
                    os.utime(self.root / name, (now, now))

    def discard(self, path: Path, error: PackError) -> None:
        """Forget a corrupt pack (and delete it, unless read-only); counted, logged."""
        name = path.name
        with self._lock:
            self._counts.corrupt_packs += 1
        self._drop(name)
        if self.read_only:
            with contextlib.suppress(OSError):
                st = (self.root / name).stat()
                with self._lock:
                    self._bad[name] = (st.st_size, st.st_mtime)
            log.warning("%s; left in place (read-only plan directory), not used", error)
            return
        with contextlib.suppress(FileNotFoundError):
            (self.root / name).unlink()
        log.warning("%s; deleted (its plans are rebuilt)", error)

    # ---------------------------------------------------------------- writes
    def write(self, key: PackKey, page_bytes: int, plans: Sequence[tuple[Bits, bytes | memoryview]]) -> bool:
        """Write and index a pack, then evict down to `max_bytes`. Never raises for the disk: an OSError (a full
        disk, an unwritable directory) is counted and logged (once per kind) and False returned."""
        if self.read_only:
            return False
        chunks = encode_pack(key, page_bytes, plans)
        size = sum(memoryview(c).nbytes for c in chunks)
        if size > self.max_bytes:
            self._note_error("too-large", f"a pack of {size} bytes does not fit --plan-dir-max-gb ({self.max_bytes} "
                             "bytes): not written")  # fmt: skip
            return False
        try:
            header = write_encoded(self.root, key, chunks)
        except OSError as e:
            kind = errno.errorcode.get(e.errno or 0, type(e).__name__)
            self._note_error(kind, f"cannot write plan pack {key.file_name} in {self.root}: {e}")
            return False
        now = self._clock()
        with contextlib.suppress(OSError):
            os.utime(header.path, (now, now))  # last use on the store's clock, as `touch` sets it
        with self._lock:
            self._counts.stored_plans += len(plans)
            self._counts.written_bytes += header.file_bytes
        self._index(header, header.file_bytes, now, stamp=None)
        self._evict(protect=key.file_name)
        return True

    def _note_error(self, kind: str, message: str) -> None:
        with self._lock:
            self._counts.write_errors += 1
            first = kind not in self._counts.logged
            self._counts.logged.add(kind)
        if first:
            log.warning("%s (requests go on; further %s errors are counted, not logged)", message, kind)
        else:
            log.debug("%s", message)

    # ---------------------------------------------------------------- the index
    def scan(self) -> None:
        """Index every pack of the directory not indexed yet (headers only), forget the files gone."""
        self._last_scan = self._clock()
        try:
            entries = list(pack_files(self.root))
        except OSError as err:
            log.warning("cannot list plan directory %s: %s", self.root, err)
            return
        seen = set()
        for e in entries:
            seen.add(e.name)
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            stamp = (st.st_size, st.st_mtime)
            with self._lock:
                known = self._packs.get(e.name)
                if (known is not None and known.stamp[0] == stamp[0]) or self._bad.get(e.name) == stamp:
                    continue
            try:
                header = read_header(e.path)
            except PackVersionError as err:
                with self._lock:
                    self._bad[e.name] = stamp
                log.info("%s: skipped", err)
                continue
            except PackCorruptError as err:
                self.discard(Path(e.path), err)
                continue
            except OSError:
                continue
            self._index(header, st.st_size, st.st_mtime, stamp)
        with self._lock:
            gone = [n for n in self._packs if n not in seen]
        for n in gone:
            self._drop(n)
        if not self.read_only:
            for p in stale_partials(self.root):
                with contextlib.suppress(OSError):
                    p.unlink()

    def _index(self, header: PackHeader, size: int, last_used: float, stamp: tuple[int, float] | None) -> None:
        identity = header.key.identity.digest
        name = header.path.name
        with self._lock:
            self._packs[name] = _Pack(header, identity, size, last_used, stamp or (size, last_used))
            for entry in header.plans:
                self._plans.setdefault((identity, entry.bits), {})[name] = entry

    def _drop(self, name: str) -> None:
        with self._lock:
            p = self._packs.pop(name, None)
            if p is None:
                return
            for entry in p.header.plans:
                where = self._plans.get((p.identity, entry.bits))
                if where is not None:
                    where.pop(name, None)
                    if not where:
                        del self._plans[(p.identity, entry.bits)]

    def _evict(self, protect: str | None) -> None:
        """Delete least recently used packs until the indexed ones fit `max_bytes` (never `protect`)."""
        while True:
            with self._lock:
                total = sum(p.bytes for p in self._packs.values())
                if total <= self.max_bytes:
                    return
                victims = sorted((p for n, p in self._packs.items() if n != protect), key=lambda p: p.last_used)
                if not victims:
                    return
                victim = victims[0].header.path.name
                self._counts.evictions += 1
            self._drop(victim)
            with contextlib.suppress(FileNotFoundError):
                (self.root / victim).unlink()
            log.debug("evicted plan pack %s (plan directory over %d bytes)", victim, self.max_bytes)
