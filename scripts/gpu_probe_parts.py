"""The five measurements of scripts/gpu_probe.py, each through the project's own code (or diffusers' classes) at the
released sizes on CUDA, at the `tiny` preset's on the CPU. Each returns the numbers of its one JSON line.

  slab     a slab of 49 x 3 pages (plancache_service.device.SlabMemory), exported, opened in a second process with
           ditruntime.slab.SlabMapping.open, read there (a whole-slab reduction and the per-step SlotReads), closed;
           the consumer's weak reference must expire and the producer's device memory come back
  swap     host-tier swap-in (tiers.HostMemoryTier.fill, pinned on cuda) vs one plain `copy_` of the same bytes
  block    one MiniMaxH3TransformerBlock forward per attention backend diffusers can run, at two token counts
  vae      AutoencoderKLMiniMaxH3.decode per output frame, float32 vs bfloat16 (`_keep_in_fp32_modules` kept)
  rebuild  one adaln_proj GEMM (M = 3, bfloat16 as the checkpoint stores it) vs the host-to-device copy of its weight
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ditcore.plans import PageLayout, PlanKey, SlotReads
from ditcore.presets import H3Preset, get_preset
from ditcore.shards import load_dtype

SLOTS, WIDTH = 49, 3
"""A 50-step request's forwards, each a plan of up to 3 pages (t2va's video/text and audio, fl2va's keyframe)."""
PCIE_GEN5_GBPS = 64.0
"""PCIe Gen5 x16, one direction (the H200's host link), GB/s."""
SWAP_TARGET = 0.9
"""The host tier's swap-in must reach this share of a plain pinned copy of the same bytes."""
BACKENDS = ("native", "_native_cudnn", "_native_flash", "_native_efficient", "_native_math", "flash", "_flash_3",
            "sage", "xformers")  # fmt: skip
"""diffusers' attention backends tried (the *_hub ones download kernels: nothing can be fetched on the device)."""
MATH_SCORES_LIMIT = 16 * 1024**3
"""_native_math materializes the (S, S) scores per head; skipped above this many bytes of them."""


@dataclass(frozen=True)
class Context:
    device: torch.device
    scaled: bool  # the CPU dry run: the tiny preset's sizes

    @property
    def preset(self) -> H3Preset:
        return get_preset("tiny" if self.scaled else "h3")

    @property
    def layout(self) -> PageLayout:
        return PageLayout.from_config(self.preset.transformer_kwargs())

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def sizes(part: str, scaled: bool) -> dict[str, Any]:
    """What `part` runs at: full size (the released shapes) or scaled (the CPU dry run)."""
    p = get_preset("tiny" if scaled else "h3")
    page = PageLayout.from_config(p.transformer_kwargs()).page_numel
    shape = {"preset": p.name, "heads": p.num_attention_heads, "head_dim": p.attention_head_dim,
             "hidden": p.hidden_size, "ffn": p.ffn_dim, "time_embed_dim": p.time_embed_dim}  # fmt: skip
    if part in ("slab", "swap"):
        return {"slots": SLOTS, "width": WIDTH, "page_numel": page, "dtype": "bfloat16",
                "page_bytes": page * 2, "bytes": SLOTS * WIDTH * page * 2}  # fmt: skip
    if part == "block":
        return {**shape, "tokens": [256, 1024] if scaled else [8192, 32768], "dtype": "bfloat16", "repeats": 3}
    if part == "vae":
        config = "ditcore.repo tiny VAE" if scaled else "released (AutoencoderKLMiniMaxH3's defaults)"
        height, width = (64, 64) if scaled else (768, 1344)
        return {"config": config, "height": height, "width": width, "frames": 22, "latent_frames": 7}
    if part == "rebuild":
        return {**shape, "rows": 18 * p.hidden_size, "m": WIDTH, "dtype": "bfloat16", "repeats": 20}
    raise ValueError(f"unknown part {part!r}")


def timed(ctx: Context, fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` after `warmup` calls (CUDA events on cuda)."""
    for _ in range(warmup):
        fn()
    ctx.sync()
    out: list[float] = []
    for _ in range(repeats):
        if ctx.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def gbps(nbytes: int, seconds: float) -> float | None:
    """Decimal GB/s; None for a time too short to read."""
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else None


# ---------------------------------------------------------------------------- slab
def part_slab(ctx: Context) -> dict[str, Any]:
    from ditruntime.slab import descriptor_to_proto
    from plancache_service.device import SlabMemory

    page = ctx.layout.page_numel
    before = device_bytes(ctx)
    mem = SlabMemory(SLOTS, WIDTH, page, torch.bfloat16, str(ctx.device), "/dev/shm")
    mem.slab.fill_(0.5)
    allocated = device_bytes(ctx)
    export = mem.export()
    wire = descriptor_to_proto(export.descriptor).SerializeToString()
    ctx.sync()
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "gpu_probe.py"), "--consume-slab"],
                          input=wire, capture_output=True, timeout=300)  # fmt: skip
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the consumer exited {proc.returncode}: {proc.stderr.decode(errors='replace')[-1500:]}")
    consumer = json.loads(lines[-1])
    from torch.multiprocessing.reductions import StorageWeakRef

    producer_ref = StorageWeakRef(mem.slab.untyped_storage())
    paths = mem.paths
    export.close()
    mem.close()
    del mem, export
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
        torch.cuda.ipc_collect()  # frees what was exported once its consumer has released it
        torch.cuda.empty_cache()
    after = device_bytes(ctx)
    producer_freed = producer_ref.expired() and after["allocated"] <= before["allocated"]
    unlinked = not any(os.path.exists(p) for p in paths)
    ok = consumer["weakref_expired"] and consumer["close_ok"] and producer_freed and unlinked
    return {"pass": ok, "transport": "cuda_ipc" if ctx.device.type == "cuda" else "shm", "consumer": consumer,
            "producer": {"before": before, "allocated": allocated, "after_free": after, "storage_freed": producer_freed,
                         "shm_files_unlinked": unlinked}}  # fmt: skip


def device_bytes(ctx: Context) -> dict[str, int]:
    """This process's allocated bytes (torch's allocator) and the device's free bytes (cuda); /dev/shm used (cpu)."""
    if ctx.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(ctx.device)
        return {"allocated": int(torch.cuda.memory_allocated(ctx.device)), "device_free": int(free)}
    st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    used = (st.f_blocks - st.f_bfree) * st.f_frsize if st else 0
    return {"allocated": 0, "shm_used": int(used)}


def consume_slab() -> int:
    """The second process of part slab: open the descriptor on stdin, read, close; one JSON line."""
    from ditruntime.slab import SlabMapping, descriptor_from_proto
    from protos.ditserve.plancache.v1 import plancache_pb2 as pb

    desc = descriptor_from_proto(pb.SlabDescriptor.FromString(sys.stdin.buffer.read()))
    ctx = Context(torch.device("cuda" if desc.transport == "cuda_ipc" else "cpu"), desc.transport != "cuda_ipc")
    t0 = time.perf_counter()
    mapping = SlabMapping.open(desc, ctx.device)
    result = {"open_s": round(time.perf_counter() - t0, 4), **_read_slab(ctx, mapping)}
    ref = result.pop("ref")  # every view of the slab is gone with _read_slab's frame
    t0 = time.perf_counter()
    result["close_ok"] = mapping.close(timeout_s=10.0)
    result["close_s"] = round(time.perf_counter() - t0, 4)
    gc.collect()
    result["weakref_expired"] = ref.expired()
    print(json.dumps(result))
    return 0


def _read_slab(ctx: Context, mapping: Any) -> dict[str, Any]:
    """Read bandwidth of the mapped slab: a whole-slab reduction, then every step's SlotReads; and a weak reference
    to its storage (`ref`)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    slab, desc = mapping.slab, mapping.descriptor
    reduce_s = statistics.median(timed(ctx, lambda: slab.sum(dtype=torch.float32), repeats=10))
    reads = SlotReads(slab, list(range(desc.num_slots)), [desc.width] * desc.num_slots)
    steps_s = statistics.median(timed(ctx, lambda: [reads.read(i) for i in range(reads.steps)], repeats=5))
    return {"read_gbps": gbps(desc.slab_bytes, reduce_s), "slot_reads_gbps": gbps(desc.slab_bytes, steps_s),
            "slot_reads_per_step_us": round(steps_s / desc.num_slots * 1e6, 2),
            "ref": StorageWeakRef(slab.untyped_storage())}  # fmt: skip


# ---------------------------------------------------------------------------- swap
def part_swap(ctx: Context) -> dict[str, Any]:
    from plancache_service.config import CacheConfig
    from plancache_service.device import Copier
    from plancache_service.tiers import HostMemoryTier, SlabPages

    page, dtype, n_pages = ctx.layout.page_numel, torch.bfloat16, SLOTS * WIDTH
    nbytes = n_pages * page * dtype.itemsize
    config = CacheConfig(host_cache_bytes=nbytes, device=str(ctx.device), host_reserve_bytes=0)
    tier = HostMemoryTier.allocate(config, page, dtype, ctx.device)
    keys = [PlanKey.from_timesteps(0.001 * (i + 1), 0.1 + 0.001 * (i + 1), 0.9) for i in range(SLOTS)]
    if not tier.host.admit(keys, lambda key, pages: None):
        raise RuntimeError(f"the host tier ({tier.host.capacity_pages} pages) could not take {n_pages} pages")
    for chunk in tier.host.buffer.chunks:
        chunk.fill_(0.25)
    slab = torch.empty((SLOTS, WIDTH, page), dtype=dtype, device=ctx.device)
    pages = SlabPages(slab, Copier(ctx.device))
    fills = [tier.fill(keys, list(range(SLOTS)), pages).counts for _ in range(6)][1:]  # the first warms up
    tier_gbps = statistics.median(c.swap_in_bytes / c.swap_in_s / 1e9 for c in fills)
    src = torch.empty(n_pages * page, dtype=dtype, pin_memory=ctx.device.type == "cuda")
    src.fill_(0.25)
    dst = slab.view(-1)

    def plain_copy() -> float:
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        ctx.sync()
        return time.perf_counter() - t0

    base = [plain_copy() for _ in range(6)][1:]
    base_gbps = nbytes / statistics.median(base) / 1e9
    ratio = tier_gbps / base_gbps
    return {"pass": ratio >= SWAP_TARGET if ctx.device.type == "cuda" else None, "pinned": tier.pinned,
            "chunks": len(tier.host.buffer.chunks), "swap_in_gbps": round(tier_gbps, 3),
            "plain_copy_gbps": round(base_gbps, 3), "ratio": round(ratio, 3), "target_ratio": SWAP_TARGET,
            "vs_pcie_gen5": round(tier_gbps / PCIE_GEN5_GBPS, 3) if ctx.device.type == "cuda" else None,
            "pcie_gen5_gbps": PCIE_GEN5_GBPS}  # fmt: skip


# ---------------------------------------------------------------------------- block
def part_block(ctx: Context) -> dict[str, Any]:
    from diffusers.models.attention_dispatch import attention_backend
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed, MiniMaxH3TransformerBlock

    p, info = ctx.preset, sizes("block", ctx.scaled)
    with torch.device(ctx.device):
        block = MiniMaxH3TransformerBlock(p.hidden_size, p.num_attention_heads, p.attention_head_dim, p.ffn_dim,
                                          p.time_embed_dim, norm_eps=1e-5, qk_norm_eps=1e-5)  # fmt: skip
        block = block.to(torch.bfloat16).eval()  # the block stack is bfloat16 in the released checkpoint
        rope = MiniMaxH3RotaryPosEmbed(rope_freq_dim=p.rope_freq_dim)
    per_token = [block.attn, block.ff]  # adaln_proj runs once per timestep (M = 3), not per token
    linear_params = sum(m.weight.numel() for mod in per_token for m in mod.modules() if isinstance(m, torch.nn.Linear))
    results: dict[str, dict[str, Any]] = {}
    for tokens in info["tokens"]:
        pos = torch.arange(tokens, device=ctx.device)
        position_ids = torch.stack([pos // 4032, (pos // 84) % 48, pos % 84], dim=-1)  # (S, 3): 48 x 84 latent grid
        rotary = rope(position_ids)
        hidden = torch.randn(1, tokens, p.hidden_size, dtype=torch.bfloat16, device=ctx.device)
        temb = torch.randn(WIDTH, p.time_embed_dim, device=ctx.device)  # float32, as the time embedder gives it
        rows = torch.randint(0, WIDTH * 3, (tokens,), device=ctx.device)  # timestep index * 3 + modality tag
        flops = 2 * tokens * linear_params + 4 * tokens * tokens * p.num_attention_heads * p.attention_head_dim
        for name in BACKENDS:
            results.setdefault(name, {})[str(tokens)] = _forward(ctx, name, attention_backend, block,
                                                                 (hidden, temb, rows, rotary), flops, info["repeats"])  # fmt: skip
        del hidden, rotary
    usable = sorted(n for n, r in results.items() if all(v.get("status") == "ok" for v in r.values()))
    best = min(usable, key=lambda n: results[n][str(info["tokens"][-1])]["ms"]) if usable else None
    return {"attention_inner": p.num_attention_heads * p.attention_head_dim, "linear_params": linear_params,
            "backends": results, "usable": usable, "fastest_at_largest": best}  # fmt: skip


def _forward(
    ctx: Context, name: str, backend: Any, block: Any, args: tuple[Any, ...], flops: int, repeats: int
) -> dict[str, Any]:
    tokens, heads = int(args[0].shape[1]), int(block.attn.heads)
    if name == "_native_math" and tokens * tokens * heads * 2 > MATH_SCORES_LIMIT:
        return {
            "status": "skipped",
            "reason": f"would materialize {tokens * tokens * heads * 2 / 1024**3:.0f} GiB of scores",
        }
    try:
        with backend(name), torch.no_grad():
            times = timed(ctx, lambda: block(*args), repeats=repeats)
    except Exception as e:  # a backend this device cannot run (missing package, no kernel), or out of memory
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        kind = "unavailable" if "not usable" in str(e) else "error"
        return {"status": kind, "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"}
    ms = statistics.median(times) * 1000
    return {"status": "ok", "ms": round(ms, 3), "tflops": round(flops / (ms / 1000) / 1e12, 2)}


# ---------------------------------------------------------------------------- vae
def part_vae(ctx: Context) -> dict[str, Any]:
    from diffusers import AutoencoderKLMiniMaxH3

    from ditcore.repo import _build_vae

    info = sizes("vae", ctx.scaled)
    if ctx.scaled:
        vae = _build_vae(seed=0).to(ctx.device)
    else:
        with torch.device(ctx.device):
            vae = AutoencoderKLMiniMaxH3()  # diffusers' defaults are the released configuration
    vae = vae.eval()
    ratio = vae.spatial_compression_ratio
    shape = (1, vae.config.latent_channels, info["latent_frames"], info["height"] // ratio, info["width"] // ratio)
    z = torch.randn(shape, device=ctx.device)
    tile = z[..., : 256 // ratio, : 256 // ratio]  # warm-up on one tile: the same kernels and shapes as every tile
    out: dict[str, Any] = {"decoder_params": sum(t.numel() for t in vae.decoder.parameters())}
    decoded: dict[str, torch.Tensor] = {}
    for dtype in (torch.float32, torch.bfloat16):
        if dtype == torch.bfloat16:  # from_pretrained(torch_dtype=bfloat16)'s rule: _keep_in_fp32_modules stay float32
            keep = list(vae._keep_in_fp32_modules or [])
            for pname, param in vae.named_parameters():
                param.data = param.data.to(load_dtype(pname, dtype, keep))
        name = str(dtype).removeprefix("torch.")
        with torch.no_grad():
            vae.decode(tile)
            ctx.sync()
            t0 = time.perf_counter()
            decoded[name] = vae.decode(z).sample  # (1, 3, frames, height, width)
            ctx.sync()
            seconds = time.perf_counter() - t0
        frames = int(decoded[name].shape[2])
        out[name] = {"decode_s": round(seconds, 4), "frames": frames, "per_frame_s": round(seconds / frames, 5)}
    diff = (decoded["float32"] - decoded["bfloat16"].float()).abs()
    out["bf16_vs_fp32"] = {"max_abs_diff": round(float(diff.max()), 5), "mean_abs_diff": round(float(diff.mean()), 6)}
    out["speedup"] = round(out["float32"]["decode_s"] / out["bfloat16"]["decode_s"], 2)
    return out


# ---------------------------------------------------------------------------- rebuild
def part_rebuild(ctx: Context) -> dict[str, Any]:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AdaLayerNormModulation

    p, info, cuda = ctx.preset, sizes("rebuild", ctx.scaled), ctx.device.type == "cuda"
    with torch.device(ctx.device):
        proj = MiniMaxH3AdaLayerNormModulation(p.time_embed_dim, p.hidden_size).to(torch.bfloat16)
    temb = torch.randn(info["m"], p.time_embed_dim, device=ctx.device)  # (M, E) float32, one plan's temb
    weight, bias = proj.linear.weight, proj.linear.bias
    nbytes = weight.nbytes + bias.nbytes
    with torch.no_grad():
        gemm = statistics.median(timed(ctx, lambda: proj(temb), repeats=info["repeats"]))
    copies: dict[str, Any] = {}
    for kind in ("pinned", "pageable") if cuda else ("pageable",):
        host_w = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=kind == "pinned").fill_(0.5)
        host_b = torch.empty(bias.shape, dtype=bias.dtype, pin_memory=kind == "pinned").fill_(0.5)

        def h2d(w: torch.Tensor = host_w, b: torch.Tensor = host_b) -> None:
            weight.data.copy_(w, non_blocking=True)
            bias.data.copy_(b, non_blocking=True)

        s = statistics.median(timed(ctx, h2d, repeats=5))
        copies[kind] = {"s": round(s, 6), "gbps": gbps(nbytes, s)}
    copy_s = copies["pinned" if cuda else "pageable"]["s"]
    layers = get_preset("h3").num_layers
    return {"weight_bytes": nbytes, "gemm_s": round(gemm, 7), "gemm_gbps": gbps(nbytes, gemm),
            "gemm_tflops": round(2 * info["m"] * weight.numel() / gemm / 1e12, 3), "copy": copies,
            "gemm_vs_copy": round(gemm / copy_s, 4),
            "modeled_49_plan_pass_s": round(layers * (copy_s + SLOTS * gemm), 3),
            "note": None if cuda else "no device: the copy is host to host"}  # fmt: skip


PARTS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "slab": part_slab, "swap": part_swap, "block": part_block, "vae": part_vae, "rebuild": part_rebuild,
}  # fmt: skip
