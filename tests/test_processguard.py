"""The `processes` marker is what the quick tier leaves out; tests/processguard.py keeps it true by failing a test that
starts a process without it. Here the guard itself: it fails an undeclared start (subprocess or multiprocessing) with
a message naming the test and the command, lets a declared one through, and cannot be caught as an ordinary error."""

from __future__ import annotations

import multiprocessing
import subprocess

import processguard
import pytest
from servicekit import REPO_ROOT
from slowfirst import SLOW_FIRST


def test_an_undeclared_subprocess_fails_the_test_naming_it_and_the_command() -> None:
    with processguard.running("tests/x.py::test_y", allowed=False):
        with pytest.raises(
            pytest.fail.Exception, match=r"tests/x.py::test_y starts a process \(subprocess: \['true'\]\)"
        ):
            subprocess.run(["true"], check=True)
        try:  # an outcome, not an Exception: code under test that catches errors cannot turn it into a skip
            subprocess.run(["true"], check=True)
        except Exception:  # pragma: no cover - the point of the test is that this does not happen
            pytest.fail("the guard's failure was caught as an ordinary exception")
        except pytest.fail.Exception:
            pass


def test_an_undeclared_multiprocessing_start_fails() -> None:
    with (
        processguard.running("tests/x.py::test_z", allowed=False),
        pytest.raises(pytest.fail.Exception, match=r"test_z starts a process \(multiprocessing: "),
    ):
        multiprocessing.get_context("spawn").Process(target=print).start()


@pytest.mark.processes
def test_a_declared_start_runs_and_the_outer_state_comes_back() -> None:
    with processguard.running("tests/x.py::test_w", allowed=True):
        assert subprocess.run(["true"], check=True).returncode == 0
    assert subprocess.run(["true"], check=True).returncode == 0  # this test is marked: the hook's state again


def test_every_end_to_end_test_and_every_process_fixture_user_is_marked(request: pytest.FixtureRequest) -> None:
    items = request.session.items
    assert items, "collected nothing"
    unmarked = [
        i.nodeid
        for i in items
        if ("e2e" in i.keywords or {"procs", "proc_pair", "run_cli_proc", "pg_url"} & set(i.fixturenames))
        and i.get_closest_marker("processes") is None
    ]
    assert not unmarked, unmarked


def test_the_slow_first_modules_exist() -> None:
    assert [p for p in SLOW_FIRST if not (REPO_ROOT / p).is_file()] == []
