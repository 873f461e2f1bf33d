#!/usr/bin/env bash
# Quick start: install (into .venv, once) and start both services on a generated demo
# checkpoint. Extra arguments go to `ditserve serve` (e.g. --port 50052 --checkpoint DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/ditserve serve "$@"
