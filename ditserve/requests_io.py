"""Request input shared by `generate-local` and `generate`: flags, JSONL, keyframe files, the JSON line.

The request flags and the JSONL keys are `ditcore.GenerationRequest`'s fields (`--num-inference-steps` is the key
`num_inference_steps`); omitted keys take the flag values, whose defaults are GenerationRequest's. Keyframes are
files: `--first-frame PATH` / `--last-frame PATH`, and in a JSONL line "first_frame" / "last_frame" are paths relative
to the JSONL file's directory (null or "" for none). ref2va references are files too, in order: `--reference
[KIND:]PATH` (repeatable; KIND image, video or audio, default by content: "audio:clip.mp4" takes a video's soundtrack
alone), and in a JSONL line "references": a list of such strings (paths relative to the JSONL file's directory).
Adapters: `--adapter NAME[=SCALE]` (repeatable, in order; scale 1.0 by default), and in a JSONL line "adapters": a
list of {"name": ..., "scale": ...} objects or bare names (a line's list replaces the flags'). A
request whose task is left unset (no `--task`, no "task" key) is ref2va when it has references, fl2va when it has a
keyframe, else t2va (`ditcore.request.infer_task`). `--out` and `--output-type` are resolved by
`outputs.py`. `generate-local` validates every request against MiniMax-H3's rules before any runs, so bad input writes
nothing (`generate` leaves that to the server, whose operator limits may be tighter).
"""

from __future__ import annotations

import argparse
import json
import math
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ditcore.media import OUTPUT_TYPES
from ditcore.references import KINDS, Reference
from ditcore.report import CacheReport
from ditcore.request import (
    ADAPTER_NAME,
    DEFAULTED,
    H3_LIMITS,
    KEYFRAME_FIELDS,
    MAX_FRAMES,
    MAX_KEYFRAME_BYTES,
    MAX_REFERENCE_BYTES,
    MAX_STEPS,
    MIN_FRAMES,
    MIN_STEPS,
    TASKS,
    AdapterUse,
    GenerationRequest,
    RequestError,
    RequestLimits,
)

from .errors import UsageError
from .outputs import OutputTarget, output_target
from .progress import add_progress_flag

_DEFAULTS = GenerationRequest()
DEFAULTED_FIELDS = tuple(name for name, _ in DEFAULTED)
"""The request fields an adapter's contract may default: their flags default to unset."""
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
    "quality",
)
"""GenerationRequest fields that have a flag of the same name (request_id has its own default rule; the keyframes
and the output type have their own flags)."""


def add_request_flags(p: argparse.ArgumentParser) -> None:
    """Single-request flags; their defaults are GenerationRequest's. Also the output flags (--out, --output-type,
    --progress)."""
    g = p.add_argument_group("request (with --requests, the defaults of every line)")
    g.add_argument("--requests", metavar="FILE.jsonl", help="run every request of a JSONL file, in order")
    g.add_argument("--request-id", default=None, help="request id (default req-<index>)")
    g.add_argument(
        "--task",
        default=None,
        help=f"one of {', '.join(TASKS)} (default: fl2va with --first-frame or --last-frame, else t2va)",
    )
    g.add_argument("--prompt", default=_DEFAULTS.prompt, help="the text, non-empty, presented verbatim")
    g.add_argument("--first-frame", metavar="PATH", default=None, help="fl2va: PNG or JPEG the video starts from")
    g.add_argument("--last-frame", metavar="PATH", default=None, help="fl2va: PNG or JPEG the video ends on")
    g.add_argument(
        "--reference",
        metavar="[KIND:]PATH",
        action="append",
        default=[],
        help="ref2va: a reference file, in the order the model reads them (repeat it; up to 9 images PNG/JPEG, 3 "
        "videos MP4/WebM with their soundtrack, 3 audio clips WAV/FLAC/MP3/AAC, 12 in all); KIND image, video or "
        "audio (default: by content; audio:clip.mp4 takes a video's soundtrack alone)",
    )
    g.add_argument(
        "--adapter",
        metavar="NAME[=SCALE]",
        type=parse_adapter,
        action="append",
        default=[],
        help="an adapter (LoRA) of the generator's --adapter-dir, by name (its file's stem), at SCALE (a finite "
        "number, default 1.0); repeat it to compose several, in order",
    )
    contract = "the adapters' contract default, else"
    g.add_argument(
        "--num-inference-steps",
        type=int,
        default=None,
        help=f"schedule grid points in [{MIN_STEPS}, {MAX_STEPS}]; N points run N - 1 forwards (default: {contract} "
        f"{_DEFAULTS.num_inference_steps})",
    )
    g.add_argument(
        "--flow-shift", type=float, default=None,
        help=f"video schedule shift (default: {contract} {_DEFAULTS.flow_shift:g})",
    )  # fmt: skip
    g.add_argument(
        "--audio-flow-shift", type=float, default=None,
        help=f"audio schedule shift (default: {contract} {_DEFAULTS.audio_flow_shift:g})",
    )  # fmt: skip
    g.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="noise seed (default %(default)s)")
    g.add_argument(
        "--quality", default=_DEFAULTS.quality,
        help="a quality level of the server's --quality-levels (a step cache; docs/quality.md); default: lossless",
    )  # fmt: skip
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
    o = p.add_argument_group("output")
    o.add_argument(
        "--out",
        default=None,
        help="a file (FILE.mp4, FILE.zip = PNG frames + audio.wav, FILE.safetensors = latents; one request) or a "
        "directory (no suffix: DIR/<request_id>.mp4|.zip|.safetensors per request)",
    )
    o.add_argument(
        "--output-type",
        choices=OUTPUT_TYPES,
        default=None,
        help="latents, mp4 or frames_and_wav (default: --out's suffix, else the JSONL line's, else latents)",
    )
    add_progress_flag(o)


def parse_adapter(value: str) -> AdapterUse:
    """An `--adapter` value: "NAME" (scale 1.0) or "NAME=SCALE" (SCALE a finite number); argparse's error (exit 2,
    naming --adapter) otherwise."""
    name, sep, scale_text = value.partition("=")
    name = name.strip()
    if not ADAPTER_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"{value!r}: NAME[=SCALE], NAME an adapter's name (its file's stem: 1-128 of A-Z a-z 0-9 . _ -, no path)"
        )
    if not sep:
        return AdapterUse(name)
    try:
        scale = float(scale_text)
    except ValueError:
        scale = math.nan
    if not math.isfinite(scale):
        raise argparse.ArgumentTypeError(f"{value!r}: NAME=SCALE, SCALE a finite number (e.g. {name}=0.8)")
    return AdapterUse(name, scale)


def _keyframe_from_flag(flag: str, value: str | None) -> bytes:
    return b"" if value is None else _read_keyframe(Path(value).expanduser(), lambda msg: UsageError(f"{flag} {msg}"))


def _read_keyframe(path: Path, error: Any, limit: int = MAX_KEYFRAME_BYTES, what: str = "keyframe") -> bytes:
    """The file's bytes; `error(message)` is raised (with the path leading the message) when it cannot be read."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: cannot read it (not a regular file)")
        if st.st_size > limit:
            raise error(f"{path}: {st.st_size} bytes, over the {what} limit of {limit} bytes")
        return path.read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror or e})") from e


def parse_reference(value: str) -> tuple[str, str]:
    """A `--reference` value: (kind, path); the kind is "" unless the value starts with "image:", "video:" or
    "audio:"."""
    head, sep, rest = value.partition(":")
    return (head, rest) if sep and head in KINDS else ("", value)


def read_references(values: Sequence[str], error: Any, base: Path | None = None) -> tuple[Reference, ...]:
    """The references `--reference` values (or a JSONL line's "references") name, read in order; `error(index,
    message)` is raised for one that cannot be read. Relative paths are relative to `base` (default: the working
    directory)."""
    out = []
    for i, value in enumerate(values):
        kind, name = parse_reference(value)
        path = Path(name).expanduser()
        if base is not None:
            path = base / path
        data = _read_keyframe(path, lambda msg, i=i: error(i, msg), MAX_REFERENCE_BYTES, "reference")
        out.append(Reference(data, kind))
    return tuple(out)


def _defaults_from_args(args: argparse.Namespace, target: OutputTarget) -> GenerationRequest:
    values = {name: getattr(args, name) for name in REQUEST_FIELDS}
    values["task"] = values["task"] or ""  # unset: inferred per request
    for name in DEFAULTED_FIELDS:  # unset: H3's default here, and left unset for the server (`unset_fields`)
        if values[name] is None:
            values[name] = getattr(_DEFAULTS, name)
    return GenerationRequest(
        **values,
        first_frame=_keyframe_from_flag("--first-frame", args.first_frame),
        last_frame=_keyframe_from_flag("--last-frame", args.last_frame),
        output_type=target.output_type or _DEFAULTS.output_type,
        references=read_references(
            getattr(args, "reference", None) or [], lambda i, msg: UsageError(f"--reference #{i + 1}: {msg}")
        ),
        adapters=tuple(getattr(args, "adapter", None) or ()),
    )


def _line_keyframes(data: dict[str, Any], where: str, base: Path) -> None:
    """A JSONL line's keyframe paths (relative to `base`) replaced by the files' bytes, in place."""
    for name in KEYFRAME_FIELDS:
        if name not in data:
            continue
        value = data[name]
        if value is None or value == "":
            data[name] = b""
        elif isinstance(value, str):
            path = base / Path(value).expanduser()
            data[name] = _read_keyframe(path, lambda msg, name=name: RequestError(name, f"{where}: {msg}"))
        else:
            raise RequestError(name, f"{where}: must be a file path (a string), got {type(value).__name__}")
    if "references" in data:
        value = data["references"]
        if value is None:
            value = []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise RequestError("references", f'{where}: must be a list of "[KIND:]PATH" strings')
        data["references"] = read_references(
            value, lambda i, msg: RequestError(f"references[{i}]", f"{where}: {msg}"), base
        )


def _line_adapters(data: dict[str, Any], where: str) -> None:
    """A JSONL line's "adapters" checked for its shape (null: none), in place; each entry becomes an AdapterUse in
    GenerationRequest.from_dict."""
    if "adapters" not in data:
        return
    value = data["adapters"]
    if value is None:
        value = []
    ok = isinstance(value, list) and all(
        isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("name"), str)) for v in value
    )
    if not ok:
        raise RequestError("adapters", f'{where}: must be a list of {{"name": ..., "scale": ...}} objects or names')
    data["adapters"] = value


def requests_from_args(args: argparse.Namespace, target: OutputTarget | None = None) -> list[GenerationRequest]:
    """The requests a command will run (not yet validated). `target`: --out / --output-type, resolved."""
    return [request for request, _ in requests_with_unset(args, target)]


def requests_with_unset(
    args: argparse.Namespace, target: OutputTarget | None = None
) -> list[tuple[GenerationRequest, frozenset[str]]]:
    """Each request with the fields of DEFAULTED_FIELDS its caller left unset (no flag, no JSONL key): they hold
    H3's defaults here, and are sent unset (`request_to_proto(unset=...)`) so the server applies the request's
    adapters' contract defaults first."""
    if target is None:
        target = output_target(args.out, args.output_type)
    defaults = _defaults_from_args(args, target)
    flags_unset = frozenset(f for f in DEFAULTED_FIELDS if getattr(args, f, None) is None)
    if not args.requests:
        one = GenerationRequest.from_dict({"request_id": args.request_id or "req-0"}, defaults).with_task_inferred()
        return [(one, flags_unset)]
    path = Path(args.requests)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise RequestError("requests", f"cannot read {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise RequestError("requests", f"{path} is not UTF-8 text ({e.reason})") from e
    out: list[tuple[GenerationRequest, frozenset[str]]] = []
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
        _line_keyframes(data, f"{path}:{n}", path.parent)
        _line_adapters(data, f"{path}:{n}")
        fixed = target.output_type
        if fixed is not None and data.get("output_type", fixed) != fixed:
            raise RequestError(
                "output_type", f"{path}:{n}: {data['output_type']!r} conflicts with {target.fixed_by} ({fixed})"
            )
        try:
            out.append((GenerationRequest.from_dict(data, defaults).with_task_inferred(), flags_unset - set(data)))
        except RequestError as e:
            raise RequestError(e.field, f"{path}:{n}: {e.description}") from e
    if not out:
        raise RequestError("requests", f"{path} holds no requests")
    return out


def prepare_run(args: argparse.Namespace) -> tuple[list[GenerationRequest], OutputTarget, list[frozenset[str]]]:
    """The requests, where their results go and the fields each left unset (`requests_with_unset`), every refusal
    that needs no model done: --out / --output-type, keyframe files, JSONL, and whether the target can take the
    requests."""
    target = output_target(args.out, args.output_type)
    pairs = requests_with_unset(args, target)
    requests = [r for r, _ in pairs]
    target.check(requests)
    return requests, target, [u for _, u in pairs]


def validate_all(requests: Sequence[GenerationRequest], limits: RequestLimits = H3_LIMITS) -> None:
    """Validate every request and the uniqueness of their ids before anything runs."""
    seen: set[str] = set()
    for r in requests:
        r.validate(limits)
        if r.request_id in seen:
            raise RequestError("request_id", f"duplicate request_id {r.request_id!r}; ids must be unique")
        seen.add(r.request_id)


def result_line(
    request: GenerationRequest,
    sha256: str,
    timings_ms: dict[str, float],
    cache: CacheReport | None = None,
    shapes: tuple[Sequence[int], Sequence[int]] | None = None,
    **extra: Any,
) -> str:
    """The one JSON line printed per request by every generate command: the latents' sha256 always, their shapes
    (video, audio) for latents results, then `extra` (the written file's fields, the server's generation, ...)."""
    line: dict[str, Any] = {
        "request_id": request.request_id,
        "task": request.task,
        "num_inference_steps": request.num_inference_steps,
        "output_type": request.output_type,
        "sha256": sha256,
    }
    if shapes is not None:
        line["video_shape"], line["audio_shape"] = list(shapes[0]), list(shapes[1])
    line["timings_ms"] = timings_ms
    line.update(extra)
    if cache is not None:
        line["cache"] = cache.to_dict()
    return json.dumps(line, sort_keys=False)
