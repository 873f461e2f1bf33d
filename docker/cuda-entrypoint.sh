#!/bin/sh
# Dockerfile.cuda's entrypoint: refuse a CUDA allocator setting that breaks the plan-cache slab's
# CUDA IPC export, then exec `ditserve ARGS...` (the sidecar exports the slab through a
# CUDA IPC memory handle, which memory from expandable segments does not support: the
# generator's open fails, or maps the wrong memory).
set -eu
refuse_expandable() {  # refuse_expandable NAME VALUE
  squeezed=$(printf '%s' "$2" | tr -d ' \t' | tr '[:upper:]' '[:lower:]')
  case ",$squeezed," in
    *,expandable_segments:true,*)
      echo "ditserve: refusing to start: $1='$2' sets expandable_segments:True, which breaks the CUDA IPC" \
        "export of the plan-cache slab to the generator. Unset $1 or set expandable_segments:False." >&2
      exit 2
      ;;
  esac
}
refuse_expandable PYTORCH_CUDA_ALLOC_CONF "${PYTORCH_CUDA_ALLOC_CONF:-}"
refuse_expandable PYTORCH_ALLOC_CONF "${PYTORCH_ALLOC_CONF:-}"  # torch's newer name for the same setting
exec "${DITSERVE_BIN:-ditserve}" "$@"
