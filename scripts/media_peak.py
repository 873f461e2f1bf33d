"""Peak host memory of one request's media stage on the CPU (decode to uint8 frames, then encode as mp4 or
frames_and_wav, the file read out as a stream reads it), before and after the bounded media path.

    .venv/bin/python scripts/media_peak.py                                      # the current code, 768 x 1344 x 124
    .venv/bin/python scripts/media_peak.py --write-before HEAD /tmp/before.py   # a revision's code, as one file
    .venv/bin/python scripts/media_peak.py --before /tmp/before.py              # both, with the ratios
    .venv/bin/python scripts/media_peak.py --source pixels --frames 345         # what a CUDA host adds, released size

--source says where the stage starts: `vae` (default) runs random latents through the tiny preset's VAEs (the
released bfloat16) and diffusers' decode step; `synthetic` replaces the VAE's output by a synthetic one of its shape
and dtype (a scrolling gradient with mild noise, made during the stage as the VAE's would be); `pixels` makes the
decode step's float32 video before the stage and measures only what the host adds to it, the uint8 conversion and
the encode (on CUDA that video, and the step's float temporaries, are device memory). Each measurement is its own
subprocess: it loads the decoder, resets its peak RSS (/proc/self/clear_refs), runs the stage and reports VmHWM;
"stage" is that peak less the RSS just before the stage. `--before FILE` is a Python file defining the old
`decode(decoder, video, audio)`, `encode(media, output_type)` and `DecodedMedia`; `--write-before REV FILE` builds
one from a git revision (its whole ditcore/media.py, which imports nothing of ditcore, plus its `decode`: in
ditcore/decode.py, or ditcore/pipeline.py before that module); with `--source pixels` the old conversion is its
decode's line after the step (the step's "pil" output stacked). Linux only (/proc). At 124 frames a case takes one to
two minutes on two cores.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

CASES = ("mp4", "frames_and_wav")
SOURCES = {
    "vae": "latents through the tiny VAEs (bfloat16)",
    "synthetic": "a synthetic VAE output (bfloat16) through the decode step",
    "pixels": "the decode step's float32 video, made before the stage",
}
PIXEL_MEAN, PIXEL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


# ---------------------------------------------------------------------------------------------- the "before" file
def write_before(rev: str, out: Path) -> None:
    """`rev`'s ditcore/media.py with its `decode` appended (ditcore/decode.py's, or ditcore/pipeline.py's in a
    revision before that module; it needs only DecodedMedia)."""

    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout  # fmt: skip

    media = show("ditcore/media.py")
    try:
        where, module = "decode", show("ditcore/decode.py")
    except subprocess.CalledProcessError:  # a revision from before ditcore/decode.py: the decode was pipeline.py's
        where, module = "pipeline", show("ditcore/pipeline.py")
    node = next(n for n in ast.parse(module).body if isinstance(n, ast.FunctionDef) and n.name == "decode")
    lines = module.splitlines()
    source = "\n".join(
        lines[node.decorator_list[0].lineno - 1 if node.decorator_list else node.lineno - 1 : node.end_lineno]
    )
    out.write_text(f"{media}\n\nimport torch  # appended: {rev}'s ditcore.{where}.decode\n\n\n{source}\n")


# ------------------------------------------------------------------------------------------------------ the child
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _synthetic_vae_output(frames: int, height: int, width: int, dtype: Any) -> Any:
    """(1, 3, F, H, W) in the VAE's output space (ImageNet-normalized): a scrolling gradient with mild noise."""
    import torch

    g = torch.Generator().manual_seed(0)
    y = torch.linspace(0, 1, height).view(height, 1)
    x = torch.linspace(0, 1, width).view(1, width)
    mean, std = torch.tensor(PIXEL_MEAN).view(3, 1, 1), torch.tensor(PIXEL_STD).view(3, 1, 1)
    out = torch.empty(1, 3, frames, height, width, dtype=dtype)
    for i in range(frames):
        base = torch.stack([(x + 0 * y + i / 97) % 1, (y + 0 * x + i / 61) % 1, (x + y) / 2])
        pixels = (base + 0.02 * torch.randn(base.shape, generator=g)).clamp(0, 1)
        out[0, :, i] = ((pixels - mean) / std).to(dtype)
    return out


def _load(args: argparse.Namespace) -> Any:
    """The implementation measured: the --before file as a module, or the current ditcore."""
    import importlib.util

    if args.impl == "after":
        from ditcore import decode, media

        return argparse.Namespace(decode=decode.decode, encode=media.encode, DecodedMedia=media.DecodedMedia)
    spec = importlib.util.spec_from_file_location("media_before", args.before)
    assert spec is not None and spec.loader is not None
    impl = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = impl  # dataclasses look their module up
    spec.loader.exec_module(impl)
    return impl


def _to_frames(args: argparse.Namespace, processor: Any, pixels: Any) -> Any:
    """--source pixels: (F, C, H, W) float32 -> uint8 frames as each implementation does after the decode step's
    float work: before, the step's "pil" postprocess stacked (its old decode's one line); after, to_uint8_frames."""
    import numpy as np

    if args.impl == "after":
        from ditcore.decode import to_uint8_frames

        return to_uint8_frames(processor, pixels)
    images = processor.postprocess_video(pixels.permute(1, 0, 2, 3)[None], output_type="pil")[0]
    return np.stack([np.asarray(image) for image in images])


def child(args: argparse.Namespace) -> dict[str, Any]:
    import gc

    import torch

    from ditcore.decode import load_decoder
    from ditcore.pipeline import load_pipeline

    impl = _load(args)
    pipe = load_pipeline(args.repo, "mixed", vae_dtype="bfloat16")
    decoder = load_decoder(pipe, args.repo, "bfloat16")  # the released decode dtype
    latent_frames = (args.frames - 5) // 17 * 5 + 2  # 17 n + 5 frames <- 5 n + 2 latent frames
    g = torch.Generator().manual_seed(1)
    video = torch.randn(1, 24, latent_frames, args.height // 16, args.width // 16, generator=g)
    audio = torch.randn(2, 32, -(-args.frames * 40 // 24), generator=g)  # 40 audio latents per second
    if args.source != "vae":  # the VAE's output appears during the stage, as the VAE's would
        shape = (args.frames, args.height, args.width, decoder.vae.dtype)
        decoder.vae.decode = lambda z, return_dict=False: (_synthetic_vae_output(*shape),)
    pixels = waveform = None
    if args.source == "pixels":  # the step's float work done before the stage (device memory on CUDA)
        out = decoder(latents=video, audio_latents=audio, output_type="pt", output=["videos", "audio"])
        pixels, waveform = out["videos"][0], out["audio"][0].numpy()  # (F, C, H, W) float32, (2, S)
        del out
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    base_kb = _status_kb("VmRSS")
    t0 = time.perf_counter()
    if pixels is None:
        media = impl.decode(decoder, video, audio)
    else:
        frames = _to_frames(args, decoder.video_processor, pixels)
        media = impl.DecodedMedia(frames=frames, audio=waveform, sampling_rate=decoder.audio_sampling_rate)
        del frames
    decoded_s = time.perf_counter() - t0
    encoded = impl.encode(media, args.case)
    size, sha256 = encoded.size, encoded.sha256
    if hasattr(encoded, "chunks"):  # the spooled file, read out as a stream does
        for _ in encoded.chunks():
            pass
        encoded.close()
    seconds = time.perf_counter() - t0
    return {"peak_kb": _status_kb("VmHWM"), "base_kb": base_kb, "size": size, "sha256": sha256,
            "decode_s": round(decoded_s, 1), "total_s": round(seconds, 1), "frames": int(media.frames.shape[0])}  # fmt: skip


# ----------------------------------------------------------------------------------------------------- the parent
def measure(args: argparse.Namespace, case: str, impl: str, repo: Path) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", "--case", case, "--impl", impl, "--repo", str(repo),
            "--frames", str(args.frames), "--height", str(args.height), "--width", str(args.width)]  # fmt: skip
    if args.before:
        argv += ["--before", str(args.before)]
    argv += ["--source", args.source]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{case} {impl} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _gb(kb: int) -> str:
    return f"{kb / 1024**2:.2f} GiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="a file with the old decode() and encode(): measure it too")
    parser.add_argument("--write-before", nargs=2, metavar=("REV", "FILE"), help="write that file from a revision")
    parser.add_argument("--frames", type=int, default=124, help="17 n + 5 frames (default 124)")
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--width", type=int, default=1344)
    parser.add_argument("--source", choices=SOURCES, default="vae", help="what the stage starts from (see above)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated output types")
    parser.add_argument("--repo", type=Path, help="a tiny MiniMax-H3 repository (default: one written to a temp dir)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.write_before:
        write_before(args.write_before[0], Path(args.write_before[1]))
        return 0
    if (args.frames - 5) % 17 or args.height % 32 or args.width % 32:
        parser.error("--frames must be 17 n + 5, --height and --width multiples of 32")
    with tempfile.TemporaryDirectory() as tmp:
        repo = args.repo
        if repo is None:
            from ditcore.repo import write_repository

            repo = write_repository(Path(tmp) / "tiny", "tiny", seed=0, dtype="mixed")
        print(f"media stage at {args.height} x {args.width} x {args.frames} (height x width x frames), CPU, from "
              f"{SOURCES[args.source]}; stage = peak - RSS before it")  # fmt: skip
        print(f"{'case':<16}{'impl':<8}{'peak RSS':>12}{'stage':>12}{'bytes':>13}{'time':>8}  sha256", flush=True)
        rows: dict[str, dict[str, dict[str, Any]]] = {}
        for case in args.cases.split(","):
            for impl in ("before", "after") if args.before else ("after",):
                r = measure(args, case, impl, repo)
                rows.setdefault(case, {})[impl] = r
                stage = r["peak_kb"] - r["base_kb"]
                print(f"{case:<16}{impl:<8}{_gb(r['peak_kb']):>12}{_gb(stage):>12}{r['size']:>13,}"
                      f"{r['total_s']:>7.0f}s  {r['sha256'][:16]}", flush=True)  # fmt: skip
        if args.before:
            print(f"\n{'case':<16}{'peak before':>12}{'peak after':>12}{'ratio':>7}{'stage before':>14}"
                  f"{'stage after':>13}{'ratio':>7}  same bytes")  # fmt: skip
            for case, r in rows.items():
                b, a = r["before"], r["after"]
                sb, sa = b["peak_kb"] - b["base_kb"], a["peak_kb"] - a["base_kb"]
                print(f"{case:<16}{_gb(b['peak_kb']):>12}{_gb(a['peak_kb']):>12}{b['peak_kb'] / a['peak_kb']:>6.1f}x"
                      f"{_gb(sb):>14}{_gb(sa):>13}{sb / max(sa, 1):>6.1f}x  {b['sha256'] == a['sha256']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
