"""A cancel is a normal end of a run: one log line (its request id, where it was, the steps it finished), no
traceback, neither ours nor the ones diffusers' blocks log for every exception that leaves one (once per nesting
level). Another error keeps diffusers' records."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from servicekit import REQ_FOX, wait_for

from ditcore import GenerationRequest
from ditcore.pipeline import DIFFUSERS_BLOCKS_LOGGER
from generator_service.backends.resident import ResidentBackend
from generator_service.errors import CancelledError
from generator_service.execution.executor import Executor
from generator_service.execution.runs import (
    Decoding,
    Failed,
    Finished,
    Run,
    RunEvent,
    StepDone,
    quiet_run_stops,
)


@pytest.fixture(scope="module")
def backend(resident_backend: ResidentBackend) -> ResidentBackend:
    return resident_backend


@pytest.fixture
def executor(backend: ResidentBackend) -> Iterator[Executor]:
    ex = Executor(backend, max_queue_depth=2, prefetch=False)
    ex.start()
    yield ex
    ex.stop()


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    """Every record, diffusers' included (its library logger does not propagate by default)."""
    monkeypatch.setattr(logging.getLogger("diffusers"), "propagate", True)
    caplog.set_level(logging.INFO)
    return caplog


def _final(run: Run) -> RunEvent:
    while True:
        event = run.events.get(timeout=120)
        if isinstance(event, Failed | Finished):
            return event


def _cancelled_at(executor: Executor, rid: str, when: type[StepDone] | type[Decoding], output: str) -> Failed:
    """A run cancelled from its own event listener (on the executor's thread) at its second step or its decode."""
    run = Run(GenerationRequest.from_dict({**REQ_FOX, "request_id": rid, "num_inference_steps": 6,
                                           "output_type": output}))  # fmt: skip

    def cancel(r: Run, event: RunEvent) -> None:
        if isinstance(event, when) and (not isinstance(event, StepDone) or event.step == 2):
            r.cancel()

    run.subscribe(cancel)
    executor.submit(run)
    final = _final(run)
    assert isinstance(final, Failed) and isinstance(final.error, CancelledError)
    return final


@pytest.mark.parametrize(
    ("when", "output", "line"),
    [
        (StepDone, "latents", "request cx cancelled while denoising, after step 2 of 5"),
        (Decoding, "mp4", "request cx cancelled while decoding, after step 5 of 5"),
    ],
)
def test_a_cancelled_run_logs_one_line_and_no_traceback(
    executor: Executor, logs: pytest.LogCaptureFixture, when: type[StepDone] | type[Decoding], output: str, line: str
) -> None:
    logs.clear()
    _cancelled_at(executor, "cx", when, output)
    wait_for(lambda: any("cx" in r.getMessage() for r in logs.records), 10, "the cancel's line")
    about = [r for r in logs.records if "cx" in r.getMessage() or r.name.startswith("diffusers")]
    assert [(r.levelno, r.getMessage()) for r in about] == [(logging.INFO, line)]
    assert not [r for r in logs.records if r.exc_info or "Traceback" in r.getMessage()]


def test_another_error_keeps_diffusers_records(logs: pytest.LogCaptureFixture) -> None:
    """The filter drops a stop's records only: an error of a block's own is still logged by diffusers."""
    quiet_run_stops()
    quiet_run_stops()  # once per process
    blocks = logging.getLogger(DIFFUSERS_BLOCKS_LOGGER)
    assert blocks.filters.count(blocks.filters[-1]) == 1
    for error in (CancelledError("stopped"), ValueError("a bug")):
        try:
            raise error
        except Exception:
            blocks.error("Error in block: %s", type(error).__name__)
    assert [r.getMessage() for r in logs.records if r.name == DIFFUSERS_BLOCKS_LOGGER] == ["Error in block: ValueError"]
