"""An adapter's sampling contract and the rules a request's adapters follow, without torch (both sides and the
client read them): `AdapterContract` (what a manifest declares: `NAME.json` beside `NAME.safetensors`, or the
file's `__metadata__` entry `ditserve_contract`), `AdapterUse` (one adapter of a request and its scale) and the
checks, each a RequestError naming the adapter, the field and the rule.

A manifest is one JSON object; every key is optional:

    {"steps": [5, 9],                 # allowed num_inference_steps (sigma points: 4 forwards = 5)
     "flow_shifts": [5.0],            # allowed video flow shifts
     "audio_flow_shifts": [3.0],      # allowed audio flow shifts
     "scale": [0.0, 1.0],             # allowed scale range, inclusive
     "tasks": ["t2va", "fl2va"],      # tasks it may run with
     "partition": "base",             # the transformer it targets ("base" or "ref"; default: what its keys say)
     "default_steps": 5, "default_flow_shift": 5.0, "default_audio_flow_shift": 3.0}
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from .request import ADAPTER_NAME, DEFAULTED, TASKS, AdapterUse, RequestError, check_uses

__all__ = ["DEFAULTED", "AdapterContract", "AdapterError", "AdapterNotFoundError", "AdapterUse", "ManifestError",
           "check_uses", "contract_defaults"]  # fmt: skip

NAME = ADAPTER_NAME
DEFAULT_SCALE_RANGE = (0.0, 4.0)
"""The scales an adapter without a declared range takes."""
METADATA_KEY = "ditserve_contract"
"""The safetensors `__metadata__` entry that may carry the manifest."""
_KEYS = ("steps", "flow_shifts", "audio_flow_shifts", "scale", "tasks", "partition", "default_steps",
         "default_flow_shift", "default_audio_flow_shift")  # fmt: skip


class ManifestError(ValueError):
    """A manifest that breaks a rule: names the file and the key."""


class AdapterError(ValueError):
    """An adapter this server cannot serve (a file diffusers' loader refuses, non-finite factors, a broken manifest,
    or a modulation adapter on cached plans): names the adapter and the rule."""


class AdapterNotFoundError(LookupError):
    """A request names an adapter the server's --adapter-dir does not hold."""


@dataclass(frozen=True)
class AdapterContract:
    """What an adapter may be sampled with (empty tuples: anything)."""

    steps: tuple[int, ...] = ()
    flow_shifts: tuple[float, ...] = ()
    audio_flow_shifts: tuple[float, ...] = ()
    scale: tuple[float, float] = DEFAULT_SCALE_RANGE
    tasks: tuple[str, ...] = ()
    partition: str = ""
    """"base" or "ref" when the manifest says; "" otherwise (the adapter's keys say)."""
    default_steps: int | None = None
    default_flow_shift: float | None = None
    default_audio_flow_shift: float | None = None
    source: str = field(default="", compare=False)
    """Where it was read ("" for none)."""

    @classmethod
    def parse(cls, text: str, source: str) -> AdapterContract:
        """The contract a manifest's JSON text declares; ManifestError naming `source` and the key."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{source}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ManifestError(f"{source}: must be a JSON object")
        unknown = sorted(set(data) - set(_KEYS))
        if unknown:
            raise ManifestError(f"{source}: unknown key {unknown[0]!r}; allowed: {', '.join(_KEYS)}")
        steps = _ints(data, "steps", source)
        scale = data.get("scale", list(DEFAULT_SCALE_RANGE))
        if not (
            isinstance(scale, list) and len(scale) == 2 and all(_finite(v) for v in scale) and scale[0] <= scale[1]
        ):
            raise ManifestError(f"{source}: scale must be [low, high], finite numbers with low <= high")
        tasks = data.get("tasks", [])
        if not (isinstance(tasks, list) and all(t in TASKS for t in tasks)):
            raise ManifestError(f"{source}: tasks must be a list of {', '.join(TASKS)}")
        partition = data.get("partition", "")
        if partition not in ("", "base", "ref"):
            raise ManifestError(f"{source}: partition must be base or ref, got {partition!r}")
        contract = cls(
            steps=steps, flow_shifts=_floats(data, "flow_shifts", source),
            audio_flow_shifts=_floats(data, "audio_flow_shifts", source), scale=(float(scale[0]), float(scale[1])),
            tasks=tuple(tasks), partition=partition, default_steps=_optional_int(data, "default_steps", source),
            default_flow_shift=_optional_float(data, "default_flow_shift", source),
            default_audio_flow_shift=_optional_float(data, "default_audio_flow_shift", source), source=source,
        )  # fmt: skip
        contract._check_defaults()
        return contract

    def _check_defaults(self) -> None:
        for name, value, allowed in (("default_steps", self.default_steps, self.steps),
                                     ("default_flow_shift", self.default_flow_shift, self.flow_shifts),
                                     ("default_audio_flow_shift", self.default_audio_flow_shift,
                                      self.audio_flow_shifts)):  # fmt: skip
            if value is not None and allowed and value not in allowed:
                raise ManifestError(f"{self.source}: {name} {value} is not one of its allowed values {list(allowed)}")

    def canonical(self) -> str:
        """The contract as canonical JSON (part of the adapter's identity)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in _KEYS}
        return json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}, sort_keys=True)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(self.canonical())  # type: ignore[no-any-return]

    def check(self, name: str, scale: float, task: str, steps: int, flow_shift: float, audio_flow_shift: float) -> None:
        """RequestError naming the adapter and the field unless a request of these values may use it at `scale`."""
        low, high = self.scale
        if not low <= scale <= high:
            raise RequestError("adapters", f"{name}: scale {scale:g} is outside its range [{low:g}, {high:g}]")
        if self.tasks and task not in self.tasks:
            raise RequestError("task", f"adapter {name} runs with tasks {', '.join(self.tasks)}, not {task}")
        if self.steps and steps not in self.steps:
            allowed = ", ".join(map(str, self.steps))
            raise RequestError(
                "num_inference_steps",
                f"adapter {name} allows num_inference_steps {allowed} (sigma points: N points run N - 1 forwards), "
                f"got {steps}",
            )
        for fname, value, allowed_shifts in (("flow_shift", flow_shift, self.flow_shifts),
                                              ("audio_flow_shift", audio_flow_shift, self.audio_flow_shifts)):  # fmt: skip
            if allowed_shifts and value not in allowed_shifts:
                raise RequestError(
                    fname, f"adapter {name} allows {fname} {', '.join(f'{v:g}' for v in allowed_shifts)}, got {value:g}"
                )


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _ints(data: dict[str, Any], key: str, source: str) -> tuple[int, ...]:
    v = data.get(key, [])
    if not (isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 2 for x in v)):
        raise ManifestError(f"{source}: {key} must be a list of integers >= 2")
    return tuple(v)


def _floats(data: dict[str, Any], key: str, source: str) -> tuple[float, ...]:
    v = data.get(key, [])
    if not (isinstance(v, list) and all(_finite(x) and x > 0 for x in v)):
        raise ManifestError(f"{source}: {key} must be a list of positive finite numbers")
    return tuple(float(x) for x in v)


def _optional_int(data: dict[str, Any], key: str, source: str) -> int | None:
    v = data.get(key)
    if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 2):
        raise ManifestError(f"{source}: {key} must be an integer >= 2")
    return v


def _optional_float(data: dict[str, Any], key: str, source: str) -> float | None:
    v = data.get(key)
    if v is not None and not (_finite(v) and v > 0):
        raise ManifestError(f"{source}: {key} must be a positive finite number")
    return float(v) if v is not None else None


def contract_defaults(contracts: Sequence[tuple[str, AdapterContract]], unset: Collection[str]) -> dict[str, Any]:
    """The values a request's adapters give the fields in `unset` (request field names of DEFAULTED) that it left
    unset: `contracts` are its adapters' (name, contract), in the request's order; the first adapter declaring a
    default for a field gives it. Another adapter declaring a different default for the same unset field is a
    RequestError naming the field and both adapters (the request must then set the field itself)."""
    out: dict[str, Any] = {}
    given_by: dict[str, str] = {}
    for name, contract in contracts:
        for request_field, key in DEFAULTED:
            value = getattr(contract, key)
            if request_field not in unset or value is None:
                continue
            if request_field not in out:
                out[request_field], given_by[request_field] = value, name
            elif value != out[request_field]:
                raise RequestError(
                    request_field,
                    f"is unset and the adapters' contracts default it differently: {given_by[request_field]} "
                    f"{key} {out[request_field]:g}, {name} {key} {value:g}; set {request_field} in the request",
                )
    return out
