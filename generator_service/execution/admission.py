"""Admission: the cheap checks a request passes before it takes a queue slot (no gRPC).

H3's rules and the operator's limits (keyframes and references by their headers and structure only: their pixels are
decoded when the run starts, one at a time, on the executor thread; a refusal over an operator limit names its flag),
the partition it needs, the prompt's tokens, whether it can ever fit the slab and split across a replica's ranks, its
modeled activation peak (ditcore.sizing) against the device's free memory (RequestTooLargeForDeviceError), and
`expected_generation`. The queue's capacity is checked first, by the queue (generator_service.execution.queue).
"""

from __future__ import annotations

from ditcore import GenerationRequest, RequestError, RequestLimits
from ditcore.keyframes import MediaError
from ditcore.request import KEYFRAME_FIELDS
from ditruntime.errors import GenerationMismatchError

from ..backends.base import Backend, check_prompt_tokens
from .policy import LIMITED_FIELDS, MIB, SizingPolicy
from .runs import Run


def check_request(request: GenerationRequest, limits: RequestLimits) -> None:
    """H3's rules and the operator's limits; a refusal over an operator limit names its flag."""
    try:
        request.validate(limits)
    except RequestError as e:
        note = _operator_limit(request, limits, e)
        if note:
            raise RequestError(e.field, f"{e.description} (this server's {note})") from e
        raise


def _operator_limit(request: GenerationRequest, limits: RequestLimits, e: RequestError) -> str:
    """'--flag is value' of the operator limit `e` broke ("" if it broke H3's own rule or a format rule)."""
    if e.field in KEYFRAME_FIELDS:  # the limit ditcore.media names on the MediaError behind it
        broken = e.__cause__.limit if isinstance(e.__cause__, MediaError) else ""
        if broken == "max_bytes":
            return f"--max-keyframe-mb is {limits.max_keyframe_bytes / MIB:g}"
        if broken == "max_pixels":
            return f"--max-keyframe-pixels is {limits.max_keyframe_pixels}"
        return ""
    if e.field.startswith("references"):  # ditcore.references' limit names, behind the MediaError
        broken = e.__cause__.limit if isinstance(e.__cause__, MediaError) else ""
        flags = {
            "max_bytes": f"--max-reference-mb is {limits.max_reference_bytes / MIB:g}",
            "max_total_bytes": f"--max-references-mb is {limits.max_references_bytes / MIB:g}",
            "max_seconds": f"--max-reference-seconds is {limits.max_reference_seconds:g}",
            "max_frame_pixels": f"--max-reference-frame-pixels is {limits.max_reference_frame_pixels}",
            "max_decoded_bytes": f"--max-reference-decoded-mb is {limits.max_reference_decoded_bytes / MIB:g}",
            "max_pixels": f"--max-keyframe-pixels is {limits.max_keyframe_pixels}",
        }
        return flags.get(broken, "")
    if e.field == "num_frames" and request.height * request.width * request.num_frames > limits.max_video_pixels:
        return f"--max-video-pixels is {limits.max_video_pixels}"
    attr = LIMITED_FIELDS.get(e.field)
    if attr is None:
        return ""
    value = getattr(request, e.field)
    size = len(value.encode("utf-8")) if isinstance(value, str) else value
    limit = getattr(limits, attr)
    if isinstance(size, int) and size > limit:  # a side over its own limit is named before the area
        return "--" + attr.replace("_", "-") + f" is {limit}"
    if e.field in ("height", "width") and request.height * request.width > limits.max_pixels:
        return f"--max-canvas-pixels is {limits.max_pixels}"
    return ""


def check_generation(backend: Backend, run: Run) -> None:
    """GenerationMismatchError when the run asked for a weight generation other than the one served."""
    if run.expected_generation is not None:
        current = backend.generation()
        if current != run.expected_generation:
            raise GenerationMismatchError(current, run.expected_generation)


class Admission:
    """Every check but the queue's capacity, against `limits` (H3's rules, tightened by the operator's flags) and,
    with `sizing.memory_check`, the modeled activation peak against the device's free memory."""

    def __init__(self, backend: Backend, limits: RequestLimits, sizing: SizingPolicy) -> None:
        self.backend = backend
        self.limits = limits
        self.sizing = sizing

    def check(self, run: Run, running: GenerationRequest | None) -> None:
        """Raises what a refused submit raises; `running` is the request denoising now (its activations are on the
        device beside this one's at the memory check)."""
        check_request(run.request, self.limits)
        self.backend.check_partition(run.request)
        self.backend.check_adapters(run.request)
        self.backend.check_quality(run.request)
        tokens = check_prompt_tokens(self.backend, run.request, self.limits)  # the served tokenizer: ~8 ms for 16 KB
        self.backend.check_fits(run.request)
        self.backend.check_split(run.request, tokens)
        if self.sizing.memory_check:
            self.backend.check_memory(run.request, running, self.sizing.memory_reserve_bytes)
        check_generation(self.backend, run)
