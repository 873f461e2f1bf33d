"""The DiT: three modality streams (video, audio, text) with joint attention and AdaLN.

Two modes share every line of forward code and differ only in where a block's modulation
comes from (`Modulation`): `resident` projects `adaln_proj` each step, `cached` slices the
step's plan pages. Shapes: B batch (2 with guidance), N joint tokens, h hidden, W plan width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import MOD_CHUNKS, MODALITIES, TEXT_VOCAB, DiTConfig
from .plans import page_slices, project

_EPS = 1e-6


def sinusoid(positions: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """(P,) float32 -> (P, dim) float32 [cos | sin] features (DiT's timestep embedding)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=positions.device) / half)
    args = positions.to(torch.float32)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class Modulation(Protocol):
    """Where a step's AdaLN parameters come from."""

    def block(self, i: int) -> torch.Tensor:
        """(W, 6*3*h) params of block i for the step's W distinct timesteps."""
        ...

    def final(self) -> torch.Tensor:
        """(W, 2*h) shift/scale of the final layer."""
        ...


class PageModulation:
    """Cached mode: slices of the step's plan pages (W, page_numel); no weights involved."""

    def __init__(self, config: DiTConfig, pages: torch.Tensor) -> None:
        self._pages = pages
        self._cols = page_slices(config)

    def block(self, i: int) -> torch.Tensor:
        return self._pages[:, self._cols[i]]

    def final(self) -> torch.Tensor:
        return self._pages[:, self._cols[-1]]


class ResidentModulation:
    """Resident mode: projects the loaded adaln_proj weights with M = W rows each step."""

    def __init__(self, model: DiT, adaln_input: torch.Tensor) -> None:
        self._model = model
        self._x = adaln_input  # (W, T)

    def block(self, i: int) -> torch.Tensor:
        block = self._model.blocks[i]
        assert isinstance(block, DiTBlock)
        proj = block.adaln_proj
        assert proj is not None, "resident modulation needs adaln_proj loaded"
        return project(self._x, proj.weight, proj.bias)

    def final(self) -> torch.Tensor:
        proj = self._model.final_layer.adaln_proj
        assert proj is not None, "resident modulation needs adaln_proj loaded"
        return project(self._x, proj.weight, proj.bias)


class TimestepEmbedder(nn.Module):
    """Sinusoid -> MLP. Small and resident in both the generator and the sidecar."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.freq_dim = config.freq_embed_dim
        self.fc1 = nn.Linear(config.freq_embed_dim, config.time_embed_dim)
        self.fc2 = nn.Linear(config.time_embed_dim, config.time_embed_dim)

    def adaln_input(self, timesteps: torch.Tensor) -> torch.Tensor:
        """(W,) float32 timesteps -> (W, T) silu(temb): the input of every adaln_proj."""
        freq = sinusoid(timesteps, self.freq_dim).to(self.fc1.weight.dtype)
        temb = self.fc2(F.silu(self.fc1(freq)))
        return F.silu(temb)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # (B, heads, N, d)
        return self.out(y.transpose(1, 2).reshape(b, n, h))


class MLP(nn.Module):
    def __init__(self, hidden: int, ratio: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ratio * hidden)
        self.fc2 = nn.Linear(ratio * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class TextLayer(nn.Module):
    """Plain pre-LN transformer layer of the byte-level text encoder."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.norm1 = nn.LayerNorm(h, eps=_EPS)
        self.attn = Attention(h, config.num_heads)
        self.norm2 = nn.LayerNorm(h, eps=_EPS)
        self.mlp = MLP(h, config.mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TextEncoder(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TextLayer(config) for _ in range(config.text_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class DiTBlock(nn.Module):
    def __init__(self, config: DiTConfig, with_adaln: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.hidden = h
        self.adaln_proj = nn.Linear(config.time_embed_dim, config.block_mod_numel) if with_adaln else None
        self.attn = Attention(h, config.num_heads)
        self.mlp = MLP(h, config.mlp_ratio)

    def forward(self, x: torch.Tensor, params: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # params (W, 18h) -> per-modality (3, 6, h) picked by page row -> per token (N, 6, h)
        w = params.shape[0]
        mod = params.view(w, len(MODALITIES), len(MOD_CHUNKS), self.hidden)
        per_mod = mod[rows, torch.arange(len(MODALITIES), device=rows.device)]  # (3, 6, h)
        tok = per_mod.repeat_interleave(counts, dim=0)  # (N, 6, h)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = tok.unbind(1)
        norm = F.layer_norm(x, (self.hidden,), eps=_EPS)
        x = x + gate_msa * self.attn(modulate(norm, shift_msa, scale_msa))
        norm = F.layer_norm(x, (self.hidden,), eps=_EPS)
        return x + gate_mlp * self.mlp(modulate(norm, shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, config: DiTConfig, with_adaln: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.adaln_proj = nn.Linear(config.time_embed_dim, config.final_mod_numel) if with_adaln else None
        self.video_out = nn.Linear(h, config.video_patch_numel)
        self.audio_out = nn.Linear(h, config.audio_channels)


class DiT(nn.Module):
    """The H3-style DiT. `with_adaln=False` builds the cached-mode model (no adaln_proj)."""

    def __init__(self, config: DiTConfig, with_adaln: bool = True) -> None:
        super().__init__()
        self.config = config
        self.with_adaln = with_adaln
        h = config.hidden_size
        self.time_embed = TimestepEmbedder(config)
        self.text_embed = nn.Embedding(TEXT_VOCAB, h)
        self.text_encoder = TextEncoder(config)
        self.video_embed = nn.Linear(config.video_patch_numel, h)
        self.audio_embed = nn.Linear(config.audio_channels, h)
        self.blocks = nn.ModuleList(DiTBlock(config, with_adaln) for _ in range(config.num_layers))
        self.final_layer = FinalLayer(config, with_adaln)

    # ---------------------------------------------------------------- helpers
    def _pos(self, n: int, offset: int, like: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(offset, offset + n, device=like.device)
        return sinusoid(pos, self.config.hidden_size).to(like.dtype)

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, Lt) byte ids -> (B, Lt, h) text context, computed once per request."""
        x = self.text_embed(tokens)
        return self.text_encoder(x + self._pos(tokens.shape[1], 0, x))

    def resident_modulation(self, timesteps: torch.Tensor) -> Modulation:
        return ResidentModulation(self, self.time_embed.adaln_input(timesteps))

    def _patchify(self, video: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        # (B, C, F, H, W) -> (B, F'*H'*W', C*pf*ph*pw)
        b, c, f, hh, ww = video.shape
        pf, ph, pw = self.config.patch_size
        x = video.view(b, c, f // pf, pf, hh // ph, ph, ww // pw, pw)
        x = x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, (f // pf) * (hh // ph) * (ww // pw), -1)
        return x, (b, c, f, hh, ww)

    def _unpatchify(self, x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        b, c, f, hh, ww = shape
        pf, ph, pw = self.config.patch_size
        x = x.view(b, f // pf, hh // ph, ww // pw, c, pf, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(b, c, f, hh, ww)

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        video: torch.Tensor,
        audio: torch.Tensor | None,
        text_ctx: torch.Tensor,
        mod: Modulation,
        video_row: int,
        audio_row: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Velocity for video (B, Cv, F, H, W) and audio (B, Ca, La) latents, in model dtype."""
        vtok, vshape = self._patchify(video)
        xv = self.video_embed(vtok)
        xv = xv + self._pos(xv.shape[1], 0, xv)
        parts = [xv]
        na = 0
        if audio is not None:
            xa = self.audio_embed(audio.transpose(1, 2))  # (B, La, h)
            parts.append(xa + self._pos(xa.shape[1], 0, xa))
            na = xa.shape[1]
        parts.append(text_ctx)
        x = torch.cat(parts, dim=1)  # (B, N, h), modality order video, audio, text
        counts = torch.tensor([xv.shape[1], na, text_ctx.shape[1]], device=x.device)
        rows = torch.tensor([video_row, audio_row, video_row], device=x.device)  # text follows the video timestep
        for i, block in enumerate(self.blocks):
            x = block(x, mod.block(i), rows, counts)
        return self._final(x, mod.final(), vshape, xv.shape[1], na, video_row, audio_row)

    def _final(
        self, x: torch.Tensor, params: torch.Tensor, vshape: Sequence[int], nv: int, na: int, vrow: int, arow: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.config.hidden_size
        fin = params.view(params.shape[0], 2, h)  # (W, shift|scale, h)
        norm = F.layer_norm(x, (h,), eps=_EPS)
        yv = modulate(norm[:, :nv], fin[vrow, 0], fin[vrow, 1])
        video = self._unpatchify(self.final_layer.video_out(yv), vshape)
        if na == 0:
            return video, None
        ya = modulate(norm[:, nv : nv + na], fin[arow, 0], fin[arow, 1])
        return video, self.final_layer.audio_out(ya).transpose(1, 2)
