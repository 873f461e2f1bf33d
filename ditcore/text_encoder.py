"""MiniMax-H3's Qwen3-VL text encoder as the pipeline reads it: only the decoder layers up to the hidden state diffusers
conditions on, no language-model head, and placed on a device, on the CPU, or offloaded to pinned host memory.

diffusers' MiniMax-H3 text blocks (`get_qwen3vl_prompt_embeds`) call `text_encoder.model(..., output_hidden_states=
True)` and keep `hidden_states[text_encoder_layer]` (50): the input of decoder layer 50, which the layers above and
`lm_head` never touch. They refuse a stack of <= 50 layers (its last hidden state is post-norm), so exactly
`text_encoder_layer + 1` layers are kept (51 of the released Qwen3-VL-32B's 64). The dropped tensors are never read
nor allocated: from_pretrained gets a config with 51 layers and a class without `lm_head`, so their checkpoint keys
are unexpected ones, which transformers never materializes. Bit-exact with diffusers on the whole encoder
(tests/core/test_core_text_encoder.py); 13.26 GiB of bfloat16 not loaded at the released size.

Placement (`TextEncoderPlacement`: the generator's --text-encoder-device / --text-encoder-offload):
    device    weights and compute on its device ("auto": the model's), loaded straight onto it
    cpu       weights and compute on the CPU while the model runs on an accelerator
    offload   weights in pinned host memory; diffusers' group offloading copies one decoder layer at a time to the
              CUDA device for each encode (the next layer's copy, on a side stream, overlaps this layer's compute)
              and drops it after; only the token embeddings stay on the device (1.45 GiB at the released size;
              offload_model says why). An encode is then bound by the copy (47.4 GiB: about 1 s at PCIe Gen5's
              ~55 GB/s); it is not overlapped with the previous request's denoise, which would need the device
              memory the offload frees.
Inputs reach an encoder on another device than the model's through a pre-hook on `text_encoder.model`; diffusers
moves the embeddings back (`.to(device)`), and the pipeline's execution device stays the model's (pipeline.py).
On a replica of several ranks only rank 0 loads one: it broadcasts each prompt embedding (share_prompt_embeddings),
which the other ranks' weightless ReceivedTextEncoder returns (receive_text_encoder).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .replica import Replica

AUTO = "auto"
TEXT_ENCODER_DEVICES = (AUTO, "cuda", "cpu")
"""--text-encoder-device: "auto" (the model's device), "cuda" (the model's CUDA device, else the current one), "cpu"."""
PLACEMENTS = ("device", "cpu", "offload", "rank0")
""""rank0": a replica rank other than 0, which loads no text encoder and receives rank 0's prompt embedding."""
"""How an encoder is placed, as GetStatus reports it (ComponentPlacement.placement)."""
_OFFLOADED_BLOCKS = ["visual", "language_model"]
"""The children of `Qwen3VLModel` group offloading descends into (offload_model)."""


class TextEncoderError(ValueError):
    """A text encoder that cannot be loaded or placed as asked; the message names the file or the flag."""


@dataclass(frozen=True)
class TextEncoderPlacement:
    """Where the text encoder runs and where its weights live between requests."""

    device: str = AUTO
    """One of TEXT_ENCODER_DEVICES (--text-encoder-device)."""
    offload: bool = False
    """Keep the weights in pinned host memory and stream them to the (CUDA) device per encode (--text-encoder-offload)."""

    def __post_init__(self) -> None:
        if self.device not in TEXT_ENCODER_DEVICES:
            raise TextEncoderError(
                f"--text-encoder-device must be one of {', '.join(TEXT_ENCODER_DEVICES)}; got {self.device!r}"
            )
        if self.offload and self.device == "cpu":
            raise TextEncoderError(
                "--text-encoder-offload streams the weights to a CUDA text encoder; --text-encoder-device is cpu"
            )

    def device_for(self, model_device: torch.device) -> torch.device:
        """The device the encoder computes on, for a model on `model_device` (no check that it exists)."""
        if self.device == AUTO:
            return model_device
        if self.device == "cuda":
            return model_device if model_device.type == "cuda" else torch.device("cuda")
        return torch.device("cpu")

    def check(self, model_device: torch.device) -> None:
        """TextEncoderError when offload is asked of an encoder that would not compute on CUDA."""
        device = self.device_for(model_device)
        if self.offload and device.type != "cuda":
            raise TextEncoderError(
                f"--text-encoder-offload streams the weights to a CUDA device; --text-encoder-device {self.device} "
                f"resolves to {device} (the model runs on {model_device})"
            )

    def resolve(self, model_device: torch.device) -> torch.device:
        """device_for, checked: offload needs CUDA, and a CUDA device must be there."""
        self.check(model_device)
        device = self.device_for(model_device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise TextEncoderError(f"--text-encoder-device {self.device} is {device}, but torch sees no CUDA device")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # from_pretrained's device_map wants one
        return device

    def kind(self, model_device: torch.device) -> str:
        """ "offload", "cpu" (on the CPU while the model is not) or "device" (PLACEMENTS)."""
        if self.offload:
            return "offload"
        cpu_apart = self.device_for(model_device).type == "cpu" and model_device.type != "cpu"
        return "cpu" if cpu_apart else "device"


@dataclass(frozen=True)
class LoadedTextEncoder:
    """What load_text_encoder kept and where it put it (GetStatus' note for the text encoder)."""

    stored_layers: int
    """Decoder layers in the checkpoint (text_encoder/config.json's text_config.num_hidden_layers)."""
    kept_layers: int
    """Decoder layers loaded: text_encoder_layer + 1."""
    head_dropped: bool
    """The checkpoint's `lm_head` was not loaded (False only where it is tied to the embeddings, i.e. not stored)."""
    saved_bytes: int
    """Bytes of the dropped layers and lm_head at the loaded dtype: never read, never allocated."""
    device: torch.device
    """Where it computes."""
    placement: str
    """One of PLACEMENTS."""

    def note(self) -> str:
        if self.placement == "rank0":
            return "not loaded on this rank: rank 0 encodes each prompt and broadcasts its embedding"
        kept = f"text layers 0..{self.kept_layers - 1} of {self.stored_layers} kept"
        head = ", lm_head dropped" if self.head_dropped else ""
        out = f"{kept}{head} ({self.saved_bytes:,} bytes = {self.saved_bytes / 2**30:.2f} GiB not loaded)"
        if self.placement == "offload":
            out += f"; offloaded: pinned host memory, streamed to {self.device} layer by layer per encode (the token"
            out += " embeddings stay there)"
        return out


@functools.cache
def conditioner_class() -> Any:
    """Qwen3VLForConditionalGeneration without `lm_head`: what diffusers' MiniMax-H3 blocks call (`.model`) and no
    more. Keys of the decoder layers above the config's count, and the head's, are expected to be in the checkpoint
    and skipped unread; any other unexpected or missing key is still reported by transformers."""
    from transformers import Qwen3VLForConditionalGeneration

    class Qwen3VLConditioner(Qwen3VLForConditionalGeneration):
        _tied_weights_keys: dict[str, str] = {}  # noqa: RUF012 - transformers' class attribute; no head to tie

        def __init__(self, config: Any) -> None:
            super().__init__(config)  # from_pretrained builds on meta: the head below was never allocated
            del self.lm_head
            kept = "|".join(str(i) for i in range(config.text_config.num_hidden_layers))
            inherited = getattr(self, "_keys_to_ignore_on_load_unexpected", None)  # post_init's: with the children's
            self._keys_to_ignore_on_load_unexpected = set(inherited or ()) | {
                r"^lm_head\.",
                rf"^model\.language_model\.layers\.(?!(?:{kept})\.)\d+\.",
            }

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            raise TypeError(
                "this Qwen3-VL was loaded for MiniMax-H3 without its language-model head; diffusers' blocks call "
                "text_encoder.model(...) and read hidden_states[text_encoder_layer]"
            )

    return Qwen3VLConditioner


def _trimmed_config(pipe: Any) -> tuple[Any, str, dict[str, Any], int, int]:
    """`pipe`'s text encoder config (its ComponentSpec: repository, subfolder, variant, revision) trimmed to
    `text_encoder_layer + 1` decoder layers; (config, root, where, stored layers, kept layers)."""
    spec = pipe.get_component_spec("text_encoder")
    where = {k: getattr(spec, k) for k in spec.loading_fields() if getattr(spec, k, None) is not None}
    root = where.pop("pretrained_model_name_or_path")
    config = spec.type_hint.config_class.from_pretrained(root, **where)
    stored, keep = int(config.text_config.num_hidden_layers), int(pipe.text_encoder_layer) + 1
    if stored < keep:
        raise TextEncoderError(
            f"{where.get('subfolder', '')}/config.json: MiniMax-H3 reads hidden_states[{keep - 1}] of its Qwen3-VL, "
            f"which needs {keep} decoder layers; text_config.num_hidden_layers is {stored}"
        )
    return config, root, where, stored, keep


def receive_text_encoder(pipe: Any, dtype: torch.dtype, replica: Any) -> LoadedTextEncoder:
    """On a replica rank other than 0: install a text encoder that holds no weights and receives rank 0's prompt
    embedding for each encode (ReceivedTextEncoder); none of its bytes are read."""
    config, _, _, stored, keep = _trimmed_config(pipe)
    saved = dropped_bytes(config, 0, dtype)  # every layer and the head: nothing of it is loaded here
    config.text_config.num_hidden_layers = keep
    pipe.update_components(text_encoder=ReceivedTextEncoder(config, dtype, keep - 1, replica))
    return LoadedTextEncoder(stored, 0, True, saved, replica.device, "rank0")


def load_text_encoder(
    pipe: Any, dtype: torch.dtype, placement: TextEncoderPlacement, model_device: torch.device
) -> LoadedTextEncoder:
    """Load `pipe`'s text encoder (its ComponentSpec: repository, subfolder, variant, revision) at `dtype`, trimmed
    to `pipe.text_encoder_layer + 1` decoder layers without lm_head, place it, and install it in `pipe`."""
    config, root, where, stored, keep = _trimmed_config(pipe)
    saved = dropped_bytes(config, keep, dtype)
    config.text_config.num_hidden_layers = keep
    device = placement.resolve(model_device)
    load_on = torch.device("cpu") if placement.offload else device
    encoder, info = conditioner_class().from_pretrained(
        root, config=config, dtype=dtype, device_map={"": str(load_on)}, output_loading_info=True, **where
    )
    if info["missing_keys"] or info["mismatched_keys"] or info["unexpected_keys"]:
        raise TextEncoderError(
            f"{where.get('subfolder', '')}: tensors missing {sorted(info['missing_keys'])}, mismatched "
            f"{sorted(info['mismatched_keys'])}, unexpected {sorted(info['unexpected_keys'])}"
        )
    encoder.eval()
    tied = _tied(config)
    loaded = LoadedTextEncoder(stored, keep, not tied, saved, device, placement.kind(model_device))
    place(encoder, device, placement.offload, model_device)
    pipe.update_components(text_encoder=encoder)
    return loaded


def _tied(config: Any) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def dropped_bytes(config: Any, keep: int, dtype: torch.dtype) -> int:
    """Bytes at `dtype` of a Qwen3-VL config's decoder layers from `keep` up and of its lm_head (none when tied to
    the embeddings): what a trimmed load never reads. One decoder layer is built on meta to count its parameters."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextDecoderLayer

    text = config.text_config
    with torch.device("meta"):
        layer = Qwen3VLTextDecoderLayer(text, 0)
    per_layer = sum(p.numel() for p in layer.parameters())
    head = 0 if _tied(config) else int(text.hidden_size) * int(text.vocab_size)
    return (max(0, int(text.num_hidden_layers) - keep) * per_layer + head) * dtype.itemsize


def place(encoder: Any, device: torch.device, offload: bool, model_device: torch.device) -> None:
    """Offload `encoder.model` (offload_model) or leave it where it was loaded; bridge its inputs when it computes
    elsewhere than the model."""
    if offload:
        offload_model(encoder.model, device)
    if device != model_device:
        encoder.model.register_forward_pre_hook(_inputs_to(device), with_kwargs=True)


def offload_model(model: Any, device: torch.device) -> None:
    """Qwen3VLModel `model` in pinned host memory, onloaded group by group to `device` by diffusers' group
    offloading (block level: the vision tower's and the language model's ModuleLists, a block per group, the rest of
    each in one group onloaded at its forward), except the token embeddings, moved to `device` for good:
    `Qwen3VLModel.forward` calls them itself, before the language model's forward whose hooks would onload them
    (1.45 GiB at the released size; every other weight leaves the device after each encode)."""
    from diffusers.hooks import apply_group_offloading

    language = model.language_model
    embed = language.embed_tokens.to(device)
    del language.embed_tokens  # out of every group: offloading sees the language model without it
    try:
        if device.type == "cuda":  # pin tensor by tensor: the host never holds two copies of the weights
            for t in itertools.chain(model.parameters(), model.buffers()):
                t.data = t.data.pin_memory()
        apply_group_offloading(
            model, onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
            num_blocks_per_group=1, use_stream=device.type == "cuda", block_modules=_OFFLOADED_BLOCKS,
        )  # fmt: skip
    finally:
        language.embed_tokens = embed


def _inputs_to(device: torch.device) -> Any:
    """A forward pre-hook moving every tensor argument to `device` (diffusers builds them on the model's device)."""
    from accelerate.utils import send_to_device

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return send_to_device(args, device), send_to_device(kwargs, device)

    return hook


# ---------------------------------------------------------------------------- on a replica: rank 0 encodes for all
def share_prompt_embeddings(text_encoder: Any, layer: int, replica: Replica) -> Any:
    """On rank 0: after each forward of `text_encoder.model` (diffusers' MiniMax-H3 text blocks read its
    `hidden_states[layer]`), broadcast that hidden state to the other ranks. Returns the hook's handle."""

    def share(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        state = output.hidden_states[layer]
        replica.broadcast_tensor(state, state.dtype, state.device)

    return text_encoder.model.register_forward_hook(share, with_kwargs=True)


class _Received:
    """What diffusers reads of a Qwen3-VL forward's output: `hidden_states[layer]`, here the broadcast one."""

    def __init__(self, layer: int, state: torch.Tensor) -> None:
        self._layer, self._state = layer, state

    @property
    def hidden_states(self) -> _Received:
        return self

    def __getitem__(self, index: int) -> torch.Tensor:
        if index != self._layer:
            raise IndexError(f"rank 0 broadcast hidden_states[{self._layer}] only, not [{index}]")
        return self._state


class ReceivedTextEncoder(torch.nn.Module):
    """A rank's text encoder that is rank 0's: no weights; `model(...)` returns the hidden state rank 0 broadcast
    for the same call (every rank runs diffusers' same blocks on the same request, so the calls pair up). `config`
    is the trimmed Qwen3-VL config diffusers checks; `dtype` the encoder's."""

    def __init__(self, config: Any, dtype: torch.dtype, layer: int, replica: Replica) -> None:
        super().__init__()
        self.config = config
        self._dtype = dtype
        self._layer = layer
        self._replica = replica
        self.model = _ReceivedModel(self)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def receive(self) -> _Received:
        state = self._replica.broadcast_tensor(None, self._dtype, self._replica.device)
        return _Received(self._layer, state)


class _ReceivedModel:
    def __init__(self, owner: ReceivedTextEncoder) -> None:
        self._owner = owner

    def __call__(self, *args: Any, **kwargs: Any) -> _Received:
        return self._owner.receive()
