from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_CUDA_IPC: _ClassVar[Transport]
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_SHM: Transport
TRANSPORT_CUDA_IPC: Transport

class AttachRequest(_message.Message):
    __slots__ = ("client_name",)
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    def __init__(self, client_name: _Optional[str] = ...) -> None: ...

class SlabDescriptor(_message.Message):
    __slots__ = ("transport", "slab_path", "table_path", "slab_bytes", "table_bytes", "dtype", "num_slots", "width", "page_numel", "device", "device_uuid", "table_row_words", "cuda_ipc")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SLAB_PATH_FIELD_NUMBER: _ClassVar[int]
    TABLE_PATH_FIELD_NUMBER: _ClassVar[int]
    SLAB_BYTES_FIELD_NUMBER: _ClassVar[int]
    TABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    PAGE_NUMEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    TABLE_ROW_WORDS_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    transport: Transport
    slab_path: str
    table_path: str
    slab_bytes: int
    table_bytes: int
    dtype: str
    num_slots: int
    width: int
    page_numel: int
    device: str
    device_uuid: str
    table_row_words: int
    cuda_ipc: CudaIpcHandle
    def __init__(self, transport: _Optional[_Union[Transport, str]] = ..., slab_path: _Optional[str] = ..., table_path: _Optional[str] = ..., slab_bytes: _Optional[int] = ..., table_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., num_slots: _Optional[int] = ..., width: _Optional[int] = ..., page_numel: _Optional[int] = ..., device: _Optional[str] = ..., device_uuid: _Optional[str] = ..., table_row_words: _Optional[int] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("mem_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    MEM_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    mem_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, mem_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "slab", "generation", "weights_path", "fingerprint", "slabs", "partitions")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SLAB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SLABS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    slab: SlabDescriptor
    generation: int
    weights_path: str
    fingerprint: str
    slabs: _containers.RepeatedCompositeFieldContainer[SlabDescriptor]
    partitions: _containers.RepeatedCompositeFieldContainer[Partition]
    def __init__(self, session_id: _Optional[str] = ..., slab: _Optional[_Union[SlabDescriptor, _Mapping]] = ..., generation: _Optional[int] = ..., weights_path: _Optional[str] = ..., fingerprint: _Optional[str] = ..., slabs: _Optional[_Iterable[_Union[SlabDescriptor, _Mapping]]] = ..., partitions: _Optional[_Iterable[_Union[Partition, _Mapping]]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("session", "heartbeat")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    session: Session
    heartbeat: Heartbeat
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class PlanKey(_message.Message):
    __slots__ = ("timestep_bits", "partition", "adapters")
    TIMESTEP_BITS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    timestep_bits: _containers.RepeatedScalarFieldContainer[int]
    partition: str
    adapters: str
    def __init__(self, timestep_bits: _Optional[_Iterable[int]] = ..., partition: _Optional[str] = ..., adapters: _Optional[str] = ...) -> None: ...

class AdapterSpec(_message.Message):
    __slots__ = ("name", "identity", "scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    identity: str
    scale: float
    def __init__(self, name: _Optional[str] = ..., identity: _Optional[str] = ..., scale: _Optional[float] = ...) -> None: ...

class Partition(_message.Message):
    __slots__ = ("name", "folder", "fingerprint", "slots_ready", "slots_allowed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FOLDER_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SLOTS_READY_FIELD_NUMBER: _ClassVar[int]
    SLOTS_ALLOWED_FIELD_NUMBER: _ClassVar[int]
    name: str
    folder: str
    fingerprint: str
    slots_ready: int
    slots_allowed: int
    def __init__(self, name: _Optional[str] = ..., folder: _Optional[str] = ..., fingerprint: _Optional[str] = ..., slots_ready: _Optional[int] = ..., slots_allowed: _Optional[int] = ...) -> None: ...

class PreparePlansRequest(_message.Message):
    __slots__ = ("session_id", "generation", "plan_keys", "request_id", "step_bound_s", "adapters")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PLAN_KEYS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_BOUND_S_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    generation: int
    plan_keys: _containers.RepeatedCompositeFieldContainer[PlanKey]
    request_id: str
    step_bound_s: float
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterSpec]
    def __init__(self, session_id: _Optional[str] = ..., generation: _Optional[int] = ..., plan_keys: _Optional[_Iterable[_Union[PlanKey, _Mapping]]] = ..., request_id: _Optional[str] = ..., step_bound_s: _Optional[float] = ..., adapters: _Optional[_Iterable[_Union[AdapterSpec, _Mapping]]] = ...) -> None: ...

class CacheReport(_message.Message):
    __slots__ = ("gpu_hit_plans", "host_hit_plans", "built_plans", "rebuild_s", "swap_in_s", "host_stored", "disk_hit_plans", "disk_read_s", "disk_stored_plans", "rebuild_read_bytes", "rebuild_read_s")
    GPU_HIT_PLANS_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_PLANS_FIELD_NUMBER: _ClassVar[int]
    BUILT_PLANS_FIELD_NUMBER: _ClassVar[int]
    REBUILD_S_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_S_FIELD_NUMBER: _ClassVar[int]
    HOST_STORED_FIELD_NUMBER: _ClassVar[int]
    DISK_HIT_PLANS_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_S_FIELD_NUMBER: _ClassVar[int]
    DISK_STORED_PLANS_FIELD_NUMBER: _ClassVar[int]
    REBUILD_READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    REBUILD_READ_S_FIELD_NUMBER: _ClassVar[int]
    gpu_hit_plans: int
    host_hit_plans: int
    built_plans: int
    rebuild_s: float
    swap_in_s: float
    host_stored: bool
    disk_hit_plans: int
    disk_read_s: float
    disk_stored_plans: int
    rebuild_read_bytes: int
    rebuild_read_s: float
    def __init__(self, gpu_hit_plans: _Optional[int] = ..., host_hit_plans: _Optional[int] = ..., built_plans: _Optional[int] = ..., rebuild_s: _Optional[float] = ..., swap_in_s: _Optional[float] = ..., host_stored: _Optional[bool] = ..., disk_hit_plans: _Optional[int] = ..., disk_read_s: _Optional[float] = ..., disk_stored_plans: _Optional[int] = ..., rebuild_read_bytes: _Optional[int] = ..., rebuild_read_s: _Optional[float] = ...) -> None: ...

class PreparePlansResponse(_message.Message):
    __slots__ = ("lease_id", "slots", "report", "generation")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    slots: _containers.RepeatedScalarFieldContainer[int]
    report: CacheReport
    generation: int
    def __init__(self, lease_id: _Optional[int] = ..., slots: _Optional[_Iterable[int]] = ..., report: _Optional[_Union[CacheReport, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class ReleasePlansRequest(_message.Message):
    __slots__ = ("session_id", "lease_id", "request_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_id: int
    request_id: str
    def __init__(self, session_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReleasePlansResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("num_slots", "slot_width", "page_bytes", "slots_ready", "slots_leased", "host_capacity_bytes", "host_used_bytes", "host_groups", "host_pinned", "slot_hit_plans", "host_hit_plans", "built_plans", "rebuild_passes", "rebuild_s", "swap_in_bytes", "swap_in_s", "slot_evictions", "host_group_evictions", "host_pressure_skips", "prepares", "failed_prepares", "disk_capacity_bytes", "disk_used_bytes", "disk_packs", "disk_read_only", "disk_hit_plans", "disk_read_bytes", "disk_read_s", "disk_stored_plans", "disk_written_bytes", "disk_evictions", "disk_corrupt_packs", "disk_write_errors", "disk_write_skips", "rebuild_read_bytes", "rebuild_read_s")
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_READY_FIELD_NUMBER: _ClassVar[int]
    SLOTS_LEASED_FIELD_NUMBER: _ClassVar[int]
    HOST_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_GROUPS_FIELD_NUMBER: _ClassVar[int]
    HOST_PINNED_FIELD_NUMBER: _ClassVar[int]
    SLOT_HIT_PLANS_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_PLANS_FIELD_NUMBER: _ClassVar[int]
    BUILT_PLANS_FIELD_NUMBER: _ClassVar[int]
    REBUILD_PASSES_FIELD_NUMBER: _ClassVar[int]
    REBUILD_S_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_S_FIELD_NUMBER: _ClassVar[int]
    SLOT_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_GROUP_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_PRESSURE_SKIPS_FIELD_NUMBER: _ClassVar[int]
    PREPARES_FIELD_NUMBER: _ClassVar[int]
    FAILED_PREPARES_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_PACKS_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    DISK_HIT_PLANS_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_S_FIELD_NUMBER: _ClassVar[int]
    DISK_STORED_PLANS_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DISK_CORRUPT_PACKS_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITE_SKIPS_FIELD_NUMBER: _ClassVar[int]
    REBUILD_READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    REBUILD_READ_S_FIELD_NUMBER: _ClassVar[int]
    num_slots: int
    slot_width: int
    page_bytes: int
    slots_ready: int
    slots_leased: int
    host_capacity_bytes: int
    host_used_bytes: int
    host_groups: int
    host_pinned: bool
    slot_hit_plans: int
    host_hit_plans: int
    built_plans: int
    rebuild_passes: int
    rebuild_s: float
    swap_in_bytes: int
    swap_in_s: float
    slot_evictions: int
    host_group_evictions: int
    host_pressure_skips: int
    prepares: int
    failed_prepares: int
    disk_capacity_bytes: int
    disk_used_bytes: int
    disk_packs: int
    disk_read_only: bool
    disk_hit_plans: int
    disk_read_bytes: int
    disk_read_s: float
    disk_stored_plans: int
    disk_written_bytes: int
    disk_evictions: int
    disk_corrupt_packs: int
    disk_write_errors: int
    disk_write_skips: int
    rebuild_read_bytes: int
    rebuild_read_s: float
    def __init__(self, num_slots: _Optional[int] = ..., slot_width: _Optional[int] = ..., page_bytes: _Optional[int] = ..., slots_ready: _Optional[int] = ..., slots_leased: _Optional[int] = ..., host_capacity_bytes: _Optional[int] = ..., host_used_bytes: _Optional[int] = ..., host_groups: _Optional[int] = ..., host_pinned: _Optional[bool] = ..., slot_hit_plans: _Optional[int] = ..., host_hit_plans: _Optional[int] = ..., built_plans: _Optional[int] = ..., rebuild_passes: _Optional[int] = ..., rebuild_s: _Optional[float] = ..., swap_in_bytes: _Optional[int] = ..., swap_in_s: _Optional[float] = ..., slot_evictions: _Optional[int] = ..., host_group_evictions: _Optional[int] = ..., host_pressure_skips: _Optional[int] = ..., prepares: _Optional[int] = ..., failed_prepares: _Optional[int] = ..., disk_capacity_bytes: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., disk_packs: _Optional[int] = ..., disk_read_only: _Optional[bool] = ..., disk_hit_plans: _Optional[int] = ..., disk_read_bytes: _Optional[int] = ..., disk_read_s: _Optional[float] = ..., disk_stored_plans: _Optional[int] = ..., disk_written_bytes: _Optional[int] = ..., disk_evictions: _Optional[int] = ..., disk_corrupt_packs: _Optional[int] = ..., disk_write_errors: _Optional[int] = ..., disk_write_skips: _Optional[int] = ..., rebuild_read_bytes: _Optional[int] = ..., rebuild_read_s: _Optional[float] = ...) -> None: ...

class GetStateResponse(_message.Message):
    __slots__ = ("generation", "weights_path", "fingerprint", "leases_held", "session_attached", "stats", "serving", "not_serving_reason", "pending_weights_path", "partitions")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LEASES_HELD_FIELD_NUMBER: _ClassVar[int]
    SESSION_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    NOT_SERVING_REASON_FIELD_NUMBER: _ClassVar[int]
    PENDING_WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    weights_path: str
    fingerprint: str
    leases_held: int
    session_attached: bool
    stats: CacheStats
    serving: bool
    not_serving_reason: str
    pending_weights_path: str
    partitions: _containers.RepeatedCompositeFieldContainer[Partition]
    def __init__(self, generation: _Optional[int] = ..., weights_path: _Optional[str] = ..., fingerprint: _Optional[str] = ..., leases_held: _Optional[int] = ..., session_attached: _Optional[bool] = ..., stats: _Optional[_Union[CacheStats, _Mapping]] = ..., serving: _Optional[bool] = ..., not_serving_reason: _Optional[str] = ..., pending_weights_path: _Optional[str] = ..., partitions: _Optional[_Iterable[_Union[Partition, _Mapping]]] = ...) -> None: ...

class PrepareWeightUpdateRequest(_message.Message):
    __slots__ = ("from_generation", "weights_path")
    FROM_GENERATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    from_generation: int
    weights_path: str
    def __init__(self, from_generation: _Optional[int] = ..., weights_path: _Optional[str] = ...) -> None: ...

class PrepareWeightUpdateResponse(_message.Message):
    __slots__ = ("fingerprint",)
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    def __init__(self, fingerprint: _Optional[str] = ...) -> None: ...

class CommitWeightUpdateRequest(_message.Message):
    __slots__ = ("from_generation", "weights_path")
    FROM_GENERATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    from_generation: int
    weights_path: str
    def __init__(self, from_generation: _Optional[int] = ..., weights_path: _Optional[str] = ...) -> None: ...

class CommitWeightUpdateResponse(_message.Message):
    __slots__ = ("generation", "fingerprint", "kept_partitions")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEPT_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    fingerprint: str
    kept_partitions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, generation: _Optional[int] = ..., fingerprint: _Optional[str] = ..., kept_partitions: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortWeightUpdateRequest(_message.Message):
    __slots__ = ("weights_path",)
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    weights_path: str
    def __init__(self, weights_path: _Optional[str] = ...) -> None: ...

class AbortWeightUpdateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
