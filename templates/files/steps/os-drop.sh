#!/usr/bin/env bash
# os-drop.sh PATTERN...: purge the base image's installed packages that match PATTERN
# (dpkg-query's patterns). --keep-toolchain only: the final image is then the builder, and the
# nvidia/cuda devel images install libnccl2 (and libnccl-dev) beside the nvidia-nccl wheel torch
# loads; two libnccl on the image's library paths is what the smoke test's nccl_copies refuses.
# The builder needs neither: DeepSpeed's ops and the extensions compile against the wheels.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

mapfile -t found < <(dpkg-query -W -f='${binary:Package}\t${db:Status-Status}\n' "$@" 2> /dev/null \
    | awk -F'\t' '$2 == "installed" {print $1}')
if ((${#found[@]} == 0)); then
    log "os-drop: none of $* is installed"
    exit 0
fi
# The nvidia/cuda images hold libnccl2 (apt-mark hold): the hold guards against an upgrade, not this.
dpkg --purge --force-hold "${found[@]}"
log "os-drop: purged the base image's ${found[*]} (torch loads the venv's nvidia-nccl wheel)"
