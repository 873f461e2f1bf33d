"""`ditserve generate --target HOST:PORT`, `status`, `adapters` and `update-weights`: the command line's gRPC clients.

`generate` prints the same JSON line per request as `generate-local` (plus `generation`), writes results where
`--out` says (outputs.py: latents as safetensors, or the service's MP4 / ZIP as received, after the client has checked
its size and sha256), and shows a progress bar on stderr (progress.py): the steps, "decode+mux" from the stream's
decoding event, then the bytes received. The server validates each request (its operator limits may be tighter
than MiniMax-H3's); INVALID_ARGUMENT exits 2, other failures 1.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from ditcore.request import GenerationRequest
from ditruntime.auth import ADMIN_TOKEN_ENV, bearer_metadata, is_loopback_host, listen_host, read_token_file

from .client import GeneratorClient
from .client_results import ClientResult, IntegrityError
from .errors import UsageError
from .outputs import write_output
from .progress import Progress, progress_enabled
from .requests_io import prepare_run, result_line


class RemoteError(Exception):
    """A request failed at the server; carries the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


def run_one(
    client: GeneratorClient, req: GenerationRequest, expected_generation: int | None, show_progress: bool = False,
    unset: frozenset[str] = frozenset(),
) -> ClientResult:  # fmt: skip
    with Progress(req.request_id, show_progress, decodes=False) as bar:

        def progress(kind: str, payload: Any) -> None:
            if bar.bar is None:
                return
            if kind == "plans_ready":
                bar.bar.set_postfix_str(
                    f"built {payload.built_plans} host {payload.host_hit_plans} hit {payload.gpu_hit_plans}"
                )
            elif kind == "step":
                bar.step(*payload)
            elif kind == "decoding":
                bar.stage("decode+mux")
            elif kind == "receiving":
                bar.transfer(*payload)

        try:
            return client.generate(req, expected_generation=expected_generation, progress=progress, unset=unset)
        except grpc.RpcError as e:
            raise RemoteError(e.code(), e.details() or "") from e


def add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=None, help="PEM CA to verify the server (enables TLS)")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", default=None, help="PEM key of --tls-cert")


def credentials_from_args(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS from --tls-ca (and mutual TLS from --tls-cert / --tls-key); None: plaintext."""
    if not (args.tls_ca or args.tls_cert):
        return None

    def read(p: str | None) -> bytes | None:
        return Path(p).read_bytes() if p else None

    return grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key), read(args.tls_cert))


API_KEY_ENV = "DITSERVE_API_KEY"
"""The environment variable the Jobs commands read their client key from (`--api-key-file` wins)."""


def add_api_key_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key-file", default=None,
        help=f"read this client's key (a --client-keys-file key of the server) from this file (default: ${API_KEY_ENV}, "
        f"else ${ADMIN_TOKEN_ENV})",
    )  # fmt: skip


def api_key_metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """`authorization: Bearer` metadata for the Jobs API: --api-key-file's key, else $DITSERVE_API_KEY, else the
    admin token ($DITSERVE_ADMIN_TOKEN: sees every job; sent only over TLS or to a loopback target, never in
    cleartext across a network); none when none is set (a server without authentication)."""
    key = ""
    if getattr(args, "api_key_file", None):
        try:
            key = read_token_file(Path(args.api_key_file), "--api-key-file")
        except ValueError as e:
            raise UsageError(str(e)) from e
    key = key or os.environ.get(API_KEY_ENV, "")
    tls = bool(getattr(args, "tls_ca", None) or getattr(args, "tls_cert", None))
    if not key and (tls or is_loopback_host(listen_host(args.target))):
        key = os.environ.get(ADMIN_TOKEN_ENV, "")
    return bearer_metadata(key) if key else ()


def client_from_args(args: argparse.Namespace) -> GeneratorClient:
    return GeneratorClient(args.target, credentials=credentials_from_args(args))


def add_admin_token_flags(p: argparse.ArgumentParser) -> None:
    """The admin token's flags (update-weights, adapters load / unload, audit-quality)."""
    p.add_argument("--token", default=None, help="admin token (default: $DITSERVE_ADMIN_TOKEN); visible in ps")
    p.add_argument("--token-file", default=None, help="read the admin token from this file (not readable by others)")
    p.add_argument(
        "--allow-plaintext-admin", action="store_true",
        help="send the token without TLS to a target that is not loopback (it then crosses the network in cleartext)",
    )  # fmt: skip


def admin_token_of(args: argparse.Namespace) -> str:
    """`--token`, or the contents of `--token-file` (UsageError for both, or for a file others may read)."""
    if args.token and args.token_file:
        raise UsageError("give --token or --token-file, not both")
    if args.token_file:
        try:
            return read_token_file(Path(args.token_file), "--token-file")
        except ValueError as e:
            raise UsageError(str(e)) from e
    return str(args.token or "")


def check_token_transport(args: argparse.Namespace) -> None:
    """The admin token never leaves this machine in cleartext: without TLS (--tls-ca / --tls-cert) the target must
    be loopback (the server refuses such an update from beyond loopback anyway, after the token has crossed), unless
    --allow-plaintext-admin."""
    if args.tls_ca or args.tls_cert or args.allow_plaintext_admin:
        return
    host = listen_host(args.target)
    if not is_loopback_host(host):
        raise UsageError(
            f"refusing to send the admin token in cleartext to {host}: give --tls-ca (TLS), or "
            "--allow-plaintext-admin to send it anyway"
        )


def check_client_args(args: argparse.Namespace) -> None:
    """The values a proto field or a deadline could not carry: exit 2 before any call."""
    expected = getattr(args, "expected_generation", None)
    if expected is not None and expected < 0:
        raise UsageError(f"--expected-generation must be >= 0, got {expected}")
    timeout = getattr(args, "timeout_s", None)
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"--timeout-s must be finite and > 0, got {timeout}")


def cmd_generate(args: argparse.Namespace) -> int:
    check_client_args(args)
    requests, target, unset = prepare_run(args)
    show = progress_enabled(args.progress)
    with client_from_args(args) as client:
        for req, left in zip(requests, unset, strict=True):
            try:
                res = run_one(client, req, args.expected_generation, show, left)
            except RemoteError as e:
                print(f"ditserve generate: request {req.request_id} failed: {e}", file=sys.stderr)
                return 2 if e.code == grpc.StatusCode.INVALID_ARGUMENT else 1
            except IntegrityError as e:
                print(f"ditserve generate: request {req.request_id}: bad result: {e}", file=sys.stderr)
                return 1
            shapes = None
            if res.media is None:
                assert res.video is not None and res.audio is not None  # checked by the client for latents
                shapes = (res.video.shape, res.audio.shape)
            files = write_output(target.path_for(req), req, res.media, res)
            extra = {"generation": res.generation, "adaln_mode": res.adaln_mode, **files}
            if res.quality != "lossless":
                extra.update(
                    quality=res.quality, blocks_skipped=res.blocks_skipped, quality_warning=res.quality_warning
                )
            print(result_line(req, res.sha256, res.timings_ms, res.cache, shapes, **extra), flush=True)
    return 0


def _call(args: argparse.Namespace, command: str, call: Callable[[Any], Any]) -> Any:
    """`call(client)` on a client of --target; None (the failure on stderr) when the RPC fails."""
    check_client_args(args)
    with client_from_args(args) as client:
        try:
            return call(client)
        except grpc.RpcError as e:
            print(f"ditserve {command}: failed: {e.code().name}: {e.details()}", file=sys.stderr)
            return None


def cmd_status(args: argparse.Namespace) -> int:
    """The generator's GetStatus as one JSON object on stdout (proto field names); exit 1 when the call fails."""
    import json

    from google.protobuf.json_format import MessageToDict

    resp = _call(args, "status", lambda client: client.status(timeout=args.timeout_s))
    if resp is None:
        return 1
    print(json.dumps(MessageToDict(resp, preserving_proto_field_name=True), sort_keys=True))
    return 0


def cmd_adapters(args: argparse.Namespace) -> int:
    """The generator's ListAdapters: a table (one row per adapter, then the refused files with why), or with --json
    the response as one JSON object (proto field names); exit 1 when the call fails. `load NAME` / `unload NAME`:
    LoadAdapter / UnloadAdapter with the admin token (as update-weights reads it), the response as one JSON line;
    exit 2 for INVALID_ARGUMENT, 1 for any other failure."""
    import json

    from google.protobuf.json_format import MessageToDict

    if args.action != "list":
        return _adapter_admin(args)
    if args.name is not None or args.identity is not None:
        raise UsageError("ditserve adapters (list) takes no NAME nor --identity: `adapters load NAME` loads one")
    if args.timeout_s is None:
        args.timeout_s = 10.0
    resp = _call(args, "adapters", lambda client: client.list_adapters(timeout=args.timeout_s))
    if resp is None:
        return 1
    if args.json:
        data = MessageToDict(resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        print(json.dumps(data, sort_keys=True))
    else:
        print(adapters_table(resp), flush=True)
    return 0


def _adapter_admin(args: argparse.Namespace) -> int:
    """`ditserve adapters load|unload NAME`: one JSON line (proto field names) on success."""
    import json

    from google.protobuf.json_format import MessageToDict

    if not args.name:
        raise UsageError(f"ditserve adapters {args.action} needs NAME: the adapter (its file's stem)")
    if args.action == "unload" and args.identity is not None:
        raise UsageError("--identity is load's: unload deletes every identity of NAME")
    if args.timeout_s is None:
        args.timeout_s = 600.0
    check_client_args(args)
    token = admin_token_of(args) or os.environ.get(ADMIN_TOKEN_ENV, "")
    if token:
        check_token_transport(args)
    with client_from_args(args) as client:
        try:
            if args.action == "load":
                resp = client.load_adapter(args.name, args.identity or "", token, timeout=args.timeout_s)
            else:
                resp = client.unload_adapter(args.name, token, timeout=args.timeout_s)
        except grpc.RpcError as e:
            print(f"ditserve adapters {args.action}: failed: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    data = MessageToDict(resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    print(json.dumps(data, sort_keys=True), flush=True)
    return 0


def contract_summary(c: Any) -> str:
    """An AdapterContract in one cell: its scale range, then each rule it declares (steps, shifts, tasks, defaults)."""
    parts = [f"scale [{c.scale_min:g}, {c.scale_max:g}]"]
    for label, values in (("steps", c.steps), ("flow_shift", c.flow_shifts), ("audio_flow_shift", c.audio_flow_shifts),
                          ("tasks", c.tasks)):  # fmt: skip
        if values:
            parts.append(f"{label} {','.join(v if isinstance(v, str) else f'{v:g}' for v in values)}")
    for name in ("default_steps", "default_flow_shift", "default_audio_flow_shift"):
        if c.HasField(name):
            parts.append(f"{name.removeprefix('default_')}={getattr(c, name):g} by default")
    return "; ".join(parts)


def adapters_table(resp: Any) -> str:
    """A ListAdaptersResponse as text: a header and a row per adapter (targets: trunk/modulation/time modules), then
    each refused file with why."""
    header = ("NAME", "PARTITION", "RANK", "TARGETS t/m/time", "LOADED", "IDENTITY", "CONTRACT")
    rows = [
        (a.name, a.partition, str(a.rank), f"{a.targets.trunk}/{a.targets.modulation}/{a.targets.time}",
         "yes" if a.loaded else "no", a.identity[:12], contract_summary(a.contract))
        for a in resp.adapters
    ]  # fmt: skip
    lines = []
    if rows:
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header) - 1)]
        for r in (header, *rows):
            lines.append("  ".join([*(cell.ljust(w) for cell, w in zip(r, widths, strict=False)), r[-1]]))
    else:
        lines.append("no adapters (the generator serves those of its --adapter-dir)")
    if resp.refused:
        lines.append("refused:")
        lines.extend(f"  {r.name}: {r.message}" for r in resp.refused)
    return "\n".join(lines)


def cmd_update_weights(args: argparse.Namespace) -> int:
    """One JSON line with generation, previous_generation, weights_path (and more) on success."""
    import json
    import os

    from protos.ditserve.generator.v1 import generator_pb2 as pb

    check_client_args(args)
    token = admin_token_of(args) or os.environ.get("DITSERVE_ADMIN_TOKEN", "")
    if token:
        check_token_transport(args)
    metadata = bearer_metadata(token) if token else ()
    req = pb.UpdateWeightsRequest(weights_path=args.path, request_id=args.request_id or "")
    if args.expected_generation is not None:
        req.expected_generation = args.expected_generation
    with client_from_args(args) as client:
        try:
            resp = client.stub.UpdateWeights(req, metadata=metadata, timeout=args.timeout_s)
        except grpc.RpcError as e:
            print(f"ditserve update-weights: failed: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    print(
        json.dumps(
            {
                "generation": resp.generation,
                "previous_generation": resp.previous_generation,
                "weights_path": resp.weights_path,
                "fingerprint": resp.fingerprint,
                "phase_ms": dict(resp.phase_ms),
                "kept_partitions": list(resp.kept_partitions),
            }
        ),
        flush=True,
    )
    return 0
