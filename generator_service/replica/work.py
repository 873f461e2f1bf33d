"""The work items rank 0 and the other ranks exchange (replica.proto `RankWork`): request and plan-key conversions,
each rank's report, the exit status and errors both sides share. No grpc here."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from ditcore import GenerationRequest
from ditcore.model import H3Model
from ditcore.plans import PlanKey
from ditcore.references import Reference
from ditcore.replica import Replica
from ditcore.request import AdapterUse
from ditcore.step_cache import StepCache
from protos.ditserve.replica.v1 import replica_pb2 as rpb

from ..errors import GeneratorError

EXIT_REPLICA_LOST = 75
"""A rank's exit status when its replica broke: the elastic launcher restarts every rank."""


class RankStoppedError(GeneratorError):
    """On a rank other than 0: rank 0 stopped the request at this step (its own reason is rank 0's)."""


# ---------------------------------------------------------------------------- request on the wire
def request_to_work(
    request: GenerationRequest, identities: Sequence[str] = (), step_cache: StepCache | None = None
) -> rpb.Request:
    """The request as rank 0 hands it on, with each adapter's identity as rank 0 read it (`identities`, in order)
    and its quality level's step cache (every rank installs the same hooks)."""
    adapters = [rpb.AdapterUse(name=u.name, scale=float(u.scale), identity=i)
                for u, i in zip(request.adapters, identities, strict=True)]  # fmt: skip
    return rpb.Request(
        adapters=adapters,
        request_id=request.request_id, task=request.task, prompt=request.prompt,
        num_inference_steps=request.num_inference_steps, flow_shift=request.flow_shift,
        audio_flow_shift=request.audio_flow_shift, seed=request.seed, height=request.height, width=request.width,
        num_frames=request.num_frames, first_frame=request.first_frame, last_frame=request.last_frame,
        references=[rpb.Reference(data=r.data, kind=r.kind) for r in request.references],
        step_cache=json.dumps(step_cache.to_dict(), sort_keys=True) if step_cache is not None else "",
    )  # fmt: skip


def step_cache_from_work(msg: rpb.Request) -> StepCache | None:
    """The step cache rank 0 handed on (None: lossless)."""
    return StepCache.parse(json.loads(msg.step_cache), "rank 0's step cache") if msg.step_cache else None


def request_from_work(msg: rpb.Request) -> GenerationRequest:
    """The request as a rank other than 0 runs it: its loop only (rank 0 decodes)."""
    return GenerationRequest(
        request_id=msg.request_id, task=msg.task, prompt=msg.prompt, num_inference_steps=msg.num_inference_steps,
        flow_shift=msg.flow_shift, audio_flow_shift=msg.audio_flow_shift, seed=msg.seed, height=msg.height,
        width=msg.width, num_frames=msg.num_frames, first_frame=msg.first_frame, last_frame=msg.last_frame,
        output_type="latents", references=tuple(Reference(r.data, r.kind) for r in msg.references),
        adapters=tuple(AdapterUse(a.name, a.scale) for a in msg.adapters),
    )  # fmt: skip


def keys_from_work(msg: rpb.Run) -> list[PlanKey]:
    return [PlanKey(tuple(int(b) for b in k.timestep_bits), k.partition or "base", k.adapters) for k in msg.plan_keys]


def key_to_work(key: PlanKey) -> rpb.PlanKey:
    return rpb.PlanKey(timestep_bits=list(key.bits), partition=key.partition, adapters=key.adapters)


# ---------------------------------------------------------------------------- what every rank answers
def rank_report(replica: Replica, model: H3Model | None) -> rpb.RankReport:
    """This rank's device and its model's components."""
    components = [rpb.Component(**dataclasses.asdict(c)) for c in model.components()] if model is not None else []
    return rpb.RankReport(rank=replica.rank, device=str(replica.device), components=components,
                          node=replica.node_rank)  # fmt: skip


def raise_first(statuses: Sequence[str], kind: type[GeneratorError] = GeneratorError) -> None:
    """The gathered statuses ("" = fine, in rank order): `kind` naming the first rank that failed, if any."""
    for rank, status in enumerate(statuses):
        if status:
            raise kind(f"replica rank {rank}: {status}")


# ---------------------------------------------------------------------------- where every rank runs
def gather_places(replica: Replica, sidecar: str) -> list[rpb.RankPlace]:
    """Every rank's place (its node, its local rank, its device, and its node's sidecar: `sidecar`, this rank's
    --sidecar), in rank order, on every rank: collective, once when the replica forms."""
    mine = rpb.RankPlace(rank=replica.rank, node_rank=replica.node_rank, local_rank=replica.local_rank,
                         sidecar=sidecar, device=str(replica.device))  # fmt: skip
    return [rpb.RankPlace.FromString(b) for b in replica.gather_bytes(mine.SerializeToString())]


def node_sidecars(places: Sequence[rpb.RankPlace], per_node: int) -> list[str]:
    """Each node's sidecar target as its ranks name it, in node order. ValueError when a node's ranks name different
    sidecars, or two nodes the same one (each node's sidecar owns that node's slabs)."""
    nodes: dict[int, str] = {}
    for place in places:
        if place.rank != place.node_rank * per_node + place.local_rank:
            raise ValueError(f"replica rank {place.rank} is local rank {place.local_rank} of node {place.node_rank}: "
                             f"ranks must be numbered node by node ({per_node} per node)")  # fmt: skip
        named = nodes.setdefault(place.node_rank, place.sidecar)
        if named != place.sidecar:
            raise ValueError(f"node {place.node_rank}'s ranks name different sidecars ({named!r}, {place.sidecar!r}): "
                             "every rank of a node names its node's --sidecar")  # fmt: skip
    targets = [nodes[n] for n in sorted(nodes)]
    for n, target in enumerate(targets):
        if not target:
            raise ValueError(f"node {n} names no --sidecar: every node of a cached replica runs its own sidecar")
        if target in targets[:n]:
            raise ValueError(f"nodes {targets.index(target)} and {n} both name the sidecar {target!r}: each node's "
                             "ranks name their own node's sidecar, as rank 0 reaches it")  # fmt: skip
    return targets
