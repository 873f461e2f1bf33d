#!/usr/bin/env bash
# Create .venv (if needed) and install ditserve with its dev tools, CPU torch pinned.
# Idempotent: re-runs only when pyproject.toml or requirements-cpu.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DITSERVE_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.ditserve-installed"
want=$(cat pyproject.toml requirements-cpu.txt | sha256sum | cut -d' ' -f1)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q -r requirements-cpu.txt
"$VENV/bin/python" -m pip install -q -e '.[dev]'
echo "$want" > "$stamp"
