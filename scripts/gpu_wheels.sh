#!/usr/bin/env bash
# Fetch, here, the wheels the offline GPU check carries to a lent H200 (scripts/gpu-wheels.txt, at requirements.lock's
# pins, sha256-checked against it) into the ignored .whl/, for CPython 3.12 manylinux x86_64 by default:
#     scripts/gpu_wheels.sh [--python-version 3.12] [--dest .whl]
# then run the check there with `carry: [".whl"]`: scripts/gpu_check.sh --offline. Needs pip and PyPI (here, not
# there). Fails, printing the total, above 60 MiB (--max-mib). PYTHON: the interpreter whose pip downloads (default
# the venv's, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" scripts/gpu_wheels.py "$@"
