import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Task(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_UNSPECIFIED: _ClassVar[Task]
    TASK_T2VA: _ClassVar[Task]
    TASK_FL2VA: _ClassVar[Task]
    TASK_REF2VA: _ClassVar[Task]

class ReferenceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFERENCE_KIND_UNSPECIFIED: _ClassVar[ReferenceKind]
    REFERENCE_KIND_IMAGE: _ClassVar[ReferenceKind]
    REFERENCE_KIND_VIDEO: _ClassVar[ReferenceKind]
    REFERENCE_KIND_AUDIO: _ClassVar[ReferenceKind]

class OutputType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_TYPE_UNSPECIFIED: _ClassVar[OutputType]
    OUTPUT_TYPE_LATENTS: _ClassVar[OutputType]
    OUTPUT_TYPE_MP4: _ClassVar[OutputType]
    OUTPUT_TYPE_FRAMES_AND_WAV: _ClassVar[OutputType]

class AdalnMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADALN_MODE_UNSPECIFIED: _ClassVar[AdalnMode]
    ADALN_MODE_RESIDENT: _ClassVar[AdalnMode]
    ADALN_MODE_CACHED: _ClassVar[AdalnMode]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]

class JobStage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STAGE_UNSPECIFIED: _ClassVar[JobStage]
    JOB_STAGE_QUEUED: _ClassVar[JobStage]
    JOB_STAGE_PREPARING: _ClassVar[JobStage]
    JOB_STAGE_DENOISING: _ClassVar[JobStage]
    JOB_STAGE_DECODING: _ClassVar[JobStage]
    JOB_STAGE_MUXING: _ClassVar[JobStage]
    JOB_STAGE_STORING: _ClassVar[JobStage]
    JOB_STAGE_DONE: _ClassVar[JobStage]
TASK_UNSPECIFIED: Task
TASK_T2VA: Task
TASK_FL2VA: Task
TASK_REF2VA: Task
REFERENCE_KIND_UNSPECIFIED: ReferenceKind
REFERENCE_KIND_IMAGE: ReferenceKind
REFERENCE_KIND_VIDEO: ReferenceKind
REFERENCE_KIND_AUDIO: ReferenceKind
OUTPUT_TYPE_UNSPECIFIED: OutputType
OUTPUT_TYPE_LATENTS: OutputType
OUTPUT_TYPE_MP4: OutputType
OUTPUT_TYPE_FRAMES_AND_WAV: OutputType
ADALN_MODE_UNSPECIFIED: AdalnMode
ADALN_MODE_RESIDENT: AdalnMode
ADALN_MODE_CACHED: AdalnMode
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
JOB_STAGE_UNSPECIFIED: JobStage
JOB_STAGE_QUEUED: JobStage
JOB_STAGE_PREPARING: JobStage
JOB_STAGE_DENOISING: JobStage
JOB_STAGE_DECODING: JobStage
JOB_STAGE_MUXING: JobStage
JOB_STAGE_STORING: JobStage
JOB_STAGE_DONE: JobStage

class Reference(_message.Message):
    __slots__ = ("data", "upload_id", "kind")
    DATA_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    upload_id: str
    kind: ReferenceKind
    def __init__(self, data: _Optional[bytes] = ..., upload_id: _Optional[str] = ..., kind: _Optional[_Union[ReferenceKind, str]] = ...) -> None: ...

class UploadReferenceRequest(_message.Message):
    __slots__ = ("chunk", "kind")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    chunk: bytes
    kind: ReferenceKind
    def __init__(self, chunk: _Optional[bytes] = ..., kind: _Optional[_Union[ReferenceKind, str]] = ...) -> None: ...

class UploadReferenceResponse(_message.Message):
    __slots__ = ("upload_id", "size_bytes", "sha256", "kind", "expires_at")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    size_bytes: int
    sha256: str
    kind: str
    expires_at: _timestamp_pb2.Timestamp
    def __init__(self, upload_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., kind: _Optional[str] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "task", "prompt", "num_inference_steps", "flow_shift", "audio_flow_shift", "seed", "num_frames", "height", "width", "expected_generation", "output_type", "first_frame", "last_frame", "references", "adapters", "quality", "quality_audit")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    FLOW_SHIFT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FLOW_SHIFT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TYPE_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_FIELD_NUMBER: _ClassVar[int]
    LAST_FRAME_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    QUALITY_AUDIT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    task: Task
    prompt: str
    num_inference_steps: int
    flow_shift: float
    audio_flow_shift: float
    seed: int
    num_frames: int
    height: int
    width: int
    expected_generation: int
    output_type: OutputType
    first_frame: bytes
    last_frame: bytes
    references: _containers.RepeatedCompositeFieldContainer[Reference]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterUse]
    quality: str
    quality_audit: bool
    def __init__(self, request_id: _Optional[str] = ..., task: _Optional[_Union[Task, str]] = ..., prompt: _Optional[str] = ..., num_inference_steps: _Optional[int] = ..., flow_shift: _Optional[float] = ..., audio_flow_shift: _Optional[float] = ..., seed: _Optional[int] = ..., num_frames: _Optional[int] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., expected_generation: _Optional[int] = ..., output_type: _Optional[_Union[OutputType, str]] = ..., first_frame: _Optional[bytes] = ..., last_frame: _Optional[bytes] = ..., references: _Optional[_Iterable[_Union[Reference, _Mapping]]] = ..., adapters: _Optional[_Iterable[_Union[AdapterUse, _Mapping]]] = ..., quality: _Optional[str] = ..., quality_audit: _Optional[bool] = ...) -> None: ...

class AdapterUse(_message.Message):
    __slots__ = ("name", "scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    scale: float
    def __init__(self, name: _Optional[str] = ..., scale: _Optional[float] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "refused")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    refused: _containers.RepeatedCompositeFieldContainer[AdapterRefusal]
    def __init__(self, adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ..., refused: _Optional[_Iterable[_Union[AdapterRefusal, _Mapping]]] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "identity", "rank", "partition", "bytes", "targets", "contract", "loaded", "changes_modulation", "loaded_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    CHANGES_MODULATION_FIELD_NUMBER: _ClassVar[int]
    LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    identity: str
    rank: int
    partition: str
    bytes: int
    targets: AdapterTargets
    contract: AdapterContract
    loaded: bool
    changes_modulation: bool
    loaded_bytes: int
    def __init__(self, name: _Optional[str] = ..., identity: _Optional[str] = ..., rank: _Optional[int] = ..., partition: _Optional[str] = ..., bytes: _Optional[int] = ..., targets: _Optional[_Union[AdapterTargets, _Mapping]] = ..., contract: _Optional[_Union[AdapterContract, _Mapping]] = ..., loaded: _Optional[bool] = ..., changes_modulation: _Optional[bool] = ..., loaded_bytes: _Optional[int] = ...) -> None: ...

class AdapterTargets(_message.Message):
    __slots__ = ("trunk", "modulation", "time")
    TRUNK_FIELD_NUMBER: _ClassVar[int]
    MODULATION_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    trunk: int
    modulation: int
    time: int
    def __init__(self, trunk: _Optional[int] = ..., modulation: _Optional[int] = ..., time: _Optional[int] = ...) -> None: ...

class AdapterContract(_message.Message):
    __slots__ = ("steps", "flow_shifts", "audio_flow_shifts", "scale_min", "scale_max", "tasks", "default_steps", "default_flow_shift", "default_audio_flow_shift")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    FLOW_SHIFTS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FLOW_SHIFTS_FIELD_NUMBER: _ClassVar[int]
    SCALE_MIN_FIELD_NUMBER: _ClassVar[int]
    SCALE_MAX_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_STEPS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FLOW_SHIFT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_AUDIO_FLOW_SHIFT_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedScalarFieldContainer[int]
    flow_shifts: _containers.RepeatedScalarFieldContainer[float]
    audio_flow_shifts: _containers.RepeatedScalarFieldContainer[float]
    scale_min: float
    scale_max: float
    tasks: _containers.RepeatedScalarFieldContainer[str]
    default_steps: int
    default_flow_shift: float
    default_audio_flow_shift: float
    def __init__(self, steps: _Optional[_Iterable[int]] = ..., flow_shifts: _Optional[_Iterable[float]] = ..., audio_flow_shifts: _Optional[_Iterable[float]] = ..., scale_min: _Optional[float] = ..., scale_max: _Optional[float] = ..., tasks: _Optional[_Iterable[str]] = ..., default_steps: _Optional[int] = ..., default_flow_shift: _Optional[float] = ..., default_audio_flow_shift: _Optional[float] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "identity")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    identity: str
    def __init__(self, name: _Optional[str] = ..., identity: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter", "already_loaded", "replaced_identities")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ALREADY_LOADED_FIELD_NUMBER: _ClassVar[int]
    REPLACED_IDENTITIES_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    already_loaded: bool
    replaced_identities: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ..., already_loaded: _Optional[bool] = ..., replaced_identities: _Optional[_Iterable[str]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("was_loaded", "identities")
    WAS_LOADED_FIELD_NUMBER: _ClassVar[int]
    IDENTITIES_FIELD_NUMBER: _ClassVar[int]
    was_loaded: bool
    identities: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, was_loaded: _Optional[bool] = ..., identities: _Optional[_Iterable[str]] = ...) -> None: ...

class ListQualityLevelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListQualityLevelsResponse(_message.Message):
    __slots__ = ("levels", "world_size", "transformer_blocks", "source", "audit_dir")
    LEVELS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSFORMER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    AUDIT_DIR_FIELD_NUMBER: _ClassVar[int]
    levels: _containers.RepeatedCompositeFieldContainer[QualityLevel]
    world_size: int
    transformer_blocks: int
    source: str
    audit_dir: str
    def __init__(self, levels: _Optional[_Iterable[_Union[QualityLevel, _Mapping]]] = ..., world_size: _Optional[int] = ..., transformer_blocks: _Optional[int] = ..., source: _Optional[str] = ..., audit_dir: _Optional[str] = ...) -> None: ...

class QualityLevel(_message.Message):
    __slots__ = ("name", "description", "digest", "definition_json", "cache", "tasks", "steps", "max_height", "max_width", "max_num_frames", "world_sizes", "adapters", "adapter_names", "unaudited", "thresholds", "audits")
    class ThresholdsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DEFINITION_JSON_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_NAMES_FIELD_NUMBER: _ClassVar[int]
    UNAUDITED_FIELD_NUMBER: _ClassVar[int]
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    AUDITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    digest: str
    definition_json: str
    cache: StepCacheDefinition
    tasks: _containers.RepeatedScalarFieldContainer[str]
    steps: _containers.RepeatedScalarFieldContainer[int]
    max_height: int
    max_width: int
    max_num_frames: int
    world_sizes: _containers.RepeatedScalarFieldContainer[int]
    adapters: str
    adapter_names: _containers.RepeatedScalarFieldContainer[str]
    unaudited: str
    thresholds: _containers.ScalarMap[str, float]
    audits: QualityAudits
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., digest: _Optional[str] = ..., definition_json: _Optional[str] = ..., cache: _Optional[_Union[StepCacheDefinition, _Mapping]] = ..., tasks: _Optional[_Iterable[str]] = ..., steps: _Optional[_Iterable[int]] = ..., max_height: _Optional[int] = ..., max_width: _Optional[int] = ..., max_num_frames: _Optional[int] = ..., world_sizes: _Optional[_Iterable[int]] = ..., adapters: _Optional[str] = ..., adapter_names: _Optional[_Iterable[str]] = ..., unaudited: _Optional[str] = ..., thresholds: _Optional[_Mapping[str, float]] = ..., audits: _Optional[_Union[QualityAudits, _Mapping]] = ...) -> None: ...

class StepCacheDefinition(_message.Message):
    __slots__ = ("kind", "params_json")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    params_json: str
    def __init__(self, kind: _Optional[str] = ..., params_json: _Optional[str] = ...) -> None: ...

class QualityAudits(_message.Message):
    __slots__ = ("passed", "failed", "covered", "last_audit_at")
    PASSED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    COVERED_FIELD_NUMBER: _ClassVar[int]
    LAST_AUDIT_AT_FIELD_NUMBER: _ClassVar[int]
    passed: int
    failed: int
    covered: _containers.RepeatedCompositeFieldContainer[AuditShape]
    last_audit_at: _timestamp_pb2.Timestamp
    def __init__(self, passed: _Optional[int] = ..., failed: _Optional[int] = ..., covered: _Optional[_Iterable[_Union[AuditShape, _Mapping]]] = ..., last_audit_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class AuditShape(_message.Message):
    __slots__ = ("task", "num_inference_steps", "height", "width", "num_frames", "world_size")
    TASK_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    task: str
    num_inference_steps: int
    height: int
    width: int
    num_frames: int
    world_size: int
    def __init__(self, task: _Optional[str] = ..., num_inference_steps: _Optional[int] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., num_frames: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class AdapterRefusal(_message.Message):
    __slots__ = ("name", "message")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    message: str
    def __init__(self, name: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

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

class StageTimings(_message.Message):
    __slots__ = ("queue_ms", "prepare_ms", "encode_ms", "denoise_ms", "total_ms", "decode_ms", "mux_ms", "attention_backend")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_MS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_MS_FIELD_NUMBER: _ClassVar[int]
    DENOISE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    MUX_MS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    prepare_ms: float
    encode_ms: float
    denoise_ms: float
    total_ms: float
    decode_ms: float
    mux_ms: float
    attention_backend: str
    def __init__(self, queue_ms: _Optional[float] = ..., prepare_ms: _Optional[float] = ..., encode_ms: _Optional[float] = ..., denoise_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., mux_ms: _Optional[float] = ..., attention_backend: _Optional[str] = ...) -> None: ...

class Media(_message.Message):
    __slots__ = ("content_type", "size_bytes", "sha256", "data", "filename")
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    content_type: str
    size_bytes: int
    sha256: str
    data: bytes
    filename: str
    def __init__(self, content_type: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., data: _Optional[bytes] = ..., filename: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "generation", "sha256", "tensors", "cache", "timings", "adaln_mode", "media", "output_type", "total_bytes", "num_inference_steps", "flow_shift", "audio_flow_shift", "quality", "blocks_skipped", "quality_warning")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ADALN_MODE_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TYPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    FLOW_SHIFT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FLOW_SHIFT_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    QUALITY_WARNING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generation: int
    sha256: str
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    cache: CacheReport
    timings: StageTimings
    adaln_mode: AdalnMode
    media: Media
    output_type: OutputType
    total_bytes: int
    num_inference_steps: int
    flow_shift: float
    audio_flow_shift: float
    quality: str
    blocks_skipped: _containers.RepeatedScalarFieldContainer[float]
    quality_warning: str
    def __init__(self, request_id: _Optional[str] = ..., generation: _Optional[int] = ..., sha256: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., cache: _Optional[_Union[CacheReport, _Mapping]] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., adaln_mode: _Optional[_Union[AdalnMode, str]] = ..., media: _Optional[_Union[Media, _Mapping]] = ..., output_type: _Optional[_Union[OutputType, str]] = ..., total_bytes: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., flow_shift: _Optional[float] = ..., audio_flow_shift: _Optional[float] = ..., quality: _Optional[str] = ..., blocks_skipped: _Optional[_Iterable[float]] = ..., quality_warning: _Optional[str] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ...) -> None: ...

class Queued(_message.Message):
    __slots__ = ("request_id", "position")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    position: int
    def __init__(self, request_id: _Optional[str] = ..., position: _Optional[int] = ...) -> None: ...

class PlansReady(_message.Message):
    __slots__ = ("cache", "generation")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    cache: CacheReport
    generation: int
    def __init__(self, cache: _Optional[_Union[CacheReport, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class StepProgress(_message.Message):
    __slots__ = ("step", "total")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    step: int
    total: int
    def __init__(self, step: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class ResultChunk(_message.Message):
    __slots__ = ("name", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("queued", "plans_ready", "step", "result", "chunk", "decoding")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PLANS_READY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DECODING_FIELD_NUMBER: _ClassVar[int]
    queued: Queued
    plans_ready: PlansReady
    step: StepProgress
    result: GenerateResponse
    chunk: ResultChunk
    decoding: Decoding
    def __init__(self, queued: _Optional[_Union[Queued, _Mapping]] = ..., plans_ready: _Optional[_Union[PlansReady, _Mapping]] = ..., step: _Optional[_Union[StepProgress, _Mapping]] = ..., result: _Optional[_Union[GenerateResponse, _Mapping]] = ..., chunk: _Optional[_Union[ResultChunk, _Mapping]] = ..., decoding: _Optional[_Union[Decoding, _Mapping]] = ...) -> None: ...

class Decoding(_message.Message):
    __slots__ = ("output_type",)
    OUTPUT_TYPE_FIELD_NUMBER: _ClassVar[int]
    output_type: OutputType
    def __init__(self, output_type: _Optional[_Union[OutputType, str]] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("weights_path", "expected_generation", "request_id", "tensors")
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    weights_path: str
    expected_generation: int
    request_id: str
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, weights_path: _Optional[str] = ..., expected_generation: _Optional[int] = ..., request_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("generation", "previous_generation", "weights_path", "fingerprint", "phase_ms", "kept_partitions")
    class PhaseMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_GENERATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PHASE_MS_FIELD_NUMBER: _ClassVar[int]
    KEPT_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    previous_generation: int
    weights_path: str
    fingerprint: str
    phase_ms: _containers.ScalarMap[str, float]
    kept_partitions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, generation: _Optional[int] = ..., previous_generation: _Optional[int] = ..., weights_path: _Optional[str] = ..., fingerprint: _Optional[str] = ..., phase_ms: _Optional[_Mapping[str, float]] = ..., kept_partitions: _Optional[_Iterable[str]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SlabGeometry(_message.Message):
    __slots__ = ("num_slots", "width", "page_numel", "page_bytes", "dtype", "device", "transport")
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    PAGE_NUMEL_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    num_slots: int
    width: int
    page_numel: int
    page_bytes: int
    dtype: str
    device: str
    transport: str
    def __init__(self, num_slots: _Optional[int] = ..., width: _Optional[int] = ..., page_numel: _Optional[int] = ..., page_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("generation", "weights_path", "fingerprint", "adaln_mode", "sidecar_connected", "sidecar_target", "queue_depth", "max_queue_depth", "slab", "serving", "model_preset", "memory", "precision", "components", "attention_backend", "decode_dtype", "replica", "partitions", "start_placement", "adapters")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ADALN_MODE_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_TARGET_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    SLAB_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    MODEL_PRESET_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DECODE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    START_PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    weights_path: str
    fingerprint: str
    adaln_mode: AdalnMode
    sidecar_connected: bool
    sidecar_target: str
    queue_depth: int
    max_queue_depth: int
    slab: SlabGeometry
    serving: bool
    model_preset: str
    memory: ModelMemory
    precision: str
    components: _containers.RepeatedCompositeFieldContainer[ComponentPlacement]
    attention_backend: str
    decode_dtype: str
    replica: ReplicaStatus
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionStatus]
    start_placement: StartPlacement
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    def __init__(self, generation: _Optional[int] = ..., weights_path: _Optional[str] = ..., fingerprint: _Optional[str] = ..., adaln_mode: _Optional[_Union[AdalnMode, str]] = ..., sidecar_connected: _Optional[bool] = ..., sidecar_target: _Optional[str] = ..., queue_depth: _Optional[int] = ..., max_queue_depth: _Optional[int] = ..., slab: _Optional[_Union[SlabGeometry, _Mapping]] = ..., serving: _Optional[bool] = ..., model_preset: _Optional[str] = ..., memory: _Optional[_Union[ModelMemory, _Mapping]] = ..., precision: _Optional[str] = ..., components: _Optional[_Iterable[_Union[ComponentPlacement, _Mapping]]] = ..., attention_backend: _Optional[str] = ..., decode_dtype: _Optional[str] = ..., replica: _Optional[_Union[ReplicaStatus, _Mapping]] = ..., partitions: _Optional[_Iterable[_Union[PartitionStatus, _Mapping]]] = ..., start_placement: _Optional[_Union[StartPlacement, _Mapping]] = ..., adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ...) -> None: ...

class StartPlacement(_message.Message):
    __slots__ = ("text_encoder", "partitions", "decided", "free_bytes", "free_source", "need_bytes", "left_bytes", "canvas", "ranks")
    TEXT_ENCODER_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    DECIDED_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    NEED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEFT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CANVAS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    text_encoder: str
    partitions: _containers.RepeatedScalarFieldContainer[str]
    decided: bool
    free_bytes: int
    free_source: str
    need_bytes: int
    left_bytes: int
    canvas: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankNeed]
    def __init__(self, text_encoder: _Optional[str] = ..., partitions: _Optional[_Iterable[str]] = ..., decided: _Optional[bool] = ..., free_bytes: _Optional[int] = ..., free_source: _Optional[str] = ..., need_bytes: _Optional[int] = ..., left_bytes: _Optional[int] = ..., canvas: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankNeed, _Mapping]]] = ...) -> None: ...

class RankNeed(_message.Message):
    __slots__ = ("ranks", "bytes", "items")
    class ItemsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RANKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    ranks: str
    bytes: int
    items: _containers.ScalarMap[str, int]
    def __init__(self, ranks: _Optional[str] = ..., bytes: _Optional[int] = ..., items: _Optional[_Mapping[str, int]] = ...) -> None: ...

class PartitionStatus(_message.Message):
    __slots__ = ("name", "folder", "loaded", "tasks", "fingerprint", "memory")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FOLDER_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    name: str
    folder: str
    loaded: bool
    tasks: _containers.RepeatedScalarFieldContainer[str]
    fingerprint: str
    memory: ModelMemory
    def __init__(self, name: _Optional[str] = ..., folder: _Optional[str] = ..., loaded: _Optional[bool] = ..., tasks: _Optional[_Iterable[str]] = ..., fingerprint: _Optional[str] = ..., memory: _Optional[_Union[ModelMemory, _Mapping]] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("ranks", "ulysses_degree", "ring_degree", "rank_placements", "nodes", "node_sidecars")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ULYSSES_DEGREE_FIELD_NUMBER: _ClassVar[int]
    RING_DEGREE_FIELD_NUMBER: _ClassVar[int]
    RANK_PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NODE_SIDECARS_FIELD_NUMBER: _ClassVar[int]
    ranks: int
    ulysses_degree: int
    ring_degree: int
    rank_placements: _containers.RepeatedCompositeFieldContainer[RankPlacement]
    nodes: int
    node_sidecars: _containers.RepeatedCompositeFieldContainer[NodeSidecar]
    def __init__(self, ranks: _Optional[int] = ..., ulysses_degree: _Optional[int] = ..., ring_degree: _Optional[int] = ..., rank_placements: _Optional[_Iterable[_Union[RankPlacement, _Mapping]]] = ..., nodes: _Optional[int] = ..., node_sidecars: _Optional[_Iterable[_Union[NodeSidecar, _Mapping]]] = ...) -> None: ...

class NodeSidecar(_message.Message):
    __slots__ = ("node", "target", "attached", "generation", "weights_path", "fingerprint")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    node: int
    target: str
    attached: bool
    generation: int
    weights_path: str
    fingerprint: str
    def __init__(self, node: _Optional[int] = ..., target: _Optional[str] = ..., attached: _Optional[bool] = ..., generation: _Optional[int] = ..., weights_path: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class RankPlacement(_message.Message):
    __slots__ = ("rank", "device", "components", "node")
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    device: str
    components: _containers.RepeatedCompositeFieldContainer[ComponentPlacement]
    node: int
    def __init__(self, rank: _Optional[int] = ..., device: _Optional[str] = ..., components: _Optional[_Iterable[_Union[ComponentPlacement, _Mapping]]] = ..., node: _Optional[int] = ...) -> None: ...

class ComponentPlacement(_message.Message):
    __slots__ = ("name", "device", "placement", "dtype", "bytes", "device_bytes", "note")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    name: str
    device: str
    placement: str
    dtype: str
    bytes: int
    device_bytes: int
    note: str
    def __init__(self, name: _Optional[str] = ..., device: _Optional[str] = ..., placement: _Optional[str] = ..., dtype: _Optional[str] = ..., bytes: _Optional[int] = ..., device_bytes: _Optional[int] = ..., note: _Optional[str] = ...) -> None: ...

class ModelMemory(_message.Message):
    __slots__ = ("transformer_bytes", "plan_tensor_bytes", "held_plan_bytes", "saved_bytes", "saved_fraction")
    TRANSFORMER_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLAN_TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_PLAN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAVED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    transformer_bytes: int
    plan_tensor_bytes: int
    held_plan_bytes: int
    saved_bytes: int
    saved_fraction: float
    def __init__(self, transformer_bytes: _Optional[int] = ..., plan_tensor_bytes: _Optional[int] = ..., held_plan_bytes: _Optional[int] = ..., saved_bytes: _Optional[int] = ..., saved_fraction: _Optional[float] = ...) -> None: ...

class JobProgress(_message.Message):
    __slots__ = ("stage", "steps_done", "steps_total")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    stage: JobStage
    steps_done: int
    steps_total: int
    def __init__(self, stage: _Optional[_Union[JobStage, str]] = ..., steps_done: _Optional[int] = ..., steps_total: _Optional[int] = ...) -> None: ...

class JobError(_message.Message):
    __slots__ = ("code", "reason", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    reason: str
    message: str
    def __init__(self, code: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("request_id", "task", "prompt", "num_inference_steps", "flow_shift", "audio_flow_shift", "seed", "num_frames", "height", "width", "output_type", "has_first_frame", "has_last_frame", "expected_generation", "adapters", "quality")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    FLOW_SHIFT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FLOW_SHIFT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TYPE_FIELD_NUMBER: _ClassVar[int]
    HAS_FIRST_FRAME_FIELD_NUMBER: _ClassVar[int]
    HAS_LAST_FRAME_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    task: Task
    prompt: str
    num_inference_steps: int
    flow_shift: float
    audio_flow_shift: float
    seed: int
    num_frames: int
    height: int
    width: int
    output_type: OutputType
    has_first_frame: bool
    has_last_frame: bool
    expected_generation: int
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterUse]
    quality: str
    def __init__(self, request_id: _Optional[str] = ..., task: _Optional[_Union[Task, str]] = ..., prompt: _Optional[str] = ..., num_inference_steps: _Optional[int] = ..., flow_shift: _Optional[float] = ..., audio_flow_shift: _Optional[float] = ..., seed: _Optional[int] = ..., num_frames: _Optional[int] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., output_type: _Optional[_Union[OutputType, str]] = ..., has_first_frame: _Optional[bool] = ..., has_last_frame: _Optional[bool] = ..., expected_generation: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[AdapterUse, _Mapping]]] = ..., quality: _Optional[str] = ...) -> None: ...

class JobContent(_message.Message):
    __slots__ = ("content_type", "total_bytes", "sha256", "filename", "available")
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    content_type: str
    total_bytes: int
    sha256: str
    filename: str
    available: bool
    def __init__(self, content_type: _Optional[str] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., filename: _Optional[str] = ..., available: _Optional[bool] = ...) -> None: ...

class JobResult(_message.Message):
    __slots__ = ("sha256", "generation", "output_type", "content", "timings", "cache")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TYPE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    generation: int
    output_type: OutputType
    content: JobContent
    timings: StageTimings
    cache: CacheReport
    def __init__(self, sha256: _Optional[str] = ..., generation: _Optional[int] = ..., output_type: _Optional[_Union[OutputType, str]] = ..., content: _Optional[_Union[JobContent, _Mapping]] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., cache: _Optional[_Union[CacheReport, _Mapping]] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "state", "spec", "idempotency_key", "created_at", "started_at", "finished_at", "queue_position", "progress", "error", "result", "attempts", "cancel_requested", "replica", "expires_at", "owner")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    spec: JobSpec
    idempotency_key: str
    created_at: _timestamp_pb2.Timestamp
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    queue_position: int
    progress: JobProgress
    error: JobError
    result: JobResult
    attempts: int
    cancel_requested: bool
    replica: str
    expires_at: _timestamp_pb2.Timestamp
    owner: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., idempotency_key: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., queue_position: _Optional[int] = ..., progress: _Optional[_Union[JobProgress, _Mapping]] = ..., error: _Optional[_Union[JobError, _Mapping]] = ..., result: _Optional[_Union[JobResult, _Mapping]] = ..., attempts: _Optional[int] = ..., cancel_requested: _Optional[bool] = ..., replica: _Optional[str] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., owner: _Optional[str] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("request", "idempotency_key")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    idempotency_key: str
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class CreateJobResponse(_message.Message):
    __slots__ = ("job", "created")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    job: Job
    created: bool
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "states", "oldest_first")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    OLDEST_FIRST_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    states: _containers.RepeatedScalarFieldContainer[JobState]
    oldest_first: bool
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., states: _Optional[_Iterable[_Union[JobState, str]]] = ..., oldest_first: _Optional[bool] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class WatchJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class GetJobContentRequest(_message.Message):
    __slots__ = ("job_id", "offset")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    offset: int
    def __init__(self, job_id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class ContentHeader(_message.Message):
    __slots__ = ("content", "offset")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    content: JobContent
    offset: int
    def __init__(self, content: _Optional[_Union[JobContent, _Mapping]] = ..., offset: _Optional[int] = ...) -> None: ...

class ContentChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetJobContentResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ContentHeader
    chunk: ContentChunk
    def __init__(self, header: _Optional[_Union[ContentHeader, _Mapping]] = ..., chunk: _Optional[_Union[ContentChunk, _Mapping]] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class DeleteJobResponse(_message.Message):
    __slots__ = ("job_id", "deleted")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    deleted: bool
    def __init__(self, job_id: _Optional[str] = ..., deleted: _Optional[bool] = ...) -> None: ...
