"""The media of the request being run, decoded once: its keyframes and references probed and decoded within the limits
the caller gives, remembered across its plan keys and its loop, and dropped after each request."""

from __future__ import annotations

import functools
from typing import Any

from .keyframes import ImageLimits, decode_image
from .reference_decode import decode_reference
from .references import Reference, ReferenceLimits, ReferenceProbe, probe_references


@functools.lru_cache(maxsize=2)
def decoded_keyframe(data: bytes, limits: ImageLimits) -> Any:
    """decode_image, remembered for the last two keyframes: a keyframe is decoded once although generate()'s steps (its
    plan keys and its loop) each ask for the pipeline inputs (a MediaError is not remembered). The image is shared:
    diffusers' blocks only read it (resizing makes a new one). The request passes its hard caps as `limits` (the
    operator's tighter limits are checked before: GenerationRequest.keyframes)."""
    return decode_image(data, limits)


@functools.lru_cache(maxsize=12)
def decoded_reference(ref: Reference, probe: ReferenceProbe, limits: ReferenceLimits) -> Any:
    """decode_reference, remembered for one request's references (at most 12): its plan keys and its loop each ask
    for the pipeline inputs. The request passes its hard caps as `limits` (its own limits were probed first)."""
    return decode_reference(ref, probe, limits)


@functools.lru_cache(maxsize=8)
def probed_references(refs: tuple[Reference, ...], limits: ReferenceLimits) -> tuple[ReferenceProbe, ...]:
    """probe_references, remembered: admission, the plan keys and the loop of one request each ask (a MediaError
    is not remembered)."""
    return tuple(probe_references(refs, limits))


def forget_decoded_keyframes() -> None:
    """Drop the remembered keyframes and references, their media and bytes: a server calls this after each request,
    so an idle one holds none."""
    decoded_keyframe.cache_clear()
    decoded_reference.cache_clear()
    probed_references.cache_clear()
