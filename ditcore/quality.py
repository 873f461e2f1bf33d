"""Quality levels: named step caches an operator defines (`--quality-levels FILE`, TOML), each with what it may be
combined with, and the audits that say where it keeps its quality. `lossless` (no step cache: today's bits) is
always there and is every request's default.

A level file:

```toml
[levels.fast]
description = "FirstBlockCache at 0.04, audited on t2va 768x1344"
cache = { kind = "first_block", threshold = 0.04 }   # ditcore.step_cache: diffusers' config and its parameters
tasks = ["t2va", "fl2va"]            # default: every task
steps = [30, 50]                     # num_inference_steps it may run with; default: any
max_height = 768                     # canvas bounds; default: the request limits'
max_width = 1344
max_num_frames = 345
world_sizes = [1]                    # the replica sizes (ranks) it may run on; default [1]
adapters = "none"                    # "none" | "trunk" (trunk-only adapters) | "any" | a list of adapter names
unaudited = "refuse"                 # a request no passing audit covers: "refuse" (default) or "warn"
audit = { min_psnr_db = 28.0, min_ssim = 0.92, min_audio_snr_db = 10.0, min_audio_corr = 0.9 }
```

Fail closed: a request outside what its level allows is a RequestError naming `quality` and the rule
(INVALID_ARGUMENT); one no passing audit covers is `QualityNotAuditedError` under "refuse". An audit record
(`AuditRecord`, written by `ditserve audit-quality`) covers a request when it audited the same level definition on
the same shape (task, steps, height, width, frames) and world size and passed the level's thresholds.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from .request import QUALITY_NAME, TASKS, GenerationRequest, RequestError
from .step_cache import StepCache, StepCacheError

LOSSLESS = "lossless"
AUDIT_RUN = "audit run: "
"""The warning's prefix of an audit run (`GenerationRequest.quality_audit`) at a shape no audit covers yet: it runs
its level even under the policy "refuse"; every other rule of the level still holds."""
LEVEL_NAME = QUALITY_NAME
ADAPTER_POLICIES = ("none", "trunk", "any")
PER_RANK_DECISIONS = ("first_block",)
"""Step caches whose skip decision reads the rank's own activations (not the step index or calibrated ratios)."""
NOT_CONTEXT_PARALLEL = ("mag",)
"""Step caches diffusers 0.42.1 cannot run under its context parallelism: MagCache's tail hook subtracts the first
block's input, as the head hook kept it (every rank's tokens), from the last block's output (the rank's own): a size
mismatch (RuntimeError) in diffusers' own 2-rank loop."""
UNAUDITED = ("refuse", "warn")
THRESHOLDS = ("min_psnr_db", "min_ssim", "min_audio_snr_db", "min_audio_corr")
_KEYS = ("description", "cache", "tasks", "steps", "max_height", "max_width", "max_num_frames", "world_sizes",
         "adapters", "unaudited", "audit")  # fmt: skip


class QualityLevelsError(ValueError):
    """A levels file that cannot be served: names the file, the level and the key."""


class QualityNotAuditedError(Exception):
    """A request at a level whose audits do not cover it (its policy: refuse)."""


@dataclass(frozen=True)
class QualityLevel:
    """One named level: its step cache and what it may run with."""

    name: str
    cache: StepCache
    description: str = ""
    tasks: tuple[str, ...] = TASKS
    steps: tuple[int, ...] = ()
    """Allowed num_inference_steps; empty: any."""
    max_height: int = 0
    max_width: int = 0
    max_num_frames: int = 0
    """Canvas bounds (0: the request limits')."""
    world_sizes: tuple[int, ...] = (1,)
    adapters: str | tuple[str, ...] = "none"
    unaudited: str = "refuse"
    audit: tuple[tuple[str, float], ...] = ()
    """Thresholds an audit must meet (THRESHOLDS), by name."""

    @property
    def digest(self) -> str:
        """sha256 of the definition (an audit covers the definition it audited, never an edited one)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "cache": self.cache.to_dict(),
                "tasks": list(self.tasks), "steps": list(self.steps), "max_height": self.max_height,
                "max_width": self.max_width, "max_num_frames": self.max_num_frames,
                "world_sizes": list(self.world_sizes),
                "adapters": self.adapters if isinstance(self.adapters, str) else list(self.adapters),
                "unaudited": self.unaudited, "audit": dict(self.audit)}  # fmt: skip

    # ---------------------------------------------------------------- the rules
    def check(self, request: GenerationRequest, world_size: int, trunk_only: Sequence[bool] = ()) -> None:
        """RequestError naming `quality` and the rule unless this level allows `request` on `world_size` ranks.
        `trunk_only`: per adapter of the request, whether it changes only the trunk (for `adapters = "trunk"`)."""

        def refuse(rule: str) -> None:
            raise RequestError("quality", f"level {self.name} {rule}")

        if request.task not in self.tasks:
            refuse(f"runs with tasks {', '.join(self.tasks)}, not {request.task}")
        if self.steps and request.num_inference_steps not in self.steps:
            refuse(f"runs with num_inference_steps {', '.join(map(str, self.steps))}, not "
                   f"{request.num_inference_steps}")  # fmt: skip
        for name, bound in (("height", self.max_height), ("width", self.max_width),
                            ("num_frames", self.max_num_frames)):  # fmt: skip
            if bound and getattr(request, name) > bound:
                refuse(f"runs with {name} up to {bound}, not {getattr(request, name)}")
        if world_size not in self.world_sizes:
            refuse(f"runs on {' or '.join(map(str, self.world_sizes))} rank(s), not on this server's {world_size}")
        names = [u.name for u in request.adapters]
        if names:
            if self.adapters == "none":
                refuse("runs without adapters")
            elif self.adapters == "trunk" and not all(trunk_only):
                odd = [n for n, t in zip(names, trunk_only, strict=False) if not t] or names
                refuse(f"runs with trunk-only adapters; {', '.join(odd)} changes the modulation")
            elif isinstance(self.adapters, tuple) and set(names) - set(self.adapters):
                refuse(
                    f"runs with adapters {', '.join(self.adapters)} only, not {', '.join(sorted(set(names) - set(self.adapters)))}"
                )

    def shape(self, request: GenerationRequest, world_size: int) -> tuple[Any, ...]:
        """What an audit must have covered for `request` (task, steps, height, width, frames, ranks)."""
        return (request.task, request.num_inference_steps, request.height, request.width, request.num_frames,
                world_size)  # fmt: skip


def _level(name: str, data: Any, source: str) -> QualityLevel:
    where = f"{source} [levels.{name}]"
    if not LEVEL_NAME.fullmatch(name) or name == LOSSLESS:
        raise QualityLevelsError(f"{where}: a level's name is 1-64 of a-z 0-9 _ - starting with a letter, not "
                                 f"{LOSSLESS}")  # fmt: skip
    if not isinstance(data, Mapping):
        raise QualityLevelsError(f"{where}: a level is a table")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise QualityLevelsError(f"{where}: unknown key {unknown[0]!r}; a level takes {', '.join(_KEYS)}")
    if "cache" not in data:
        raise QualityLevelsError(f"{where}: needs a cache (a step cache's kind and parameters)")
    try:
        cache = StepCache.parse(data["cache"], f"{where} cache")
    except StepCacheError as e:
        raise QualityLevelsError(str(e)) from None

    def ints(key: str, low: int) -> tuple[int, ...]:
        v = data.get(key, [])
        if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= low for i in v):
            raise QualityLevelsError(f"{where}: {key} must be a list of integers >= {low}")
        return tuple(v)

    tasks = data.get("tasks", list(TASKS))
    if not isinstance(tasks, list) or not tasks or any(t not in TASKS for t in tasks):
        raise QualityLevelsError(f"{where}: tasks must be a non-empty list of {', '.join(TASKS)}")
    bounds = {}
    for key in ("max_height", "max_width", "max_num_frames"):
        v = data.get(key, 0)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise QualityLevelsError(f"{where}: {key} must be an integer >= 0 (0: the request limits')")
        bounds[key] = v
    adapters = data.get("adapters", "none")
    if isinstance(adapters, list) and all(isinstance(a, str) for a in adapters):
        adapters = tuple(adapters)
    elif adapters not in ADAPTER_POLICIES:
        raise QualityLevelsError(f"{where}: adapters must be one of {', '.join(ADAPTER_POLICIES)} or a list of names")
    unaudited = data.get("unaudited", "refuse")
    if unaudited not in UNAUDITED:
        raise QualityLevelsError(f"{where}: unaudited must be one of {', '.join(UNAUDITED)}")
    audit = data.get("audit", {})
    if (
        not isinstance(audit, Mapping)
        or set(audit) - set(THRESHOLDS)
        or not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in audit.values())
    ):
        raise QualityLevelsError(f"{where}: audit is a table of finite thresholds among {', '.join(THRESHOLDS)}")
    world_sizes = ints("world_sizes", 1) or (1,)
    if cache.kind in PER_RANK_DECISIONS and max(world_sizes) > 1:
        raise QualityLevelsError(
            f"{where}: world_sizes {list(world_sizes)}: {cache.kind} decides per rank from the rank's own rows (its "
            "first block's residual), so on a replica the ranks could disagree and stall in a collective; run it on "
            "1 rank, or use a kind whose decisions every rank makes alike (taylorseer)"
        )
    if cache.kind in NOT_CONTEXT_PARALLEL and max(world_sizes) > 1:
        raise QualityLevelsError(
            f"{where}: world_sizes {list(world_sizes)}: diffusers' {cache.kind} cache fails under context parallelism "
            "(its tail hook subtracts every rank's first-block input from the rank's own last-block output); run it "
            "on 1 rank, or use taylorseer on a replica"
        )
    description = data.get("description", "")
    if not isinstance(description, str):
        raise QualityLevelsError(f"{where}: description must be a string")
    return QualityLevel(name, cache, description, tuple(tasks), ints("steps", 2), world_sizes=world_sizes,
                        adapters=adapters, unaudited=unaudited, audit=tuple(sorted(audit.items())),
                        **bounds)  # fmt: skip


@dataclass(frozen=True)
class AuditRecord:
    """One audited request (`ditserve audit-quality`): the level definition it ran (its digest), its shape, the
    measures against lossless and whether they met the level's thresholds."""

    level: str
    digest: str
    shape: tuple[Any, ...]
    measures: dict[str, float] = field(default_factory=dict)
    passed: bool = False
    at: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "digest": self.digest, "shape": list(self.shape), "measures": self.measures,
                "passed": self.passed, "at": self.at}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AuditRecord:
        return cls(str(data["level"]), str(data["digest"]), tuple(data["shape"]), dict(data.get("measures", {})),
                   bool(data.get("passed")), str(data.get("at", "")))  # fmt: skip


def verdict(level: QualityLevel, measures: Mapping[str, float]) -> tuple[bool, list[str]]:
    """Whether `measures` (psnr_db, ssim, audio_snr_db, audio_corr) meet the level's thresholds, and the misses."""
    misses = []
    for key, bound in level.audit:
        got = measures.get(key.removeprefix("min_"))
        if got is None or not got >= bound:  # NaN fails
            misses.append(f"{key.removeprefix('min_')} {got} < {bound}")
    return not misses, misses


@dataclass
class QualityLevels:
    """The levels a server serves (lossless always, the file's besides) and the audits it reads."""

    levels: dict[str, QualityLevel] = field(default_factory=dict)
    audit_dir: Path | None = None
    source: str = ""

    @classmethod
    def load(cls, path: Path | None, audit_dir: Path | None = None) -> QualityLevels:
        """The levels of a TOML file (None: lossless only). QualityLevelsError naming the file, level and key."""
        if path is None:
            return cls(audit_dir=audit_dir)
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise QualityLevelsError(f"{path}: not a readable TOML file ({e})") from None
        unknown = sorted(set(data) - {"levels"})
        if unknown or not isinstance(data.get("levels", {}), Mapping):
            raise QualityLevelsError(f"{path}: a levels file holds [levels.NAME] tables only")
        levels = {name: _level(name, body, str(path)) for name, body in data.get("levels", {}).items()}
        return cls(levels, audit_dir, str(path))

    def get(self, name: str) -> QualityLevel | None:
        """The level `name` (None for lossless / ""); RequestError naming `quality` for an unknown one."""
        if name in ("", LOSSLESS):
            return None
        level = self.levels.get(name)
        if level is None:
            known = ", ".join([LOSSLESS, *sorted(self.levels)])
            raise RequestError("quality", f"unknown level {name!r}; this server serves {known}")
        return level

    def audits(self, level: QualityLevel) -> list[AuditRecord]:
        """The audit records of `level`'s current definition (`AUDIT_DIR/NAME.jsonl`, one record per line)."""
        if self.audit_dir is None:
            return []
        path = self.audit_dir / f"{level.name}.jsonl"
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                record = AuditRecord.from_dict(json.loads(line))
            except (ValueError, KeyError, TypeError):
                continue  # a torn or foreign line covers nothing
            if record.level == level.name and record.digest == level.digest:
                out.append(record)
        return out

    def covered(self, level: QualityLevel, request: GenerationRequest, world_size: int) -> bool:
        """A passing audit of this definition covers the request's shape on this many ranks."""
        shape = level.shape(request, world_size)
        return any(r.passed and tuple(r.shape) == shape for r in self.audits(level))

    def for_request(self, request: GenerationRequest, world_size: int, uses: Sequence[tuple[Any, float]] = ()) -> tuple[
            QualityLevel | None, str]:  # fmt: skip
        """`check` with the request's adapters as read (`uses`: (AdapterInfo, scale), whose `changes_modulation` says
        which are trunk-only)."""
        return self.check(request, world_size, [not info.changes_modulation for info, _ in uses])

    def check(self, request: GenerationRequest, world_size: int, trunk_only: Sequence[bool] = ()) -> tuple[
            QualityLevel | None, str]:  # fmt: skip
        """The request's level (None: lossless) and a warning ("" if none): RequestError for a rule it breaks,
        QualityNotAuditedError when no passing audit covers it and the level refuses that (unless it is an audit
        run: the server admits those from the admin alone)."""
        level = self.get(request.quality)
        if level is None:
            return None, ""
        level.check(request, world_size, trunk_only)
        if self.covered(level, request, world_size):
            return level, ""
        message = (f"level {level.name}: no passing audit covers {request.task} {request.num_inference_steps} steps "
                   f"{request.height}x{request.width}x{request.num_frames} on {world_size} rank(s); run `ditserve "
                   f"audit-quality --level {level.name}` on such requests")  # fmt: skip
        if request.quality_audit:  # an audit has to run a level before any audit covers it (the admin's call)
            return level, AUDIT_RUN + message
        if level.unaudited == "refuse":
            raise QualityNotAuditedError(message)
        return level, message
