"""Context parallelism for MiniMax-H3 through diffusers' own hooks, and the torch.distributed group it runs in.

    spec = ParallelSpec(ulysses_degree=2)                  # --ulysses-degree / --ring-degree (product = ranks)
    spec.check(world_size=2, heads=56, backend="gloo")     # ParallelError naming the flag and the rule
    ranks = init_process_group(torch.device("cpu"))        # torchrun's environment: RANK, WORLD_SIZE, MASTER_*
    enable_context_parallel(pipe.transformer, spec, device)  # diffusers' enable_parallelism + MiniMax-H3's _cp_plan
    guard = split_guard(pipe.transformer, spec)            # Ulysses x ring only: rows that do not split, SplitError

The model side is diffusers' `ModelMixin.enable_parallelism(config=ContextParallelConfig(...))`: its `_cp_plan`
splits the packed sequence at the first block (with the rope rows, every block's `adaln_indices` and norm_out's
`timestep_indices`) and gathers the two output heads, and its attention dispatcher runs the Ulysses all-to-all or
the ring. The one thing ditserve changes is where diffusers puts the rank: its `_resolve_parallel_config` picks
`torch.device(accelerator, rank % device_count)` (a ZeroDivisionError on a CPU-only host, and the wrong device for
`--devices cuda:2,cuda:3`); `enable_context_parallel` gives the model instance a resolver that builds the same
`ParallelConfig` and device mesh on the rank's own device, calls diffusers' `enable_parallelism`, and removes the
resolver again. Everything else (the hooks, the sharder, the all-to-all) is diffusers' code.

Any packed length runs on Ulysses alone and on the ring alone: the config turns on diffusers' `ulysses_anything` /
`ring_anything`, whose sharder gives rank r rows `tensor_split(N)[r]` (the first `rows % N` ranks one more), whose
all-to-all takes per-rank split sizes (gloo's and NCCL's alltoall both do), and whose ring pads its KV all-gather.
The one collective diffusers runs uneven that gloo refuses is the output gather (`_all_gather_anything`: an
`all_gather` of unequal tensors); `enable_context_parallel` swaps that one function, for CPU tensors only, for
`gather_rows`: every rank's rows zero-padded to the longest share inside the all-gather's buffers and stripped after,
so the result is the bytes diffusers' own gather would return. CUDA tensors keep diffusers' function (NCCL gathers
unequal sizes). Only the unified layout (Ulysses and ring both > 1), which diffusers splits evenly only, still needs
rows that divide by the degree (`check_rows`, `split_guard`: SplitError on every rank before any collective).

The process group's backend is "cpu:gloo" on CPU and "cpu:gloo,cuda:nccl" on CUDA: diffusers' Ulysses reads
`"cpu" in str(dist.get_backend())` to decide where its size exchange runs, and ditserve's own broadcasts of request
bytes go over gloo on the host either way.

A plan's pages (PlanLinear) are the full (T, page_numel) rows on every rank: the CP hooks split `adaln_indices`,
so each rank indexes its own rows of the same pages, and the cached transformer runs under CP unchanged.
"""

from __future__ import annotations

import os
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class ParallelError(ValueError):
    """A parallel layout that cannot run: names the flag and the rule it breaks."""


class SplitError(ParallelError):
    """A request whose packed sequence does not split evenly across a unified (Ulysses x ring) layout's ranks."""


@dataclass(frozen=True)
class ParallelSpec:
    """How one replica splits a request's packed sequence across its ranks.

    `ulysses_degree` x `ring_degree` must equal the replica's ranks. Any packed length splits on Ulysses alone or
    the ring alone (diffusers' `ulysses_anything` / `ring_anything`, always on); Ulysses x ring needs even splits.
    """

    ulysses_degree: int = 1
    ring_degree: int = 1

    @property
    def degree(self) -> int:
        """The number of ranks the sequence is split across."""
        return self.ulysses_degree * self.ring_degree

    @property
    def enabled(self) -> bool:
        return self.degree > 1

    def check(self, world_size: int, heads: int, backend: str) -> None:
        """ParallelError unless this layout runs on `world_size` ranks of a model with `heads` attention heads over
        the process group `backend` ("gloo" or "nccl")."""
        self.check_layout(world_size, backend)
        if heads % self.ulysses_degree:
            raise ParallelError(
                f"--ulysses-degree must divide the transformer's {heads} attention heads, got {self.ulysses_degree}"
                f" (allowed: {', '.join(str(d) for d in range(1, heads + 1) if heads % d == 0)})"
            )

    def check_layout(self, world_size: int, backend: str) -> None:
        """`check` without the model: the degrees, the ranks and the backend (a replica's start)."""
        for flag, value in (("--ulysses-degree", self.ulysses_degree), ("--ring-degree", self.ring_degree)):
            if value < 1:
                raise ParallelError(f"{flag} must be at least 1, got {value}")
        if self.degree != world_size:
            raise ParallelError(
                f"--ulysses-degree x --ring-degree must equal the replica's ranks: "
                f"{self.ulysses_degree} x {self.ring_degree} = {self.degree}, ranks = {world_size}"
            )
        if self.ring_degree > 1 and backend == "gloo":
            raise ParallelError(
                f"--ring-degree {self.ring_degree} needs an attention backend that returns its log-sum-exp "
                "(flash, _native_cudnn, ... on CUDA); the CPU's native backend does not: use --ulysses-degree"
            )

    @property
    def unified(self) -> bool:
        """Ulysses and ring both > 1: diffusers' unified attention, which splits the rows evenly only."""
        return self.ulysses_degree > 1 and self.ring_degree > 1

    def check_rows(self, rows: int) -> None:
        """SplitError unless a packed sequence of `rows` rows runs on this layout (any length but on Ulysses x ring,
        which needs a multiple of the degree)."""
        if self.unified and rows % self.degree:
            raise SplitError(
                f"the request's packed sequence has {rows} rows (video + text + audio, and "
                f"ref2va's reference rows), which does not split "
                f"across --ulysses-degree x --ring-degree = {self.degree} ranks: with both degrees above 1 the rows "
                f"must be a multiple of {self.degree} (change the prompt, num_frames, height, width or the "
                f"references by a little, or use --ulysses-degree or --ring-degree alone, which take any length)"
            )

    def context_parallel_config(self, mesh: Any = None) -> Any:
        """diffusers' ContextParallelConfig for this layout (on `mesh`, else one diffusers builds)."""
        from diffusers import ContextParallelConfig

        return ContextParallelConfig(
            ulysses_degree=self.ulysses_degree if self.ulysses_degree > 1 else None,
            ring_degree=self.ring_degree if self.ring_degree > 1 else None,
            ulysses_anything=self.ulysses_degree > 1 and not self.unified,
            ring_anything=self.ring_degree > 1 and not self.unified,
            mesh=mesh,
        )

    def device_mesh(self, device: torch.device) -> Any:
        """The ("ring", "ulysses") device mesh of this layout, built collectively (every rank calls it together),
        with diffusers' flattened view made now too: every model loaded later reuses it, so a load on one rank
        alone (a weight update staged on rank 0 first) runs no collective."""
        from torch.distributed.device_mesh import init_device_mesh

        config = self.context_parallel_config()
        mesh = init_device_mesh(device.type, config.mesh_shape, mesh_dim_names=config.mesh_dim_names)
        mesh["ring", "ulysses"]._flatten()  # what ContextParallelConfig.setup flattens; cached on the mesh
        return mesh


@dataclass(frozen=True)
class Ranks:
    """This process's place in the replica (torchrun's environment): its global rank, and its node's (torchrun's
    GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE). Ranks are numbered node by node: rank = node_rank x
    local_world_size + local_rank (torchrun's static rendezvous, `--node-rank`)."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int = 0
    local_world_size: int = 0
    """Ranks per node (0: every rank on one node)."""

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def per_node(self) -> int:
        return self.local_world_size or self.world_size

    @property
    def nnodes(self) -> int:
        return self.world_size // self.per_node

    @property
    def node_leader(self) -> bool:
        """Local rank 0: the rank that names its node's sidecar to rank 0."""
        return self.local_rank == 0


def ranks_from_env(environ: Mapping[str, str] | None = None) -> Ranks:
    """RANK / WORLD_SIZE / LOCAL_RANK / GROUP_RANK / LOCAL_WORLD_SIZE as torchrun sets them (one rank of one when
    unset). ParallelError unless the ranks are numbered node by node on equal nodes."""
    env = os.environ if environ is None else environ
    try:
        rank = int(env.get("RANK", "0"))
        world = int(env.get("WORLD_SIZE", "1"))
        local = int(env.get("LOCAL_RANK", str(rank)))
        node = int(env.get("GROUP_RANK", "0"))
        per_node = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    except ValueError as e:
        raise ParallelError(
            f"RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK and LOCAL_WORLD_SIZE must be integers: {e}"
        ) from None
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ParallelError(
            f"RANK must lie in [0, WORLD_SIZE) and WORLD_SIZE >= 1; got RANK={rank}, WORLD_SIZE={world}"
        )
    if per_node < 1 or world % per_node or node < 0 or rank != node * per_node + local:
        raise ParallelError(
            f"a replica's nodes must each run LOCAL_WORLD_SIZE ranks numbered node by node (RANK = GROUP_RANK x "
            f"LOCAL_WORLD_SIZE + LOCAL_RANK: torchrun's --node-rank with the same --nproc-per-node on every node); "
            f"got RANK={rank}, WORLD_SIZE={world}, GROUP_RANK={node}, LOCAL_WORLD_SIZE={per_node}, LOCAL_RANK={local}"
        )
    return Ranks(rank=rank, world_size=world, local_rank=local, node_rank=node, local_world_size=per_node)


def default_layout(ranks: Ranks, backend: str, ulysses_degree: int = 0, ring_degree: int = 0) -> ParallelSpec:
    """The layout of `--ulysses-degree` / `--ring-degree` on `ranks` (0 = auto): Ulysses within a node and the ring
    across nodes where the ring runs (NCCL), Ulysses over every rank on gloo (no log-sum-exp backend on the CPU);
    a degree given alone takes the rest of the ranks as the other."""
    ring = ring_degree
    if ring == 0:
        if ulysses_degree:
            ring = max(1, ranks.world_size // ulysses_degree)
        else:
            ring = ranks.nnodes if backend == "nccl" else 1
    ulysses = ulysses_degree or max(1, ranks.world_size // ring)
    return ParallelSpec(ulysses, ring)


def process_group_backend(device: torch.device) -> str:
    """torch.distributed's backend string for ranks on `device`: gloo on the host, NCCL for CUDA tensors."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "cpu:gloo"


def collective_backend(device: torch.device) -> str:
    """The backend the attention's collectives run on ("nccl" or "gloo"), as ParallelSpec.check takes it."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(
    device: torch.device, environ: Mapping[str, str] | None = None, timeout_s: float | None = None
) -> Ranks:
    """Join the replica's process group from torchrun's environment (env:// rendezvous at MASTER_ADDR:MASTER_PORT),
    binding CUDA ranks to `device`; `timeout_s` bounds one collective (None: torch's default). Idempotent within a
    process."""
    import datetime

    ranks = ranks_from_env(environ)
    env = os.environ if environ is None else environ
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
        # torchrun's agent keeps one store across the restarts of its workers: the keys of every attempt are
        # prefixed by its restart count, or a restarted rank would read its dead peers' addresses
        from torch.distributed.distributed_c10d import PrefixStore
        from torch.distributed.rendezvous import rendezvous

        store, _, _ = next(rendezvous("env://", ranks.rank, ranks.world_size))
        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend=process_group_backend(device),
            store=PrefixStore(f"ditserve/attempt-{attempt}", store),
            rank=ranks.rank,
            world_size=ranks.world_size,
            device_id=device if device.type == "cuda" else None,
            timeout=timeout,
        )
    return ranks


def _resolver(device: torch.device) -> Any:
    """A `_resolve_parallel_config` for one model instance: diffusers' own steps, on `device`."""
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    def resolve(model: Any, config: Any) -> Any:
        if isinstance(config, ContextParallelConfig):
            config = ParallelConfig(context_parallel_config=config)
        cp = config.context_parallel_config
        if cp is None:
            raise ParallelError("enable_context_parallel takes a context-parallel config only")
        mesh = cp.mesh or init_device_mesh(device.type, cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
        config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
        model._parallel_config = config
        return config

    return resolve


def enable_context_parallel(model: Any, spec: ParallelSpec, device: torch.device, mesh: Any = None) -> None:
    """diffusers' `enable_parallelism` with `spec`'s ContextParallelConfig on `model` (a MiniMaxH3Transformer3DModel,
    resident or cached), its rank on `device`, on `mesh` (ParallelSpec.device_mesh; None: diffusers builds one,
    collectively). A no-op for a degree of 1."""
    if not spec.enabled:
        return
    if not dist.is_initialized():
        raise ParallelError("context parallel needs the replica's process group (init_process_group) first")
    _use_gather_rows()
    model._resolve_parallel_config = types.MethodType(_resolver(torch.device(device)), model)
    try:
        model.enable_parallelism(config=spec.context_parallel_config(mesh))
    finally:
        del model._resolve_parallel_config  # the class's own again


def gather_rows(tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Every rank's `tensor` concatenated along `dim` in rank order, the ranks' sizes along `dim` may differ (diffusers'
    `_all_gather_anything`, on gloo): each share zero-padded to the longest inside the all-gather's buffers, the
    padding stripped after. Equal shares gather as they are."""
    from diffusers.models._modeling_parallel import gather_size_by_comm

    tensor = tensor.contiguous()
    sizes = gather_size_by_comm(tensor.shape[dim], group)  # one int64 all_gather on the host
    longest = max(sizes)
    if tensor.shape[dim] < longest:
        pad = torch.zeros((*tensor.shape[:dim], longest - tensor.shape[dim], *tensor.shape[dim + 1 :]),
                          dtype=tensor.dtype, device=tensor.device)  # fmt: skip
        tensor = torch.cat([tensor, pad], dim=dim)
    buffers = [torch.empty_like(tensor) for _ in sizes]
    dist.all_gather(buffers, tensor, group=group)
    return torch.cat([b.narrow(dim, 0, n) for b, n in zip(buffers, sizes, strict=True)], dim=dim)


def _use_gather_rows() -> None:
    """Point diffusers' context-parallel output gather at `gather_rows` for CPU tensors (gloo), its own for the rest
    (NCCL gathers unequal sizes). Process-wide and idempotent; what it returns is the same bytes either way."""
    from diffusers.hooks import context_parallel as cp

    own = cp._all_gather_anything
    if getattr(own, "_ditserve", False):
        return

    def all_gather_anything(tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        return gather_rows(tensor, dim, group) if tensor.device.type == "cpu" else own(tensor, dim, group)

    all_gather_anything._ditserve = True  # type: ignore[attr-defined]
    cp._all_gather_anything = all_gather_anything


def split_guard(model: Any, spec: ParallelSpec) -> Any:
    """A forward pre-hook on `model` that raises SplitError before a forward whose packed sequence (`position_ids`
    rows) does not split across a unified layout's ranks (ParallelSpec.check_rows), so no rank enters a collective the
    others refuse. Returns the handle. Every rank computes the same shapes, so every rank raises at the same forward."""

    def check(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        positions = kwargs.get("position_ids")
        if positions is not None:
            spec.check_rows(int(positions.shape[0]))

    return model.register_forward_pre_hook(check, with_kwargs=True)
