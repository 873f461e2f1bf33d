"""A loaded MiniMax-H3 checkpoint, ready to serve requests: `load_model` and `H3Model` (`generate()`, the one way a
request runs on it, is generation.py's).

`H3Model` is diffusers' own modular pipeline on a checkpoint (pipeline.py): in **resident** mode with the transformer
exactly as `from_pretrained` loads it; in **cached** mode with the transformer loaded without its plan tensors (never
read, never allocated) and every `adaln_proj.linear` / `norm_out.linear` replaced by a module that reads the current
step's rows from a plan lease. One model holds the transformer of every partition it serves ("base": `transformer/`,
t2va and fl2va; "ref": `transformer_ref/`, ref2va), each cached or resident as the mode says.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .adapters import AdapterRegistry, ModelAdapters
from .attention import AUTO, backend_of, check_name, use_backend
from .checkpoint import CheckpointInfo, validate_checkpoint
from .checkpoint_files import PARTITION_TASKS
from .checkpoint_files import PARTITIONS as PARTITION_FOLDERS
from .decode import load_decoder, vae_dtype
from .parallel import collective_backend, enable_context_parallel, split_guard
from .pipeline import (
    DECODE_DTYPES,
    PartitionNotLoadedError,
    decode_dtype_for,
    load_pipeline,
    loaded_partitions,
    pipeline_with,
    plan_holder,
    repository_partitions,
    transformer_for,
)
from .plans import PlanKey, is_plan_tensor
from .quality import QualityLevels
from .replica import Replica
from .request import GenerationRequest
from .schedule import ScheduleKeys
from .text_encoder import LoadedTextEncoder, TextEncoderPlacement

ADALN_MODES = ("resident", "cached")


@dataclass(frozen=True)
class RunOptions:
    """How a loaded checkpoint runs, beside its weights and mode (the generator's flags of the same names)."""

    attention_backend: str = AUTO
    """diffusers' attention backend for the transformer (ditcore.attention); "auto": the best one that runs on the
    device ("native" on CPU)."""
    decode_dtype: str = AUTO
    """The dtype the VAEs decode in (pipeline.DECODE_DTYPES); "auto": the released one for the checkpoint's precision
    (bfloat16 for mixed, float32 for float32: pipeline.released_decode_dtype)."""
    text_encoder: TextEncoderPlacement = field(default_factory=TextEncoderPlacement)
    """Where the text encoder runs and keeps its weights (ditcore.text_encoder); the default: on the model's device."""
    partitions: str = AUTO
    """The transformer partitions loaded, comma-separated ("base", "base,ref"); "auto": every one the repository
    has (a repository without transformer_ref/ serves t2va and fl2va only)."""
    adapters: AdapterRegistry | None = field(default=None, compare=False)
    """Where a request's adapter names are read (--adapter-dir; ditcore.adapters); None: no adapters."""
    max_loaded_adapters: int = 8
    """Adapters one model holds loaded at most (the least recently used is deleted first)."""
    max_loaded_adapter_bytes: int = 8 << 30
    """What the loaded adapters hold on the model's device together, at most (ditcore.adapters.ModelAdapters)."""
    quality: QualityLevels = field(default_factory=QualityLevels, compare=False)
    """The quality levels a request may name (ditcore.quality; lossless only by default)."""
    adapter_plans: bool = False
    """A cached model's plans are built with the request's modulation-changing adapters (the generator's sidecar
    does: plan keys carry their digest); False: such adapters are refused on a cached model."""

    def __post_init__(self) -> None:
        check_name(self.attention_backend)
        if self.decode_dtype != AUTO and self.decode_dtype not in DECODE_DTYPES:
            raise ValueError(f"decode dtype must be one of {[AUTO, *DECODE_DTYPES]}, got {self.decode_dtype!r}")
        if self.partitions != AUTO:
            names = [p.strip() for p in self.partitions.split(",") if p.strip()]
            if "base" not in names or any(n not in PARTITION_TASKS for n in names) or len(set(names)) != len(names):
                raise ValueError(
                    f"partitions must be auto or distinct names among {list(PARTITION_TASKS)} including base, got "
                    f"{self.partitions!r}"
                )

    def partitions_for(self, info: CheckpointInfo) -> tuple[str, ...]:
        """The partitions to load from `info`: the repository's ("auto") or those named (ValueError naming the
        missing folder when the repository lacks one)."""
        if self.partitions == AUTO:
            return tuple(info.partitions)
        names = tuple(p.strip() for p in self.partitions.split(",") if p.strip())
        for name in names:
            info.partition(name)  # CheckpointError naming the folder
        return names

    def decode_dtype_for(self, precision: str) -> str:
        """The dtype a checkpoint of `precision` decodes in under these options (pipeline.decode_dtype_for)."""
        return decode_dtype_for(self.decode_dtype, precision)


@dataclass(frozen=True)
class ModelMemory:
    """What the served transformer holds, against the plan tensors of its checkpoint."""

    transformer_bytes: int
    """Parameter and buffer bytes of the transformer as loaded."""
    plan_tensor_bytes: int
    """Bytes of every `adaln_proj` and `norm_out.linear` tensor in the checkpoint (as stored)."""
    held_plan_bytes: int
    """Of those, the bytes this model holds (all in resident mode, none in cached mode)."""

    @property
    def saved_bytes(self) -> int:
        return self.plan_tensor_bytes - self.held_plan_bytes

    @property
    def saved_fraction(self) -> float:
        return self.saved_bytes / self.plan_tensor_bytes if self.plan_tensor_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "transformer_bytes": self.transformer_bytes,
            "plan_tensor_bytes": self.plan_tensor_bytes,
            "held_plan_bytes": self.held_plan_bytes,
            "saved_bytes": self.saved_bytes,
            "saved_fraction": round(self.saved_fraction, 6),
        }


def _module_bytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


COMPONENTS = ("transformer", "transformer_ref", "text_encoder", "vae", "audio_vae")
"""The pipeline's weight-bearing components, as GetStatus lists them (transformer_ref when its partition is loaded)."""


@dataclass(frozen=True)
class ComponentInfo:
    """One loaded component: where its weights are and how many bytes (GetStatus' ComponentPlacement)."""

    name: str
    """As in model_index.json: one of COMPONENTS."""
    device: str
    """Where its weights live while serving ("cuda:0", "cpu"; "cpu" for an offloaded text encoder)."""
    placement: str
    """"device" (kept on its device), "cpu" (runs on the CPU while the model does not) or "offload" (kept in host
    memory, moved to the execution device for each use): text_encoder.PLACEMENTS."""
    dtype: str
    """The dtype holding most of its parameter bytes ("bfloat16", "float32", ...)."""
    bytes: int
    """Parameter and buffer bytes as loaded (tensors left on meta excluded)."""
    device_bytes: int
    """Of those, bytes on an accelerator now."""
    note: str = ""


def _component_info(name: str, module: torch.nn.Module, placement: str, note: str) -> ComponentInfo:
    tensors = [t for t in (*module.parameters(), *module.buffers()) if not t.is_meta]
    by_dtype: dict[torch.dtype, int] = {}
    for p in module.parameters():
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel() * p.element_size()
    dtype = str(max(by_dtype, key=lambda d: by_dtype[d])).removeprefix("torch.") if by_dtype else ""
    devices = {str(t.device) for t in tensors}
    device = "cpu" if placement == "offload" or not devices else sorted(devices)[0]
    size = sum(t.numel() * t.element_size() for t in tensors)
    on_device = sum(t.numel() * t.element_size() for t in tensors if t.device.type != "cpu")
    return ComponentInfo(name, device, placement, dtype, size, on_device, note)


class H3Model:
    """diffusers' MiniMax-H3 pipeline on one checkpoint, resident or cached; one request at a time (see generate)."""

    def __init__(
        self,
        info: CheckpointInfo,
        mode: str,
        device: torch.device | str = "cpu",
        text_encoder: TextEncoderPlacement | None = None,
        decode_dtype: str | None = None,
        replica: Replica | None = None,
        partitions: Sequence[str] | None = None,
    ) -> None:
        """Load `info` in `mode`: each component moved to `device` as it is loaded (pipeline.load_pipeline), the
        cached transformers built without their plan tensors, the text encoder trimmed and placed as `text_encoder`
        says (default: on `device`), the VAEs at `decode_dtype` (default: the precision's load dtype), the
        transformer of each of `partitions` (default: every one the repository has)."""
        if mode not in ADALN_MODES:
            raise ValueError(f"adaln mode must be one of {list(ADALN_MODES)}, got {mode!r}")
        if mode == "resident" and not info.has_adaln:
            raise ValueError(f"{info.path}: resident mode needs the transformer's native adaln_proj tensors")
        self.info = info
        self.mode = mode
        self.device = torch.device(device)
        self.precision = info.precision
        self.pipe: Any = load_pipeline(
            info.path,
            self.precision,
            cached=mode == "cached",
            device=self.device,
            text_encoder=text_encoder,
            vae_dtype=decode_dtype,
            replica=replica,
            partitions=partitions,
        )
        self.replica = replica
        """The replica this rank's model runs in (None: one device); its transformer runs context parallel."""
        self.quality = QualityLevels()
        """The quality levels a request may name (RunOptions.quality)."""
        self._adapter_set: ModelAdapters | None = None
        self.partitions: tuple[str, ...] = loaded_partitions(self.pipe)
        """The partitions whose transformer this model holds ("base", and "ref" when loaded)."""
        self.repository_partitions: tuple[str, ...] = repository_partitions(info.path)
        if mode == "cached":
            self.holders = {p: plan_holder(self.transformer_of(p)) for p in self.partitions}
            self.holder = self.holders["base"]
        self.decoder: Any = load_decoder(self.pipe, info.path)
        self.schedule = ScheduleKeys(info.path)

    @property
    def path(self) -> Path:
        return self.info.path

    @property
    def transformer(self) -> Any:
        """diffusers' MiniMaxH3Transformer3DModel of the base partition (t2va, fl2va)."""
        return self.pipe.transformer

    @property
    def world_size(self) -> int:
        """The ranks this model's replica runs on (1: one device)."""
        return self.replica.world_size if self.replica is not None else 1

    @property
    def adapter_set(self) -> ModelAdapters:
        """The adapters loaded into this model's transformers (ditcore.adapters), created on first use."""
        if self._adapter_set is None:
            self._adapter_set = ModelAdapters(self)
        return self._adapter_set

    def transformer_of(self, partition: str) -> Any:
        """The transformer of `partition` (PartitionNotLoadedError naming the folder when not loaded)."""
        return transformer_for(self.pipe, partition)

    def transformers(self) -> dict[str, Any]:
        """Every loaded partition's transformer."""
        return {p: self.transformer_of(p) for p in self.partitions}

    def check_partition(self, request: GenerationRequest) -> None:
        """PartitionNotLoadedError naming the missing folder unless this model runs the request's partition."""
        if request.partition not in self.partitions:
            folder = PARTITION_FOLDERS[request.partition]
            why = (
                f"{folder}/: the served repository {self.path} has no '{request.partition}' partition"
                if request.partition not in self.repository_partitions
                else f"{folder}/: this server does not load the '{request.partition}' partition (--partitions)"
            )
            raise PartitionNotLoadedError(
                f"{why}; {request.task} runs on it, this server serves {', '.join(self.tasks)}"
            )

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks this model serves (its partitions')."""
        return tuple(t for p in self.partitions for t in PARTITION_TASKS[p])

    @property
    def attention_backend(self) -> str:
        """The diffusers attention backend the transformer's forwards run with (read from its processors)."""
        return backend_of(self.transformer)

    @property
    def decode_dtype(self) -> str:
        """The dtype the VAEs decode in ("bfloat16", "float16" or "float32"; as the decoder's video VAE is loaded)."""
        return vae_dtype(self.decoder)

    def plan_keys(self, request: GenerationRequest, adapters: str = "") -> list[PlanKey]:
        """Every step's plan key (cheap: the schedulers alone; safe while another request runs), its pages built with
        the modulation-changing adapters of digest `adapters` ("": the base weights'; ditcore.adapter_plans)."""
        keys = self.schedule.keys(request)
        return [k.with_adapters(adapters) for k in keys] if adapters else keys

    def memory(self) -> ModelMemory:
        """Every loaded transformer's bytes against their checkpoint plan tensors (none held in cached mode)."""
        parts = self.partition_memory().values()
        return ModelMemory(
            sum(m.transformer_bytes for m in parts),
            sum(m.plan_tensor_bytes for m in parts),
            sum(m.held_plan_bytes for m in parts),
        )

    def partition_memory(self) -> dict[str, ModelMemory]:
        """Per loaded partition: its transformer's bytes against its plan tensors."""
        out = {}
        for partition, transformer in self.transformers().items():
            part = self.info.partitions[partition]
            plan_bytes = part.layout.plan_tensor_bytes(part.projection_dtype)
            held = sum(t.numel() * t.element_size() for n, t in transformer.state_dict().items() if is_plan_tensor(n))
            out[partition] = ModelMemory(_module_bytes(transformer), plan_bytes, held)
        return out

    def components(self) -> list[ComponentInfo]:
        """Each weight-bearing component (COMPONENTS, in that order): device, placement, dtype and bytes."""
        loaded: LoadedTextEncoder = self.pipe.text_encoder_load
        transformer_note = (
            "adaln_proj / norm_out.linear not loaded: modulation rows read from plan pages"
            if self.mode == "cached"
            else "as diffusers' from_pretrained loads it, adaln_proj included"
        )
        out = [
            _component_info(PARTITION_FOLDERS[p], t, "device", transformer_note) for p, t in self.transformers().items()
        ]
        out.append(_component_info("text_encoder", self.pipe.text_encoder, loaded.placement, loaded.note()))
        out += [_component_info(name, getattr(self.pipe, name), "device", "") for name in ("vae", "audio_vae")]
        return out

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> H3Model:
        """A resident copy whose transformer has the named tensors replaced (checked by the caller); the text
        encoder and the rest are shared."""
        if self.mode != "resident":
            raise ValueError("only a resident model takes pushed tensors")
        transformer = copy.deepcopy(self.transformer)
        state = transformer.state_dict()
        for name, t in tensors.items():
            state[name].copy_(t.to(state[name].device))
        other = copy.copy(self)
        # self.pipe.blocks is a copy of its quiet blocks: no progress bars either
        other.pipe = pipeline_with(self.pipe, self.info.path, transformer=transformer)
        return other


def load_model(
    checkpoint: CheckpointInfo | str | Path,
    mode: str,
    device: torch.device | str = "cpu",
    options: RunOptions | None = None,
    replica: Replica | None = None,
) -> H3Model:
    """Validate (unless given a CheckpointInfo) and load a checkpoint for serving in `mode`, run as `options` say
    (default: RunOptions(), the released decode dtype, the device's best attention backend and every partition the
    repository has). On a `replica` of
    several ranks (this process one of them, its group joined) the transformer runs context parallel
    (ditcore.parallel: diffusers' enable_parallelism) on an attention backend that supports it, rank 0 encodes the
    prompts; any packed length splits, except on a unified Ulysses x ring layout, where a forward whose rows do not
    divide by the degree is refused on every rank (SplitError)."""
    info = (
        checkpoint
        if isinstance(checkpoint, CheckpointInfo)
        else validate_checkpoint(checkpoint, require_adaln=mode == "resident")
    )
    options = options if options is not None else RunOptions()
    # the VAEs are loaded (once) at the options' decode dtype
    parallel = replica if replica is not None and replica.spec.enabled else None
    if parallel is not None:
        heads = int(info.transformer_config["num_attention_heads"])
        parallel.spec.check(parallel.world_size, heads, collective_backend(parallel.device))
    model = H3Model(
        info, mode, device, options.text_encoder, options.decode_dtype_for(info.precision), replica,
        options.partitions_for(info),
    )  # fmt: skip
    model.adapter_set.registry, model.adapter_set.max_loaded = options.adapters, options.max_loaded_adapters
    model.adapter_set.max_loaded_bytes = options.max_loaded_adapter_bytes
    model.adapter_set.modulation_plans = options.adapter_plans
    model.quality = options.quality
    for transformer in model.transformers().values():
        # the backend resolved for the served transformer's device and dtype (AttentionBackendError if it cannot run)
        use_backend(transformer, options.attention_backend, context_parallel=parallel is not None)
        if parallel is not None:
            enable_context_parallel(transformer, parallel.spec, parallel.device, parallel.mesh)
            if parallel.spec.unified:
                split_guard(transformer, parallel.spec)
    return model
