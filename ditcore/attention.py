"""The transformer's attention backend: diffusers' `set_attention_backend` names, or "auto" (the best one that runs on
the device, found by a tiny real call through diffusers' dispatcher), set on the served transformer alone.

    name = resolve("auto", device, torch.bfloat16, heads=56, head_dim=128)   # "_native_cudnn", ... ; cpu: "native"
    use_backend(transformer, "auto")                                        # resolve for its attention, then set
    backend_of(transformer)                                                 # what its forwards dispatch to

diffusers' `ModelMixin.set_attention_backend` also makes the backend the process default, which every module whose
processor names none dispatches to (the two VAEs' attention among them, some of it float32, which `_native_cudnn`
and the flash kernels refuse); `use_backend` puts the process default back, so only the transformer changes.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

AUTO = "auto"
CUDA_PREFERENCE = ("_flash_3", "_native_cudnn", "flash", "_native_flash", "native")
"""What "auto" tries on CUDA, fastest first on Hopper: FlashAttention-3 (its `flash_attn_interface` build), cuDNN's
fused attention (torch's SDPA, cuDNN >= 9), FlashAttention-2 (the `flash-attn` package), torch's built-in FA2, then
torch's own SDPA choice. All but the last take bfloat16 / float16 only, so a float32 checkpoint gets `native`.
MiniMax-H3 passes no attention mask, which `_native_flash` would refuse. Never chosen: the quantized `sage*`
kernels (not bit-faithful), `flex` (needs torch.compile to be fast), `xformers`, and the `*_hub` kernels (downloaded
at first use; the device machines are offline)."""
CPU_PREFERENCE = ("native",)
PROBE_TOKENS = 16
_PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}
"""Largest |difference| a probe's output may have from float32 math attention on the same inputs (kernel order and
the input dtype's rounding; a broken kernel is off by the size of the values, ~1)."""


class AttentionBackendError(ValueError):
    """An attention backend name diffusers does not have, or one that does not run here."""


def backend_names() -> tuple[str, ...]:
    """diffusers' attention backend names (`AttentionBackendName`), in its order."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return tuple(b.value for b in AttentionBackendName)


def check_name(name: str) -> None:
    """AttentionBackendError unless `name` is "auto" or one of diffusers' backend names."""
    if name != AUTO and name not in backend_names():
        allowed = ", ".join((AUTO, *backend_names()))
        raise AttentionBackendError(f"attention backend must be one of {allowed}; got {name!r}")


def probe(name: str, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> str | None:
    """Why backend `name` cannot run attention of `heads` x `head_dim` in `dtype` on `device`; None when it can.

    The test is real: diffusers' requirement check for the backend, then one `dispatch_attention_fn` call on
    (1, PROBE_TOKENS, heads, head_dim) inputs, the layout MiniMax-H3's processor passes, compared with float32 math
    attention on the same inputs."""
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _check_attention_backend_requirements,
        dispatch_attention_fn,
    )

    backend = AttentionBackendName(name)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, PROBE_TOKENS, heads, head_dim, generator=g).to(device, dtype) for _ in range(3))
    try:
        _check_attention_backend_requirements(backend)
        with warnings.catch_warnings():  # e.g. flex's "use torch.compile" note: the probe asks whether it runs
            warnings.simplefilter("ignore")
            out = dispatch_attention_fn(q, k, v, backend=backend)  # (1, S, H, D)
        want = dispatch_attention_fn(q.float(), k.float(), v.float(), backend=AttentionBackendName._NATIVE_MATH)
        off = (out.float() - want).abs().max().item()
    except Exception as e:  # whatever the kernel raises (missing package, no kernel for this device or dtype)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    if not off <= _PROBE_TOLERANCE.get(dtype, 1e-3):
        return f"its output is {off:.3g} away from math attention on the same inputs"
    return None


def usable_backends(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> list[str]:
    """Every backend that runs here (probe), less the `*_hub` ones, which download their kernel at first use."""
    names = [n for n in backend_names() if not n.endswith("_hub")]
    return [n for n in names if probe(n, device, dtype, heads, head_dim) is None]


def preference(device: torch.device) -> Sequence[str]:
    """The backends "auto" tries on `device`, in order."""
    return CUDA_PREFERENCE if device.type == "cuda" else CPU_PREFERENCE


def resolve(name: str, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> str:
    """The backend to run: `name` if it runs here (else AttentionBackendError naming what does), or for "auto" the
    first of `preference(device)` that does (each one skipped is logged)."""
    check_name(name)
    where = f"{device} ({dtype_label(dtype)}, {heads} heads of {head_dim})"
    if name != AUTO:
        why = probe(name, device, dtype, heads, head_dim)
        if why is not None:
            usable = ", ".join([AUTO, *usable_backends(device, dtype, heads, head_dim)])
            raise AttentionBackendError(f"attention backend {name!r} does not run on {where}: {why}; usable: {usable}")
        return name
    for candidate in preference(device):
        why = probe(candidate, device, dtype, heads, head_dim)
        if why is None:
            log.info("attention backend: %s (auto on %s)", candidate, where)
            return candidate
        log.info("attention backend %s does not run on %s (%s); trying the next", candidate, where, why)
    raise AttentionBackendError(f"no attention backend of {list(preference(device))} runs on {where}")


def check_runs(name: str, device: torch.device) -> None:
    """Before any checkpoint is loaded (a server's start): AttentionBackendError unless backend `name` runs the
    released attention (bfloat16, the `h3` preset's heads) on `device`; "auto" always passes. Loading a checkpoint
    checks again, at its own dtype and shapes (use_backend)."""
    from .presets import get_preset

    if name == AUTO:
        return
    h3 = get_preset("h3")
    resolve(name, device, torch.bfloat16, h3.num_attention_heads, h3.attention_head_dim)


def _attention_modules(transformer: Any) -> list[Any]:
    from diffusers.models.attention import AttentionModuleMixin

    return [m for m in transformer.modules() if isinstance(m, AttentionModuleMixin)]


def context_parallel_capable(name: str) -> bool:
    """Whether diffusers' backend `name` runs under context parallel (its registry's `supports_context_parallel`)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    return bool(_AttentionBackendRegistry._is_context_parallel_available(AttentionBackendName(name)))


def use_backend(transformer: Any, name: str, context_parallel: bool = False) -> str:
    """Resolve `name` for `transformer`'s attention (its device, its projections' dtype, its heads) and set it on
    every attention processor of the transformer alone; returns the backend set. With `context_parallel` (a replica
    of several ranks) "auto" considers only the backends diffusers runs under context parallel, and a named one that
    does not is refused."""
    from diffusers.models.attention_dispatch import attention_backend

    attn = _attention_modules(transformer)[0]
    weight = attn.to_q.weight
    if context_parallel and name != AUTO and not context_parallel_capable(name):
        usable = [b for b in backend_names() if context_parallel_capable(b)]
        raise AttentionBackendError(
            f"attention backend {name!r} does not run under context parallel (--ulysses-degree / --ring-degree); "
            f"diffusers' context-parallel backends: {', '.join(usable)}"
        )
    if context_parallel and name == AUTO:
        for candidate in preference(weight.device):
            if (
                context_parallel_capable(candidate)
                and probe(candidate, weight.device, weight.dtype, attn.heads, attn.head_dim) is None
            ):
                name = candidate
                break
    chosen = resolve(name, weight.device, weight.dtype, attn.heads, attn.head_dim)
    # diffusers makes it the process default too; the context puts the old default back on exit
    with attention_backend():
        transformer.set_attention_backend(chosen)
    return chosen


def backend_of(transformer: Any) -> str:
    """The backend `transformer`'s attention dispatches to: the one its processors name, else the process default
    (diffusers' DIFFUSERS_ATTN_BACKEND, "native" unless set)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    named = {getattr(m.processor, "_attention_backend", None) for m in _attention_modules(transformer)}
    if len(named) != 1:
        raise AttentionBackendError(f"the transformer's attention processors name different backends: {named}")
    backend = named.pop() or _AttentionBackendRegistry.get_active_backend()[0]
    return str(backend.value if hasattr(backend, "value") else backend)


def dtype_label(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")
