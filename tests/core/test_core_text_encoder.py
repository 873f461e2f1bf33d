"""ditcore.text_encoder: the Qwen3-VL text encoder kept to the decoder layers MiniMax-H3 reads, without lm_head, gives
exactly diffusers' prompt embeddings and latents (torch.equal against diffusers run with the whole encoder), never
reads the dropped tensors, offloads through the path diffusers calls, reports itself in H3Model.components(), and
refuses a placement it cannot serve; the saving at the released size counted on the real classes (meta)."""

from __future__ import annotations

import dataclasses
import io
import shutil
from pathlib import Path
from typing import Any, ClassVar

import load_probe
import pytest
import torch
from oracle import diffusers_request_latents
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ditcore import GenerationRequest, load_model
from ditcore.denoise import generate_latents
from ditcore.pipeline import load_pipeline
from ditcore.repo import TEXT_LAYERS, write_repository
from ditcore.text_encoder import (
    TEXT_ENCODER_DEVICES,
    TextEncoderError,
    TextEncoderPlacement,
    conditioner_class,
    dropped_bytes,
    place,
)

transformers = pytest.importorskip("transformers")

STORED_LAYERS = 54
"""More than the 51 kept (the tiny preset's own 51 would leave only lm_head to drop)."""
REQUEST = GenerationRequest(prompt="a red fox runs through the snow", num_inference_steps=4, seed=7, height=32,
                            width=32, num_frames=124)  # fmt: skip
RELEASED_TEXT = {
    "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
}  # fmt: skip
"""Qwen3-VL-32B's text_config (hidden 5120, intermediate 25600, vocab 151936; 64 heads of 128, 8 KV heads)."""


def keyframe_png(width: int, height: int, seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def repo54(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset (released mixed precision) whose text encoder has 54 decoder layers and its own lm_head."""
    repo = write_repository(tmp_path_factory.mktemp("te54") / "ckpt", "tiny", seed=0, dtype="mixed", shards=1)
    config = transformers.Qwen3VLConfig.from_pretrained(repo / "text_encoder")
    config.text_config.num_hidden_layers = STORED_LAYERS
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(21)
        encoder = transformers.Qwen3VLForConditionalGeneration(config).eval()
    for p in encoder.parameters():
        p.data = p.data.to(torch.bfloat16)  # the released Qwen3-VL is bfloat16 throughout
    shutil.rmtree(repo / "text_encoder")
    encoder.save_pretrained(repo / "text_encoder")
    return repo


@pytest.fixture(scope="module")
def pipe(repo54: Path) -> Any:
    return load_pipeline(repo54, "mixed")


def prompt_embeds(encoder: Any, pipe: Any, prompt: str) -> torch.Tensor:
    """diffusers' own conditioner call (get_qwen3vl_prompt_embeds), as its t2va text block makes it on `pipe`."""
    from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

    ids = pipe.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return get_qwen3vl_prompt_embeds(encoder, pipe.processor, ids, {}, text_encoder_layer=pipe.text_encoder_layer,
                                     device=pipe._execution_device, dtype=encoder.dtype)  # fmt: skip


def whole_encoder(repo: Path) -> Any:
    return transformers.Qwen3VLForConditionalGeneration.from_pretrained(repo / "text_encoder", dtype=torch.bfloat16)


def test_trimmed_encoder_gives_diffusers_embeddings_and_latents(repo54: Path, pipe: Any) -> None:
    encoder, whole = pipe.text_encoder, whole_encoder(repo54)
    assert len(whole.model.language_model.layers) == STORED_LAYERS and whole.lm_head.weight.numel() > 0
    assert len(encoder.model.language_model.layers) == TEXT_LAYERS == pipe.text_encoder_layer + 1
    assert not hasattr(encoder, "lm_head") and encoder.config.text_config.num_hidden_layers == TEXT_LAYERS
    for prompt in (REQUEST.prompt, "waves crash on the rocky shore, drone shot"):
        ours, ref = prompt_embeds(encoder, pipe, prompt), prompt_embeds(whole, pipe, prompt)
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, ref)
    video, audio = generate_latents(pipe, REQUEST)
    ref_video, ref_audio = diffusers_request_latents(repo54, REQUEST)  # diffusers' pipeline, whole encoder
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)


def test_fl2va_vision_path_equals_diffusers(repo54: Path, pipe: Any) -> None:
    """fl2va runs the keyframe through the vision tower, whose DeepStack features enter the first decoder layers."""
    request = dataclasses.replace(REQUEST, task="fl2va", first_frame=keyframe_png(48, 40, 1))
    video, audio = generate_latents(pipe, request)
    ref_video, ref_audio = diffusers_request_latents(repo54, request)
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)


def test_dropped_layers_and_head_are_never_read(repo54: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.modeling_utils as modeling_utils

    real = modeling_utils.safe_open
    monkeypatch.setattr(modeling_utils, "safe_open", lambda path, *a, **k: load_probe._Handle(real, path, *a, **k))
    monkeypatch.setattr(load_probe, "READS", [])
    load_pipeline(repo54, "mixed")
    names = [r["name"] for r in load_probe.READS if Path(r["file"]).parent.name == "text_encoder"]
    read = set(names)
    assert len(names) == len(read)
    stored = _keys(repo54)
    dropped = {n for n in stored if n.startswith("lm_head.") or _layer(n) >= TEXT_LAYERS}
    assert "lm_head.weight" in dropped and {_layer(n) for n in dropped} >= set(range(TEXT_LAYERS, STORED_LAYERS))
    assert read == stored - dropped  # every kept tensor (each once), no dropped one


def _keys(repo: Path) -> set[str]:
    """Every tensor name in the text encoder's safetensors files (headers only)."""
    from ditcore.checkpoint_files import read_shard_header

    return {n for f in (repo / "text_encoder").glob("*.safetensors") for n in read_shard_header(f).tensors}


def _layer(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "language_model" in parts and "layers" in parts else -1


class OffloadWatch(TorchFunctionMode):
    """Tracks which of an offloaded module's tensors diffusers' group offloading has onloaded (ModuleGroup.onload_
    / offload_) and records every torch function that reads one that is not: on CUDA that weight would still be in
    host memory. Tensors in no group (`resident`) stay where they are. Metadata reads (`.dtype`, is_floating_point)
    are not data reads."""

    METADATA: ClassVar[set[str]] = {"__get__", "is_floating_point"}

    def __init__(self, module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        from diffusers.hooks import group_offloading

        super().__init__()
        self.names = {id(t): n for n, t in [*module.named_parameters(), *module.named_buffers()]}
        self.misses: list[tuple[str, str]] = []
        self.onloads: list[str] = []  # the first module of each group onloaded
        onload, offload = group_offloading.ModuleGroup.onload_, group_offloading.ModuleGroup.offload_

        def members(group: Any) -> list[int]:
            tensors = [t for m in group.modules for t in (*m.parameters(), *m.buffers())]
            return [id(t) for t in (*tensors, *group.parameters, *group.buffers)]

        hooks = [
            m._diffusers_hook.get_hook("group_offloading") for m in module.modules() if hasattr(m, "_diffusers_hook")
        ]
        grouped = {i for hook in hooks if hook is not None for i in members(hook.group)}
        self.resident = sorted(n for i, n in self.names.items() if i not in grouped)
        self.live = set(self.names) - grouped

        def watched_onload(group: Any) -> None:
            self.live.update(members(group))
            self.onloads.append(type(group.modules[0]).__name__ if group.modules else "parameters")
            onload(group)

        def watched_offload(group: Any) -> None:
            offload(group)
            self.live.difference_update(members(group))

        monkeypatch.setattr(group_offloading.ModuleGroup, "onload_", watched_onload)
        monkeypatch.setattr(group_offloading.ModuleGroup, "offload_", watched_offload)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in self.METADATA:
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and id(t) in self.names and id(t) not in self.live:
                    self.misses.append((self.names[id(t)], getattr(func, "__name__", str(func))))
        return func(*args, **kwargs)


def test_offload_onloads_every_weight_before_it_is_read(
    repo54: Path, pipe: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """diffusers calls `text_encoder.model(...)`, not the top-level forward, and Qwen3VLModel runs the token
    embeddings itself before the language model: every weight the encode reads (text and vision paths) is onloaded
    by the group-offloading hooks when it is read, each decoder layer once per encode, and the results stay
    bit-exact. On CPU the onload device is the CPU (no stream, no pinning); the CUDA run is
    test_gpu_offload_equals_device."""
    request = dataclasses.replace(REQUEST, task="fl2va", first_frame=keyframe_png(48, 40, 1))
    want_embeds = prompt_embeds(pipe.text_encoder, pipe, REQUEST.prompt)
    want = generate_latents(pipe, request)
    offloaded = load_pipeline(repo54, "mixed")
    place(offloaded.text_encoder, torch.device("cpu"), True, torch.device("cpu"))
    watch = OffloadWatch(offloaded.text_encoder.model, monkeypatch)
    with watch:
        embeds = prompt_embeds(offloaded.text_encoder, offloaded, REQUEST.prompt)
        assert watch.onloads.count("Qwen3VLTextDecoderLayer") == TEXT_LAYERS
        got = generate_latents(offloaded, request)
    assert watch.misses == []
    assert watch.resident == ["language_model.embed_tokens.weight"]  # kept on the device (offload_model)
    assert "Qwen3VLVisionBlock" in watch.onloads  # the keyframe went through the vision tower
    assert torch.equal(embeds, want_embeds)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_components_report_the_trim(repo54: Path) -> None:
    model = load_model(repo54, "cached")
    comps = {c.name: c for c in model.components()}
    assert list(comps) == ["transformer", "transformer_ref", "text_encoder", "vae", "audio_vae"]
    te = comps["text_encoder"]
    assert (te.device, te.placement, te.dtype, te.device_bytes) == ("cpu", "device", "bfloat16", 0)
    assert te.bytes == sum(p.numel() * p.element_size() for p in model.pipe.text_encoder.parameters()) + sum(
        b.numel() * b.element_size() for b in model.pipe.text_encoder.buffers()
    )
    assert te.note.startswith(f"text layers 0..{TEXT_LAYERS - 1} of {STORED_LAYERS} kept, lm_head dropped")
    whole = whole_encoder(repo54)
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    kept_bytes = sum(p.numel() * p.element_size() for p in model.pipe.text_encoder.parameters())
    assert model.pipe.text_encoder_load.saved_bytes == whole_bytes - kept_bytes > 0
    assert comps["transformer"].bytes + comps["transformer_ref"].bytes == model.memory().transformer_bytes
    assert "adaln_proj" in comps["transformer"].note


def test_released_trim_saving_by_the_real_classes() -> None:
    """Qwen3-VL-32B, 64 -> 51 decoder layers and no lm_head, in bfloat16: 13 x 487,598,336 + 777,912,320
    parameters = 14,233,381,376 bytes (13.26 GiB) never read; the same difference between the whole class and the
    trimmed one, both on meta."""
    config = transformers.Qwen3VLConfig(text_config=RELEASED_TEXT, tie_word_embeddings=False)
    saved = dropped_bytes(config, TEXT_LAYERS, torch.bfloat16)
    assert saved == (13 * 487_598_336 + 777_912_320) * 2 == 14_233_381_376
    trimmed = transformers.Qwen3VLConfig(text_config={**RELEASED_TEXT, "num_hidden_layers": TEXT_LAYERS},
                                         tie_word_embeddings=False)  # fmt: skip
    with torch.device("meta"):
        whole = transformers.Qwen3VLForConditionalGeneration(config)
        kept = conditioner_class()(trimmed)
    assert not hasattr(kept, "lm_head") and len(kept.model.language_model.layers) == TEXT_LAYERS
    assert (sum(p.numel() for p in whole.parameters()) - sum(p.numel() for p in kept.parameters())) * 2 == saved


def test_placement_is_validated() -> None:
    with pytest.raises(TextEncoderError, match=r"--text-encoder-device must be one of auto, cuda, cpu; got 'gpu'"):
        TextEncoderPlacement("gpu")
    with pytest.raises(TextEncoderError, match=r"--text-encoder-offload .* --text-encoder-device is cpu"):
        TextEncoderPlacement("cpu", offload=True)
    with pytest.raises(TextEncoderError, match=r"--text-encoder-offload .* auto resolves to cpu"):
        TextEncoderPlacement("auto", offload=True).check(torch.device("cpu"))
    cuda = torch.device("cuda", 1)
    assert TextEncoderPlacement("auto").device_for(cuda) == TextEncoderPlacement("cuda").device_for(cuda) == cuda
    assert TextEncoderPlacement("cuda").device_for(torch.device("cpu")) == torch.device("cuda")
    assert [TextEncoderPlacement(d).kind(cuda) for d in TEXT_ENCODER_DEVICES] == ["device", "device", "cpu"]
    assert TextEncoderPlacement("cpu").kind(torch.device("cpu")) == "device"
    assert TextEncoderPlacement("cuda", offload=True).kind(cuda) == "offload"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_text_encoder_refused_without_cuda(repo54: Path) -> None:
    with pytest.raises(TextEncoderError, match="--text-encoder-device cuda is cuda, but torch sees no CUDA device"):
        load_pipeline(repo54, "mixed", text_encoder=TextEncoderPlacement("cuda"))


def test_generator_flags_are_validated(repo54: Path) -> None:
    from generator_service.config import GeneratorConfig

    base = {"adaln_mode": "resident", "checkpoint": repo54}
    with pytest.raises(ValueError, match="--text-encoder-device must be one of auto, cuda, cpu"):
        GeneratorConfig(**base, text_encoder_device="gpu")
    with pytest.raises(ValueError, match=r"--text-encoder-offload .* resolves to cpu"):
        GeneratorConfig(**base, text_encoder_offload=True)  # --device cpu
    cfg = GeneratorConfig(**base, device="cuda:1", text_encoder_device="cpu")
    assert cfg.run_options.text_encoder == TextEncoderPlacement("cpu")
    assert GeneratorConfig(**base, device="cuda", text_encoder_offload=True).run_options.text_encoder.offload


def test_generate_local_flags(run_cli: Any, repo54: Path) -> None:
    res = run_cli(["generate-local", "--checkpoint", repo54, "--prompt", "a fox", "--text-encoder-device", "gpu"])
    assert res.code == 2 and "--text-encoder-device" in res.err and "'cpu'" in res.err
    res = run_cli(["generate-local", "--checkpoint", repo54, "--prompt", "a fox", "--text-encoder-offload"])
    assert res.code == 2 and "--text-encoder-offload" in res.err and "resolves to cpu" in res.err


# ---------------------------------------------------------------- CUDA (skipped without it)
@pytest.mark.gpu
def test_gpu_offload_equals_device(repo54: Path) -> None:
    """Offloaded (pinned host memory, one layer at a time on a side stream) and resident on the GPU: the same
    embeddings and latents, and once the request is done no text-encoder byte on the GPU but the token embeddings."""
    from ditcore.model import RunOptions

    resident = load_model(repo54, "resident", "cuda")
    options = RunOptions(text_encoder=TextEncoderPlacement("cuda", offload=True))
    offloaded = load_model(repo54, "resident", "cuda", options=options)
    assert torch.equal(prompt_embeds(offloaded.pipe.text_encoder, offloaded.pipe, REQUEST.prompt),
                       prompt_embeds(resident.pipe.text_encoder, resident.pipe, REQUEST.prompt))  # fmt: skip
    want, got = generate_latents(resident.pipe, REQUEST), generate_latents(offloaded.pipe, REQUEST)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    te = {c.name: c for c in offloaded.components()}["text_encoder"]
    language = offloaded.pipe.text_encoder.model.language_model
    assert (te.device, te.placement, te.device_bytes) == ("cpu", "offload", language.embed_tokens.weight.nbytes)
    assert all(p.is_pinned() for p in language.layers.parameters())


@pytest.mark.gpu
def test_gpu_model_with_cpu_text_encoder(repo54: Path) -> None:
    """The model on the GPU, the text encoder on the CPU: its embeddings are the CPU encoder's (diffusers' own call,
    bit for bit) and the request runs on the GPU."""
    from ditcore.model import RunOptions

    model = load_model(repo54, "resident", "cuda", options=RunOptions(text_encoder=TextEncoderPlacement("cpu")))
    assert model.pipe._execution_device == torch.device("cuda")
    cpu = load_pipeline(repo54, "mixed")
    assert torch.equal(prompt_embeds(model.pipe.text_encoder, cpu, REQUEST.prompt),
                       prompt_embeds(cpu.text_encoder, cpu, REQUEST.prompt))  # fmt: skip
    video, _ = generate_latents(model.pipe, REQUEST)
    assert video.device.type == "cuda"
    te = {c.name: c for c in model.components()}["text_encoder"]
    assert (te.device, te.placement, te.device_bytes) == ("cpu", "cpu", 0)
