#!/usr/bin/env bash
# Quick start: install (into .venv, once) and start both services on a generated demo
# repository (MiniMax-H3 preset tiny, released mixed precision, random weights; written to
# <run-dir>/demo-h3-tiny-mixed on first start), with the OpenAI-compatible /v1/videos facade on
# 127.0.0.1:8000. Extra arguments go to `ditserve serve` (e.g. --port 50052 --checkpoint DIR, DIR a
# MiniMax-H3 diffusers repository; a later --openai-port wins).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/ditserve serve --openai-port 8000 "$@"
