"""One rank's replica: its layout, its place and its device, and the typed exchanges rank 0 drives (bytes and tensors
broadcast, a status gathered), over the process group parallel.py joins."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .parallel import ParallelSpec, Ranks


class ReplicaLostError(RuntimeError):
    """A collective of the replica failed: a rank is gone (its process died or the group broke)."""


class Replica:
    """One rank's view of its replica: the layout, its place, its device, and the typed exchanges rank 0 drives
    (bytes and tensors broadcast from rank 0, a status gathered from every rank). Nothing is pickled: bytes travel
    as uint8 tensors behind an int64 length, over gloo on the host (the group's CPU backend)."""

    def __init__(self, spec: ParallelSpec, ranks: Ranks, device: torch.device) -> None:
        """Collective: every rank of the replica constructs its Replica together (the device mesh is built here)."""
        self.spec = spec
        self.ranks = ranks
        self.device = torch.device(device)
        self.mesh = spec.device_mesh(self.device) if spec.enabled else None
        """The context-parallel mesh every model of this rank runs on (enable_context_parallel)."""

    @property
    def leader(self) -> bool:
        return self.ranks.leader

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    @property
    def node_rank(self) -> int:
        return self.ranks.node_rank

    @property
    def local_rank(self) -> int:
        return self.ranks.local_rank

    @property
    def nnodes(self) -> int:
        return self.ranks.nnodes

    @property
    def per_node(self) -> int:
        """Ranks on each node."""
        return self.ranks.per_node

    def _collective(self, what: str, op: Any) -> Any:
        try:
            return op()
        except (RuntimeError, dist.DistBackendError) as e:  # gloo: "Connection closed by peer", a timeout
            raise ReplicaLostError(f"replica rank {self.rank}: {what} failed (a rank is gone?): {e}") from e

    def broadcast_bytes(self, data: bytes | None = None) -> bytes:
        """Rank 0's `data` on every rank (the others pass None)."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self._collective("broadcast", lambda: dist.broadcast(size, src=0))
        if self.leader:
            assert data is not None
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
        if buf.numel():
            self._collective("broadcast", lambda: dist.broadcast(buf, src=0))
        return data if self.leader and data is not None else buf.numpy().tobytes()

    def broadcast_tensor(self, tensor: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Rank 0's `tensor` (its shape travels first) on every rank, as `dtype` on `device`; bytes on the host."""
        if self.leader:
            assert tensor is not None
            host = tensor.detach().to("cpu", dtype).contiguous()
            shape = torch.tensor([host.ndim, *host.shape], dtype=torch.int64)
        else:
            shape = torch.empty(0, dtype=torch.int64)
        ndim = torch.tensor([shape.numel()], dtype=torch.int64)
        self._collective("broadcast", lambda: dist.broadcast(ndim, src=0))
        if not self.leader:
            shape = torch.empty(int(ndim.item()), dtype=torch.int64)
        self._collective("broadcast", lambda: dist.broadcast(shape, src=0))
        dims = [int(d) for d in shape[1:].tolist()]
        if not self.leader:
            host = torch.empty(dims, dtype=dtype)
        flat = host.view(-1).view(torch.uint8) if host.numel() else torch.empty(0, dtype=torch.uint8)
        if flat.numel():
            self._collective("broadcast", lambda: dist.broadcast(flat, src=0))
        return host.to(device)

    def gather_status(self, status: str) -> list[str]:
        """Every rank's `status` ("" = fine), in rank order, on every rank."""
        return [b.decode(errors="replace") for b in self.gather_bytes(status.encode())]

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order, on every rank."""
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._collective("all_gather", lambda: dist.all_gather(sizes, size))
        longest = max(int(s.item()) for s in sizes)
        if longest == 0:
            return [b""] * self.world_size
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        parts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._collective("all_gather", lambda: dist.all_gather(parts, mine))
        return [p[: int(n.item())].numpy().tobytes() for p, n in zip(parts, sizes, strict=True)]

    def agree(self, stop: bool) -> bool:
        """Whether rank 0 says stop (every rank learns it at the same step)."""
        flag = torch.tensor([1 if stop and self.leader else 0], dtype=torch.int64)
        self._collective("broadcast", lambda: dist.broadcast(flag, src=0))
        return bool(flag.item())
