"""The seven measurements of scripts/gpu_probe.py, each through the project's own code (or diffusers' classes) at the
released sizes on CUDA, at the `tiny` preset's on the CPU. Each returns the numbers of its one JSON line.

  slab     a slab of 49 x 3 pages (plancache_service.device.SlabMemory), exported, opened in a second process with
           ditruntime.slab.SlabMapping.open, read there (a whole-slab reduction and the per-step SlotReads), closed;
           the consumer's weak reference must expire and the producer's device memory come back
  swap     host-tier swap-in (tiers.HostMemoryTier.fill, pinned on cuda) vs one plain `copy_` of the same bytes
  block    one MiniMaxH3TransformerBlock forward per attention backend diffusers can run, at two token counts
  vae      AutoencoderKLMiniMaxH3.decode per output frame, float32 vs bfloat16 (`_keep_in_fp32_modules` kept)
  rebuild  one adaln_proj GEMM (M = 3, bfloat16 as the checkpoint stores it) vs the host-to-device copy of its weight
  disk     the disk tier (plancache_service.disk_tier.DiskTier over ditruntime.plan_packs.PackStore): a 50-point
           schedule's pack written from a slab (checksums, fsync, rename), its page cache dropped, every plan read
           back (one preadv per plan into the slot or pinned staging, per-plan XXH3-128, copy into the slab) cold and
           warm; the checksum's share alone
  readpath the rebuild's streamed read path (ditcore.plan_stream.PlanStream over projection_reads' ranges of a
           synthetic shard of released-shape adaln_proj tensors) vs one plain sequential pread of the same ranges,
           warm and cold; on cuda the stream's bytes land on the device (pinned staging, side stream)
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
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
DISK_WIDTHS = (1,) + (2,) * (SLOTS - 1)
"""A 50-point schedule's plans as the disk tier stores them: the first forward's one timestep, every later one's two
(97 pages: 0.94 GB at the released page size)."""
READPATH_LAYERS = 3
"""Block projections in part readpath's synthetic shard (0.52 GB each at the released shapes: 1.56 GB; a third
reuses the first's buffer, as every later projection of a pass does)."""
READ_TARGET = 0.8
"""The rebuild's streamed read must reach this share of a plain sequential read of the same bytes."""
RAM_FILE_SYSTEMS = ("tmpfs", "ramfs")
"""File systems a scratch file must avoid: their pages are memory, so nothing is read cold from them."""


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
    if part == "disk":
        pages = sum(DISK_WIDTHS)
        return {"plans": len(DISK_WIDTHS), "pages": pages, "page_numel": page, "dtype": "bfloat16",
                "page_bytes": page * 2, "bytes": pages * page * 2, "warm_repeats": 2}  # fmt: skip
    if part == "readpath":
        layout = PageLayout.from_config(p.transformer_kwargs())
        proj = layout.block_numel * (layout.time_embed_dim + 1) * 2
        return {"layers": READPATH_LAYERS, "rows": layout.block_numel, "time_embed_dim": layout.time_embed_dim,
                "dtype": "bfloat16", "projection_bytes": proj, "bytes": READPATH_LAYERS * proj,
                "warm_repeats": 3}  # fmt: skip
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


# ---------------------------------------------------------------------------- scratch files and the page cache
def file_system(path: Path) -> str:
    """The type of the file system holding `path` (/proc/self/mounts: the longest mount point above it)."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


def scratch_root(need: int) -> tuple[Path, str]:
    """Where a part writes `need` bytes of scratch files, and its file system: DITSERVE_GPU_PROBE_DIR if set, else the
    first of the temp dir and the repository's folder that is on disk (not tmpfs) with room to spare."""
    env = os.environ.get("DITSERVE_GPU_PROBE_DIR")
    if env:
        return Path(env), file_system(Path(env))
    candidates = [Path(tempfile.gettempdir()), Path(__file__).resolve().parent.parent]
    roomy = [c for c in candidates if c.is_dir() and os.access(c, os.W_OK) and free_bytes(c) > need * 1.5 + 2**30]
    for c in roomy:
        if file_system(c) not in RAM_FILE_SYSTEMS:
            return c, file_system(c)
    chosen = roomy[0] if roomy else candidates[0]
    return chosen, file_system(chosen)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def resident_share(path: Path) -> float | None:
    """The share of the file's pages in the page cache (mincore over a read-only mapping: nothing is read), or None
    where it cannot be told."""
    try:
        size = path.stat().st_size
        if size == 0:
            return 0.0
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 0x1, 0x1, fd, 0)  # PROT_READ, MAP_SHARED
        finally:
            os.close(fd)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            pages = -(-size // os.sysconf("SC_PAGE_SIZE"))
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                return None
            resident = pages - bytes(vec).count(0)
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
        return round(resident / pages, 4)
    except (OSError, AttributeError, ValueError):
        return None


def drop_page_cache(path: Path) -> dict[str, Any]:
    """posix_fadvise(POSIX_FADV_DONTNEED) over the whole (fsynced) file; whether it ran and the share of its pages
    still cached after it (`dropped`: none left, None where that cannot be told)."""
    out: dict[str, Any] = {"fadvise": False}
    if not hasattr(os, "posix_fadvise"):
        out["error"] = "no os.posix_fadvise here"
    else:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            out["fadvise"] = True
        except OSError as e:
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            os.close(fd)
    share = resident_share(path)
    out["resident_after"] = share
    out["dropped"] = None if share is None else out["fadvise"] and share <= 0.01
    return out


# ---------------------------------------------------------------------------- disk
class _PackSource:
    """What DiskTier asks of its rebuild source: the identity and page geometry of the plans (nothing is rebuilt)."""

    def __init__(self, layout: PageLayout, device: torch.device) -> None:
        self.layout, self.device, self.devices = layout, device, [device]
        self.dtype, self.shard_mode = torch.bfloat16, "whole"
        self.page_numel, self.page_bytes = layout.page_numel, layout.page_numel * 2

    def partition_fingerprints(self) -> dict[str, str]:
        return {"base": "gpu-probe"}


class _NoRebuild:
    """The rebuild tier behind the probe's disk tier: every plan must come from the pack."""

    def __init__(self, source: _PackSource) -> None:
        self.source = source
        self.built: set[PlanKey] | None = None

    def fill(self, keys: Sequence[PlanKey], slots: Sequence[int], slab: Any) -> Any:
        raise RuntimeError(f"the disk tier missed {len(keys)} plan(s) it had just written")


def part_disk(ctx: Context) -> dict[str, Any]:
    from ditruntime.plan_packs import PackStore, plan_checksum
    from plancache_service.device import Copier
    from plancache_service.disk_tier import DiskTier
    from plancache_service.tiers import SlabPages

    info, layout, cuda = sizes("disk", ctx.scaled), ctx.layout, ctx.device.type == "cuda"
    keys = [
        PlanKey.from_timesteps(*(0.999 - 0.02 * i - 0.001 * j for j in range(w))) for i, w in enumerate(DISK_WIDTHS)
    ]
    slots = list(range(len(keys)))
    assert [k.width for k in keys] == list(DISK_WIDTHS) and len(set(keys)) == len(keys)
    src = torch.randn((len(keys), max(DISK_WIDTHS), layout.page_numel), dtype=torch.bfloat16, device=ctx.device)
    dst = torch.zeros_like(src)
    root, fs = scratch_root(info["bytes"])
    with tempfile.TemporaryDirectory(prefix="gpu-probe-disk-", dir=root) as tmp:
        store = PackStore(Path(tmp) / "plans", max_bytes=2 * info["bytes"] + 2**24)
        rebuild = _NoRebuild(_PackSource(layout, ctx.device))
        tier = DiskTier(store, rebuild, max_pending_bytes=2 * info["bytes"], background=False)  # type: ignore[arg-type]
        assert rebuild.built is not None
        rebuild.built.update(keys)  # as if this prepare had rebuilt them: the tier stores the group
        booked = tier.store(keys, slots, SlabPages(src, Copier(ctx.device)))
        ctx.sync()
        t0 = time.perf_counter()
        booked.copy()  # the pages out of the slab, the pack's checksums, write, fsync, rename (the writer's work)
        write_s = time.perf_counter() - t0
        stats, headers = store.stats(), store.headers()
        if stats.write_errors or len(headers) != 1:
            raise RuntimeError(f"the pack was not written: {stats}")
        header = headers[0]
        dropped = drop_page_cache(header.path)
        pages = SlabPages(dst, Copier(ctx.device))

        def fill() -> tuple[float, int]:
            t0 = time.perf_counter()
            done = tier.fill(keys, slots, pages)  # lookup, read into slot / pinned staging, checksum, copy, fence
            seconds = time.perf_counter() - t0
            if done.counts.disk_hit_plans != len(keys):
                raise RuntimeError(f"{done.counts.disk_hit_plans} of {len(keys)} plans came from the pack")
            return seconds, done.counts.disk_read_bytes

        cold_s, nbytes = fill()
        equal = bool(torch.equal(dst[0, :1], src[0, :1]) and torch.equal(dst[1:], src[1:]))
        warm_s = statistics.median(fill()[0] for _ in range(info["warm_repeats"]))
        refs = [ref for ref in (store.lookup(tier.identity(k), k.bits) for k in keys) if ref is not None]
        t0 = time.perf_counter()
        fd = os.open(header.path, os.O_RDONLY)
        try:  # the reads alone (warm): what is left of a fill is its checksums and copies
            datas = [os.pread(fd, ref.entry.length, header.payload_offset + ref.entry.offset) for ref in refs]
        finally:
            os.close(fd)
        pread_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for data in datas:
            plan_checksum(data)
        sha_s = time.perf_counter() - t0
        del datas
    full = sizes("disk", False)["bytes"]
    return {"pass": equal, "dir": str(root), "fs": fs, "pack_bytes": header.file_bytes, "plans": len(keys),
            "pages": sum(DISK_WIDTHS), "write_s": round(write_s, 4), "write_gbps": gbps(header.file_bytes, write_s),
            "page_cache": dropped, "read_bytes": nbytes, "cold_read_s": round(cold_s, 4),
            "cold_read_gbps": gbps(nbytes, cold_s), "warm_read_s": round(warm_s, 4),
            "warm_read_gbps": gbps(nbytes, warm_s), "pread_only_warm_gbps": gbps(nbytes, pread_s),
            "checksum": "xxh3_128", "checksum_s": round(sha_s, 4), "checksum_gbps": gbps(nbytes, sha_s),
            "checksum_share_warm": round(sha_s / warm_s, 3), "checksum_share_cold": round(sha_s / cold_s, 3),
            "copy": "pinned staging to device" if cuda else "file into the slot", "pages_equal": equal,
            "modeled_50_point_restart_s": round(full * cold_s / nbytes, 3),
            "modeled_50_point_restart_warm_s": round(full * warm_s / nbytes, 3)}  # fmt: skip


# ---------------------------------------------------------------------------- readpath
def write_projection_shard(path: Path, layout: PageLayout, layers: int) -> tuple[list[str], float]:
    """A single-file safetensors shard of the first `layers` blocks' adaln_proj weight and bias (bfloat16 at the
    layout's shapes, random bytes, each bias beside its weight as safetensors lays them out), fsynced: their prefixes
    and the seconds the write and fsync took."""
    prefixes = [prefix for prefix, _, _ in layout.projections()][:layers]
    entries, end = {}, 0
    for prefix in prefixes:
        for part, shape in (("bias", [layout.block_numel]), ("weight", [layout.block_numel, layout.time_embed_dim])):
            n = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)
            entries[f"{prefix}.{part}"] = {"dtype": "BF16", "shape": shape, "data_offsets": [end, end + n]}
            end += n
    head = json.dumps(entries, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    chunk = memoryview(torch.randint(0, 256, (min(end, 64 * 1024**2),), dtype=torch.uint8).numpy().tobytes())
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        left = end
        while left:
            left -= f.write(chunk[: min(left, len(chunk))])
        f.flush()
        os.fsync(f.fileno())
    return prefixes, time.perf_counter() - t0


def part_readpath(ctx: Context) -> dict[str, Any]:
    from ditcore.checkpoint_files import pread_into
    from ditcore.plan_stream import KEEP_BUFFER_BYTES, PlanStream, ReadConfig, projection_reads
    from ditcore.shards import SINGLE_FILE, shard_map

    info, layout, cuda = sizes("readpath", ctx.scaled), ctx.layout, ctx.device.type == "cuda"
    config = ReadConfig.for_device(ctx.device)  # PlanBuilder's default
    root, fs = scratch_root(info["bytes"])
    with tempfile.TemporaryDirectory(prefix="gpu-probe-readpath-", dir=root) as tmp:
        shard = Path(tmp) / SINGLE_FILE
        prefixes, write_s = write_projection_shard(shard, layout, info["layers"])
        files = shard_map(tmp)
        reads = projection_reads(tmp, files, [(p, None) for p in prefixes], ctx.device)  # as PlanBuilder.build asks
        nbytes = sum(r.read_bytes for r in reads)
        plain_buf = memoryview(bytearray(max(s.nbytes for r in reads for s in r.segments)))

        kept: list[torch.Tensor] = []

        def streamed(buffers: Sequence[torch.Tensor] = (), keep: bool = False) -> tuple[float, float]:
            """Seconds from the stream's start to its last projection landed, and the reader's own (read_s); `keep`:
            hold on to its buffers (`kept`) for the next."""
            ctx.sync()
            t0 = time.perf_counter()
            with PlanStream(reads, ctx.device, config, buffers) as stream:
                got = sum(1 for _ in stream)  # the builder's loop, without its GEMMs
            ctx.sync()
            seconds = time.perf_counter() - t0
            if got != len(reads) or stream.read_bytes != nbytes:
                raise RuntimeError(f"the stream gave {got} of {len(reads)} projections, {stream.read_bytes} bytes")
            kept[:] = stream.buffers if keep else []
            return seconds, stream.read_s

        def plain() -> float:
            """One sequential pread per range into a host buffer (no threads, no staging)."""
            t0 = time.perf_counter()
            fd = os.open(shard, os.O_RDONLY)
            try:
                for r in reads:
                    for seg in r.segments:
                        pread_into(fd, plain_buf[: seg.nbytes], seg.offset, seg.path)
            finally:
                os.close(fd)
            return time.perf_counter() - t0

        streamed(), plain()  # warm-up: the page cache, the allocators (pinned staging), the threads
        warm_stream, warm_plain = [], []
        for i in range(info["warm_repeats"]):
            warm_stream.append(streamed(keep=i == info["warm_repeats"] - 1))
            warm_plain.append(plain())
        # PlanBuilder hands a pass's buffers to the next only up to KEEP_BUFFER_BYTES; at the released size every
        # pass allocates its own (on the CPU they are faulted in as they are read into; cuda's allocator caches them)
        reused = streamed(list(kept))
        kept.clear()
        drop_stream = drop_page_cache(shard)
        cold_stream = streamed()
        drop_plain = drop_page_cache(shard)
        cold_plain = plain()

    def numbers(stream: tuple[float, float], plain_s: float, drop: dict[str, Any] | None) -> dict[str, Any]:
        out = {"stream_gbps": gbps(nbytes, stream[0]), "reader_gbps": gbps(nbytes, stream[1]),
               "plain_gbps": gbps(nbytes, plain_s), "ratio": round(plain_s / stream[0], 3)}  # fmt: skip
        return out if drop is None else {**out, "page_cache": drop}

    warm = numbers((statistics.median(s for s, _ in warm_stream), statistics.median(r for _, r in warm_stream)),
                   statistics.median(warm_plain), None)  # fmt: skip
    warm["stream_kept_buffers_gbps"] = gbps(nbytes, reused[0])
    cold = numbers(cold_stream, cold_plain, {"stream": drop_stream, "plain": drop_plain})
    cold_valid = bool(drop_stream["dropped"] and drop_plain["dropped"])
    buffer_bytes = min(config.buffers, len(reads)) * max(r.nbytes for r in reads)  # a PlanStream's projection buffers
    ratios = [warm["ratio"]] + ([cold["ratio"]] if cold_valid else [])
    return {"pass": min(ratios) >= READ_TARGET if cuda else None, "dir": str(root), "fs": fs,
            "layers": len(prefixes), "read_bytes": nbytes, "segments": sum(len(r.segments) for r in reads),
            "fresh_buffers_per_pass": buffer_bytes > KEEP_BUFFER_BYTES,
            "shard_write_gbps": gbps(nbytes, write_s),
            "config": {"threads": config.threads, "staging_bytes": config.staging_bytes, "depth": config.depth,
                       "buffers": config.buffers},
            "lands": "on the device (pinned staging, side stream)" if cuda else "in host buffers",
            "warm": warm, "cold": cold, "cold_valid": cold_valid, "target_ratio": READ_TARGET}  # fmt: skip


PARTS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "slab": part_slab, "swap": part_swap, "block": part_block, "vae": part_vae, "rebuild": part_rebuild,
    "disk": part_disk, "readpath": part_readpath,
}  # fmt: skip
