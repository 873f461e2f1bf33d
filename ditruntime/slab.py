"""The slab contract both services import: slot-table row layout, the slab descriptor and its
one proto conversion, the descriptor's validation, and the consumer side of sharing (map the
table and slab read-only, open a CUDA IPC export; `SlabMapping` closes what it mapped). The
sidecar owns allocation (`plancache_service.device`); the generator only maps. See
docs/architecture.md, "The slab and the lease protocol".

Nothing here deserializes objects: a CUDA IPC export travels as typed fields (`CudaIpcHandle`)
that are checked field by field (`validate_descriptor`) before torch opens them.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import re
import stat
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ditcore.plans import DTYPES
from protos.ditserve.plancache.v1 import plancache_pb2 as pb

log = logging.getLogger(__name__)

# slot-table row layout (int64 words): state, generation, key width, write sequence, the key's partition
# (ditcore.plans.PARTITION_CODES), the key's adapters (PlanKey.adapters_code: 0 for the base weights' plan), then the
# key's timestep bits
COL_STATE, COL_GENERATION, COL_LENGTH, COL_SEQ, COL_PARTITION, COL_ADAPTERS = 0, 1, 2, 3, 4, 5
ROW_WORDS = 6
EMPTY, FILLING, READY = 0, 1, 2
STATE_NAMES = {EMPTY: "EMPTY", FILLING: "FILLING", READY: "READY"}

# CUDA IPC export, as torch's UntypedStorage._share_cuda_() writes it
CUDA_IPC_HANDLE_SIZE = 64
"""Bytes of a cudaIpcMemHandle_t and of a cudaIpcEventHandle_t."""
MEM_HANDLE_SIZE = 2 + CUDA_IPC_HANDLE_SIZE
"""torch's shareable handle of a cudaMalloc block: a version byte, b"c", the cudaIpcMemHandle_t."""
MEM_HANDLE_CUDA_MALLOC = ord("c")
MEM_HANDLE_EXPANDABLE = ord("e")
REF_COUNTER_SLOTS = 10_000
"""int64 counters per torch reference-counter file (torch::CUDA_IPC_REF_COUNTER_FILE_SIZE)."""
REF_COUNTER_NAME = re.compile(rb"/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}")
"""torch's reference-counter file names (at::NewProcessWideShmHandle: /torch_<pid>_<random>_<counter>)."""
DEVICE_UUID = re.compile(r"(GPU-)?[0-9A-Za-z-]{1,64}")
MAX_SLOTS, MAX_WIDTH = 1_000_000, 16  # CacheConfig's bounds on --gpu-plans / --plan-width
MAX_SLAB_BYTES = 1 << 48

# the sidecar's shared-memory files (plancache_service.device names them with tempfile.mkstemp)
TABLE_PREFIX, SLAB_PREFIX = "ditserve-table-", "ditserve-slab-"
SHM_NAME = {field: re.compile(re.escape(prefix) + r"[A-Za-z0-9_]{1,64}")
            for field, prefix in (("table_path", TABLE_PREFIX), ("slab_path", SLAB_PREFIX))}  # fmt: skip
"""The file names a descriptor may carry, per field: the prefix, then mkstemp's random characters."""
DEFAULT_SHM_DIR = "/dev/shm"
"""Where the sidecar puts its files (CacheConfig.shm_dir), falling back to the temp dir when it is not writable."""


def default_shm_dirs() -> tuple[str, ...]:
    """The directories a consumer maps the sidecar's files from by default: /dev/shm and the temp dir (the
    sidecar's fallback)."""
    return (DEFAULT_SHM_DIR, tempfile.gettempdir())


class SlabDescriptorError(ValueError):
    """A slab descriptor that breaks a rule; the message names the field and the rule."""


@dataclass(frozen=True)
class CudaIpcHandle:
    """A CUDA IPC export of the slab's storage, field by field (torch's `_share_cuda_()` tuple
    without the device index: the consumer finds its own index from `device_uuid`)."""

    mem_handle: bytes  # version byte, b"c", 64-byte cudaIpcMemHandle_t of the allocation
    storage_size_bytes: int
    storage_offset_bytes: int  # of the storage in that allocation
    ref_counter_handle: bytes  # torch's shared-memory counter file of this export
    ref_counter_offset: int
    event_handle: bytes  # cudaIpcEventHandle_t recorded after the producer's last write
    event_sync_required: bool


@dataclass(frozen=True)
class SlabDescriptor:
    """What a consumer needs to map the slab and the table (sent by Attach)."""

    transport: str  # "shm" (cpu) or "cuda_ipc"
    slab_path: str  # shm file of the slab ("" on cuda)
    table_path: str  # shm file of the slot table
    slab_bytes: int
    table_bytes: int
    dtype: str
    num_slots: int
    width: int
    page_numel: int
    device: str  # "cpu" or "cuda:N"
    device_uuid: str = ""
    cuda_ipc: CudaIpcHandle | None = None  # one export per Attach session (cuda_ipc only)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def table_words(self) -> int:
        return ROW_WORDS + self.width


# ---------------------------------------------------------------------------- validation
def _bad(field_name: str, rule: str) -> SlabDescriptorError:
    return SlabDescriptorError(f"slab descriptor: {field_name}: {rule}")


def validate_descriptor(desc: SlabDescriptor) -> torch.dtype:
    """Check every field before anything is mapped or opened; returns the page dtype.

    Geometry: dtype in the allow-list, counts in range, `slab_bytes` = num_slots·width·page_numel·itemsize,
    `table_bytes` = num_slots·(ROW_WORDS + width)·8. Transport: shm carries paths and no IPC export;
    cuda_ipc carries a device UUID and an export whose handle lengths, types, counter name and storage
    size match torch's format and the geometry.
    """
    dtype = DTYPES.get(desc.dtype)
    if dtype is None:
        raise _bad("dtype", f"{desc.dtype!r} is not one of {sorted(DTYPES)}")
    if not 1 <= desc.num_slots <= MAX_SLOTS:
        raise _bad("num_slots", f"{desc.num_slots} is outside [1, {MAX_SLOTS}]")
    if not 1 <= desc.width <= MAX_WIDTH:
        raise _bad("width", f"{desc.width} is outside [1, {MAX_WIDTH}]")
    if not 1 <= desc.page_numel <= MAX_SLAB_BYTES:
        raise _bad("page_numel", f"{desc.page_numel} is outside [1, 2^48]")
    itemsize = torch.empty((), dtype=dtype).element_size()
    want_slab = desc.num_slots * desc.width * desc.page_numel * itemsize
    want_table = desc.num_slots * desc.table_words * 8
    if desc.slab_bytes != want_slab or want_slab > MAX_SLAB_BYTES:
        raise _bad(
            "slab_bytes",
            f"{desc.slab_bytes} must equal num_slots*width*page_numel*itemsize = "
            f"{desc.num_slots}*{desc.width}*{desc.page_numel}*{itemsize} = {want_slab} (at most 2^48)",
        )
    if desc.table_bytes != want_table:
        raise _bad("table_bytes", f"{desc.table_bytes} must equal num_slots*(ROW_WORDS+width)*8 = {want_table}")
    _check_path("table_path", desc.table_path)
    if desc.transport == "shm":
        _check_path("slab_path", desc.slab_path)
        if desc.cuda_ipc is not None or desc.device != "cpu":
            raise _bad("cuda_ipc", f"the shm transport is the cpu slab; got device {desc.device!r} and an IPC export")
        return dtype
    if desc.transport != "cuda_ipc":
        raise _bad("transport", f"{desc.transport!r} is not 'shm' or 'cuda_ipc'")
    if desc.slab_path:
        raise _bad("slab_path", "must be empty on the cuda_ipc transport")
    if not re.fullmatch(r"cuda(:[0-9]{1,3})?", desc.device):
        raise _bad("device", f"{desc.device!r} is not 'cuda' or 'cuda:N'")
    if not DEVICE_UUID.fullmatch(desc.device_uuid):
        raise _bad("device_uuid", f"{desc.device_uuid!r} is not a CUDA device UUID")
    _check_ipc(desc.cuda_ipc, want_slab, itemsize)
    return dtype


def _check_path(name: str, path: str) -> None:
    """An absolute, normalized path whose file name is the sidecar's (`ditserve-table-*` / `ditserve-slab-*`);
    which directory it may be in is the consumer's to say (`map_slab`'s `shm_dirs`)."""
    if not path.startswith("/") or "\x00" in path or len(path) > 4096:
        raise _bad(name, f"{path!r} must be an absolute path without NUL bytes")
    if os.path.normpath(path) != path:
        raise _bad(name, f"{path!r} must be a normalized path (no '..', '.', '//' or trailing '/')")
    if not SHM_NAME[name].fullmatch(os.path.basename(path)):
        prefix = TABLE_PREFIX if name == "table_path" else SLAB_PREFIX
        raise _bad(name, f"{path!r}: the file name must be the sidecar's, {prefix}<random letters, digits or _>")


def _check_ipc(ipc: CudaIpcHandle | None, slab_bytes: int, itemsize: int) -> None:
    if ipc is None:
        raise _bad("cuda_ipc", "missing: the cuda_ipc transport needs the slab's IPC export")
    h = ipc.mem_handle
    if len(h) >= 2 and h[1] == MEM_HANDLE_EXPANDABLE:
        raise _bad(
            "cuda_ipc.mem_handle",
            "an expandable-segment handle is not accepted; start the sidecar without "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        )
    if len(h) != MEM_HANDLE_SIZE or h[0] == 0 or h[1] != MEM_HANDLE_CUDA_MALLOC:
        raise _bad(
            "cuda_ipc.mem_handle",
            f"must be {MEM_HANDLE_SIZE} bytes (version byte >= 1, b'c', a {CUDA_IPC_HANDLE_SIZE}-byte "
            f"cudaIpcMemHandle_t); got {len(h)} bytes starting {h[:2]!r}",
        )
    if ipc.storage_size_bytes != slab_bytes:
        raise _bad("cuda_ipc.storage_size_bytes", f"{ipc.storage_size_bytes} must equal slab_bytes {slab_bytes}")
    if not 0 <= ipc.storage_offset_bytes <= MAX_SLAB_BYTES or ipc.storage_offset_bytes % itemsize:
        raise _bad(
            "cuda_ipc.storage_offset_bytes",
            f"{ipc.storage_offset_bytes} must be in [0, 2^48] and a multiple of {itemsize}",
        )
    if not REF_COUNTER_NAME.fullmatch(ipc.ref_counter_handle):
        raise _bad(
            "cuda_ipc.ref_counter_handle",
            f"{ipc.ref_counter_handle[:80]!r} is not a torch counter file name /torch_<pid>_<n>_<n>",
        )
    if not 0 <= ipc.ref_counter_offset < REF_COUNTER_SLOTS:
        raise _bad("cuda_ipc.ref_counter_offset", f"{ipc.ref_counter_offset} is outside [0, {REF_COUNTER_SLOTS})")
    if len(ipc.event_handle) != CUDA_IPC_HANDLE_SIZE:
        raise _bad("cuda_ipc.event_handle", f"must be {CUDA_IPC_HANDLE_SIZE} bytes, got {len(ipc.event_handle)}")
    if not isinstance(ipc.event_sync_required, bool):
        raise _bad("cuda_ipc.event_sync_required", f"must be a bool, got {type(ipc.event_sync_required).__name__}")


# ---------------------------------------------------------------------------- consumer side
def map_slab(
    desc: SlabDescriptor, device: torch.device | None = None, shm_dirs: Sequence[str | Path] | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[mmap.mmap]]:
    """Consumer side: validate the descriptor, check the slab is on `device` (the model's; not checked when
    None), then map the table (and, on cpu, the slab) read-only.

    The files must be regular files directly in one of `shm_dirs` (default `default_shm_dirs()`), named as
    the sidecar names them, and are opened without following a symlink (`open_shm_file`). On cuda the slab
    comes from its IPC export (`open_ipc`), opened only after `check_device` accepted its GPU. Returns
    (slab, table, mmaps); keep the mmaps alive as long as the tensors are used (`SlabMapping` does).
    """
    dtype = validate_descriptor(desc)
    if device is not None:
        check_device(desc, device)  # before anything is opened: opening an IPC handle creates a CUDA context
    dirs = default_shm_dirs() if shm_dirs is None else tuple(shm_dirs)
    maps: list[mmap.mmap] = []
    table = _map_readonly("table_path", desc.table_path, desc.table_bytes, torch.int64, maps, dirs)
    table = table.view(desc.num_slots, desc.table_words)
    if desc.transport == "cuda_ipc":
        return open_ipc(desc, device), table, maps
    slab = _map_readonly("slab_path", desc.slab_path, desc.slab_bytes, dtype, maps, dirs)
    return slab.view(desc.num_slots, desc.width, desc.page_numel), table, maps


def open_shm_file(name: str, path: str, nbytes: int, shm_dirs: Sequence[str | Path]) -> int:
    """A read-only fd of the sidecar's file `path` (descriptor field `name`), refused (SlabDescriptorError)
    unless it is a regular file of exactly `nbytes` bytes, directly in one of `shm_dirs`, named as the sidecar
    names it. The file is opened relative to its directory with O_NOFOLLOW, so a symlink planted under the
    sidecar's name (to any other readable file) is refused, not followed."""
    _check_path(name, path)
    parent, base = os.path.split(path)
    allowed = {os.path.normpath(os.path.abspath(d)) for d in shm_dirs}
    allowed |= {os.path.realpath(d) for d in allowed}
    if parent not in allowed:
        raise _bad(name, f"{path!r} is not in the shm directory ({', '.join(sorted(map(str, shm_dirs)))})")
    try:
        dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = os.open(base, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        why = "is a symlink (not followed)" if os.path.islink(path) else f"cannot be opened: {e.strerror}"
        raise _bad(name, f"{path!r} {why}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _bad(name, f"{path!r} is not a regular file")
        if st.st_size != nbytes:
            raise _bad(name, f"{path!r} is {st.st_size} bytes, the descriptor says {nbytes}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map_readonly(
    name: str, path: str, nbytes: int, dtype: torch.dtype, maps: list[mmap.mmap], shm_dirs: Sequence[str | Path]
) -> torch.Tensor:
    fd = open_shm_file(name, path, nbytes, shm_dirs)
    try:
        mm = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    maps.append(mm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: writes would fault
        return torch.frombuffer(mm, dtype=dtype)


class SlabMappingClosedError(RuntimeError):
    """The mapping was closed (its session ended): its slab may no longer be read."""


@dataclass(eq=False)
class SlabMapping:
    """One attachment's mapped slab and table. `close()` drops every reference this mapping
    holds and waits (bounded) until nothing else holds the slab's storage, on either transport
    (a weak reference to it tells): on cuda so the IPC mapping is closed and the producer's
    reference counter released before a new slab is mapped; on cpu so the shm pages are
    unmapped (their last view gone) rather than pinned by a stale reader."""

    descriptor: SlabDescriptor
    _slab: torch.Tensor | None
    _table: torch.Tensor | None
    _maps: list[mmap.mmap] = field(default_factory=list)
    _storage_ref: StorageWeakRef | None = None  # the released slab's storage (cpu or cuda) until it is freed

    @classmethod
    def open(
        cls, desc: SlabDescriptor, device: torch.device | None = None, shm_dirs: Sequence[str | Path] | None = None
    ) -> SlabMapping:
        """`map_slab`: validated, on `device` (checked before anything is opened), the sidecar's files only."""
        slab, table, maps = map_slab(desc, device, shm_dirs)
        return cls(desc, slab, table, maps)

    @property
    def closed(self) -> bool:
        return self._slab is None

    @property
    def slab(self) -> torch.Tensor:
        slab = self._slab
        if slab is None:
            raise SlabMappingClosedError("the slab mapping of this session was closed")
        return slab

    @property
    def table(self) -> torch.Tensor:
        table = self._table
        if table is None:
            raise SlabMappingClosedError("the slab mapping of this session was closed")
        return table

    def release(self) -> None:
        """Drop this mapping's references now (idempotent); reads through it fail from here on."""
        slab, self._slab, self._table = self._slab, None, None
        if slab is not None:
            self._storage_ref = StorageWeakRef(slab.untyped_storage())
        del slab
        self._close_maps()

    def close(self, timeout_s: float = 10.0) -> bool:
        """`release()`, then wait (bounded) until nothing holds the slab's storage any more: on cuda
        the IPC mapping is then closed and the producer's counter released, on cpu the shm pages
        unmapped. True once it is (and on every later call); views taken from the slab keep it
        alive (an in-flight step's views are dropped within a step). False, logged, on timeout."""
        self.release()
        ref = self._storage_ref
        if ref is None:
            return True
        end = time.monotonic() + timeout_s
        while not ref.expired():
            gc.collect()
            if ref.expired() or time.monotonic() >= end:
                break
            time.sleep(0.05)
        if not ref.expired():
            log.warning("the old slab (%s) is still referenced after %.1f s; it is unmapped when released",
                        self.descriptor.device, timeout_s)  # fmt: skip
            return False
        self._storage_ref = None
        return True

    def _close_maps(self) -> None:
        # Dropped, never closed here: torch.frombuffer holds no buffer export, so closing an mmap
        # would unmap pages a view still reads. Each mmap is unmapped when its last view dies.
        self._maps = []


# ---------------------------------------------------------------------------- wire form
_TRANSPORT_TO_PROTO = {"shm": pb.TRANSPORT_SHM, "cuda_ipc": pb.TRANSPORT_CUDA_IPC}
_TRANSPORT_FROM_PROTO = {v: k for k, v in _TRANSPORT_TO_PROTO.items()}


def descriptor_to_proto(d: SlabDescriptor) -> pb.SlabDescriptor:
    """The Attach wire form; every dataclass field has a proto counterpart (test_proto_contracts)."""
    fields = d.to_dict()
    fields["transport"] = _TRANSPORT_TO_PROTO[d.transport]
    ipc = fields.pop("cuda_ipc")
    msg = pb.SlabDescriptor(**fields, table_row_words=d.table_words)
    if ipc is not None:
        msg.cuda_ipc.CopyFrom(pb.CudaIpcHandle(**ipc))
    return msg


def descriptor_from_proto(msg: pb.SlabDescriptor) -> SlabDescriptor:
    """The consumer's view of an Attach descriptor: typed fields only (validated by `map_slab`)."""
    names = [f for f in SlabDescriptor.__dataclass_fields__ if f not in ("transport", "cuda_ipc")]
    kwargs: dict[str, Any] = {n: getattr(msg, n) for n in names}
    ipc = None
    if msg.HasField("cuda_ipc"):
        m = msg.cuda_ipc
        ipc = CudaIpcHandle(**{n: getattr(m, n) for n in CudaIpcHandle.__dataclass_fields__})
    return SlabDescriptor(transport=_TRANSPORT_FROM_PROTO.get(msg.transport, "unknown"), cuda_ipc=ipc, **kwargs)


# ---------------------------------------------------------------------------- CUDA devices and IPC
def device_uuid(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    props = torch.cuda.get_device_properties(device)
    return str(getattr(props, "uuid", ""))


def visible_uuids() -> list[str]:
    """The UUIDs of the CUDA devices this process sees, by local index (CUDA_VISIBLE_DEVICES applies)."""
    if not torch.cuda.is_available():
        return []
    return [device_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]


def _visible_note() -> str:
    return f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}"


def check_device(
    desc: SlabDescriptor,
    model_device: torch.device,
    uuid_of: Callable[[torch.device], str] | None = None,
    visible: Callable[[], list[str]] | None = None,
) -> None:
    """Refuse a slab that is not on the model's device, naming both, before anything is opened (opening a CUDA
    IPC handle creates a CUDA context on whichever GPU has the slab's UUID). On cuda the GPU is compared by UUID
    (the two processes may number their GPUs differently); a UUID no device of this process has is named as
    such. `uuid_of` / `visible` default to this module's `device_uuid` / `visible_uuids` (tests pass fakes)."""
    uuid_of = uuid_of or device_uuid
    if desc.transport != "cuda_ipc":
        if model_device.type != "cpu":
            raise ValueError(
                f"the slab is on {desc.device} (shared memory) but the model runs on {model_device} (--device)"
            )
        return
    if model_device.type != "cuda":
        raise ValueError(
            f"the slab is on {desc.device} (GPU UUID {desc.device_uuid}) but the model runs on {model_device} "
            "(--device): start both services on the same GPU"
        )
    model_uuid = uuid_of(model_device)
    if model_uuid == desc.device_uuid:
        return
    if desc.device_uuid not in (visible or visible_uuids)():
        raise ValueError(
            f"the slab is on GPU UUID {desc.device_uuid} ({desc.device} at the sidecar), which no CUDA device "
            f"visible to this process has ({_visible_note()}); the model runs on {model_device}, GPU UUID "
            f"{model_uuid}: start both services on the same GPU (--device)"
        )
    raise ValueError(
        f"the slab is on GPU UUID {desc.device_uuid} ({desc.device} at the sidecar) but the model runs on "
        f"{model_device}, GPU UUID {model_uuid}: start both services on the same GPU (--device)"
    )


def local_device_for_uuid(uuid: str) -> torch.device:
    """This process's index of the CUDA device with `uuid` (CUDA_VISIBLE_DEVICES may differ)."""
    for i, u in enumerate(visible_uuids()):
        if u == uuid:
            return torch.device("cuda", i)
    raise ValueError(f"no CUDA device visible to this process has UUID {uuid} ({_visible_note()})")


def open_ipc(desc: SlabDescriptor, device: torch.device | None = None) -> torch.Tensor:
    """Consumer side (cuda): open the slab's IPC export (once per attachment) on `device`, which must have the
    slab's UUID (`check_device`, run first); None: the device with that UUID (`local_device_for_uuid`).

    The validated fields go to `torch.UntypedStorage._new_shared_cuda` (what torch's own
    `rebuild_cuda_tensor` calls), and the tensor is the contiguous (num_slots, width, page_numel)
    view of that storage: nothing is unpickled.
    """
    dtype = validate_descriptor(desc)
    ipc = desc.cuda_ipc
    assert ipc is not None  # validate_descriptor
    if device is None:
        device = local_device_for_uuid(desc.device_uuid)
    else:
        check_device(desc, device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(device):
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index,
            ipc.mem_handle,
            ipc.storage_size_bytes,
            ipc.storage_offset_bytes,
            ipc.ref_counter_handle,
            ipc.ref_counter_offset,
            ipc.event_handle,
            ipc.event_sync_required,
        )
        shape = (desc.num_slots, desc.width, desc.page_numel)
        stride = (desc.width * desc.page_numel, desc.page_numel, 1)
        slab = torch.empty((0,), dtype=dtype, device=device).set_(storage, 0, shape, stride)
    if storage.nbytes() != desc.slab_bytes:
        raise SlabDescriptorError(
            f"slab descriptor: IPC storage is {storage.nbytes()} bytes, slab_bytes says {desc.slab_bytes}"
        )
    return slab
