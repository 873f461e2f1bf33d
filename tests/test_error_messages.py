"""What a client is told never carries the server's insides: no results-directory path in a missing content's
error, no sidecar address (or its last connection error) in a detached generator's, no SQL in a store error's
(tests/test_job_store.py), only an unexpected error's class name in an INTERNAL status."""

from __future__ import annotations

from pathlib import Path

import pytest

from ditruntime.rpc_errors import classify
from generator_service.backends.sidecar_client import SidecarClient
from generator_service.errors import SidecarUnavailableError
from generator_service.health import ServingState
from generator_service.jobs.results import ContentMissingError, ResultStore


def test_missing_content_names_no_path(tmp_path: Path) -> None:
    results = ResultStore(tmp_path / "secret-results-dir")
    with pytest.raises(ContentMissingError) as err:
        results.open("a" * 64)
    assert "secret-results-dir" not in str(err.value) and str(tmp_path) not in str(err.value)


def test_a_detached_generator_names_no_sidecar_address() -> None:
    link = SidecarClient("10.1.2.3:50099", 1.0, lambda att: None, ServingState(False, lambda up, why: None))  # detached
    try:
        link._note_error("sidecar 10.1.2.3:50099: UNAVAILABLE: failed to connect to all addresses")
        with pytest.raises(SidecarUnavailableError) as err:
            link.prepare([], 1, "req-1")
        assert "10.1.2.3" not in str(err.value) and "50099" not in str(err.value)
    finally:
        link.close()


def test_an_unexpected_error_is_internal_with_its_class_name_only() -> None:
    code, reason, message = classify(ValueError("/var/lib/ditserve/jobs.db: [SQL: SELECT ...] at 10.0.0.5"))
    assert (code.name, reason) == ("INTERNAL", "INTERNAL")
    assert message == "internal error (ValueError)"
