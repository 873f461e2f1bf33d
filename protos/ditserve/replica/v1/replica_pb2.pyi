from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SwapAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SWAP_ACTION_UNSPECIFIED: _ClassVar[SwapAction]
    SWAP_ACTION_INSTALL: _ClassVar[SwapAction]
    SWAP_ACTION_ROLLBACK: _ClassVar[SwapAction]
    SWAP_ACTION_DROP: _ClassVar[SwapAction]
    SWAP_ACTION_RETIRE: _ClassVar[SwapAction]
SWAP_ACTION_UNSPECIFIED: SwapAction
SWAP_ACTION_INSTALL: SwapAction
SWAP_ACTION_ROLLBACK: SwapAction
SWAP_ACTION_DROP: SwapAction
SWAP_ACTION_RETIRE: SwapAction

class RankWork(_message.Message):
    __slots__ = ("attach", "run", "stage", "swap", "stop", "describe")
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SWAP_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    DESCRIBE_FIELD_NUMBER: _ClassVar[int]
    attach: Attach
    run: Run
    stage: Stage
    swap: Swap
    stop: Stop
    describe: Describe
    def __init__(self, attach: _Optional[_Union[Attach, _Mapping]] = ..., run: _Optional[_Union[Run, _Mapping]] = ..., stage: _Optional[_Union[Stage, _Mapping]] = ..., swap: _Optional[_Union[Swap, _Mapping]] = ..., stop: _Optional[_Union[Stop, _Mapping]] = ..., describe: _Optional[_Union[Describe, _Mapping]] = ...) -> None: ...

class Describe(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankReport(_message.Message):
    __slots__ = ("rank", "device", "components", "node")
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    device: str
    components: _containers.RepeatedCompositeFieldContainer[Component]
    node: int
    def __init__(self, rank: _Optional[int] = ..., device: _Optional[str] = ..., components: _Optional[_Iterable[_Union[Component, _Mapping]]] = ..., node: _Optional[int] = ...) -> None: ...

class Component(_message.Message):
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

class Attach(_message.Message):
    __slots__ = ("epoch", "weights_path", "fingerprint", "node_sessions")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NODE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    weights_path: str
    fingerprint: str
    node_sessions: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, epoch: _Optional[int] = ..., weights_path: _Optional[str] = ..., fingerprint: _Optional[str] = ..., node_sessions: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("request_id", "task", "prompt", "num_inference_steps", "flow_shift", "audio_flow_shift", "seed", "height", "width", "num_frames", "first_frame", "last_frame", "references", "adapters", "step_cache")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    FLOW_SHIFT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FLOW_SHIFT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_FIELD_NUMBER: _ClassVar[int]
    LAST_FRAME_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    STEP_CACHE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    task: str
    prompt: str
    num_inference_steps: int
    flow_shift: float
    audio_flow_shift: float
    seed: int
    height: int
    width: int
    num_frames: int
    first_frame: bytes
    last_frame: bytes
    references: _containers.RepeatedCompositeFieldContainer[Reference]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterUse]
    step_cache: str
    def __init__(self, request_id: _Optional[str] = ..., task: _Optional[str] = ..., prompt: _Optional[str] = ..., num_inference_steps: _Optional[int] = ..., flow_shift: _Optional[float] = ..., audio_flow_shift: _Optional[float] = ..., seed: _Optional[int] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., num_frames: _Optional[int] = ..., first_frame: _Optional[bytes] = ..., last_frame: _Optional[bytes] = ..., references: _Optional[_Iterable[_Union[Reference, _Mapping]]] = ..., adapters: _Optional[_Iterable[_Union[AdapterUse, _Mapping]]] = ..., step_cache: _Optional[str] = ...) -> None: ...

class AdapterUse(_message.Message):
    __slots__ = ("name", "scale", "identity")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    scale: float
    identity: str
    def __init__(self, name: _Optional[str] = ..., scale: _Optional[float] = ..., identity: _Optional[str] = ...) -> None: ...

class Reference(_message.Message):
    __slots__ = ("data", "kind")
    DATA_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    kind: str
    def __init__(self, data: _Optional[bytes] = ..., kind: _Optional[str] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("request", "epoch", "plan_keys", "fingerprint", "nodes")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLAN_KEYS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    request: Request
    epoch: int
    plan_keys: _containers.RepeatedCompositeFieldContainer[PlanKey]
    fingerprint: str
    nodes: _containers.RepeatedCompositeFieldContainer[NodeLease]
    def __init__(self, request: _Optional[_Union[Request, _Mapping]] = ..., epoch: _Optional[int] = ..., plan_keys: _Optional[_Iterable[_Union[PlanKey, _Mapping]]] = ..., fingerprint: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[NodeLease, _Mapping]]] = ...) -> None: ...

class NodeLease(_message.Message):
    __slots__ = ("generation", "slots")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, generation: _Optional[int] = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class RankPlace(_message.Message):
    __slots__ = ("rank", "node_rank", "local_rank", "sidecar", "device")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_rank: int
    local_rank: int
    sidecar: str
    device: str
    def __init__(self, rank: _Optional[int] = ..., node_rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., sidecar: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class PlanKey(_message.Message):
    __slots__ = ("timestep_bits", "partition", "adapters")
    TIMESTEP_BITS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    timestep_bits: _containers.RepeatedScalarFieldContainer[int]
    partition: str
    adapters: str
    def __init__(self, timestep_bits: _Optional[_Iterable[int]] = ..., partition: _Optional[str] = ..., adapters: _Optional[str] = ...) -> None: ...

class Stage(_message.Message):
    __slots__ = ("weights_path", "fingerprint")
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    weights_path: str
    fingerprint: str
    def __init__(self, weights_path: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class Swap(_message.Message):
    __slots__ = ("action",)
    ACTION_FIELD_NUMBER: _ClassVar[int]
    action: SwapAction
    def __init__(self, action: _Optional[_Union[SwapAction, str]] = ...) -> None: ...

class Stop(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
