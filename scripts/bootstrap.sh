#!/usr/bin/env bash
# Create the venv (if needed) and install ditserve with its dev tools, every package pinned and
# checked against the sha256 hashes of the lock files (scripts/lock.py):
#   1. requirements.lock + requirements-dev.lock + requirements-cuda.lock (torch and torchvision as
#      PyPI builds them, CUDA 13.0, with their CUDA libraries; they run on a CPU too) in one
#      `pip install --require-hashes --no-deps`: nothing unpinned is resolved, nothing unhashed is
#      installed (pip takes a wheel from any index it is configured with, local ones included, as
#      long as its sha256 is in the lock);
#   2. ditserve itself, editable, --no-deps --no-build-isolation (its build backend, setuptools,
#      is in requirements.lock);
# then `pip check`, which fails where a package needs something the locks do not hold.
# DITSERVE_VENV: the venv (default .venv); PYTHON: the interpreter that creates it (python3, >= 3.11).
# Idempotent: re-runs only when one of its inputs (this script, pyproject.toml, the locks) changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DITSERVE_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.ditserve-installed"
want=$(cat scripts/bootstrap.sh pyproject.toml requirements.lock requirements-dev.lock requirements-cuda.lock |
  sha256sum | cut -d' ' -f1)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
# one install at a time into one venv (two test runs starting together)
if command -v flock >/dev/null; then
  exec 9>"$VENV/.ditserve-bootstrap.lock"
  flock 9
  [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && exit 0
fi
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --require-hashes --no-deps -r requirements.lock -r requirements-dev.lock -r requirements-cuda.lock
"${pip[@]}" --no-deps --no-build-isolation -e .
"$VENV/bin/python" -m pip check --disable-pip-version-check >/dev/null || {
  "$VENV/bin/python" -m pip check >&2
  echo "bootstrap: $VENV is inconsistent (above); re-compile the locks (scripts/lock.py)" >&2
  exit 1
}
echo "$want" > "$stamp"
