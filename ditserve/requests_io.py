"""Request input/output shared by `generate-local` and `generate`: flags, JSONL, result files.

The JSONL keys are the request flag names with underscores; omitted keys take the flag
defaults. Every request is validated before any runs, so bad input writes nothing.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from ditcore import DiTConfig, GenerationRequest, GenerationResult, RequestError

_DEFAULTS = GenerationRequest()


def add_request_flags(p: argparse.ArgumentParser) -> None:
    """Single-request flags; their defaults are GenerationRequest's."""
    g = p.add_argument_group("request (ignored with --requests, where they become per-line defaults)")
    g.add_argument("--requests", metavar="FILE.jsonl", help="run every request of a JSONL file, in order")
    g.add_argument("--request-id", default=None, help="request id (default req-<index>)")
    g.add_argument("--task", default=_DEFAULTS.task, help="t2v or t2va (default %(default)s)")
    g.add_argument("--prompt", default=_DEFAULTS.prompt)
    g.add_argument("--negative-prompt", default=_DEFAULTS.negative_prompt)
    g.add_argument("--steps", type=int, default=_DEFAULTS.steps, help="[1, 1000] (default %(default)s)")
    g.add_argument("--flow-shift", type=float, default=_DEFAULTS.flow_shift, help="(default %(default)s)")
    g.add_argument("--audio-flow-shift", type=float, default=None, help="t2va audio shift (default: --flow-shift)")
    g.add_argument("--guidance-scale", type=float, default=_DEFAULTS.guidance_scale, help="<=1 disables CFG")
    g.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    g.add_argument("--frames", type=int, default=_DEFAULTS.frames, help="4k+1 pixel frames")
    g.add_argument("--height", type=int, default=_DEFAULTS.height, help="pixels, multiple of 16")
    g.add_argument("--width", type=int, default=_DEFAULTS.width, help="pixels, multiple of 16")
    g.add_argument("--audio-length", type=int, default=_DEFAULTS.audio_length, help="audio latent frames (t2va)")
    g.add_argument("--out", default=None, help="write each result as OUT/<request_id>.safetensors")


def _defaults_from_args(args: argparse.Namespace) -> GenerationRequest:
    return GenerationRequest(
        task=args.task,
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        steps=args.steps,
        flow_shift=args.flow_shift,
        audio_flow_shift=args.audio_flow_shift,
        guidance_scale=args.guidance_scale,
        seed=args.seed,
        frames=args.frames,
        height=args.height,
        width=args.width,
        audio_length=args.audio_length,
    )


def requests_from_args(args: argparse.Namespace) -> list[GenerationRequest]:
    """The requests a command will run (not yet validated against a model config)."""
    defaults = _defaults_from_args(args)
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise RequestError("out", f"--out {args.out} exists and is not a directory")
    if not args.requests:
        return [GenerationRequest.from_dict({"request_id": args.request_id or "req-0"}, defaults)]
    path = Path(args.requests)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise RequestError("requests", f"cannot read {path}: {e.strerror or e}") from e
    out: list[GenerationRequest] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestError("requests", f"{path}:{n}: not valid JSON ({e.msg})") from e
        if not isinstance(data, dict):
            raise RequestError("requests", f"{path}:{n}: each line must be a JSON object")
        data.setdefault("request_id", f"req-{len(out)}")
        try:
            out.append(GenerationRequest.from_dict(data, defaults))
        except RequestError as e:
            raise RequestError(e.field, f"{path}:{n}: {e.description}") from e
    if not out:
        raise RequestError("requests", f"{path} holds no requests")
    return out


def validate_all(requests: Sequence[GenerationRequest], config: DiTConfig) -> None:
    """Validate every request and the uniqueness of their ids before anything runs."""
    seen: set[str] = set()
    for r in requests:
        r.validate(config)
        if r.request_id in seen:
            raise RequestError("request_id", f"duplicate request_id {r.request_id!r}; ids must be unique")
        seen.add(r.request_id)


def result_line(result: GenerationResult, request: GenerationRequest, **extra: Any) -> str:
    """The one JSON line printed per request by every generate command."""
    line: dict[str, Any] = {
        "request_id": result.request_id,
        "task": request.task,
        "steps": request.steps,
        "sha256": result.sha256,
        "video_shape": list(result.video.shape),
        "audio_shape": list(result.audio.shape) if result.audio is not None else None,
        "timings_ms": result.timings_ms,
    }
    line.update(extra)
    if result.cache is not None:
        line["cache"] = result.cache.to_dict()
    return json.dumps(line, sort_keys=False)


def write_result(out_dir: Path, result: GenerationResult, request: GenerationRequest) -> Path:
    """OUT/<request_id>.safetensors with tensors `video` (and `audio`); metadata = the request."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {"video": result.video.contiguous()}
    if result.audio is not None:
        tensors["audio"] = result.audio.contiguous()
    meta = {k: json.dumps(v) for k, v in request.to_dict().items()}
    meta["sha256"] = result.sha256
    path = out_dir / f"{result.request_id}.safetensors"
    save_file(tensors, str(path), metadata=meta)
    return path
