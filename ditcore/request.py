"""MiniMax-H3 generation requests: fields, defaults, and H3's rules, checked before any work.

Every service and CLI builds a `GenerationRequest` and calls `validate(limits)`; a bad field raises
`RequestError(field, message)` whose message names the field and states H3's rule (or the operator's tighter limit).
The rules are the released model's: 24 fps, 5 to 15 seconds, `num_frames` of the form 17n + 5 (the video VAE's
grouping: 124 to 345 frames), both canvas sides multiples of 32, aspect ratio 1:4 to 4:1. diffusers would round an
off-grid frame count up with a warning; the service refuses it instead, so a caller gets exactly what it asked for.
The default limits are the released envelope (sides up to 1344, at most 768 x 1344 pixels, either orientation);
an operator may raise them up to MAX_SIDE (the memory admission check then decides what fits the device).
`validate` makes only cheap checks, so admission can run it under a flood: a keyframe is checked by its header and
structure (ditcore.keyframes.probe_image), its pixels are decoded when the request runs (`keyframes`, where a fault of
the pixel data still raises RequestError naming the field), and the prompt's tokens are counted where the served
tokenizer is (`check_prompt_tokens`). A prompt is Unicode text with a visible character and no control character but
tab, line feed and carriage return.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from .keyframes import ImageLimits, MediaError, probe_image
from .media import OUTPUT_TYPES
from .media_cache import decoded_keyframe, decoded_reference, probed_references
from .references import DEFAULT_REFERENCE_LIMITS, IndexedMediaError, Reference, ReferenceLimits, ReferenceProbe

TASKS = ("t2va", "fl2va", "ref2va")
"""Served tasks: text to video+audio, first/last keyframe to video+audio (both on the `transformer/` partition),
and references (images, videos with their soundtrack, audio clips) to video+audio on the `transformer_ref/`
partition."""
KEYFRAME_FIELDS = ("first_frame", "last_frame")
"""The fl2va keyframes: PNG or JPEG bytes; diffusers' `image` (the first frame) and `last_image`."""
MAX_KEYFRAME_BYTES = 20 * 2**20
MAX_KEYFRAME_PIXELS = 4096 * 4096
"""Decoded keyframe size limit (a decompression-bomb guard: checked from the header, before decoding)."""
FPS = 24
MIN_SECONDS, MAX_SECONDS = 5, 15
FRAMES_PER_CHUNK, FRAMES_OFFSET = 17, 5  # num_frames = 17 n + 5
MIN_FRAMES = FRAMES_PER_CHUNK * math.ceil((MIN_SECONDS * FPS - FRAMES_OFFSET) / FRAMES_PER_CHUNK) + FRAMES_OFFSET  # 124
MAX_FRAMES = FRAMES_PER_CHUNK * ((MAX_SECONDS * FPS - FRAMES_OFFSET) // FRAMES_PER_CHUNK) + FRAMES_OFFSET  # 345
CANVAS_MULTIPLE = 32
MAX_SIDE = 4096
"""Largest canvas side an operator may allow (`--max-height` / `--max-width` go up to it)."""
MAX_PIXELS = MAX_SIDE * MAX_SIDE
"""Largest canvas area an operator may allow (`--max-canvas-pixels`)."""
RELEASED_MAX_SIDE = 1344
RELEASED_MAX_PIXELS = 768 * 1344
RELEASED_MAX_VIDEO_PIXELS = RELEASED_MAX_PIXELS * 345
"""The released envelope's height x width x num_frames (768 x 1344 x 345): the default pixels x frames budget, so a
canvas raised beyond the released sides still decodes within the released size's host memory (~1.07 GB of uint8
frames); MAX_VIDEO_PIXELS is the hard cap an operator may raise it to."""
"""The released canvas: 768 x 1344 in either orientation, the default limits (~104k tokens at 345 frames)."""
MIN_ASPECT, MAX_ASPECT = 1 / 4, 4.0  # width / height
MIN_STEPS, MAX_STEPS = 2, 1000
"""num_inference_steps is the schedule's grid points: N points drive N - 1 forwards, so at least 2."""
MAX_SHIFT = 1000.0
MAX_SEED = 2**63 - 1
MAX_PROMPT_BYTES = 16384
"""Prompt limit in UTF-8 bytes (a long prompt costs one text-encoder pass and one longer sequence per step)."""
MAX_PROMPT_TOKENS = 3 * MAX_PROMPT_BYTES
"""Prompt limit in the served tokenizer's tokens (`prompt_tokens`): by default what any prompt within MAX_PROMPT_BYTES
can become, so only an operator's tighter limit refuses a prompt by its tokens. Qwen's tokenizer normalizes to NFC,
which can make UTF-8 text up to 3 times longer (U+1D160, 4 bytes, becomes 3 code points of 12 bytes), and its
byte-level BPE makes at most one token per byte; Qwen3-VL reads far longer sequences."""
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
"""A request id, matched whole (`fullmatch`: "$" would also match before a trailing newline)."""
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
"""Unicode's control characters (category Cc) but tab, line feed and carriage return."""
_INVISIBLE_LETTERS = frozenset("\u115f\u1160\u3164\uffa0")
"""The Hangul fillers: letters (Lo) that render as nothing (default-ignorable code points outside the format
category)."""


class RequestError(ValueError):
    """A request field is invalid. `field` is the request field name (underscored)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message


ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""An adapter's name: its file's stem; no path, no separator."""
DEFAULTED = (("num_inference_steps", "default_steps"), ("flow_shift", "default_flow_shift"),
             ("audio_flow_shift", "default_audio_flow_shift"))  # fmt: skip
"""The request fields an adapter's contract may give a default (request field, contract key): used where a request
leaves the field unset (ditcore.adapter_contract.contract_defaults)."""
QUALITY_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")
"""A quality level's name ("lossless" is every server's)."""
MAX_ADAPTERS = 4
"""Adapters one request may compose, by default (--max-adapters-per-request)."""


@dataclass(frozen=True)
class AdapterUse:
    """One adapter of a request: its name (the adapter file's stem) and scale (PEFT's `set_adapters(names,
    weights)`: the adapter's delta times scale)."""

    name: str
    scale: float = 1.0


def check_uses(uses: Any, max_count: int = MAX_ADAPTERS) -> None:
    """RequestError naming the adapter unless a request's adapter list is well formed: at most `max_count`, names
    that are file stems (no path), no name twice, finite scales."""
    if not isinstance(uses, list | tuple) or not all(isinstance(u, AdapterUse) for u in uses):
        raise RequestError("adapters", f"must be a list of {{name, scale}}, got {uses!r}")
    if len(uses) > max_count:
        raise RequestError(
            "adapters", f"at most {max_count} adapters per request (--max-adapters-per-request), got {len(uses)}"
        )
    seen: set[str] = set()
    for i, use in enumerate(uses):
        if not isinstance(use.name, str) or not ADAPTER_NAME.fullmatch(use.name):
            raise RequestError(
                "adapters",
                f"[{i}].name must be an adapter's name (1-128 of A-Z a-z 0-9 . _ -, no path), got {use.name!r}",
            )
        if use.name in seen:
            raise RequestError("adapters", f"{use.name} is named twice; give each adapter once, with its scale")
        seen.add(use.name)
        scale = use.scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise RequestError("adapters", f"{use.name}: scale must be a finite number, got {scale!r}")


@dataclass(frozen=True)
class RequestLimits:
    """Operator limits: by default the released envelope; each may be raised up to its hard cap (MAX_SIDE,
    MAX_PIXELS) or tightened."""

    max_num_frames: int = MAX_FRAMES
    max_height: int = RELEASED_MAX_SIDE
    max_width: int = RELEASED_MAX_SIDE
    max_prompt_bytes: int = MAX_PROMPT_BYTES
    max_keyframe_bytes: int = MAX_KEYFRAME_BYTES
    max_keyframe_pixels: int = MAX_KEYFRAME_PIXELS
    max_pixels: int = RELEASED_MAX_PIXELS
    """Largest height x width."""
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    """Most tokens of the served tokenizer in a prompt (checked where a tokenizer is at hand: `prompt_tokens`)."""
    max_video_pixels: int = RELEASED_MAX_VIDEO_PIXELS
    """Largest height x width x num_frames: the decoded video's size (its frames and the files made from them)."""
    max_reference_bytes: int = DEFAULT_REFERENCE_LIMITS.max_bytes
    """Bytes of one ref2va reference."""
    max_references_bytes: int = DEFAULT_REFERENCE_LIMITS.max_total_bytes
    """Bytes of all of a request's references."""
    max_reference_seconds: float = DEFAULT_REFERENCE_LIMITS.max_seconds
    """Duration of one video or audio reference."""
    max_reference_frame_pixels: int = DEFAULT_REFERENCE_LIMITS.max_frame_pixels
    """Width x height of a video reference's frames."""
    max_reference_decoded_bytes: int = DEFAULT_REFERENCE_LIMITS.max_decoded_bytes
    """Host bytes one decoded video or audio reference may take."""
    max_adapters: int = MAX_ADAPTERS
    """Adapters one request may compose (--max-adapters-per-request)."""

    def reference_limits(self) -> ReferenceLimits:
        """The ditcore.references limits these operator limits set (an image reference: the keyframe rules, within
        the reference byte limit)."""
        return ReferenceLimits(
            max_bytes=self.max_reference_bytes,
            max_total_bytes=self.max_references_bytes,
            max_seconds=self.max_reference_seconds,
            max_frame_pixels=self.max_reference_frame_pixels,
            max_decoded_bytes=self.max_reference_decoded_bytes,
            image=dataclasses.replace(_image_limits(self), max_bytes=self.max_reference_bytes),
        )


H3_LIMITS = RequestLimits()
"""The released envelope: every front end validates against it unless an operator set other limits."""
MAX_REFERENCE_BYTES = 1024 * 2**20
"""Hard caps an operator may raise the reference limits to (`--max-reference-mb` and the rest)."""
MAX_REFERENCES_BYTES = 4096 * 2**20
MAX_REFERENCE_SECONDS = 600.0
MAX_REFERENCE_FRAME_PIXELS = MAX_SIDE * MAX_SIDE * 4
MAX_REFERENCE_DECODED_BYTES = 64 * 2**30
MODEL_LIMITS = RequestLimits(
    max_height=MAX_SIDE,
    max_width=MAX_SIDE,
    max_pixels=MAX_PIXELS,
    max_video_pixels=MAX_PIXELS * MAX_FRAMES,
    max_reference_bytes=MAX_REFERENCE_BYTES,
    max_references_bytes=MAX_REFERENCES_BYTES,
    max_reference_seconds=MAX_REFERENCE_SECONDS,
    max_reference_frame_pixels=MAX_REFERENCE_FRAME_PIXELS,
    max_reference_decoded_bytes=MAX_REFERENCE_DECODED_BYTES,
)
"""Every canvas and reference H3's rules allow up to the hard caps (what `ditserve inspect` models; what a request
already checked against an operator's limits is decoded within)."""


@dataclass(frozen=True)
class GenerationRequest:
    """One MiniMax-H3 request. Defaults are the CLI's and the RPC's defaults."""

    request_id: str = "req-0"
    task: str = "t2va"
    """"t2va" (text to video+audio) or "fl2va" (first and/or last keyframe to video+audio). Front ends that let the
    task go unset pick with `infer_task`."""
    prompt: str = ""
    """Presented verbatim (no chat template). No negative prompt: the checkpoint is guidance-distilled."""
    num_inference_steps: int = 50
    """Grid points of each schedule (`linspace(1, 0, N)`); N points drive N - 1 transformer forwards."""
    flow_shift: float = 12.0
    """Video schedule shift (H3's release default 12.0)."""
    audio_flow_shift: float = 3.0
    """Audio schedule shift (H3's release default 3.0)."""
    seed: int = 0
    """Seeds the CPU generator the video, then audio, noise is drawn from."""
    height: int = 32
    """Pixels, a multiple of 32. The small default keeps a CPU demo quick; H3's own canvas is 768 x 1344."""
    width: int = 32
    """Pixels, a multiple of 32."""
    num_frames: int = 124
    """Frames at 24 fps, 17n + 5 in [124, 345] (5 to 15 seconds)."""
    first_frame: bytes = b""
    """fl2va: PNG or JPEG bytes of the frame the video starts from (stretched onto the canvas), or empty."""
    last_frame: bytes = b""
    """fl2va: PNG or JPEG bytes of the frame the video ends on (cover-cropped when a first frame is given), or empty."""
    output_type: str = "latents"
    """What the result carries: "latents" (the final latents only), "mp4" or "frames_and_wav" (decoded; see
    ditcore.media)."""
    references: tuple[Reference, ...] = ()
    """ref2va: the references in the order the model reads them (images: PNG / JPEG; videos: MP4 / WebM, with their
    soundtrack; audio: WAV / FLAC / MP3 / AAC), or empty. diffusers' `references`."""
    adapters: tuple[AdapterUse, ...] = ()
    """Adapters active for this request, in this order, each at its scale (ditcore.adapters); empty: the base
    model."""
    quality: str = ""
    """A quality level of the server's --quality-levels (ditcore.quality: a step cache and what it may run with);
    "" or "lossless": no step cache, the model's own computation."""
    quality_audit: bool = False
    """An audit run (`ditserve audit-quality`): the level runs even where no passing audit covers the request and its
    policy refuses such a request, with the warning (ditcore.quality; Generate admits it from the admin alone).
    Every other rule of the level applies."""

    @property
    def steps(self) -> int:
        """Transformer forwards (= plan keys) the request runs."""
        return self.num_inference_steps - 1

    @property
    def has_keyframes(self) -> bool:
        return bool(self.first_frame or self.last_frame)

    def with_task_inferred(self) -> GenerationRequest:
        """This request, its task resolved by `infer_task` if a front end left it unset ("")."""
        if self.task:
            return self
        return dataclasses.replace(self, task=infer_task(self.task, self.has_keyframes, bool(self.references)))

    @property
    def partition(self) -> str:
        """The transformer partition the request's task runs on: "ref" for ref2va, "base" otherwise."""
        return "ref" if self.task == "ref2va" else "base"

    def probe_references(self, limits: RequestLimits = H3_LIMITS) -> list[ReferenceProbe]:
        """Every reference check the bytes' headers and container structure decide, nothing decoded
        (ditcore.references.probe_references; RequestError naming `references[i]`, the MediaError its cause)."""
        try:
            return list(probed_references(self.references, limits.reference_limits()))
        except IndexedMediaError as e:
            raise RequestError(e.field, e.description) from e

    def decoded_references(self, limits: RequestLimits = H3_LIMITS) -> list[Any]:
        """diffusers' reference dataclasses, in order, decoded from the request's bytes (remembered for the request's
        plan keys and its loop: `forget_decoded_keyframes` drops them); RequestError naming `references[i]`."""
        probes = self.probe_references(limits)
        out = []
        for i, (ref, probe) in enumerate(zip(self.references, probes, strict=True)):
            try:
                out.append(decoded_reference(ref, probe, MODEL_LIMITS.reference_limits()))
            except MediaError as e:
                raise RequestError(f"references[{i}]", e.description) from e
        return out

    def has_reference_audio(self) -> bool:
        """Whether any reference brings audio rows (an audio clip, or a video with a soundtrack): ref2va's audio
        reference rows, held at t = 1.0, widen every step's plan by one."""
        return any(p.has_audio for p in self.probe_references(MODEL_LIMITS))

    @property
    def decodes(self) -> bool:
        """Whether the result is decoded to video and audio (any output type but "latents")."""
        return self.output_type != "latents"

    def keyframes(self, limits: RequestLimits = H3_LIMITS) -> dict[str, Any]:
        """diffusers' keyframe inputs, `image` / `last_image`, as RGB PIL images decoded from the request's bytes
        (MediaError, as RequestError naming the field, on bad media; the MediaError is its `__cause__`). This decodes
        the pixels: `validate` has checked everything the headers decide, so what can still fail here is the pixel
        data itself (ditcore.keyframes.decode_image)."""
        inputs: dict[str, Any] = {}
        for name, key in zip(KEYFRAME_FIELDS, ("image", "last_image"), strict=True):
            data = getattr(self, name)
            if data:
                try:
                    if _image_limits(limits) != _image_limits(H3_LIMITS):  # tighter: its header checks first
                        probe_image(data, _image_limits(limits))
                    inputs[key] = decoded_keyframe(data, _image_limits(H3_LIMITS))
                except MediaError as e:
                    raise RequestError(name, e.description) from e
        return inputs

    def probe_keyframes(self, limits: RequestLimits = H3_LIMITS) -> None:
        """Every keyframe check its bytes' header and structure decide, no pixel decoded (ditcore.keyframes.probe_image;
        RequestError naming the field, the MediaError as its `__cause__`)."""
        for name in KEYFRAME_FIELDS:
            data = getattr(self, name)
            if data:
                try:
                    probe_image(data, _image_limits(limits))
                except MediaError as e:
                    raise RequestError(name, e.description) from e

    def pipeline_inputs(self) -> dict[str, Any]:
        """The keyword inputs diffusers' blocks take (the generator and shifts are set apart): the keyframes, when
        given, select the fl2va branch of every conditional block; the references the ref2va branch."""
        inputs = {
            "prompt": self.prompt,
            "height": self.height,
            "width": self.width,
            "num_frames": self.num_frames,
            "num_inference_steps": self.num_inference_steps,
            **self.keyframes(),
        }
        if self.references:
            inputs["references"] = self.decoded_references()
        return inputs

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-safe values: a keyframe is summarised as {"bytes": n, "sha256": hex} (empty: None), a
        reference as {"kind": ..., "bytes": n, "sha256": hex}."""
        out = dataclasses.asdict(self)
        for name in KEYFRAME_FIELDS:
            data = out[name]
            out[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} if data else None
        out["references"] = [
            {"kind": r.kind, "bytes": len(r.data), "sha256": hashlib.sha256(r.data).hexdigest()}
            for r in self.references
        ]
        if not self.adapters:  # a request without adapters reads as it did before they existed (a job's meaning)
            del out["adapters"]
        if not self.quality_audit:  # likewise a request that is no audit run
            del out["quality_audit"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], defaults: GenerationRequest | None = None) -> GenerationRequest:
        """Build from JSON-like data (a JSONL line); omitted keys take `defaults`' values."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise RequestError(unknown[0], f"unknown field; allowed fields: {', '.join(names)}")
        refs = data.get("references")
        if isinstance(refs, list | tuple):  # Reference, bare bytes (read by content) or {"data": ..., "kind": ...}
            data = {**data, "references": tuple(_reference(i, r) for i, r in enumerate(refs))}
        uses = data.get("adapters")
        if isinstance(uses, list | tuple):  # AdapterUse, {"name": ..., "scale": ...} or "NAME" (scale 1)
            data = {**data, "adapters": tuple(_adapter_use(i, u) for i, u in enumerate(uses))}
        return dataclasses.replace(defaults or cls(), **data)

    # ---------------------------------------------------------------- validation
    def validate(self, limits: RequestLimits = H3_LIMITS) -> GenerationRequest:
        """Raise RequestError naming the first bad field; return self when valid. Only cheap checks: a keyframe is
        checked by its header and structure (`probe_keyframes`), its pixels are decoded when the request runs
        (`keyframes`), and the prompt's tokens are counted where the tokenizer is (`prompt_tokens`)."""
        _check_types(self)
        if not _REQUEST_ID.fullmatch(self.request_id):
            raise RequestError("request_id", "must be 1-128 characters of A-Z a-z 0-9 . _ : -")
        if self.task not in TASKS:
            raise RequestError("task", f"unknown task {self.task!r}; allowed: {', '.join(TASKS)}")
        if self.output_type not in OUTPUT_TYPES:
            raise RequestError("output_type", f"must be one of {', '.join(OUTPUT_TYPES)}, got {self.output_type!r}")
        _check_prompt(self.prompt, limits)
        if not MIN_STEPS <= self.num_inference_steps <= MAX_STEPS:
            raise RequestError(
                "num_inference_steps",
                f"must be in [{MIN_STEPS}, {MAX_STEPS}] (grid points; N points run N - 1 forwards), "
                f"got {self.num_inference_steps}",
            )
        for name in ("flow_shift", "audio_flow_shift"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 < value <= MAX_SHIFT):
                raise RequestError(name, f"must be finite and in (0, {MAX_SHIFT:g}], got {value}")
        if not 0 <= self.seed <= MAX_SEED:
            raise RequestError("seed", f"must be in [0, 2^63-1], got {self.seed}")
        check_canvas(self.height, self.width, self.num_frames, limits)
        if self.task == "fl2va" and not self.has_keyframes:
            raise RequestError("first_frame", "fl2va needs a first_frame and/or a last_frame (PNG or JPEG bytes)")
        if self.task == "t2va" and self.has_keyframes:
            name = "first_frame" if self.first_frame else "last_frame"
            raise RequestError(name, "t2va takes no keyframe; use task fl2va (or leave the task unset)")
        if self.task == "ref2va" and self.has_keyframes:
            name = "first_frame" if self.first_frame else "last_frame"
            raise RequestError(name, "ref2va takes no keyframe; pass the image as a reference instead")
        if self.task == "ref2va" and not self.references:
            raise RequestError(
                "references", "ref2va needs at least one image or video reference (and at most 12 references)"
            )
        if self.task != "ref2va" and self.references:
            raise RequestError(
                "references", f"{self.task} takes no references; use task ref2va (or leave the task unset)"
            )
        self.probe_keyframes(limits)  # headers and structure only: bad media is refused before any work
        if self.references:
            self.probe_references(limits)
        check_uses(self.adapters, limits.max_adapters)
        if self.quality and not QUALITY_NAME.fullmatch(self.quality):
            raise RequestError(
                "quality", f"must be a quality level's name (1-64 of a-z 0-9 _ -, from a letter) or lossless, got "
                f"{self.quality[:80]!r}",
            )  # fmt: skip
        return self


def _adapter_use(index: int, use: Any) -> Any:
    """One entry of a JSON-like "adapters" list as an AdapterUse (anything else is left to validate's checks)."""
    if isinstance(use, str):
        return AdapterUse(use)
    if isinstance(use, dict):
        extra = sorted(set(use) - {"name", "scale"})
        if extra or "name" not in use:
            raise RequestError("adapters", f"[{index}] must be {{name, scale}}, got keys {sorted(use)}")
        return AdapterUse(use["name"], use.get("scale", 1.0))
    return use


def _reference(index: int, ref: Any) -> Any:
    """One entry of a JSON-like "references" list as a Reference (anything else is left to validate's type check)."""
    if isinstance(ref, bytes | bytearray):
        return Reference(bytes(ref))
    if isinstance(ref, dict):
        extra = sorted(set(ref) - {"data", "kind"})
        if extra or "data" not in ref:
            raise RequestError(f"references[{index}]", 'a reference mapping has "data" (bytes) and "kind" (optional)')
        return Reference(ref["data"], ref.get("kind", ""))
    return ref


def infer_task(task: str | None, has_keyframes: bool, has_references: bool = False) -> str:
    """The task of a request whose front end let it go unset (None or ""): ref2va with references, fl2va with
    keyframes, else t2va."""
    if task:
        return task
    if has_references:
        return "ref2va"
    return "fl2va" if has_keyframes else "t2va"


def prompt_tokens(tokenizer: Any, prompt: str) -> int:
    """How many tokens MiniMax-H3's text encoder reads for `prompt`: `tokenizer` (the served pipeline's) called
    exactly as diffusers' MiniMax-H3 text blocks call it, `tokenizer(prompt, add_special_tokens=False)` (no template,
    no truncation, no padding: diffusers encodes every token). RequestError naming the prompt when it holds one of
    the tokenizer's special tokens (e.g. "<|image_pad|>"): the blocks would read it as a marker of the presentation,
    not as text (an fl2va request then fails in the text encoder, its image tokens and image features no longer
    matching)."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids)
    found = next((i for i in ids if i in special), None)
    if found is not None:
        raise RequestError(
            "prompt", f"holds the text encoder's special token {tokenizer.convert_ids_to_tokens(found)!r}, which "
            "MiniMax-H3's presentation of a request reserves (it is not read as text); write it another way"
        )  # fmt: skip
    return len(ids)


def check_prompt_tokens(tokenizer: Any, prompt: str, limits: RequestLimits = H3_LIMITS) -> int:
    """`prompt_tokens`, refused over `limits.max_prompt_tokens` (RequestError naming the prompt); returns the count."""
    count = prompt_tokens(tokenizer, prompt)
    if count > limits.max_prompt_tokens:
        raise RequestError("prompt", f"is {count} tokens; allowed at most {limits.max_prompt_tokens}")
    return count


def _check_prompt(prompt: str, limits: RequestLimits) -> None:
    """Unicode text within the byte limit, with no control character but tab, line feed and carriage return, and at
    least one visible character."""
    where = _SURROGATE.search(prompt)
    if where is not None:  # a str can hold one (JSON's "\ud800"); UTF-8 cannot
        raise RequestError(
            "prompt", f"holds an unpaired surrogate (U+{ord(where.group()):04X} at character {where.start()}): not "
            "Unicode text"
        )  # fmt: skip
    n = len(prompt.encode("utf-8"))
    if n > limits.max_prompt_bytes:
        raise RequestError("prompt", f"is {n} bytes; allowed at most {limits.max_prompt_bytes} bytes (UTF-8)")
    where = _CONTROL.search(prompt)
    if where is not None:
        raise RequestError(
            "prompt", f"holds the control character U+{ord(where.group()):04X} at character {where.start()}; of the "
            "control characters only tab, line feed and carriage return are allowed"
        )  # fmt: skip
    if not any(_visible(char) for char in prompt):
        raise RequestError(
            "prompt", "must not be empty: MiniMax-H3 conditions every step on the prompt's text, and this one has no "
            "visible character (only whitespace, format, unassigned or private-use characters, or marks with no "
            "letter to sit on)"
        )  # fmt: skip


def _visible(char: str) -> bool:
    """A letter, number, punctuation, symbol or spacing mark (Unicode categories L*, N*, P*, S*, Mc) that renders as
    something; not whitespace (Z*), a control (Cc), a format character such as a zero-width space or joiner (Cf),
    private use (Co), unassigned (Cn), nor a combining mark (Mn, Me), which shows only on another character."""
    category = unicodedata.category(char)
    return (category[0] in "LNPS" or category == "Mc") and char not in _INVISIBLE_LETTERS


def _image_limits(limits: RequestLimits) -> ImageLimits:
    return ImageLimits(
        max_bytes=min(limits.max_keyframe_bytes, MAX_KEYFRAME_BYTES),
        max_pixels=min(limits.max_keyframe_pixels, MAX_KEYFRAME_PIXELS),
        min_aspect=MIN_ASPECT,
        max_aspect=MAX_ASPECT,
    )


def _check_types(req: GenerationRequest) -> None:
    for f in dataclasses.fields(req):
        v = getattr(req, f.name)
        if f.name in ("request_id", "task", "prompt", "output_type", "quality"):
            ok = isinstance(v, str)
        elif f.name in KEYFRAME_FIELDS:
            ok = isinstance(v, bytes)
        elif f.name == "references":
            ok = isinstance(v, tuple) and all(
                isinstance(r, Reference) and isinstance(r.data, bytes) and isinstance(r.kind, str) for r in v
            )
        elif f.name == "adapters":
            ok = isinstance(v, tuple)  # its entries: check_uses
        elif f.name in ("flow_shift", "audio_flow_shift"):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        elif f.name == "quality_audit":
            ok = isinstance(v, bool)
        else:
            ok = isinstance(v, int) and not isinstance(v, bool)
        if not ok:
            raise RequestError(f.name, f"has the wrong type ({type(v).__name__}: {v!r})")


def check_canvas(height: int, width: int, num_frames: int, limits: RequestLimits = H3_LIMITS) -> None:
    """H3's canvas and frame rules within `limits` (RequestError naming the field)."""
    _check_frames(num_frames, limits)
    _check_canvas(height, width, limits)
    budget = min(limits.max_video_pixels, MAX_PIXELS * MAX_FRAMES)
    if height * width * num_frames > budget:
        released = " (768 x 1344 x 345, the released envelope)" if budget == RELEASED_MAX_VIDEO_PIXELS else ""
        raise RequestError(
            "num_frames", f"height x width x num_frames must be at most {budget:,} pixels{released}, got {height} x "
            f"{width} x {num_frames} = {height * width * num_frames:,}",
        )  # fmt: skip


def _check_frames(frames: int, limits: RequestLimits) -> None:
    top = min(limits.max_num_frames, MAX_FRAMES)
    rule = (
        f"must be of the form 17n + 5 (the video VAE's grouping) for {MIN_SECONDS} to {MAX_SECONDS} seconds at "
        f"{FPS} fps, i.e. one of {MIN_FRAMES}, {MIN_FRAMES + FRAMES_PER_CHUNK}, ..., {MAX_FRAMES}"
    )
    if top < MAX_FRAMES:
        rule += f", and at most {top} on this server"
    if not (MIN_FRAMES <= frames <= top and (frames - FRAMES_OFFSET) % FRAMES_PER_CHUNK == 0):
        raise RequestError("num_frames", f"{rule}; got {frames}")


def _check_canvas(height: int, width: int, limits: RequestLimits) -> None:
    for name, value, top in (("height", height, limits.max_height), ("width", width, limits.max_width)):
        top = min(top, MAX_SIDE)
        if not (CANVAS_MULTIPLE <= value <= top and value % CANVAS_MULTIPLE == 0):
            raise RequestError(
                name,
                f"must be a multiple of {CANVAS_MULTIPLE} (MiniMax-H3's canvas multiple) in "
                f"[{CANVAS_MULTIPLE}, {top}], got {value}",
            )
    if not MIN_ASPECT <= width / height <= MAX_ASPECT:
        raise RequestError(
            "width", f"aspect ratio width:height must be between 1:4 and 4:1 (MiniMax-H3's range), got {width}:{height}"
        )
    area = min(limits.max_pixels, MAX_PIXELS)
    if height * width > area:
        released = " (768 x 1344, the released canvas)" if area == RELEASED_MAX_PIXELS else ""
        raise RequestError(
            "width", f"height x width must be at most {area:,} pixels{released}, got {height} x {width} = "
            f"{height * width:,}"
        )  # fmt: skip
