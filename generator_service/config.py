"""Generator configuration: one frozen dataclass whose fields declare their own CLI flags
(ditruntime.flags), built from `ditserve generator` / `serve` flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ditcore.attention import AUTO, check_name
from ditcore.model import RunOptions
from ditcore.parallel import ParallelSpec, Ranks, collective_backend, default_layout
from ditcore.pipeline import DECODE_DTYPES
from ditcore.references import DEFAULT_REFERENCE_LIMITS
from ditcore.request import (
    CANVAS_MULTIPLE,
    MAX_ADAPTERS,
    MAX_FRAMES,
    MAX_KEYFRAME_BYTES,
    MAX_KEYFRAME_PIXELS,
    MAX_PIXELS,
    MAX_PROMPT_BYTES,
    MAX_PROMPT_TOKENS,
    MAX_REFERENCE_BYTES,
    MAX_REFERENCE_DECODED_BYTES,
    MAX_REFERENCE_FRAME_PIXELS,
    MAX_REFERENCE_SECONDS,
    MAX_REFERENCES_BYTES,
    MAX_SIDE,
    MIN_FRAMES,
    RELEASED_MAX_PIXELS,
    RELEASED_MAX_SIDE,
    RELEASED_MAX_VIDEO_PIXELS,
    RequestLimits,
)
from ditcore.text_encoder import TEXT_ENCODER_DEVICES, TextEncoderPlacement
from ditruntime.auth import (
    ADMIN_TOKEN_ENV,
    ADMIN_TOKEN_FILE_HELP,
    ADMIN_TOKEN_HELP,
    METRICS_HOST_HELP,
    REFLECTION_HELP,
    check_tls_flags,
    listen_host,
    read_client_keys,
    resolve_admin_token,
)
from ditruntime.flags import check_bounds, flag

if TYPE_CHECKING:
    from ditcore.adapters import AdapterRegistry
    from ditcore.quality import QualityLevels

from .execution.policy import GB, MIB, SizingPolicy
from .jobs.config import JobsConfig
from .replica.link import KEEPALIVE_S, REPLICA_TIMEOUT_MIN_S

TOKEN_ENV = ADMIN_TOKEN_ENV


@dataclass(frozen=True)
class GeneratorConfig:
    adaln_mode: str = flag(
        "cached",
        "cached: plans from the sidecar; resident: no sidecar (default %(default)s)",
        choices=("cached", "resident"),
    )
    """"cached" (plans from the sidecar) or "resident" (adaln_proj loaded; no sidecar)."""
    checkpoint: Path | None = flag(None, "resident mode: checkpoint dir (cached mode loads the sidecar's)")
    """Resident mode: the checkpoint. Cached mode: ignored; the sidecar's weights are loaded."""
    sidecar: str = flag("", "sidecar socket or host:port (default <run-dir>/plancache.sock)")
    """Sidecar target: 'unix:/path/plancache.sock' or 'host:port' (cached mode). On a replica across nodes, every
    node's ranks name their own node's sidecar, as rank 0 reaches it (rank 0 gathers them at start and is the one
    client of every node's sidecar: docs/replicas.md)."""
    listen: str = flag("127.0.0.1:50051", "public address host:port (default %(default)s)")
    """Public address (host:port; port 0 picks a free one)."""
    device: str = flag("cpu", "cpu or cuda[:N] (default %(default)s)")
    """Device the DiT runs on (every rank of a replica, unless --devices)."""
    devices: str = flag(
        "", "a replica's devices, one per rank in rank order, comma-separated (e.g. cuda:0,cuda:1; default: "
        "--device for every rank)",
    )  # fmt: skip
    """A replica of N ranks (started by torchrun or `ditserve serve --nproc N`: RANK, WORLD_SIZE, LOCAL_RANK):
    rank r runs on the r-th device listed (by its LOCAL_RANK). The sidecar's --devices must list the same devices
    in the same order (its slab r is rank r's)."""
    ulysses_degree: int = flag(
        0, "a replica's Ulysses (all-to-all) sequence-parallel degree; 0: every rank (default %(default)s)",
        low=0, high=1024,
    )  # fmt: skip
    """Ulysses degree x ring degree must equal the replica's ranks; the Ulysses degree must divide the
    transformer's attention heads (56 released: 1, 2, 4, 7, 8, 14, 28, 56). 0 picks the ranks / ring degree."""
    ring_degree: int = flag(
        0, "a replica's ring-attention degree; 0: the nodes on CUDA (Ulysses within a node, the ring across "
        "nodes), 1 on CPU (default %(default)s)", low=0, high=1024,
    )  # fmt: skip
    """Ring attention passes key/value blocks around the ranks; it needs a backend returning its log-sum-exp
    (flash, _native_cudnn on CUDA), so CPU replicas use Ulysses. 0 (auto, ditcore.parallel.default_layout): a
    multi-node replica runs Ulysses within each node and the ring across the nodes on CUDA."""
    ulysses_anything: bool = flag(
        False, "accepted for older command lines: any sequence length is the default on gloo and NCCL"
    )
    """No effect: a replica always runs diffusers' `ulysses_anything` / `ring_anything`, so any packed sequence splits
    across the ranks (docs/replicas.md); the Ulysses degree must still divide the attention heads."""
    replica_timeout_s: float = flag(
        1800.0,
        f"a replica's collective timeout in seconds, at least {REPLICA_TIMEOUT_MIN_S:g} (twice the keep-alive) "
        "(default %(default)s)",
        high=86400,
    )
    """torch.distributed's timeout for one collective of the replica's group: the longest one rank may wait for the
    others (rank 0 decoding, every rank loading an update's weights). At least twice the keep-alive rank 0 sends an
    idle replica (`KEEPALIVE_S`, generator_service.replica.link), which an idle rank waits for in a collective;
    checked in `__post_init__`, so the refusal says why."""
    attention_backend: str = flag(
        AUTO,
        "the transformer's diffusers attention backend (an AttentionBackendName, e.g. native, _native_cudnn, flash); "
        "auto: the first that runs on the device of _flash_3, _native_cudnn, flash, _native_flash, native (cpu: "
        "native) (default %(default)s)",
    )
    """diffusers' attention backend for the served transformer, and for every one an update swaps in
    (ditcore.attention). "auto" is resolved at load by a tiny real call of each candidate; a named one that does not
    run on the device is refused at start, naming those that do."""
    decode_dtype: str = flag(
        AUTO,
        "dtype the VAEs decode in; auto: the released bfloat16 for a mixed checkpoint, float32 for a float32 one "
        "(default %(default)s)",
        choices=(AUTO, *DECODE_DTYPES),
    )
    """The VAEs' dtype (loaded at it as diffusers' `load_components(dtype=...)` does: the video VAE's encoder path
    and the audio VAE stay float32, so only the video decoder changes; fl2va keyframe latents do not depend on it)."""
    partitions: str = flag(
        AUTO,
        "transformer partitions to load, comma-separated: base (transformer/: t2va, fl2va), ref (transformer_ref/: "
        "ref2va); auto: every one the repository has, or base alone where they do not fit the device (decided at "
        "start) (default %(default)s)",
    )
    """Which of the repository's transformers this generator loads (`--partitions base,ref`): cached, each without
    its adaln_proj (its plans come from the sidecar, keyed by partition); resident, each as diffusers loads it. A
    request whose task needs an unloaded partition is refused FAILED_PRECONDITION naming it. "auto" loads every one
    the repository has, or base alone when the memory model (ditcore.placement: at the largest canvas the limits
    admit, against the device's free memory at start) says they do not fit; GetStatus' start_placement says which."""
    text_encoder_device: str = flag(
        AUTO,
        "where the Qwen3-VL text encoder runs: auto (decided at start from the memory model: on the --device if "
        "it fits, else offloaded from pinned host memory, else on the CPU), cuda, or cpu (default %(default)s)",
        choices=TEXT_ENCODER_DEVICES,
    )
    """Where the text encoder (trimmed to the layers MiniMax-H3 reads, no lm_head: ditcore.text_encoder) computes
    and keeps its weights. "cpu" frees its device memory (48.9 GiB in bfloat16 at the released size) at the cost of
    encoding on the CPU; the embeddings are moved to the model's device. "auto" is decided at the first load
    (generator_service.backends.placement, ditcore.placement): the device when the model fits there at the largest
    canvas the limits admit, else offloaded (CUDA), else the CPU; a layout that fits none is refused at start naming
    the flags that would make it fit. `ditserve generate-local` reads "auto" as the --device."""
    text_encoder_offload: bool = flag(
        False, "keep the text encoder in pinned host memory, streamed to its CUDA device per encode"
    )
    """Keep the text encoder's weights in pinned host memory and copy them layer by layer to its (CUDA) device for
    each encode (diffusers' group offloading; the next layer's copy overlaps this layer's compute), so it holds no
    device memory between requests. Needs --text-encoder-device to resolve to CUDA."""
    max_queue_depth: int = flag(
        16, "requests waiting or running before RESOURCE_EXHAUSTED (default %(default)s)", low=1, high=100_000
    )
    """Requests waiting or running before Generate answers RESOURCE_EXHAUSTED."""
    max_message_bytes: int = flag(
        64 * MIB, "gRPC message limit in MiB (default %(default)s)", name="--max-message-mb", scale=MIB
    )
    """gRPC send/receive limit (`--max-message-mb`); a unary result above it must use GenerateStream."""
    chunk_bytes: int = 1024 * 1024
    """Tensor or media bytes per GenerateStream chunk (well under max_message_bytes)."""
    reconnect_s: float = 0.5
    """Pause between attempts to (re)attach to the sidecar."""
    prefetch: bool = flag(True, "do not prepare the next request's plans early", negate=True)
    """Prepare the next queued request's plans while the current one denoises (`--no-prefetch`: don't)."""
    workers: int = flag(32, "gRPC server threads, one per in-flight RPC (default %(default)s)", low=2, high=4096)
    """gRPC server threads: each in-flight RPC (a stream included, for as long as it runs) holds one."""
    control_workers: int = flag(
        4, "threads kept for Health, GetStatus and UpdateWeights: Generate and GenerateStream may hold at most "
        "--workers less this many less --upload-watch-workers (default %(default)s)", low=1, high=4095,
    )  # fmt: skip
    """Threads of `workers` that no streaming call takes: Health, GetStatus, UpdateWeights and reflection always
    find one, however many clients stall (generator_service.serving.streams). A Generate call beyond
    `workers - control_workers - upload_watch_workers` is refused at once (RESOURCE_EXHAUSTED, HANDLERS_BUSY)."""
    max_concurrent_rpcs: int = flag(
        256, "RPCs in flight before the server answers RESOURCE_EXHAUSTED itself (default %(default)s)",
        low=1, high=100_000,
    )  # fmt: skip
    """grpc's `maximum_concurrent_rpcs`: calls beyond it are refused by grpc before any handler runs (a bound on
    the calls, and their messages, waiting for a thread)."""
    max_streams_per_connection: int = flag(
        16, "concurrent calls one client connection may open (HTTP/2 max concurrent streams; default %(default)s)",
        low=1, high=10_000,
    )  # fmt: skip
    """HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS (`grpc.max_concurrent_streams`): one connection cannot take every
    handler by itself."""
    stream_stall_s: float = flag(
        30.0, "cancel a GenerateStream whose client has read nothing for this many seconds (default %(default)s)",
        low=0.1, high=86_400,
    )  # fmt: skip
    """A GenerateStream whose current message has waited this long for the client's flow-control window (the
    client stopped reading) is cancelled from the server side; its thread, queue slot and result are freed."""
    stream_transfer_s: float = flag(
        600.0, "cancel a GenerateStream whose result takes longer than this to send, header to last chunk "
        "(default %(default)s)", low=0.1, high=86_400,
    )  # fmt: skip
    """The bound on sending one result, from the result header to the last chunk (a client reading just fast
    enough never to stall still ends)."""
    upload_watch_workers: int = flag(
        8, "threads UploadReference and WatchJob may hold at once, taken from --workers beside --control-workers "
        "(default %(default)s)", low=1, high=4094,
    )  # fmt: skip
    """Threads of `workers` kept for UploadReference and WatchJob, whose calls last as long as their client sends or
    watches: more at once are refused (RESOURCE_EXHAUSTED, UPLOAD_WATCH_BUSY), and however many clients hold them
    idle, Generate, GenerateStream and GetJobContent keep their own `workers - control_workers -
    upload_watch_workers` threads (generator_service.serving.streams)."""
    upload_stall_s: float = flag(
        30.0, "end an UploadReference whose client sent nothing for this many seconds (default %(default)s)",
        low=0.1, high=86_400,
    )  # fmt: skip
    """An UploadReference that received no chunk for this long ends DEADLINE_EXCEEDED (RECEIVE_TIMEOUT); its slot
    and the bytes it had sent are freed."""
    upload_max_s: float = flag(
        300.0, "end an UploadReference still receiving after this many seconds (default %(default)s)",
        low=0.1, high=86_400,
    )  # fmt: skip
    """The bound on receiving one upload, from the call's start to its last chunk (a client sending just fast enough
    never to stall still ends): DEADLINE_EXCEEDED (RECEIVE_TIMEOUT), its bytes freed."""
    watch_max_s: float = flag(
        600.0, "end a WatchJob (OK) after this many seconds, its job final or not: the client watches again "
        "(default %(default)s)", low=0.1, high=86_400,
    )  # fmt: skip
    """How long one WatchJob call may last: it then ends OK with the job's last state sent, final or not, and a
    client that wants more watches again (a watch whose client stops reading is cancelled after
    `stream_stall_s`)."""
    admin_token: str = flag("", ADMIN_TOKEN_HELP, env=TOKEN_ENV)
    """Bearer token UpdateWeights requires (`--admin-token` or DITSERVE_ADMIN_TOKEN); empty = updates off.
    Also presented to a TCP sidecar, whose weight-update RPCs require the same token. At least 16 characters
    (ditruntime.auth.check_admin_token); the token in use is `admin_secret`."""
    admin_token_file: Path | None = flag(None, ADMIN_TOKEN_FILE_HELP)
    """A file holding the admin token instead (read once at start, stripped; refused when other users may read
    it): a Kubernetes Secret volume's key, kept out of the process's argv and environment."""
    allow_plaintext_admin: bool = flag(
        False, "accept UpdateWeights over plaintext from non-loopback peers (the token then crosses the network "
        "in cleartext)",
    )  # fmt: skip
    """Without TLS on the public port, UpdateWeights from a peer that is not loopback is refused
    (FAILED_PRECONDITION, PLAINTEXT_ADMIN_REFUSED; ditruntime.auth.check_admin_transport): its bearer token has
    crossed the network in cleartext. This accepts it anyway (a network that is itself encrypted, say)."""
    weights_root: Path | None = flag(None, "UpdateWeights paths must resolve inside this directory")
    """UpdateWeights paths must resolve inside this directory."""
    drain_timeout_s: float | None = flag(
        None, "update drain bound in seconds (default: the running request's modeled remaining time)", low=0
    )
    """How long an update waits for the running request before it aborts. None (the default): until the running
    request finishes, bounded by its own remaining time (steps left x its observed or modeled step time, x
    `step_time_factor`, + its decode, + 30 s)."""
    step_time_factor: float = flag(
        2.0, "safety factor on modeled and observed step times (default %(default)s)", low=1, high=100
    )
    """Multiplies the modeled step time (ditcore.sizing) in the step bound each PreparePlans carries (the larger of
    it and the slowest step observed on this server) and the remaining time a derived drain waits. 2: the model's
    assumed MFU may be off by that much before a bound is too short."""
    memory_check: bool = flag(
        True, "do not refuse requests whose modeled activation peak exceeds free memory", negate=True
    )
    """Refuse at admission (RESOURCE_EXHAUSTED, REQUEST_TOO_LARGE_FOR_DEVICE) a request whose modeled activation
    peak (ditcore.sizing), plus `memory_reserve_bytes`, exceeds the memory free on the model's device.
    `--no-memory-check` turns this off: a request that does not fit then fails out of memory while it runs."""
    memory_reserve_bytes: int = flag(
        1 * GB, "memory admission keeps this much free, in GB (default 1)", name="--memory-reserve-gb", scale=GB,
        flag_type=float, low=0,
    )  # fmt: skip
    """Bytes the memory check keeps free beyond the modeled peak: the allocator's fragmentation and the kernels'
    workspaces (cuBLAS, attention), which the model does not count."""
    metrics_port: int | None = flag(None, "serve Prometheus /metrics on this port (default off)")
    """Prometheus /metrics HTTP port (off when None)."""
    metrics_host: str = flag("", METRICS_HOST_HELP)
    """Host /metrics binds to; empty: the `listen` host (127.0.0.1 by default), so metrics are reachable exactly
    where the API is. The resolved host is `metrics_bind_host`."""
    reflection: bool = flag(True, REFLECTION_HELP, negate=True)
    """Serve gRPC server reflection (`--no-reflection`: don't; grpcurl then needs the .proto files)."""
    max_num_frames: int = flag(
        MAX_FRAMES, "operator limit on num_frames (default: H3's %(default)s)", low=MIN_FRAMES, high=MAX_FRAMES
    )
    """Largest `num_frames` served (H3's rule still applies: 17n + 5 in [124, 345])."""
    max_height: int = flag(
        RELEASED_MAX_SIDE, "operator limit on height in pixels (default: the released %(default)s)",
        low=CANVAS_MULTIPLE, high=MAX_SIDE,
    )  # fmt: skip
    """Largest `height` served, in pixels (a multiple of 32 still required). The default is the released canvas's
    long side (768 x 1344 in either orientation); raise it up to 4096 to serve larger canvases."""
    max_width: int = flag(
        RELEASED_MAX_SIDE, "operator limit on width in pixels (default: the released %(default)s)",
        low=CANVAS_MULTIPLE, high=MAX_SIDE,
    )  # fmt: skip
    """Largest `width` served, in pixels (a multiple of 32 still required)."""
    max_canvas_pixels: int = flag(
        RELEASED_MAX_PIXELS, "operator limit on height x width (default: the released 768 x 1344 = %(default)s)",
        low=CANVAS_MULTIPLE * CANVAS_MULTIPLE, high=MAX_PIXELS,
    )  # fmt: skip
    """Largest `height x width` served. With the side limits this is the released envelope by default; a larger
    canvas must also pass the memory check (`memory_check`)."""
    max_video_pixels: int = flag(
        RELEASED_MAX_VIDEO_PIXELS, "operator limit on height x width x num_frames (default: the released 768 x 1344 "
        "x 345 = %(default)s)", low=CANVAS_MULTIPLE * CANVAS_MULTIPLE * MIN_FRAMES, high=MAX_PIXELS * MAX_FRAMES,
    )  # fmt: skip
    """Largest decoded video served, in pixels x frames: what a decode's host memory (the uint8 frames, ~1.07 GB at
    the default) and its files scale with. Raising the side or area limits alone admits larger canvases only at fewer
    frames; raise this too for more."""
    max_prompt_bytes: int = flag(
        MAX_PROMPT_BYTES, "operator limit on prompt UTF-8 bytes (default %(default)s)", low=1, high=MAX_PROMPT_BYTES
    )
    """Longest `prompt` served, in UTF-8 bytes."""
    max_prompt_tokens: int = flag(
        MAX_PROMPT_TOKENS,
        "operator limit on a prompt's tokens, counted with the served model's tokenizer at admission (default "
        "%(default)s: every prompt within the byte limit)",
        low=1,
        high=MAX_PROMPT_TOKENS,
    )
    """Most tokens a `prompt` may be, as the served model's tokenizer counts them exactly as diffusers' text blocks
    call it (no truncation). The default admits every prompt within the byte limit (NFC can make UTF-8 text 3 times
    longer, and a byte-level BPE token is at least one byte); a lower value bounds the text encoder's pass and the
    text rows of every step."""
    max_keyframe_bytes: int = flag(
        MAX_KEYFRAME_BYTES,
        "operator limit on a keyframe's (first_frame / last_frame) size in MiB (default %(default)s)",
        name="--max-keyframe-mb",
        scale=MIB,
        low=MIB,
        high=MAX_KEYFRAME_BYTES,
    )
    """Largest keyframe (`first_frame`, `last_frame`) served, in bytes (`--max-keyframe-mb`). The whole request
    must also fit `--max-message-mb`."""
    max_reference_bytes: int = flag(
        DEFAULT_REFERENCE_LIMITS.max_bytes,
        "operator limit on one ref2va reference's size in MiB (default %(default)s)",
        name="--max-reference-mb", scale=MIB, low=MIB, high=MAX_REFERENCE_BYTES,
    )  # fmt: skip
    """Largest reference file (an image, video or audio clip) served, in bytes (`--max-reference-mb`)."""
    max_references_bytes: int = flag(
        DEFAULT_REFERENCE_LIMITS.max_total_bytes,
        "operator limit on a request's references together in MiB (default %(default)s)",
        name="--max-references-mb", scale=MIB, low=MIB, high=MAX_REFERENCES_BYTES,
    )  # fmt: skip
    """The bytes of all of a request's references together (`--max-references-mb`)."""
    max_reference_seconds: float = flag(
        DEFAULT_REFERENCE_LIMITS.max_seconds,
        "operator limit on a video or audio reference's duration in seconds, from its packets (default %(default)s)",
        low=0.5, high=MAX_REFERENCE_SECONDS,
    )  # fmt: skip
    """Longest video or audio reference served (diffusers conditions on at most the generated duration; a longer
    clip is decoded whole first, so this bounds the decode)."""
    max_reference_frame_pixels: int = flag(
        DEFAULT_REFERENCE_LIMITS.max_frame_pixels,
        "operator limit on a video reference's width x height (default %(default)s)",
        low=CANVAS_MULTIPLE * CANVAS_MULTIPLE, high=MAX_REFERENCE_FRAME_PIXELS,
    )  # fmt: skip
    """Largest video-reference frame served, in pixels: checked from the stream header and the first frame at
    admission, and every decoded frame is then held to the probed size (ditcore.reference_decode)."""
    max_reference_decoded_bytes: int = flag(
        DEFAULT_REFERENCE_LIMITS.max_decoded_bytes,
        "operator limit on one video or audio reference decoded into host memory, in MiB (default %(default)s)",
        name="--max-reference-decoded-mb", scale=MIB, low=MIB, high=MAX_REFERENCE_DECODED_BYTES,
    )  # fmt: skip
    """What one decoded reference may weigh (a video's uint8 frames, an audio clip's float32 samples)."""
    adapter_dir: Path | None = flag(
        None, "directory of adapters (LoRA *.safetensors, each named by its stem, with an optional NAME.json "
        "contract) a request may name (default: none)",
    )  # fmt: skip
    """Adapters (ditcore.adapters): every `*.safetensors` here, named by its file stem, in any layout diffusers'
    MiniMax-H3 loader converts; `NAME.json` beside it (or the file's `__metadata__` entry `ditserve_contract`)
    declares what it may be sampled with. Read when first named, and again when the file changes (a new identity).
    Every rank of a replica reads the same directory."""
    quality_levels: Path | None = flag(
        None, "TOML file of quality levels a request may name: each a step cache (diffusers' FirstBlockCache, "
        "TaylorSeer, MagCache) and what it may run with (default: lossless only; docs/quality.md)",
    )  # fmt: skip
    """ditcore.quality: read at start (a bad file refuses the start, naming the level and key); `lossless` is always
    served and is every request's default. Every rank of a replica reads the same file."""
    quality_audit_dir: Path | None = flag(
        None, "directory of quality audits (NAME.jsonl, written by ditserve audit-quality) that say which requests "
        "each level covers (default: none: every level is unaudited)",
    )  # fmt: skip
    """A level's `unaudited` policy decides what a request no passing audit covers gets: refused (the default,
    FAILED_PRECONDITION QUALITY_NOT_AUDITED) or served with a warning in its response."""
    max_adapters_per_request: int = flag(
        MAX_ADAPTERS, "adapters one request may compose (default %(default)s)", low=1, high=64
    )
    """More in one request is INVALID_ARGUMENT naming the flag."""
    max_loaded_adapters: int = flag(8, "adapters the model holds loaded at once (default %(default)s)", low=1, high=256)
    """The least recently used is deleted from the model (PEFT layers) first; a request loads its own on first use."""
    max_loaded_adapter_bytes: int = flag(
        8 * 1024 * MIB, "what the loaded adapters may hold on the device together, in MiB (default %(default)s)",
        name="--max-loaded-adapter-mb", scale=MIB, low=1 * MIB, high=1024 * 1024 * MIB,
    )  # fmt: skip
    """LoRA factors at the transformer's dtype and full-parameter deltas as stored (a cached model: the trunk's only).
    The least recently used are deleted until a new one fits; one that alone exceeds it is FAILED_PRECONDITION. The
    memory-aware admission counts what a request's not-yet-loaded adapters will hold."""
    max_upload_bytes: int = flag(
        1024 * MIB, "UploadReference: bytes held for uploads at once, in MiB; 0 turns uploads off (default "
        "%(default)s)", name="--max-upload-mb", scale=MIB, low=0, high=64 * 1024 * MIB,
    )  # fmt: skip
    """Memory the uploaded references may hold together (`--max-upload-mb`), the bytes of uploads still being
    received counted with the stored ones: the chunk that would go over it is refused RESOURCE_EXHAUSTED
    (UPLOAD_CAPACITY; expired uploads are dropped first) and that upload's bytes are freed."""
    upload_ttl_s: float = flag(
        600.0, "seconds an uploaded reference is kept (default %(default)s)", low=1.0, high=7 * 24 * 3600.0
    )
    """How long an UploadReference's bytes stay for requests to name them (`--upload-ttl-s`)."""
    max_keyframe_pixels: int = flag(
        MAX_KEYFRAME_PIXELS,
        "operator limit on a keyframe's width x height, checked before decoding (default %(default)s)",
        low=1,
        high=MAX_KEYFRAME_PIXELS,
    )
    """Largest keyframe served, in pixels (width x height from the image header; the decompression-bomb guard)."""
    tls_cert: Path | None = flag(None, "PEM certificate: serve the public port over TLS")
    """PEM server certificate for the public port (TLS when set, with tls_key)."""
    tls_key: Path | None = flag(None, "PEM private key of --tls-cert")
    """PEM private key of tls_cert."""
    tls_client_ca: Path | None = flag(None, "PEM CA: require client certificates (mutual TLS)")
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)."""
    client_keys_file: Path | None = flag(
        None, "per-client bearer keys, one 'NAME KEY' per line (mode 0600): the Jobs API then needs a key, and "
        "each client sees only its own jobs",
    )  # fmt: skip
    """Per-client bearer keys (ditruntime.auth.read_client_keys). The Jobs API authenticates whenever any
    credential is configured (this file, --admin-token, or --tls-client-ca): a Jobs RPC then needs `authorization:
    Bearer <key>` (a key of this file: the client is its NAME; the admin token: the admin, who sees every job) or a
    client certificate (the client is `tls:<its common name>`), else UNAUTHENTICATED. Each job belongs to the client
    that created it: other clients' jobs are NOT_FOUND to it, and idempotency keys are per client. With none
    configured every caller is `anonymous`."""
    sidecar_tls_ca: Path | None = flag(
        None, "PEM CA that signed a TCP sidecar's certificate (required with TCP --sidecar)"
    )
    """TCP sidecar only: verify the sidecar's certificate against this CA (mutual TLS)."""
    sidecar_tls_cert: Path | None = flag(
        None, "PEM client certificate presented to a TCP sidecar (required with TCP --sidecar)"
    )
    """TCP sidecar only: the generator's client certificate (signed by the sidecar's --tls-client-ca)."""
    sidecar_tls_key: Path | None = flag(None, "PEM private key of --sidecar-tls-cert (required with TCP --sidecar)")
    """TCP sidecar only: the PEM private key of sidecar_tls_cert."""
    jobs: JobsConfig = field(default_factory=JobsConfig)
    """The jobs API: its store, results and retention (generator_service.jobs.config)."""

    @property
    def sidecar_tls_given(self) -> bool:
        return any(f is not None for f in (self.sidecar_tls_ca, self.sidecar_tls_cert, self.sidecar_tls_key))

    @property
    def sidecar_tcp(self) -> bool:
        """The sidecar target is TCP (mutual TLS + admin token), not a unix socket (peer uid)."""
        return bool(self.sidecar) and not self.sidecar.startswith("unix")

    @property
    def metrics_bind_host(self) -> str:
        """Where /metrics binds: `metrics_host`, else the host of `listen`."""
        return self.metrics_host or listen_host(self.listen)

    @cached_property
    def admin_secret(self) -> str:
        """The admin token in use: `admin_token`, or `admin_token_file`'s contents (read once, checked at start)."""
        return resolve_admin_token(self.admin_token, self.admin_token_file)

    @property
    def limits(self) -> RequestLimits:
        """The operator limits every request is validated against (H3's own rules included)."""
        return RequestLimits(
            self.max_num_frames,
            self.max_height,
            self.max_width,
            self.max_prompt_bytes,
            max_keyframe_bytes=self.max_keyframe_bytes,
            max_keyframe_pixels=self.max_keyframe_pixels,
            max_pixels=self.max_canvas_pixels,
            max_prompt_tokens=self.max_prompt_tokens,
            max_video_pixels=self.max_video_pixels,
            max_reference_bytes=self.max_reference_bytes,
            max_references_bytes=self.max_references_bytes,
            max_reference_seconds=self.max_reference_seconds,
            max_reference_frame_pixels=self.max_reference_frame_pixels,
            max_reference_decoded_bytes=self.max_reference_decoded_bytes,
            max_adapters=self.max_adapters_per_request,
        )

    @property
    def client_keys(self) -> dict[str, str]:
        """Key -> client name from `client_keys_file` (empty when unset)."""
        return read_client_keys(self.client_keys_file) if self.client_keys_file is not None else {}

    @property
    def run_options(self) -> RunOptions:
        """How every model this generator loads runs: its attention backend and decode dtype."""
        te = TextEncoderPlacement(self.text_encoder_device, self.text_encoder_offload)
        return RunOptions(self.attention_backend, self.decode_dtype, te, self.partitions, self.adapter_registry,
                          self.max_loaded_adapters, self.max_loaded_adapter_bytes,
                          adapter_plans=self.adaln_mode == "cached", quality=self.quality)  # fmt: skip

    @cached_property
    def quality(self) -> QualityLevels:
        """--quality-levels as read (lossless only without it), with --quality-audit-dir's audits."""
        from ditcore.quality import QualityLevels

        return QualityLevels.load(self.quality_levels, self.quality_audit_dir)

    @cached_property
    def adapter_registry(self) -> AdapterRegistry | None:
        """--adapter-dir's registry, one per generator (every model it loads reads it)."""
        if self.adapter_dir is None:
            return None
        from ditcore.adapters import AdapterRegistry

        return AdapterRegistry(self.adapter_dir)

    def rank_device(self, local_rank: int) -> str:
        """The device of the replica rank with this LOCAL_RANK (--devices, else --device)."""
        listed = [d.strip() for d in self.devices.split(",") if d.strip()]
        if not listed:
            return self.device
        if not 0 <= local_rank < len(listed):
            raise ValueError(f"--devices lists {len(listed)} device(s); LOCAL_RANK {local_rank} has none")
        return listed[local_rank]

    def parallel_spec(self, ranks: Ranks, device: torch.device) -> ParallelSpec:
        """The replica's layout on `ranks` (0 degrees: ditcore.parallel.default_layout for `device`'s backend)."""
        return default_layout(ranks, collective_backend(device), self.ulysses_degree, self.ring_degree)

    @property
    def request_handlers(self) -> int:
        """Threads Generate, GenerateStream and GetJobContent may hold at once."""
        return self.workers - self.control_workers - self.upload_watch_workers

    @property
    def sizing(self) -> SizingPolicy:
        """How admission and the drain use the memory and time model."""
        return SizingPolicy(self.memory_check, self.memory_reserve_bytes, self.step_time_factor)

    def __post_init__(self) -> None:
        if not self.replica_timeout_s >= REPLICA_TIMEOUT_MIN_S:  # NaN too
            raise ValueError(
                f"--replica-timeout-s must be at least {REPLICA_TIMEOUT_MIN_S:g} s, got {self.replica_timeout_s:g}: an "
                f"idle replica's ranks wait in a collective for rank 0's keep-alive, sent every {KEEPALIVE_S:g} s, so "
                "a shorter timeout breaks every idle replica, which then restarts again and again"
            )
        check_bounds(self)
        _ = self.admin_secret  # a short token or an unreadable --admin-token-file is refused now
        _ = self.client_keys  # so is a bad --client-keys-file
        from ditcore.quality import QualityLevelsError

        try:
            _ = self.quality  # and a bad --quality-levels file
        except QualityLevelsError as e:
            raise ValueError(f"--quality-levels: {e}") from e
        try:
            check_name(self.attention_backend)  # diffusers' names; whether it runs on the device is checked at start
        except ValueError as e:
            raise ValueError(f"--attention-backend: {e}") from e
        if self.decode_dtype not in (AUTO, *DECODE_DTYPES):
            raise ValueError(
                f"--decode-dtype must be one of {', '.join((AUTO, *DECODE_DTYPES))}, got {self.decode_dtype!r}"
            )
        text_encoder = TextEncoderPlacement(self.text_encoder_device, self.text_encoder_offload)  # checks the choice
        if self.text_encoder_offload:  # where it resolves to (CUDA availability is checked at load)
            text_encoder.check(torch.device(self.device))
        for d in (x.strip() for x in self.devices.split(",") if x.strip()):
            if not (d == "cpu" or d.startswith("cuda")):
                raise ValueError(f"--devices must list 'cpu' or 'cuda[:N]' devices, got {d!r} in {self.devices!r}")
        if self.adaln_mode not in ("cached", "resident"):
            raise ValueError(f"--adaln-mode must be cached or resident, got {self.adaln_mode!r}")
        if self.adaln_mode == "resident" and self.checkpoint is None:
            raise ValueError("--checkpoint is required with --adaln-mode resident")
        if self.adaln_mode == "cached" and not self.sidecar:
            raise ValueError("--sidecar is required with --adaln-mode cached")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        check_tls_flags(
            {
                "--sidecar-tls-ca": self.sidecar_tls_ca,
                "--sidecar-tls-cert": self.sidecar_tls_cert,
                "--sidecar-tls-key": self.sidecar_tls_key,
            },
            required=self.adaln_mode == "cached" and (self.sidecar_tcp or self.sidecar_tls_given),
            needed_by=f"--sidecar {self.sidecar} (TCP)" if self.sidecar_tcp else "a TCP sidecar of another node",
            stray="apply only in cached mode (to a TCP --sidecar HOST:PORT, or the TCP sidecars of a multi-node "
            "replica's other nodes)",
        )
        if self.control_workers + self.upload_watch_workers >= self.workers:
            raise ValueError(
                f"--control-workers ({self.control_workers}) plus --upload-watch-workers ({self.upload_watch_workers}) "
                f"must be less than --workers ({self.workers}): Generate needs at least one thread"
            )
        if not 1024 <= self.chunk_bytes < self.max_message_bytes:
            raise ValueError("chunk_bytes must be in [1024, max_message_bytes (--max-message-mb))")
