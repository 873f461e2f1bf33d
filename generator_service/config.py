"""Generator configuration: one frozen dataclass built from CLI flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GeneratorConfig:
    adaln_mode: str = "cached"
    """"cached" (plans from the sidecar) or "resident" (adaln_proj loaded; no sidecar)."""
    checkpoint: Path | None = None
    """Resident mode: the checkpoint. Cached mode: ignored; the sidecar's weights are loaded."""
    sidecar: str = ""
    """Sidecar target: 'unix:/path/plancache.sock' or 'host:port' (cached mode)."""
    listen: str = "127.0.0.1:50051"
    """Public address (host:port; port 0 picks a free one)."""
    device: str = "cpu"
    """Device the DiT runs on."""
    max_queue_depth: int = 16
    """Requests waiting or running before Generate answers RESOURCE_EXHAUSTED."""
    max_message_bytes: int = 64 * 1024 * 1024
    """gRPC send/receive limit; a unary result above it must use GenerateStream."""
    chunk_bytes: int = 1024 * 1024
    """Tensor bytes per GenerateStream chunk (well under max_message_bytes)."""
    reconnect_s: float = 0.5
    """Pause between attempts to (re)attach to the sidecar."""
    prefetch: bool = True
    """Prepare the next queued request's plans while the current one denoises."""
    workers: int = 32
    """gRPC server threads (one per in-flight RPC, streams included)."""
    admin_token: str = ""
    """Bearer token UpdateWeights requires (`--admin-token` or DITSERVE_ADMIN_TOKEN); empty = updates off."""
    weights_root: Path | None = None
    """UpdateWeights paths must resolve inside this directory."""
    drain_timeout_s: float = 60.0
    """How long an update waits for the running request before it aborts."""
    metrics_port: int | None = None
    """Prometheus /metrics HTTP port (off when None)."""
    max_steps: int | None = None
    """Operator limit on `steps` (default: the model's, 1000)."""
    max_frames: int | None = None
    """Operator limit on `frames` (default: the preset's max_frames)."""
    max_height: int | None = None
    """Operator limit on `height` in pixels (default: the preset's)."""
    max_width: int | None = None
    """Operator limit on `width` in pixels (default: the preset's)."""
    max_prompt_bytes: int | None = None
    """Operator limit on prompt and negative prompt bytes (default: the preset's text_len)."""
    tls_cert: Path | None = None
    """PEM server certificate for the public port (TLS when set, with tls_key)."""
    tls_key: Path | None = None
    """PEM private key of tls_cert."""
    tls_client_ca: Path | None = None
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)."""

    def __post_init__(self) -> None:
        if self.adaln_mode not in ("cached", "resident"):
            raise ValueError(f"--adaln-mode must be cached or resident, got {self.adaln_mode!r}")
        if self.adaln_mode == "resident" and self.checkpoint is None:
            raise ValueError("--checkpoint is required with --adaln-mode resident")
        if self.adaln_mode == "cached" and not self.sidecar:
            raise ValueError("--sidecar is required with --adaln-mode cached")
        if not 1 <= self.max_queue_depth <= 100_000:
            raise ValueError(f"--max-queue-depth must be in [1, 100000], got {self.max_queue_depth}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        for name in ("max_steps", "max_frames", "max_height", "max_width", "max_prompt_bytes"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if not 1024 <= self.chunk_bytes < self.max_message_bytes:
            raise ValueError("--chunk-bytes must be in [1024, max message bytes)")
