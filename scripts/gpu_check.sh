#!/usr/bin/env bash
# One-shot accelerator check: installs (if needed), then prints one PASS/FAIL/SKIP line per check and a verdict
# (scripts/gpu_check.py says what each check does). Run it on a machine with one CUDA GPU:
#     ./scripts/gpu_check.sh 2>&1 | tee gpu-check.txt
# Without CUDA it skips every check and exits 0. Exit 1 if any check failed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=${DITSERVE_VENV:-.venv}
exec timeout "${DITSERVE_GPU_CHECK_TIMEOUT:-600}" "$VENV/bin/python" scripts/gpu_check.py "$@"
