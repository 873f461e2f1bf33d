"""`ditserve inspect`'s memory and time model at a canvas (ditcore.sizing): its flags, its data and its table.

ditserve inspect --preset h3 --height 768 --width 1344 --num-frames 345          # one H200, cached and resident
ditserve inspect --preset h3 --height 768 --width 1344 --num-frames 345 --ulysses-degree 4   # 4 x H200, per rank
ditserve inspect ./ckpt --height 512 --width 896 --num-frames 124 --json         # a repository's own configs
"""

from __future__ import annotations

import argparse
from typing import Any

from ditcore.attention import check_name
from ditcore.footprint import Placement, memory_report, meta_components
from ditcore.parallel import ParallelSpec
from ditcore.pipeline import decode_dtype_for
from ditcore.placement import Footprint, PlacementError, decide, embedding_bytes
from ditcore.repo import TEXT_LAYERS
from ditcore.request import MAX_PROMPT_BYTES, MAX_STEPS, MIN_STEPS, MODEL_LIMITS, check_canvas
from ditcore.sizing import DEVICE_CLASSES, Canvas, ModelShapes
from ditruntime.flags import add_flags, from_args
from generator_service.config import GeneratorConfig
from plancache_service.config import CacheConfig

from .errors import UsageError

GIB = 1024**3
MIB = 1024**2
CACHE_FLAGS = ("gpu_plans", "plan_width", "host_cache_bytes")
MODEL_FLAGS = (
    "attention_backend", "decode_dtype", "text_encoder_device", "text_encoder_offload", "partitions", "ulysses_degree",
    "ring_degree",
)  # fmt: skip
"""The generator's flags that change what the model holds: "auto" attention is a flash-style kernel on CUDA (only
`_native_math` materializes the scores), "auto" decode the released dtype, "auto" text encoder and partitions what
the generator would choose at start (ditcore.placement), on one --device-class device per rank of the Ulysses x ring
layout."""
RELEASED_CANVAS = (768, 1344, 345)
"""What an unset canvas flag means once another is given: the released maximum canvas."""


def add_memory_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("memory and time model (any canvas flag turns it on)")
    g.add_argument("--height", type=int, default=None, help="canvas height in pixels (default with the others: 768)")
    g.add_argument("--width", type=int, default=None, help="canvas width in pixels (default with the others: 1344)")
    g.add_argument("--num-frames", type=int, default=None, help="frames, 17n + 5 (default with the others: 345)")
    g.add_argument("--prompt-tokens", type=int, default=256, help="prompt tokens (default %(default)s)")
    g.add_argument("--keyframes", type=int, default=0, help="fl2va keyframes, 0 to 2 (default %(default)s)")
    g.add_argument(
        "--num-inference-steps", type=int, default=50, help="grid points; N - 1 forwards (default %(default)s)"
    )
    g.add_argument("--latents", action="store_true", help="the request returns latents (no decode)")
    g.add_argument("--device-class", choices=tuple(DEVICE_CLASSES), default="h200", help="(default %(default)s)")
    g.add_argument(
        "--text-encoder", choices=("trimmed", "whole"), default="trimmed",
        help=f"trimmed: {TEXT_LAYERS} layers, no lm_head, as served (default %(default)s)",
    )  # fmt: skip
    add_flags(parser, GeneratorConfig, only=MODEL_FLAGS, group="model (the generator's flags)")
    add_flags(parser, CacheConfig, only=CACHE_FLAGS, group="plan cache (the sidecar's slab)")


def wants_memory(args: argparse.Namespace) -> bool:
    return any(getattr(args, name) is not None for name in ("height", "width", "num_frames"))


def _canvas(args: argparse.Namespace) -> Canvas:
    given = (args.height, args.width, args.num_frames)
    h, w, f = (v if v is not None else d for v, d in zip(given, RELEASED_CANVAS, strict=True))
    check_canvas(h, w, f, MODEL_LIMITS)  # H3's rules, up to the hard caps an operator may raise the limits to
    if not 1 <= args.prompt_tokens <= MAX_PROMPT_BYTES:
        raise UsageError(f"--prompt-tokens must be in [1, {MAX_PROMPT_BYTES}], got {args.prompt_tokens}")
    if not 0 <= args.keyframes <= 2:
        raise UsageError(f"--keyframes must be 0, 1 or 2 (fl2va's first and last frame), got {args.keyframes}")
    if not MIN_STEPS <= args.num_inference_steps <= MAX_STEPS:
        raise UsageError(f"--num-inference-steps must be in [{MIN_STEPS}, {MAX_STEPS}], got {args.num_inference_steps}")
    return Canvas(h, w, f, args.prompt_tokens, args.keyframes, decodes=not args.latents)


def memory_data(args: argparse.Namespace, precision: str) -> dict[str, Any]:
    """The modeled memory and time of the canvas the flags name, on the chosen device class (`inspect`'s "memory"),
    and the placement the generator would choose at start on one such device per rank (ditcore.placement), per mode;
    the totals are the cached choice's (the default --adaln-mode)."""
    canvas = _canvas(args)
    check_name(args.attention_backend)  # AttentionBackendError naming the valid ones
    cache = from_args(CacheConfig, args, only=CACHE_FLAGS)
    components = meta_components(preset=args.preset) if args.preset else meta_components(repository=args.checkpoint)
    device = DEVICE_CLASSES[args.device_class]
    decode = decode_dtype_for(args.decode_dtype, precision)
    shapes = ModelShapes.of_components(
        components, precision, text_layers=TEXT_LAYERS if args.text_encoder == "trimmed" else None,
        decode_dtype=decode, attention_backend=args.attention_backend,
        device_type="cpu" if args.device_class == "cpu" else "cuda",
    )  # fmt: skip
    names, auto = _partitions(args)

    def placement(text_device: str, partitions: int) -> Placement:
        return Placement(
            cache.gpu_plans, cache.plan_width, cache.host_cache_bytes, args.text_encoder, text_device,
            args.num_inference_steps - 1, partitions,
        )  # fmt: skip

    on_device = memory_report(components, shapes, canvas, placement("device", 1), device, precision)
    choices = {mode: _choice(args, on_device, shapes, mode, components, precision, names, auto, device.memory_bytes)
               for mode in ("cached", "resident")}  # fmt: skip
    chosen = choices["cached"]
    text, count = (chosen["text_encoder"], len(chosen["partitions"])) if chosen["fits"] else (_asked(args), len(names))
    report = memory_report(components, shapes, canvas, placement(text, count), device, precision).to_dict()
    report["choice"] = choices
    return report


def _asked(args: argparse.Namespace) -> str:
    """The text encoder placement the flags name ("auto": each is tried, ditcore.placement.TEXT_ORDER)."""
    if args.text_encoder_offload:
        return "offload"
    return {"auto": "device", "cuda": "device", "cpu": "cpu"}[args.text_encoder_device]


def _choice(
    args: argparse.Namespace, report: Any, shapes: ModelShapes, mode: str, components: Any, precision: str,
    names: tuple[str, ...], auto: bool, free: int,
) -> dict[str, Any]:  # fmt: skip
    """What the generator would choose at start in `mode` (the refusal's message when nothing fits)."""
    fp = Footprint.of_report(report, shapes, mode, embedding_bytes(components, precision))
    spec = ParallelSpec(max(1, args.ulysses_degree or 1), max(1, args.ring_degree or 1))  # one node: ring 0 is 1
    text = "auto" if args.text_encoder_device == "auto" and not args.text_encoder_offload else _asked(args)
    try:
        choice = decide(fp, free, spec, text, names, auto, cuda=args.device_class != "cpu")
    except PlacementError as e:
        return {"fits": False, "refusal": str(e), "ulysses_degree": spec.ulysses_degree,
                "ring_degree": spec.ring_degree, "table": [f"REFUSED at start: {e}"]}  # fmt: skip
    return {**choice.to_dict(), "table": choice.table()}


def _partitions(args: argparse.Namespace) -> tuple[tuple[str, ...], bool]:
    """The transformer partitions the modeled generator may load, and whether `--partitions auto` may drop ref:
    those named, else every one the repository has (a preset: the released transformer/ and transformer_ref/)."""
    if args.partitions != "auto":
        names = tuple(dict.fromkeys(p.strip() for p in args.partitions.split(",") if p.strip()))
        if not names or not set(names) <= {"base", "ref"} or "base" not in names:
            raise UsageError(f"--partitions must be auto, base or base,ref, got {args.partitions!r}")
        return names, False
    if args.preset:
        return ("base", "ref"), True
    from ditcore.pipeline import repository_partitions

    return repository_partitions(args.checkpoint), True


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f} GiB"


def print_memory(m: dict[str, Any]) -> None:
    """The memory table: each component, the slab, the activations, the totals per process; tokens and times."""
    c, t, a, dev = m["canvas"], m["tokens"], m["activations"], m["device"]
    rows: list[tuple[str, str]] = [
        ("canvas", f"{c['height']} x {c['width']} x {c['num_frames']} frames, {c['keyframes']} keyframe(s), "
                   f"{'decoded' if c['decodes'] else 'latents'}"),
        ("tokens", f"{t['total']:,} (video {t['video']:,}, condition {t['condition']:,}, audio {t['audio']:,}, "
                   f"text {t['text']:,})"),
        ("device class", f"{dev['name']}: {_gib(dev['memory_bytes'])}; {dev['note']}"),
    ]  # fmt: skip
    p = m["placement"]
    for w in m["weights"]:
        times = f" x {p['partitions']}" if w["name"] == "transformer" and p["partitions"] > 1 else ""
        rows.append((f"{w['name']} ({w['variant']}){times}", f"{_gib(w['bytes']):>12}  {w['params']:,} params, "
                     f"{w['dtype']}{' each (transformer/, transformer_ref/)' if times else ''}"))  # fmt: skip
    rows.append(("slab", f"{_gib(m['slab_bytes']):>12}  {p['gpu_plans']} x {p['plan_width']} pages of "
                         f"{m['page_bytes'] / MIB:.2f} MiB"))  # fmt: skip
    rows.append(("sidecar rebuild", f"{_gib(m['rebuild_bytes']):>12}  the largest plan tensor, streamed"))
    rows.append(("activations", f"{_gib(a['peak']):>12}  peak ({a['phase']}): step {_gib(a['step'])}, "
                                f"text {_gib(a['text'])}, decode {_gib(a['decode'])}"))  # fmt: skip
    for mode, tot in m["totals"].items():
        sidecar = (
            f", sidecar {_gib(tot['sidecar'])} (+ {_gib(tot['sidecar_host'])} host tier)" if tot["sidecar"] else ""
        )
        fits = "fits" if tot["free"] >= 0 else "DOES NOT FIT"
        rows.append((f"total {mode}", f"{_gib(tot['device']):>12}  generator {_gib(tot['generator'])}{sidecar}; "
                                      f"{fits}, {_gib(tot['free'])} left of {_gib(dev['memory_bytes'])}"))  # fmt: skip
        if p["partitions"] > 1:
            rows.append((f"  vs {p['partitions']} one-partition", f"{_gib(tot['separate']):>12}  on "
                         f"{p['partitions']} devices ({_gib(tot['separate'] - tot['device'])} more)"))  # fmt: skip
    for mode, choice in m["choice"].items():
        for i, line in enumerate(choice["table"]):
            rows.append((f"placement {mode}" if i == 0 else "", line))
    f = m["flops"]
    rows.append(("step time", f"{m['step_s']:,.1f} s modeled: {f['total'] / 1e15:,.2f} PFLOP "
                              f"({100 * f['attention'] / f['total']:.0f}% attention) at MFU {dev['mfu']}"))  # fmt: skip
    rows.append(("request time", f"{m['request_s']:,.1f} s ({m['request_s'] / 60:,.1f} min): encode "
                                 f"{m['encode_s']:,.2f} s + {p['steps']} steps + decode {m['decode_s']:,.1f} s"))  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print("memory model")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
