#!/usr/bin/env bash
# One-shot accelerator check: installs (if needed), then prints one PASS/FAIL/SKIP line per check, with its numbers,
# and a verdict (scripts/gpu_check.py says what each check does). Run it on a machine with one CUDA GPU:
#     ./scripts/gpu_check.sh 2>&1 | tee gpu-check.txt
# Without any GPU it skips every check and exits 0; a GPU that torch cannot use is a FAIL. Exit 1 if any check
# failed. The checks take under 5 minutes on one H200: they have a 270 s budget (DITSERVE_GPU_CHECK_BUDGET_S) and
# are killed at 300 s (DITSERVE_GPU_CHECK_TIMEOUT); the install, when needed, comes before.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=${DITSERVE_VENV:-.venv}
exec timeout "${DITSERVE_GPU_CHECK_TIMEOUT:-300}" "$VENV/bin/python" scripts/gpu_check.py "$@"
