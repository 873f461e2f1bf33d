"""A memory and time model of MiniMax-H3 at any canvas: the packed sequence, the activation peak of one denoise step,
of the text encoding and of the decode, and the modeled step time on a device class. Nothing is allocated: shapes come
from the real classes' configs (a loaded model's, or ones built on the meta device), the rest is the arithmetic below.

    shapes = ModelShapes.of_components(meta_components(preset="h3"))  # ditcore.footprint; or .of_model(h3_model)
    canvas = Canvas(768, 1344, 345)                      # or Canvas.of(request)
    shapes.tokens(canvas).total                          # 104,222 rows (256 prompt tokens)
    shapes.activations(canvas).peak                      # bytes of the largest phase (a denoise step here)
    shapes.step_time_s(canvas, DEVICE_CLASSES["h200"])   # modeled seconds per denoise step

Each component's weight bytes and the totals per process (`ditserve inspect`) are in ditcore.footprint.

Sequence (diffusers' MiniMaxH3 layout: `[text | keyframe conditions | audio | video]`):
    latent frames  Fl = 5n + 2 for 17n + 5 pixel frames (diffusers' `video_latent_num_frames`)
    video rows     Sv = Fl x (H / 16 / 2) x (W / 16 / 2)   (the VAE's 16x, then the transformer's (1, 2, 2) patch)
    condition rows Sc = keyframes x (H / 32) x (W / 32)     (fl2va: one latent frame per keyframe)
    audio rows     Sa = 2 x round(frames / 24 x 40)        (stereo, channel-major, 40 latents per second)
    text rows      St = prompt tokens (at most its UTF-8 bytes: byte-level BPE, no template, no special tokens)
                        + per keyframe a "<Picture i>: " label (at most 13 tokens) and a vision block of
                        smart_resize(H, W) / 32^2 image tokens + 2
    S = Sv + Sc + Sa + St.   768 x 1344 x 345: Sv = 102 x 24 x 42 = 102,816, Sa = 1,150.

Activation peak of one denoise step (inference, no grad; bytes; e = the compute dtype's size, D = hidden,
I = heads x head_dim, F = ffn, h = heads, r = 6 x rope_freq_dim rotated channels per head):
    held through the blocks   S·D·e (the residual stream) + (Sv + Sc + Sa)·D·4 (proj_in / audio_proj_in are float32
                              and `forward` keeps their outputs) + St·D·e + 2·S·r·4 (rotary cos, sin)
    + the widest block transient, the larger of
      attention  S·(D + 5.25·I)·e   the modulated input, q, k, v and 2.25·I of qk-norm / rotary temporaries at the
                                    widest point (three terms of the rotary sum over 3/4 of each head)
                 + 2·h·S²·e         only where the backend materializes the scores (`_native_math`): scores, softmax
      MLP        S·(3D + 4F)·e      the block's post-attention stream, its attention output, the modulated input,
                                    and SwiGLU's 2F projection, silu(gate) (F) and the product (F)
      output     S·D·max(4e, e+4)   norm_out's modulation temporaries, or its output and the float32 cast for proj_out
      + 2·S·r·e                     each block's cast of cos / sin
Text encoding (Qwen3-VL, `output_hidden_states`; L kept layers, Dt hidden, It intermediate, et its dtype):
    (L + 1)·St·Dt·et (every hidden state is kept) + St·(Dt + 3·It)·et (the widest MLP point).
Decode (V = 3 x frames x H x W pixel values, ed = the decode dtype's size):
    max(2·V·ed (the decoded chunks and their concatenation), V·ed + 8·V (the float32 denormalization))
    + one tile's ViT pass: T·(3·Dv·4 + (4·Fv + 3·Dv)·ed) with T = latent frames per clip x (tile / 16)^2 + registers
    + 1 tokens (float32 residual stream), + 2·hv·T²·ed where scores are materialized;
    + on cpu the uint8 conversion: V (the frames) + 3 x 64 MiB (one chunk's float and scaled copies).
Not modeled (each well under 1% at the released canvas): the adaln tables (6 x 3T x D), index tensors, the latents,
the keyframes' VAE encoding, the scheduler state, the audio VAE's decode (channels x samples, under 100 MB).

Step time: FLOPs / (the device class's peak for the compute dtype x its assumed MFU), with
    linear     2·S·L·(4·D·I + 3·D·F) + 2·S·D·(c_v + c_a) (the output heads run over every row) + 2·(Sv + Sc)·c_v·D
               + 2·Sa·c_a·D + 2·St·(text_dim·D + R·(4·D·I + 3·D·F))   (R refiner blocks on the text rows)
    attention  4·L·S²·I + 4·R·St²·I   (QKᵀ and AV, 2·S²·I each, per block)
The adaln projections are left out of `linear`: they run on the step's 1-3 timesteps, not on the S rows. At the
released maximum canvas attention is about 80% of a step's FLOPs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .decode import DECODE_CHUNK_BYTES
from .repo import PROCESSOR_CONFIG

GB = 1000**3
GIB = 1024**3
LABEL_TOKENS = 13
"""At most as many tokens as the bytes of "<Picture 2>: ", the label before each keyframe's vision block."""
MATERIALIZING_BACKENDS = ("_native_math",)
"""diffusers attention backends that materialize the (h, S, S) scores; every other one is flash-style (O(S) memory;
`native`, torch's SDPA, picks flash / memory-efficient / cuDNN kernels on CUDA and its flash kernel on CPU)."""
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str | torch.dtype) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {list(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


# ---------------------------------------------------------------------------- devices
@dataclass(frozen=True)
class DeviceClass:
    """A device's assumed sustained throughput: dense peak FLOP/s per dtype times an assumed model-FLOPs utilization."""

    name: str
    peak_flops: Mapping[str, float]
    """Dense peak FLOP/s per compute dtype (datasheet figures; no sparsity)."""
    mfu: float
    """Assumed fraction of the peak a denoise step sustains."""
    memory_bytes: int
    note: str

    def flops_per_s(self, dtype: str) -> float:
        return self.peak_flops[dtype] * self.mfu


DEVICE_CLASSES: dict[str, DeviceClass] = {
    "h200": DeviceClass(
        "h200", {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}, 0.45, 139 * GIB,
        "NVIDIA H200 SXM: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32 (no TF32); 141 GB marketed, ~139 GiB usable; "
        "MFU 0.45 assumed (attention-bound at 100k tokens: flash-style kernels sustain roughly 40-60% of peak)",
    ),
    "h100": DeviceClass(
        "h100", {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}, 0.45, 79 * GIB,
        "NVIDIA H100 SXM: the H200's compute with 80 GB (~79 GiB usable)",
    ),
    "cuda": DeviceClass(
        "cuda", {"bfloat16": 300e12, "float16": 300e12, "float32": 20e12}, 0.45, 79 * GIB,
        "an unrecognized CUDA GPU: 300 TFLOP/s dense bf16 assumed (an A100 is 312)",
    ),
    "cpu": DeviceClass(
        "cpu", {"bfloat16": 2.5e12, "float16": 2.5e12, "float32": 2.5e12}, 0.4, 128 * GB,
        "a 16-core AVX-512 host: ~2.5 TFLOP/s fp32 peak (bf16 without AMX runs no faster), MFU 0.4 assumed",
    ),
}  # fmt: skip


def device_class(device_name: str) -> DeviceClass:
    """The class of a device by product name ("NVIDIA H200" -> h200; "cpu" -> cpu; other GPUs -> cuda)."""
    lowered = device_name.lower()
    for key in ("h200", "h100"):
        if key in lowered:
            return DEVICE_CLASSES[key]
    return DEVICE_CLASSES["cpu" if lowered == "cpu" else "cuda"]


# ---------------------------------------------------------------------------- the request's canvas
@dataclass(frozen=True)
class Canvas:
    """What a request's memory and time depend on."""

    height: int
    width: int
    num_frames: int
    prompt_tokens: int = 256
    """Prompt tokens (a bound: `Canvas.of` takes the prompt's UTF-8 bytes)."""
    keyframes: int = 0
    """fl2va keyframes (0, 1 or 2)."""
    decodes: bool = True
    """Whether the request is decoded to video and audio."""
    references: tuple[Any, ...] = ()
    """ref2va: every reference's ditcore.references.ReferenceProbe (sizes, frames, durations), in order."""

    @classmethod
    def of(cls, request: Any) -> Canvas:
        """A GenerationRequest's canvas; its text rows bounded by the prompt's UTF-8 bytes; a ref2va request's
        references by their probes (headers and packets, nothing decoded)."""
        keyframes = int(bool(request.first_frame)) + int(bool(request.last_frame))
        references = tuple(request.probe_references()) if getattr(request, "references", ()) else ()
        return cls(
            request.height, request.width, request.num_frames, len(request.prompt.encode("utf-8")), keyframes,
            request.decodes, references,
        )  # fmt: skip

    def describe(self, tokens: Tokens) -> str:
        return f"{self.height} x {self.width} x {self.num_frames} frames ({tokens.total:,} tokens)"


@dataclass(frozen=True)
class Tokens:
    """Rows of the packed sequence, by kind."""

    video: int
    condition: int
    audio: int
    text: int

    @property
    def total(self) -> int:
        return self.video + self.condition + self.audio + self.text


# ---------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class TransformerShape:
    num_layers: int
    hidden: int
    heads: int
    head_dim: int
    ffn: int
    refiner_layers: int
    text_dim: int
    patch: tuple[int, int, int]
    video_channels: int
    """in_channels x the patch volume: proj_in's input and proj_out's output width."""
    audio_channels: int
    rotary: int
    """Channels of each head the rotary embedding rotates (6 x rope_freq_dim)."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TransformerShape:
        patch = tuple(int(p) for p in config.get("patch_size", (1, 2, 2)))
        return cls(
            int(config["num_layers"]), int(config["hidden_size"]), int(config["num_attention_heads"]),
            int(config["attention_head_dim"]), int(config["ffn_dim"]), int(config.get("num_refiner_layers", 2)),
            int(config["text_dim"]), (patch[0], patch[1], patch[2]),
            int(config.get("in_channels", 24)) * math.prod(patch), int(config.get("audio_in_channels", 32)),
            6 * int(config.get("rope_freq_dim", 16)),
        )  # fmt: skip

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def block_token_params(self) -> int:
        """Per-row weights of one block's matmuls: q, k, v, out (4·D·I) and the SwiGLU MLP (3·D·F)."""
        return 4 * self.hidden * self.inner + 3 * self.hidden * self.ffn


@dataclass(frozen=True)
class TextEncoderShape:
    hidden: int
    intermediate: int
    layers: int
    """Decoder layers the encoder runs (51 when trimmed to what hidden_states[50] needs)."""
    q_width: int
    """heads x head_dim."""
    kv_width: int

    @classmethod
    def from_config(cls, text_config: Mapping[str, Any], layers: int | None = None) -> TextEncoderShape:
        c = text_config
        head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
        return cls(
            int(c["hidden_size"]), int(c["intermediate_size"]), int(layers or c["num_hidden_layers"]),
            int(c["num_attention_heads"]) * head_dim, int(c["num_key_value_heads"]) * head_dim,
        )  # fmt: skip

    @property
    def token_params(self) -> int:
        return self.layers * (2 * self.hidden * (self.q_width + self.kv_width) + 3 * self.hidden * self.intermediate)


@dataclass(frozen=True)
class VideoDecoderShape:
    """The video VAE's ViT decoder and its tiling (diffusers' AutoencoderKLMiniMaxH3, tiling on as released)."""

    layers: int
    heads: int
    head_dim: int
    ffn_mult: int
    registers: int
    spatial: int
    temporal: int
    tile: int
    tile_overlap: int
    clip_latents: int
    """Latent frames each temporal chunk decodes (tokens_chunk_size + token_overlap)."""
    chunk_latents: int
    """Latent frames each clip of clip_frames pixel frames encodes to (tokens_chunk_size)."""
    clip_frames: int
    token_drop: int

    @classmethod
    def of(cls, vae: Any) -> VideoDecoderShape:
        """From an AutoencoderKLMiniMaxH3 instance (on any device, meta included)."""
        c = vae.config
        return cls(
            int(c.decoder_num_layers), int(c.decoder_num_attention_heads), int(c.decoder_attention_head_dim),
            int(c.decoder_ffn_mult), int(c.decoder_num_register_tokens), int(vae.spatial_compression_ratio),
            int(vae.temporal_compression_ratio), int(vae.tile_sample_min_height),
            int(vae.tile_sample_min_overlap_height), int(vae.tokens_chunk_size + vae.token_overlap),
            int(vae.tokens_chunk_size), int(c.clip_length), int(c.token_drop),
        )  # fmt: skip

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    def tiles(self, pixels: int) -> int:
        """Tiles across `pixels` (diffusers' _split_tiles: the fewest tiles whose overlaps are all >= the minimum)."""
        if self.tile >= pixels:
            return 1
        n = math.ceil(pixels / self.tile)
        while self.tile * n - self.tile_overlap * (n - 1) < pixels:
            n += 1
        return n

    def clips(self, latent_frames: int) -> int:
        """Temporal chunks of a latent video (diffusers' _decode)."""
        tokens = latent_frames + self.token_drop
        tokens += (-tokens) % self.chunk_latents
        return tokens // self.chunk_latents - int(self.token_drop > 0)

    def tile_tokens(self) -> int:
        side = self.tile // self.spatial
        return self.clip_latents * side * side + self.registers + 1


@dataclass(frozen=True)
class ReferenceGeometry:
    """The ref2va geometry configs diffusers' setup step reads (`components.config`): the released defaults, or a
    repository's (`modular_model_index.json`; the written presets shrink them)."""

    canvas_short_edge: int = 768
    canvas_max_pixels: int = 768 * 1344
    reference_image_short_edge: int = 2048

    @classmethod
    def of_pipeline(cls, pipe: Any) -> ReferenceGeometry:
        config = pipe.config
        return cls(
            int(getattr(config, "canvas_short_edge", cls.canvas_short_edge)),
            int(getattr(config, "canvas_max_pixels", cls.canvas_max_pixels)),
            int(getattr(config, "reference_image_short_edge", cls.reference_image_short_edge)),
        )


@dataclass(frozen=True)
class ModelShapes:
    """What the activation and time model reads from a model: shapes, dtypes, the attention backend."""

    transformer: TransformerShape
    text: TextEncoderShape
    video_decoder: VideoDecoderShape
    compute_dtype: str = "bfloat16"
    """The transformer's block dtype ("bfloat16" in the released mixed precision, "float32")."""
    text_dtype: str = "bfloat16"
    decode_dtype: str = "bfloat16"
    """The video decoder's compute dtype (the released recipe decodes in half precision)."""
    attention_backend: str = "native"
    text_on_device: bool = True
    """False when the text encoder runs on the host (its activations are then not on the model's device)."""
    device_type: str = "cuda"
    """Where the activations live: "cuda" or "cpu" (the uint8 conversion of a decode then shares the host)."""
    references: ReferenceGeometry = field(default_factory=ReferenceGeometry)
    """Where ref2va's references are put (their rows scale with it)."""

    # ------------------------------------------------------------ constructors
    @classmethod
    def of_components(cls, components: Any, precision: str = "mixed", **options: Any) -> ModelShapes:
        """From a transformer, text encoder and video VAE (ditcore.footprint.Components: on meta) at a repository
        `precision` ("mixed" or "float32"); `options` set the other fields (`text_layers`: the layers it runs)."""
        text_layers = options.pop("text_layers", None)
        text_config = components.text_encoder.config.text_config.to_dict()
        compute = "bfloat16" if precision == "mixed" else "float32"
        return cls(
            TransformerShape.from_config(components.transformer.config),
            TextEncoderShape.from_config(text_config, text_layers),
            VideoDecoderShape.of(components.vae),
            compute_dtype=compute,
            text_dtype=compute,
            **options,
        )

    @classmethod
    def of_model(cls, model: Any) -> ModelShapes:
        """From a loaded ditcore.H3Model: the dtypes, layers, decoder and attention backend it really runs with."""
        pipe = model.pipe
        encoder = pipe.text_encoder
        text = next(c for c in model.components() if c.name == "text_encoder")
        block_dtype = next(pipe.transformer.transformer_blocks[0].parameters()).dtype
        return cls(
            TransformerShape.from_config(model.info.transformer_config),
            TextEncoderShape.from_config(encoder.config.text_config.to_dict()),
            VideoDecoderShape.of(model.decoder.vae),
            compute_dtype=str(block_dtype).removeprefix("torch."),
            text_dtype=str(encoder.dtype).removeprefix("torch."),
            decode_dtype=model.decode_dtype,
            attention_backend=model.attention_backend,
            text_on_device=text.placement != "cpu",  # offloaded: weights on the host, compute on the device
            device_type=model.device.type,
            references=ReferenceGeometry.of_pipeline(pipe),
        )

    # ------------------------------------------------------------ sequence
    def tokens(self, canvas: Canvas) -> Tokens:
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
            MINIMAX_H3_AUDIO_CHANNELS,
            audio_latent_num_frames,
            video_latent_num_frames,
        )
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        t = self.transformer
        d = self.video_decoder
        per_frame = (canvas.height // d.spatial // t.patch[1]) * (canvas.width // d.spatial // t.patch[2])
        frames = video_latent_num_frames(canvas.num_frames, d.clip_frames, d.chunk_latents)
        image = PROCESSOR_CONFIG["image_processor"]
        factor = image["patch_size"] * image["merge_size"]
        h, w = smart_resize(
            canvas.height, canvas.width, factor, image["size"]["shortest_edge"], image["size"]["longest_edge"]
        )
        vision = canvas.keyframes * (LABEL_TOKENS + 2 + (h // factor) * (w // factor))
        ref_rows, ref_vision = self._reference_rows(canvas, factor)
        return Tokens(
            video=frames * per_frame,
            condition=canvas.keyframes * per_frame + ref_rows,
            audio=MINIMAX_H3_AUDIO_CHANNELS * audio_latent_num_frames(canvas.num_frames),
            text=canvas.prompt_tokens + vision + ref_vision,
        )

    def _reference_rows(self, canvas: Canvas, factor: int) -> tuple[int, int]:
        """(condition rows, text encoder vision tokens) of a ref2va request's references, as diffusers' setup step
        puts them: an image at the reference short edge (one latent frame), a video on the canvas its aspect ratio
        resolves to at 24 fps truncated to the generated frames (latent frames by the VAE's 17 -> 5 grouping; read
        by the text encoder at 2 fps in pairs), an audio clip or soundtrack at 40 latents per second per stereo
        channel, up to the generated duration."""
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
            MINIMAX_H3_AUDIO_CHANNELS,
            MINIMAX_H3_AUDIO_LATENTS_PER_SECOND,
            resolve_canvas_size,
        )
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        if not canvas.references:
            return 0, 0
        t, d, g = self.transformer, self.video_decoder, self.references
        multiple = d.spatial * t.patch[2]
        image = PROCESSOR_CONFIG["image_processor"]
        rows = vision = 0
        seconds = canvas.num_frames / 24
        for ref in canvas.references:
            if ref.kind == "image":
                scale = g.reference_image_short_edge / min(ref.width, ref.height)
                ih = max(multiple, round(ref.height * scale / multiple) * multiple)
                iw = max(multiple, round(ref.width * scale / multiple) * multiple)
                rows += (ih // multiple) * (iw // multiple)
                h, w = smart_resize(ih, iw, factor, image["size"]["shortest_edge"], image["size"]["longest_edge"])
                vision += LABEL_TOKENS + 2 + (h // factor) * (w // factor)
            elif ref.kind == "video":
                frames = min(canvas.num_frames, math.floor(ref.frames * 24 / ref.fps + 0.5))
                vh, vw = resolve_canvas_size(ref.width, ref.height, multiple, g.canvas_short_edge, g.canvas_max_pixels)
                latent = max(1, math.ceil(frames * d.chunk_latents / d.clip_frames))
                rows += latent * (vh // multiple) * (vw // multiple)
                h, w = smart_resize(vh, vw, factor, image["size"]["shortest_edge"], image["size"]["longest_edge"])
                blocks = math.ceil(math.ceil(frames / 12) / 2)
                vision += LABEL_TOKENS + blocks * (LABEL_TOKENS + 2 + (h // factor) * (w // factor))
            if ref.has_audio:
                rows += MINIMAX_H3_AUDIO_CHANNELS * round(
                    min(ref.seconds, seconds) * MINIMAX_H3_AUDIO_LATENTS_PER_SECOND
                )
        return rows, vision

    def latent_bytes(self, canvas: Canvas) -> int:
        """Bytes of the final latents a request returns (float32 video and audio: a "latents" result's size, less
        its framing). Each video row is one patch of in_channels x the patch volume; each audio row audio_in_channels."""
        t, n = self.transformer, self.tokens(canvas)
        return 4 * (n.video * t.video_channels + n.audio * t.audio_channels)

    def latent_frames(self, canvas: Canvas) -> int:
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import video_latent_num_frames

        d = self.video_decoder
        return int(video_latent_num_frames(canvas.num_frames, d.clip_frames, d.chunk_latents))

    # ------------------------------------------------------------ memory
    @property
    def materializes_scores(self) -> bool:
        return any(name in self.attention_backend for name in MATERIALIZING_BACKENDS)

    def step_bytes(self, canvas: Canvas) -> int:
        """Activation peak of one denoise forward (module doc)."""
        t, n = self.transformer, self.tokens(canvas)
        e, s, d = dtype_bytes(self.compute_dtype), n.total, t.hidden
        held = s * d * e + (n.video + n.condition + n.audio) * d * 4 + n.text * d * e + 2 * s * t.rotary * 4
        attention = math.ceil(s * (d + 5.25 * t.inner) * e)
        if self.materializes_scores:
            attention += 2 * t.heads * s * s * e
        mlp = s * (3 * d + 4 * t.ffn) * e
        output = s * d * max(4 * e, e + 4)
        return held + max(attention + 2 * s * t.rotary * e, mlp + 2 * s * t.rotary * e, output)

    def text_bytes(self, canvas: Canvas) -> int:
        """Activation peak of the text encoding (0 when the encoder runs off the device)."""
        if not self.text_on_device:
            return 0
        x, st, et = self.text, self.tokens(canvas).text, dtype_bytes(self.text_dtype)
        return (x.layers + 1) * st * x.hidden * et + st * (x.hidden + 3 * x.intermediate) * et

    def decode_bytes(self, canvas: Canvas) -> int:
        """Activation peak of the video decode (0 for a request that returns latents)."""
        if not canvas.decodes:
            return 0
        v = 3 * canvas.num_frames * canvas.height * canvas.width
        ed, d = dtype_bytes(self.decode_dtype), self.video_decoder
        tokens = d.tile_tokens()
        tile = tokens * (3 * d.dim * 4 + (4 * d.ffn_mult * d.dim + 3 * d.dim) * ed)
        if self.materializes_scores:
            tile += 2 * d.heads * tokens * tokens * ed
        # on cpu the uint8 frames and one conversion chunk's temporaries (ditcore.decode.to_uint8_frames)
        host = v + 3 * DECODE_CHUNK_BYTES if self.device_type == "cpu" else 0
        return max(2 * v * ed, v * ed + 8 * v) + tile + host

    def activations(self, canvas: Canvas) -> ActivationPeak:
        return ActivationPeak(self.step_bytes(canvas), self.text_bytes(canvas), self.decode_bytes(canvas))

    # ------------------------------------------------------------ time
    def step_flops(self, canvas: Canvas) -> tuple[int, int]:
        """(linear, attention) FLOPs of one denoise forward (module doc)."""
        t, n = self.transformer, self.tokens(canvas)
        s, d = n.total, t.hidden
        linear = 2 * s * (t.num_layers * t.block_token_params + d * (t.video_channels + t.audio_channels))
        linear += 2 * (n.video + n.condition) * t.video_channels * d + 2 * n.audio * t.audio_channels * d
        linear += 2 * n.text * (t.text_dim * d + t.refiner_layers * t.block_token_params)
        attention = 4 * t.num_layers * s * s * t.inner + 4 * t.refiner_layers * n.text * n.text * t.inner
        return linear, attention

    def step_time_s(self, canvas: Canvas, device: DeviceClass) -> float:
        return sum(self.step_flops(canvas)) / device.flops_per_s(self.compute_dtype)

    def encode_time_s(self, canvas: Canvas, device: DeviceClass) -> float:
        """The text encoding: 2·St·params + 4·L·St²·(heads x head_dim)."""
        x, st = self.text, self.tokens(canvas).text
        flops = 2 * st * x.token_params + 4 * x.layers * st * st * x.q_width
        return flops / device.flops_per_s(self.text_dtype)

    def decode_time_s(self, canvas: Canvas, device: DeviceClass) -> float:
        """Every tile of every temporal clip through the ViT decoder: 2·T·P + 4·Lv·T²·Dv each."""
        if not canvas.decodes:
            return 0.0
        d = self.video_decoder
        tiles = d.tiles(canvas.height) * d.tiles(canvas.width) * d.clips(self.latent_frames(canvas))
        tokens = d.tile_tokens()
        params = d.layers * (4 * d.dim * d.dim + 3 * d.dim * d.ffn_mult * d.dim)
        flops = tiles * (2 * tokens * params + 4 * d.layers * tokens * tokens * d.dim)
        return flops / device.flops_per_s(self.decode_dtype)


@dataclass(frozen=True)
class ActivationPeak:
    """Activation bytes of a request's phases; they run one after another, so the peak is the largest."""

    step: int
    text: int
    decode: int

    @property
    def peak(self) -> int:
        return max(self.step, self.text, self.decode)

    @property
    def phase(self) -> str:
        """The phase the peak comes from."""
        return max(
            ("denoise step", self.step), ("text encoding", self.text), ("decode", self.decode), key=lambda p: p[1]
        )[0]


MAX_STEP_BOUND_S = 86400.0
"""The largest step bound a PreparePlans may carry (a day: the released maximum canvas models at ~11 h per step on
the cpu class, x2); a larger bound is sent as this."""


@dataclass(frozen=True)
class RequestSizer:
    """The model of one loaded model on one device class, per request (what a server's admission and drain use)."""

    shapes: ModelShapes
    device: DeviceClass

    def canvas(self, request: Any) -> Canvas:
        return Canvas.of(request)

    def activations(self, request: Any) -> ActivationPeak:
        return self.shapes.activations(Canvas.of(request))

    def tokens(self, request: Any) -> Tokens:
        return self.shapes.tokens(Canvas.of(request))

    def latent_bytes(self, request: Any) -> int:
        return self.shapes.latent_bytes(Canvas.of(request))

    def step_s(self, request: Any) -> float:
        return self.shapes.step_time_s(Canvas.of(request), self.device)

    def encode_s(self, request: Any) -> float:
        return self.shapes.encode_time_s(Canvas.of(request), self.device)

    def decode_s(self, request: Any) -> float:
        return self.shapes.decode_time_s(Canvas.of(request), self.device)
