#!/usr/bin/env bash
# uv.sh PREFIX PART: the matrix's uv (PART: `uv==VERSION --hash=sha256:...`, matrices/bases.yaml
# installer) from PyPI's wheel by its hashes into PREFIX, outside the venv: what installs the lock's
# parts in this builder (torch.sh, cuda-toolkit.sh). pip installs it reading no configuration file;
# the final image carries pip, not uv.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

pip_env
prefix=$1 part=$2
"${PIP_CACHED[@]}" PIP_CONFIG_FILE=/dev/null "$(venv_dir)/bin/pip" install --require-hashes --no-deps \
    --only-binary :all: --no-compile --target "$prefix" -r "$part" || lock_failed --require-hashes
want=$(sed -E -n 's/^uv==([^ ]+) .*/\1/p' "$part")
got=$("$prefix/bin/uv" --version)
if [[ $got != "uv $want" && $got != "uv $want "* ]]; then
    log "uv.sh: $prefix/bin/uv says '$got', the matrix pins uv $want"
    exit 1
fi
log "installer: $got ($prefix/bin/uv)"
