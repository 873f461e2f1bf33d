"""Measures one `ditcore.load_model` in a fresh process and prints one JSON line: what it read from the checkpoint,
whether it ever built the full transformer, and its peak resident memory.

    python tests/core/load_probe.py REPO MODE [TEXT_ENCODER_DEVICE OFFLOAD]     # MODE: cached | resident

Spies (installed after the imports, so only the load is seen):
- every safetensors tensor whose *data* is read, by the three paths the load takes: `safetensors.torch.load_file`
  (diffusers' from_pretrained), `safe_open(...).get_slice(name)[...]` (transformers' from_pretrained) and
  `safe_open(...).get_tensor` (ditcore's cached transformer); headers (`get_slice(...).get_shape()`) are not reads;
- `MiniMaxH3Transformer3DModel.from_pretrained` calls, and every transformer constructed: after the load, each one is
  checked for a non-meta parameter (or non-empty buffer) with a plan-tensor name (`adaln_proj.*`, `norm_out.linear.*`);
- peak RSS: /proc/self/status VmHWM after the load, its counter reset just before (`5 > /proc/self/clear_refs`), and
  VmRSS just before, so `peak_rss_delta_bytes` is what the load itself added at its peak. A first, unmeasured load
  warms the process (lazy imports, allocator arenas).
"""

from __future__ import annotations

import functools
import gc
import json
import sys
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import transformers.modeling_utils
from diffusers import MiniMaxH3Transformer3DModel

from ditcore import load_model, validate_checkpoint
from ditcore import shards as ditcore_shards
from ditcore.plans import is_plan_tensor

READS: list[dict[str, Any]] = []
"""One entry per tensor whose data was read: file (relative to the repository), name, bytes, path taken."""
FROM_PRETRAINED: list[str] = []
BUILT: list[Any] = []


def _component(path: str, repo: Path) -> str:
    rel = Path(path).resolve().relative_to(repo.resolve())
    return str(rel)


def _record(path: str, name: str, t: torch.Tensor, via: str) -> None:
    READS.append({"file": str(path), "name": name, "bytes": t.numel() * t.element_size(), "via": via})


class _Slice:
    """A safetensors slice whose `[...]` (the data) is recorded; shape and dtype look-ups are headers."""

    def __init__(self, path: str, name: str, inner: Any) -> None:
        self._path, self._name, self._inner = path, name, inner

    def __getitem__(self, index: Any) -> torch.Tensor:
        t = self._inner[index]
        _record(self._path, self._name, t, "get_slice")
        return t

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


class _Handle:
    """A safe_open handle (context manager or not, as transformers uses it) recording data reads."""

    def __init__(self, real: Any, path: str, *args: Any, **kwargs: Any) -> None:
        self._path = str(path)
        self._inner = real(path, *args, **kwargs)

    def __enter__(self) -> _Handle:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)

    def get_tensor(self, name: str) -> torch.Tensor:
        t = self._inner.get_tensor(name)
        _record(self._path, name, t, "get_tensor")
        return t

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self._path, name, self._inner.get_slice(name))

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


def install() -> None:
    real_load_file = safetensors.torch.load_file

    def load_file(filename: Any, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        out = real_load_file(filename, *args, **kwargs)
        for name, t in out.items():
            _record(str(filename), name, t, "load_file")
        return out

    safetensors.torch.load_file = load_file
    for module in (transformers.modeling_utils, ditcore_shards):
        real = module.safe_open
        module.safe_open = lambda path, *a, _real=real, **k: _Handle(_real, path, *a, **k)  # type: ignore[attr-defined]

    real_fp = MiniMaxH3Transformer3DModel.from_pretrained.__func__  # type: ignore[attr-defined]

    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        FROM_PRETRAINED.append(str(args[0]) if args else str(kwargs.get("pretrained_model_name_or_path")))
        return real_fp(cls, *args, **kwargs)

    MiniMaxH3Transformer3DModel.from_pretrained = classmethod(from_pretrained)  # type: ignore[assignment]
    real_init = MiniMaxH3Transformer3DModel.__init__

    @functools.wraps(real_init)  # diffusers reads the config keys off __init__'s signature
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        BUILT.append(self)

    MiniMaxH3Transformer3DModel.__init__ = init  # type: ignore[method-assign]


def plan_tensors_held(model: Any) -> list[str]:
    """Plan-named parameters not on meta, and plan-named buffers holding any element (PlanLinear's 0-element
    dtype anchor is neither)."""
    named = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if b.numel())]
    return sorted(n for n, t in named if is_plan_tensor(n) and not t.is_meta)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main(repo: Path, mode: str, te_device: str = "auto", offload: bool = False) -> dict[str, Any]:
    info = validate_checkpoint(repo, require_adaln=mode == "resident")  # fingerprint samples: before the spies
    options: dict[str, Any] = {}
    if te_device != "auto" or offload:
        from ditcore.text_encoder import TextEncoderPlacement

        options["text_encoder"] = TextEncoderPlacement(te_device, offload)
    warm = load_model(info, mode, "cpu", **options)  # lazy imports and allocator arenas are not the load's
    del warm
    gc.collect()
    install()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the peak below is the load's
    rss_before = _status("VmRSS")
    model = load_model(info, mode, "cpu", **options)
    peak = _status("VmHWM")
    by_component: dict[str, int] = {}
    plan_read: list[str] = []
    for r in READS:
        comp = _component(r["file"], repo).split("/")[0]
        by_component[comp] = by_component.get(comp, 0) + r["bytes"]
        if comp in ("transformer", "transformer_ref") and is_plan_tensor(r["name"]):
            plan_read.append(f"{comp}/{r['name']}")
    text_read = sorted({r["name"] for r in READS if _component(r["file"], repo).startswith("text_encoder/")})
    return {
        "mode": mode,
        "bytes_read": sum(r["bytes"] for r in READS),
        "bytes_read_by_component": by_component,
        "plan_tensors_read": sorted(set(plan_read)),
        "plan_bytes_read": sum(
            r["bytes"] for r in READS if f"{_component(r['file'], repo).split('/')[0]}/{r['name']}" in set(plan_read)
        ),
        "text_encoder_tensors_read": text_read,
        "transformer_from_pretrained_calls": len(FROM_PRETRAINED),
        "transformers_built": len(BUILT),
        "plan_tensors_allocated": sorted({n for m in BUILT for n in plan_tensors_held(m)}),
        "served_plan_tensors": sorted(
            f"{folder}/{n}"
            for folder, t in (
                ("transformer", model.transformer_of("base")),
                ("transformer_ref", model.transformer_of("ref")),
            )
            for n in plan_tensors_held(t)
        ),
        "rss_before_bytes": rss_before,
        "peak_rss_bytes": peak,
        "peak_rss_delta_bytes": peak - rss_before,
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    te = args[2] if len(args) > 2 else "auto"
    off = len(args) > 3 and args[3] == "offload"
    print(json.dumps(main(Path(args[0]), args[1], te, off)))
