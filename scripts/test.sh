#!/usr/bin/env bash
# The project's checks: install (if needed), lock files current, protos, lint, format check, type
# check, import layers, default test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -m bench).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=${DITSERVE_VENV:-.venv}
"$VENV/bin/python" scripts/lock.py --check
"$VENV/bin/python" -m protos.generate --check
"$VENV/bin/buf" lint protos
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/mypy"
"$VENV/bin/lint-imports" --no-cache
exec "$VENV/bin/python" -m pytest "$@"
