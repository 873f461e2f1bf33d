"""Request input/output shared by `generate-local` and `generate`: flags, JSONL, result files.

The request flags and the JSONL keys are `ditcore.GenerationRequest`'s fields (`--num-inference-steps` is the key
`num_inference_steps`); omitted keys take the flag values, whose defaults are GenerationRequest's. Every request is
validated against MiniMax-H3's rules before any runs, so bad input writes nothing.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from ditcore import H3_LIMITS, GenerationRequest, GenerationResult, RequestError, RequestLimits
from ditcore.request import MAX_FRAMES, MAX_STEPS, MIN_FRAMES, MIN_STEPS, TASKS
from ditruntime.paths import prepare_dir

_DEFAULTS = GenerationRequest()
REQUEST_FIELDS = (
    "task",
    "prompt",
    "num_inference_steps",
    "flow_shift",
    "audio_flow_shift",
    "seed",
    "height",
    "width",
    "num_frames",
)
"""GenerationRequest fields that have a flag of the same name (request_id has its own default rule)."""


def add_request_flags(p: argparse.ArgumentParser) -> None:
    """Single-request flags; their defaults are GenerationRequest's."""
    g = p.add_argument_group("request (with --requests, the defaults of every line)")
    g.add_argument("--requests", metavar="FILE.jsonl", help="run every request of a JSONL file, in order")
    g.add_argument("--request-id", default=None, help="request id (default req-<index>)")
    g.add_argument("--task", default=_DEFAULTS.task, help=f"one of {', '.join(TASKS)} (default %(default)s)")
    g.add_argument("--prompt", default=_DEFAULTS.prompt, help="the text, non-empty, presented verbatim")
    g.add_argument(
        "--num-inference-steps",
        type=int,
        default=_DEFAULTS.num_inference_steps,
        help=f"schedule grid points in [{MIN_STEPS}, {MAX_STEPS}]; N points run N - 1 forwards (default %(default)s)",
    )
    g.add_argument(
        "--flow-shift", type=float, default=_DEFAULTS.flow_shift, help="video schedule shift (default %(default)s)"
    )
    g.add_argument(
        "--audio-flow-shift",
        type=float,
        default=_DEFAULTS.audio_flow_shift,
        help="audio schedule shift (default %(default)s)",
    )
    g.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="noise seed (default %(default)s)")
    g.add_argument(
        "--height", type=int, default=_DEFAULTS.height, help="pixels, a multiple of 32 (default %(default)s)"
    )
    g.add_argument("--width", type=int, default=_DEFAULTS.width, help="pixels, a multiple of 32 (default %(default)s)")
    g.add_argument(
        "--num-frames",
        type=int,
        default=_DEFAULTS.num_frames,
        help=f"frames at 24 fps, 17n + 5 in [{MIN_FRAMES}, {MAX_FRAMES}] (default %(default)s)",
    )
    g.add_argument("--out", default=None, help="write each result as OUT/<request_id>.safetensors")


def _defaults_from_args(args: argparse.Namespace) -> GenerationRequest:
    return GenerationRequest(**{name: getattr(args, name) for name in REQUEST_FIELDS})


def requests_from_args(args: argparse.Namespace) -> list[GenerationRequest]:
    """The requests a command will run (not yet validated)."""
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
    except UnicodeDecodeError as e:
        raise RequestError("requests", f"{path} is not UTF-8 text ({e.reason})") from e
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


def validate_all(requests: Sequence[GenerationRequest], limits: RequestLimits = H3_LIMITS) -> None:
    """Validate every request and the uniqueness of their ids before anything runs."""
    seen: set[str] = set()
    for r in requests:
        r.validate(limits)
        if r.request_id in seen:
            raise RequestError("request_id", f"duplicate request_id {r.request_id!r}; ids must be unique")
        seen.add(r.request_id)


def result_line(result: GenerationResult, request: GenerationRequest, **extra: Any) -> str:
    """The one JSON line printed per request by every generate command."""
    line: dict[str, Any] = {
        "request_id": result.request_id,
        "task": request.task,
        "num_inference_steps": request.num_inference_steps,
        "sha256": result.sha256,
        "video_shape": list(result.video.shape),
        "audio_shape": list(result.audio.shape),
        "timings_ms": result.timings_ms,
    }
    line.update(extra)
    if result.cache is not None:
        line["cache"] = result.cache.to_dict()
    return json.dumps(line, sort_keys=False)


def write_result(out_dir: Path, result: GenerationResult, request: GenerationRequest) -> Path:
    """OUT/<request_id>.safetensors with tensors `video` and `audio`; metadata = the request (JSON values) + sha256."""
    prepare_dir(out_dir, "--out")
    tensors = {"video": result.video.contiguous(), "audio": result.audio.contiguous()}
    meta = {k: json.dumps(v) for k, v in request.to_dict().items()}
    meta["sha256"] = result.sha256
    path = out_dir / f"{result.request_id}.safetensors"
    save_file(tensors, str(path), metadata=meta)
    return path
