"""GetStatus' answer: what this generator serves (weights, generation, queue), its model's memory, components and
partitions, the placement chosen at start, the replica's ranks and the slab's geometry; ListAdapters' and
ListQualityLevels' answers. No grpc here."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from typing import Any

from ditcore.adapters import AdapterInfo, AdapterRegistry
from ditcore.checkpoint_files import PARTITION_TASKS
from ditcore.model import ComponentInfo, H3Model
from ditcore.quality import LOSSLESS, QualityLevel, QualityLevels
from ditcore.request import TASKS
from protos.ditserve.generator.v1 import generator_pb2 as pb

from ..backends.base import Backend
from ..backends.replica_port import ReplicaPort
from ..config import GeneratorConfig
from ..execution.executor import Executor


def status_response(
    cfg: GeneratorConfig, backend: Backend, executor: Executor, mode: pb.AdalnMode
) -> pb.GetStatusResponse:
    st = backend.status()
    resp = pb.GetStatusResponse(
        adaln_mode=mode,
        weights_path=st.weights_path,
        fingerprint=st.fingerprint,
        sidecar_connected=st.sidecar_connected,
        sidecar_target=st.sidecar_target,
        queue_depth=executor.queue_depth,
        max_queue_depth=cfg.max_queue_depth,
        serving=st.serving,
    )
    if st.serving:
        resp.generation = backend.generation()
    model = backend.loaded()
    if model is not None:
        resp.model_preset = model.info.preset
        resp.precision = model.precision
        resp.attention_backend, resp.decode_dtype = model.attention_backend, model.decode_dtype
        resp.memory.CopyFrom(pb.ModelMemory(**model.memory().to_dict()))
        resp.components.extend(component_placement(c) for c in model.components())
        resp.partitions.extend(partition_status(model))
        held = model.adapter_set.loaded_bytes()
        resp.adapters.extend(adapter_message(info, True, held.get(info.identity, 0))
                             for info in model.adapter_set.loaded())  # fmt: skip
    if backend.replica is not None:
        resp.replica.CopyFrom(_replica_status(backend.replica))
        resp.replica.node_sidecars.extend(pb.NodeSidecar(**n._asdict()) for n in st.node_sidecars)
    placed = backend.placement.to_status() if backend.placement is not None else None
    if placed is not None:
        ranks = [pb.RankNeed(**r) for r in placed.pop("ranks")]
        resp.start_placement.CopyFrom(pb.StartPlacement(**placed, ranks=ranks))
    slab = st.slab
    if slab is not None:
        page_bytes = slab.slab_bytes // max(1, slab.num_slots * slab.width)
        resp.slab.CopyFrom(pb.SlabGeometry(
            num_slots=slab.num_slots, width=slab.width, page_numel=slab.page_numel, page_bytes=page_bytes,
            dtype=slab.dtype, device=slab.device, transport=slab.transport,
        ))  # fmt: skip
    return resp


def _replica_status(link: ReplicaPort) -> pb.ReplicaStatus:
    """The replica's layout and what each rank held at its last report."""
    spec = link.replica.spec
    return pb.ReplicaStatus(
        ranks=link.world_size, ulysses_degree=spec.ulysses_degree, ring_degree=spec.ring_degree,
        nodes=link.replica.nnodes,
        rank_placements=[pb.RankPlacement(rank=r.rank, device=r.device, node=r.node, components=[
            pb.ComponentPlacement(name=c.name, device=c.device, placement=c.placement, dtype=c.dtype,
                                  bytes=c.bytes, device_bytes=c.device_bytes, note=c.note)
            for c in r.components]) for r in link.reports],
    )  # fmt: skip


def partition_status(model: H3Model) -> list[pb.PartitionStatus]:
    """GetStatus' view of the repository's transformer partitions: loaded or not, their tasks and memory."""
    memory = model.partition_memory()
    out = []
    for name, part in model.info.partitions.items():
        status = pb.PartitionStatus(
            name=name, folder=part.folder, loaded=name in memory, tasks=list(PARTITION_TASKS[name]),
            fingerprint=part.fingerprint,
        )  # fmt: skip
        if name in memory:
            status.memory.CopyFrom(pb.ModelMemory(**memory[name].to_dict()))
        out.append(status)
    return out


def component_placement(c: ComponentInfo) -> pb.ComponentPlacement:
    """GetStatus' view of one loaded component (the two share their field names)."""
    return pb.ComponentPlacement(**dataclasses.asdict(c))


def adapters_response(registry: AdapterRegistry | None, model: H3Model | None) -> pb.ListAdaptersResponse:
    """ListAdapters' answer: every adapter of --adapter-dir as read now (a changed file is read again), whether the
    served model holds it, and each file refused with why. Empty without --adapter-dir."""
    resp = pb.ListAdaptersResponse()
    if registry is None:
        return resp
    found, refused = registry.scan()
    loaded = {a.identity for a in model.adapter_set.loaded()} if model is not None else set()
    held = model.adapter_set.loaded_bytes() if model is not None else {}
    resp.adapters.extend(adapter_message(i, i.identity in loaded, held.get(i.identity, 0)) for i in found)
    resp.refused.extend(pb.AdapterRefusal(name=n, message=m) for n, m in sorted(refused.items()))
    return resp


def adapter_message(info: AdapterInfo, loaded: bool, loaded_bytes: int) -> pb.Adapter:
    """One adapter as ListAdapters and GetStatus show it."""
    c = info.contract
    contract = pb.AdapterContract(
        steps=c.steps, flow_shifts=c.flow_shifts, audio_flow_shifts=c.audio_flow_shifts, scale_min=c.scale[0],
        scale_max=c.scale[1], tasks=c.tasks, default_steps=c.default_steps, default_flow_shift=c.default_flow_shift,
        default_audio_flow_shift=c.default_audio_flow_shift,
    )  # fmt: skip
    targets = pb.AdapterTargets(**{g: len(info.targets.get(g, ())) for g in ("trunk", "modulation", "time")})
    return pb.Adapter(
        name=info.name, identity=info.identity, rank=info.rank, partition=info.partition, bytes=info.size_bytes,
        targets=targets, contract=contract, loaded=loaded, changes_modulation=info.changes_modulation,
        loaded_bytes=loaded_bytes,
    )  # fmt: skip


def quality_levels_response(
    levels: QualityLevels, model: H3Model | None, world_size: int
) -> pb.ListQualityLevelsResponse:
    """ListQualityLevels' answer: lossless, then each level of `levels` by name with what it allows and the audits of
    its current definition (read again now)."""
    blocks = int(model.info.transformer_config.get("num_layers", 0)) if model is not None else 0
    resp = pb.ListQualityLevelsResponse(
        world_size=world_size, transformer_blocks=blocks, source=levels.source,
        audit_dir=str(levels.audit_dir) if levels.audit_dir is not None else "",
    )  # fmt: skip
    resp.levels.append(pb.QualityLevel(
        name=LOSSLESS, description="no step cache: the model's own computation (bit-exact with diffusers)",
        tasks=list(TASKS), adapters="any",
    ))  # fmt: skip
    resp.levels.extend(quality_level_message(levels, levels.levels[name]) for name in sorted(levels.levels))
    return resp


def quality_level_message(levels: QualityLevels, level: QualityLevel) -> pb.QualityLevel:
    """One level as ListQualityLevels shows it."""
    cache = level.cache.to_dict()
    kind = cache.pop("kind")
    listed = not isinstance(level.adapters, str)
    msg = pb.QualityLevel(
        name=level.name, description=level.description, digest=level.digest,
        definition_json=json.dumps(level.to_dict(), sort_keys=True),
        cache=pb.StepCacheDefinition(kind=kind, params_json=json.dumps(cache, sort_keys=True)),
        tasks=list(level.tasks), steps=list(level.steps), max_height=level.max_height, max_width=level.max_width,
        max_num_frames=level.max_num_frames, world_sizes=list(level.world_sizes),
        adapters="listed" if listed else str(level.adapters), adapter_names=list(level.adapters) if listed else [],
        unaudited=level.unaudited, thresholds=dict(level.audit),
    )  # fmt: skip
    records = levels.audits(level)
    covered: list[tuple[Any, ...]] = []
    for r in records:
        if r.passed and tuple(r.shape) not in covered:
            covered.append(tuple(r.shape))
    msg.audits.passed = sum(r.passed for r in records)
    msg.audits.failed = len(records) - msg.audits.passed
    for shape in covered:
        try:
            task, steps, height, width, frames, ranks = shape
            msg.audits.covered.append(pb.AuditShape(
                task=str(task), num_inference_steps=int(steps), height=int(height), width=int(width),
                num_frames=int(frames), world_size=int(ranks),
            ))  # fmt: skip
        except (TypeError, ValueError, OverflowError):
            continue  # a foreign shape covers nothing this server serves
    times = []
    for r in records:
        try:
            times.append(datetime.fromisoformat(r.at))
        except ValueError:
            continue
    if times:
        msg.audits.last_audit_at.FromDatetime(max(times))
    return msg
