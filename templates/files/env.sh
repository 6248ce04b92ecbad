# shellcheck shell=sh
# Sourced by the Docker entrypoint and by Apptainer's %environment.
# Per-job, node-local compile caches: a safety net against the shared
# ~/.cache/torch_extensions hangs (field reports 1 and 2). Sets only what is unset.
_envbuild_job=${SLURM_JOB_ID:-}
if [ -z "$_envbuild_job" ]; then
    _envbuild_job="$(id -un 2>/dev/null || id -u)-$$"
fi
_envbuild_dir=${ENVBUILD_LOCAL_DIR:-${TMPDIR:-/tmp}}
if [ -z "${TORCH_EXTENSIONS_DIR:-}" ]; then
    TORCH_EXTENSIONS_DIR="$_envbuild_dir/torch_extensions-$_envbuild_job"
    export TORCH_EXTENSIONS_DIR
fi
if [ -z "${TRITON_CACHE_DIR:-}" ]; then
    TRITON_CACHE_DIR="$_envbuild_dir/triton-$_envbuild_job"
    export TRITON_CACHE_DIR
fi
unset _envbuild_job _envbuild_dir
