#!/usr/bin/env bash
# The project's checks: install (if needed), lock files current, protos, lint, format check, type
# check, import layers, then the default test suite on two workers, printing its 25 slowest tests.
#   scripts/test.sh            what CI runs (the README's test command)
#   scripts/test.sh --quick    the inner loop: lint, format check, import layers and the quick tier (the tests that
#                              start no process: `-m "not processes"`, tests/processguard.py keeps the marker true)
# Extra arguments go to pytest (e.g. scripts/test.sh -m bench, scripts/test.sh tests/core -n 0).
# DITSERVE_TEST_WORKERS: pytest-xdist workers (default 2; 0 runs in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [[ "${1:-}" == "--quick" ]]; then
  quick=1
  shift
fi
bash scripts/bootstrap.sh
VENV=${DITSERVE_VENV:-.venv}
tier=()
if ((quick)); then
  tier=(-m "not processes and not bench and not slow")
else
  "$VENV/bin/python" scripts/lock.py --check
  "$VENV/bin/python" -m protos.generate --check
  "$VENV/bin/buf" lint protos
fi
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
((quick)) || "$VENV/bin/mypy"
"$VENV/bin/lint-imports" --no-cache
# loadfile: a module's tests share one worker, so its module-scoped servers start once; no reorder: the modules
# start in collection order, the slowest first (tests/slowfirst.py), so both workers end together
exec "$VENV/bin/python" -m pytest -n "${DITSERVE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=25 \
  "${tier[@]}" "$@"
