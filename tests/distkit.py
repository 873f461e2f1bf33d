"""Run a function on N CPU ranks joined in one gloo process group, as torchrun would start them.

    results = run_ranks(worker, world_size=2, args=(repo, ...), tmp=tmp_path)  # worker(rank, out_dir, *args)

Each rank is a fresh spawned interpreter with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT); `worker` is called with its rank and a directory it writes what it computed to (safetensors, JSON),
which the test reads after every rank has exited. An exception on any rank fails the call with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, out_dir: str, worker: Callable[..., None], args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)  # two ranks on two cores
    worker(rank, Path(out_dir), *args)  # a failure: the traceback goes to the parent, which ends the other ranks
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # every rank is past its last collective
    sys.stdout.flush()
    sys.stderr.flush()
    # past the interpreter's teardown: gloo's threads may still be joinable when torch's static destructors run, and
    # std::terminate (SIGABRT) would fail a rank that finished (seen under load)
    os._exit(0)


def run_ranks(worker: Callable[..., None], world_size: int, args: tuple[Any, ...], tmp: Path) -> Path:
    """Run `worker(rank, out_dir, *args)` on `world_size` spawned ranks; returns out_dir once all have exited."""
    out_dir = tmp / "ranks"
    out_dir.mkdir(exist_ok=True)
    mp.start_processes(_entry, args=(world_size, free_port(), str(out_dir), worker, args), nprocs=world_size,
                       join=True, start_method="spawn")  # fmt: skip
    return out_dir
