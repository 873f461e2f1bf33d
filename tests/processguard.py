"""Which tests start OS processes: `subprocess.Popen` and `multiprocessing` starts are checked against the running
test's `processes` marker (tests/conftest.py). A test without the marker that starts a process fails with the command
it ran, so the quick tier (`scripts/test.sh --quick`: `-m "not processes"`) never starts one and the marker cannot
drift from what the tests do."""

from __future__ import annotations

import contextlib
import multiprocessing.process
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import pytest

_state = threading.local()
_current: dict[str, Any] = {"nodeid": "", "allowed": True}  # the running test (one at a time per worker)
"""Outside any test (collection, teardown) every start is allowed."""
_real_popen_init = subprocess.Popen.__init__
_real_process_start = multiprocessing.process.BaseProcess.start


def _check(what: str) -> None:
    """Fail the running test (pytest.fail: an outcome, so no `except Exception` of the code under test can turn it
    into a skip or a pass) when it may not start a process."""
    if _current["allowed"] or getattr(_state, "inside", False):
        return
    pytest.fail(
        f"{_current['nodeid']} starts a process ({what}) but is not marked `processes`: add "
        "`pytestmark = pytest.mark.processes` to its module (or the marker to the test), which takes it out of the "
        "quick tier",
        pytrace=False,
    )


def _popen_init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
    _check(f"subprocess: {args!r:.200}")
    _state.inside = True  # multiprocessing may spawn through Popen: checked once
    try:
        _real_popen_init(self, args, *rest, **kwargs)
    finally:
        _state.inside = False


def _process_start(self: multiprocessing.process.BaseProcess) -> None:
    _check(f"multiprocessing: {self.name}")
    _state.inside = True
    try:
        _real_process_start(self)
    finally:
        _state.inside = False


subprocess.Popen.__init__ = _popen_init  # type: ignore[method-assign]
multiprocessing.process.BaseProcess.start = _process_start  # type: ignore[method-assign]


@contextlib.contextmanager
def running(nodeid: str, allowed: bool) -> Iterator[None]:
    """Check every process start against `allowed` while the test `nodeid` runs."""
    before = dict(_current)
    _current["nodeid"], _current["allowed"] = nodeid, allowed
    try:
        yield
    finally:
        _current.update(before)
