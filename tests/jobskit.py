"""The jobs tests' real generator: in-process, resident mode on the tiny demo checkpoint, its job store and results
in a directory the test owns (so a restart on the same directory finds them again)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
from servicekit import free_port, wait_for

from generator_service.app import build_server
from generator_service.config import GeneratorConfig
from generator_service.jobs.config import JobsConfig
from generator_service.serving.server import GeneratorServer
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

QUICK = {"prompt": "a red fox", "num_inference_steps": 3}
"""A small job: the default 32 x 32 x 124 canvas, two forwards."""


@contextlib.contextmanager
def jobs_server(checkpoint: Path, state_dir: Path, *, jobs: dict[str, Any] | None = None,
                **options: Any) -> Iterator[GeneratorServer]:  # fmt: skip
    """A started generator whose jobs live in `state_dir` (JobsConfig fields in `jobs`, GeneratorConfig's in
    `options`); stopped on exit."""
    jobs_cfg = JobsConfig(state_dir=state_dir, **{"replica_id": "test-replica", **(jobs or {})})
    cfg = GeneratorConfig(adaln_mode="resident", checkpoint=checkpoint, listen="127.0.0.1:0", jobs=jobs_cfg, **options)
    srv = build_server(cfg)
    srv.start()
    try:
        wait_for(lambda: srv.state.serving, 120, "the resident model to load")
        yield srv
    finally:
        srv.stop(1)


def jobs_stub(target: str) -> tuple[grpc.Channel, pb_grpc.JobsStub]:
    channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    return channel, pb_grpc.JobsStub(channel)


def write_keys(path: Path, keys: Mapping[str, str]) -> Path:
    """A --client-keys-file (mode 0600): one `NAME KEY` line per client."""
    path.write_text("# name key\n" + "".join(f"{name} {key}\n" for name, key in keys.items()))
    os.chmod(path, 0o600)
    return path


@contextlib.contextmanager
def facade(jobs: Any, config: Any) -> Iterator[str]:
    """The /v1/videos facade (`ditserve.openai.app.create_app(jobs, config)`) under uvicorn in a thread on a free
    port: its base URL `http://127.0.0.1:PORT/v1`; stopped on exit."""
    import uvicorn

    from ditserve.openai.app import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(jobs, config), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "uvicorn to start")
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)
