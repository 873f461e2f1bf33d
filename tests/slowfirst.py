"""The order the test modules start in (tests/conftest.py sorts the collection by it)."""

from __future__ import annotations

SLOW_FIRST = (
    "tests/test_bench_quick.py",
    "tests/parallel/test_replica_any_prompt.py",
    "tests/parallel/test_replica_nodes.py",
    "tests/test_update_crash.py",
    "tests/parallel/test_parallel_oracle.py",
    "tests/test_gpu_check.py",
    "tests/parallel/test_replica_e2e.py",
    "tests/parallel/test_replica_shutdown.py",
    "tests/test_e2e_faults.py",
    "tests/test_e2e_ref2va.py",
    "tests/test_jobs_restart_cached.py",
    # the quick tier's slowest (no processes)
    "tests/test_update_load.py",
    "tests/test_update_weights.py",
    "tests/core/test_core_pipeline.py",
    "tests/test_cli.py",
    "tests/core/test_core_ref2va.py",
    "tests/test_services_integration.py",
)
"""The slowest modules (scripts/test.sh prints the slowest tests), run first: the two workers of `--dist loadfile`
take whole modules as they free up, so the longest ones starting first lets both end together."""
