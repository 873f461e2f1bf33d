"""Assembly of the generator: one `build_server(config)` that constructs every part (backend,
executor, metrics, update coordinator, gRPC server) and passes collaborators in."""

from __future__ import annotations

import torch

from .backend import Backend, CachedBackend, ResidentBackend
from .config import GeneratorConfig
from .server import GeneratorServer


def build_server(cfg: GeneratorConfig) -> GeneratorServer:
    device = torch.device(cfg.device)
    backend: Backend
    if cfg.adaln_mode == "resident":
        assert cfg.checkpoint is not None
        backend = ResidentBackend(cfg.checkpoint, device)
        return GeneratorServer(cfg, backend)
    backend = CachedBackend(cfg.sidecar, device, cfg.reconnect_s)
    server = GeneratorServer(cfg, backend)
    backend.start(server.set_serving)
    return server
