"""The jobs core's values: its policy (from the flags), a job as CreateJob stores it and as the API shows it, the live
state of a job this replica runs, and what the metrics hear. No grpc here."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ditcore import GenerationRequest

from ..execution.runs import Run
from .schema import TERMINAL, Job

DISPATCH_AHEAD = 1
"""Jobs of ours waiting in the executor's queue at most: one, whose plans prefetch while the running one denoises."""
LATENTS_CONTENT = ("application/octet-stream", ".safetensors")

Decoder = Callable[[bytes, Mapping[str, bytes]], tuple[GenerationRequest, int | None]]
"""A stored request's bytes and its parts -> (request, expected_generation): the adapter's own parse of a
GenerateRequest."""
Classifier = Callable[[BaseException], tuple[str, str, str]]
"""An error -> (status code name, reason, message): the one error mapping's (ditruntime.rpc_errors)."""


@dataclass(frozen=True)
class JobsPolicy:
    """GeneratorConfig's jobs flags."""

    replica: str
    max_queued: int
    ttl_s: float
    results_max_bytes: int
    claim_s: float = 30.0
    poll_s: float = 1.0
    max_attempts: int = 3
    unsucceeded_ttl_s: float | None = None


@dataclass(frozen=True)
class NewJob:
    """What CreateJob stores: the request as the adapter parsed it, and its bytes (what a restart parses again):
    the message without its large parts, and the parts (stored once each, by content)."""

    job_id: str
    request: GenerationRequest
    expected_generation: int | None
    request_bytes: bytes
    parts: Mapping[str, bytes]
    uploads: Mapping[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    """upload_id -> (sha256, bytes) of the uploads it named: a retry naming them after they expired still matches."""

    @functools.cached_property
    def spec(self) -> dict[str, Any]:
        """What the record shows of the request (`job_spec`), computed once: it hashes every file."""
        return job_spec(self.request, self.expected_generation, self.uploads)

    @property
    def request_sha256(self) -> str:
        """Of the request's meaning (`spec_meaning`): an idempotent retry means the same."""
        return spec_meaning(self.spec)


def job_spec(
    request: GenerationRequest, expected_generation: int | None, uploads: Mapping[str, tuple[str, int]]
) -> dict[str, Any]:
    """A job's `spec`: the request's resolved values (each file as its bytes and sha256), the generation it insists
    on, and which uploads carried its files."""
    return {
        **request.to_dict(), "expected_generation": expected_generation,
        "upload_ids": {uid: list(d) for uid, d in uploads.items()},
    }  # fmt: skip


def spec_meaning(spec: Mapping[str, Any]) -> str:
    """sha256 of what a job's spec asks for: every resolved value and file, but not its request_id (a label: a client
    may make up a fresh one per call) nor which uploads carried the files (inline or uploaded: the same file)."""
    meaning = {k: v for k, v in spec.items() if k not in ("request_id", "upload_ids")}
    if not meaning.get("quality"):  # lossless: the meaning of a job stored before requests had a quality
        meaning.pop("quality", None)
    return hashlib.sha256(json.dumps(meaning, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class JobView:
    """A job as the API shows it: its record, with this replica's live state over it and its queue position."""

    record: Job
    state: str
    stage: str
    steps_done: int
    steps_total: int
    queue_position: int | None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    expires_at: float | None = None
    """When retention removes it (epoch seconds; None while it is live)."""

    def change_key(self) -> tuple[object, ...]:
        r = self.record
        return (self.state, self.stage, self.steps_done, self.queue_position, r.cancel_requested, r.attempts)


@dataclass
class LiveJob:
    """A job of ours the executor holds: what its events have said so far."""

    run: Run
    created_at: float = 0.0  # the store's clock (epoch seconds)
    started_at: float | None = None
    state: str = "queued"
    stage: str = "queued"
    steps_done: int = 0
    steps_total: int = 0


@dataclass(frozen=True)
class JobsObserver:
    """What the metrics hear: a job's wait in the queue when it starts, its run time and final state when it
    ends (jobs this replica ran)."""

    waited: Callable[[float], None] = lambda seconds: None
    ran: Callable[[str, float], None] = lambda state, seconds: None
