#!/usr/bin/env bash
# One-shot accelerator check: the service checks (scripts/gpu_check.py: one PASS/FAIL/SKIP line each, with its
# numbers) and the real-page-size probe (scripts/gpu_probe.py: one JSON line per part), then a verdict.
#
#     scripts/gpu_check.sh [--out DIR] [gpu_check.py's args]                      # here: bootstrap + .venv
#     scripts/gpu_check.sh --offline [--out DIR] [--wheels DIR]                   # a lent H200, no package index
#
# --offline runs on a machine with no package index and a system python that has torch (DITSERVE_GPU_CHECK_PYTHON,
# default python3): it installs the carried wheels (--wheels, default .whl/, fetched here by scripts/gpu_wheels.sh)
# with --no-index --no-deps --target into a temporary folder, puts that folder and the repository root on
# PYTHONPATH (no venv, no console scripts: `python -m ditserve`), runs the import smoke test (scripts/gpu_smoke.py:
# names every missing module; refuses a torch outside the supported range), then the probe and the checks with that
# python. Without --offline: scripts/bootstrap.sh and the venv's python, as before.
#
# Everything measured goes under DIR (default $OUT if set, else ./gpu-check-out): gpu-check.log (all output),
# probe.jsonl, gpu-tests.xml (JUnit, on CUDA), serve-logs.txt (when a service check failed): at most 8 files.
# DITSERVE_GPU_CHECK_DEVICE=cpu runs everything on the CPU, the probe at scaled-down sizes (the dry run).
# Budget: the whole run within DITSERVE_GPU_CHECK_TOTAL_S (default 480 s); the probe gets DITSERVE_GPU_PROBE_BUDGET_S
# (default 150 s), the service checks DITSERVE_GPU_CHECK_BUDGET_S (default 270 s, cut to what is left) and are killed
# DITSERVE_GPU_CHECK_GRACE_S (15 s) after it. Exit 0 when everything passed, 2 when torch is refused, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
offline=0 out="" wheels="$ROOT/.whl" args=()
while (($#)); do
  case "$1" in
    --offline) offline=1 ;;
    --out) out=$2; shift ;;
    --out=*) out=${1#--out=} ;;
    --wheels) wheels=$2; shift ;;
    --wheels=*) wheels=${1#--wheels=} ;;
    *) args+=("$1") ;;
  esac
  shift
done
out=${out:-${OUT:-$ROOT/gpu-check-out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)

TOTAL_S=${DITSERVE_GPU_CHECK_TOTAL_S:-480}
PROBE_S=${DITSERVE_GPU_PROBE_BUDGET_S:-150}
GRACE_S=${DITSERVE_GPU_CHECK_GRACE_S:-15}

setup_offline() {
  PY=${DITSERVE_GPU_CHECK_PYTHON:-python3}
  SITE=$(mktemp -d /tmp/ditserve-site.XXXXXX)
  trap 'rm -rf "$SITE"' EXIT
  shopt -s nullglob
  local whl=("$wheels"/*.whl)
  shopt -u nullglob
  if ((${#whl[@]})); then
    echo "gpu_check: installing ${#whl[@]} wheels from $wheels into $SITE"
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "${whl[@]}" || { echo "gpu_check: FAIL: $PY -m pip could not install the wheels"; return 1; }
  else
    echo "gpu_check: no wheels in $wheels (scripts/gpu_wheels.sh fetches them): the system python's packages only"
  fi
  export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  smoke=("$PY" scripts/gpu_smoke.py --site "$SITE")
}

run() {
  if ((offline)); then
    setup_offline || return 1
  else
    bash scripts/bootstrap.sh
    PY=${DITSERVE_GPU_CHECK_PYTHON:-${DITSERVE_VENV:-.venv}/bin/python}
    smoke=("$PY" scripts/gpu_smoke.py)
  fi
  export PYTHONUNBUFFERED=1
  echo "gpu_check: python $PY; out $out; device ${DITSERVE_GPU_CHECK_DEVICE:-cuda}; budget ${TOTAL_S} s"
  local rc=0
  timeout -k 10 120 "${smoke[@]}" || rc=$?
  if ((rc != 0)); then
    echo "gpu_check: FAIL: the import smoke test (exit $rc): nothing was measured"
    return $((rc == 2 ? 2 : 1))
  fi
  local probe_rc=0 check_rc=0
  local left=$((TOTAL_S - SECONDS - 2 * GRACE_S - 60))  # the service checks need a minute at least
  local probe=$((PROBE_S < left ? PROBE_S : left))
  if ((probe < 10)); then
    echo "gpu_check: FAIL: only ${left} s of the ${TOTAL_S} s budget left for the probe"
    probe_rc=1
  else
    timeout -k 10 $((probe + GRACE_S)) "$PY" scripts/gpu_probe.py --out "$out" --budget-s "$probe" || probe_rc=$?
  fi
  left=$((TOTAL_S - SECONDS - GRACE_S))
  local budget=${DITSERVE_GPU_CHECK_BUDGET_S:-270}
  budget=$((budget < left ? budget : left))
  if ((budget < 30)); then
    echo "gpu_check: FAIL: only ${left} s of the ${TOTAL_S} s budget left for the service checks"
    check_rc=1
  else
    DITSERVE_GPU_CHECK_BUDGET_S=$budget timeout -k 10 $((budget + GRACE_S)) \
      "$PY" scripts/gpu_check.py --out "$out" ${args[@]+"${args[@]}"} || check_rc=$?
  fi
  "$PY" scripts/gpu_probe.py --describe
  echo "gpu_check: probe exit $probe_rc, service checks exit $check_rc, in $SECONDS s; outputs in $out:" \
    "$(cd "$out" && ls | tr '\n' ' ')"
  ((probe_rc == 0 && check_rc == 0))
}

set +e
run 2>&1 | tee "$out/gpu-check.log"
rc=${PIPESTATUS[0]}
exit "$rc"
