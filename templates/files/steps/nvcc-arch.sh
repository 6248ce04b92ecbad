#!/usr/bin/env bash
# nvcc-arch.sh NVCC-ARGS...: nvcc with only the code the GPU profile's arches run. Each -gencode
# pair is kept when its code runs on an arch of ENVBUILD_CUDA_ARCHS ("90", "80 86", "90+PTX"):
# a cubin sm_XY runs on X.Z for Z >= Y (sm_90a and sm_100f only on their own arch), PTX
# compute_XY is kept only for an arch with +PTX at or above it. A compile left with no code
# fails, naming what the extension asked for, instead of building code the GPU cannot run.
# The largest lever on an extension's build time (causal-conv1d hard-codes nine arches).
set -euo pipefail
# ENVBUILD_CUDA_ARCHS empty (DeepSpeed's ops, whose arches TORCH_CUDA_ARCH_LIST decides): every
# pair is kept, and nvcc is only counted and cached.
: "${CUDA_HOME:?}"
wanted=${ENVBUILD_CUDA_ARCHS-}
args=() asked=() kept=0 seen=0
keep() {  # keep arch=compute_80,code=sm_80: does this code run on one of the wanted arches?
    local code=${1##*code=} want ptx=0 exact=0 c w
    code=${code//[\[\]]/}
    if [[ $code == compute_* ]]; then ptx=1; fi
    code=${code#sm_}; code=${code#compute_}
    if [[ $code == *[af] ]]; then exact=1; code=${code%[af]}; fi
    [[ $code =~ ^[0-9]+$ ]] || return 1
    for want in $wanted; do
        w=${want%+PTX}; c=$code
        if ((ptx)); then
            [[ $want == *+PTX ]] && ((c <= w)) && return 0
        elif ((exact)); then
            ((c == w)) && return 0
        elif ((c / 10 == w / 10 && c <= w)); then
            return 0
        fi
    done
    return 1
}
while (($#)); do
    case $1 in
        -gencode|--generate-code) value=$2; shift 2 ;;
        -gencode=*|--generate-code=*) value=${1#*=}; shift ;;
        *) args+=("$1"); shift; continue ;;
    esac
    seen=$((seen + 1)); asked+=("$value")
    if [[ -z $wanted ]] || keep "$value"; then args+=(-gencode "$value"); kept=$((kept + 1)); fi
done
if ((seen > 0 && kept == 0)); then
    printf 'envbuild: nvcc-arch: this compile asks for %s, none of them for the GPU arches %s: the extension does not build code for this GPU\n' \
        "${asked[*]}" "$ENVBUILD_CUDA_ARCHS" >&2
    exit 1
fi
# Counted (lib.sh compile_cache_report), and served through the compile cache when the step has
# one and its sccache handles this CUDA (lib.sh compile_cache_start); the host compiles sccache
# runs for nvcc then go to the compiler itself (ENVBUILD_SCCACHE unset below them).
if [[ -n ${ENVBUILD_COMPILES:-} ]]; then printf 'nvcc\n' >> "$ENVBUILD_COMPILES"; fi
if [[ -n ${ENVBUILD_SCCACHE:-} && ${ENVBUILD_SCCACHE_NVCC:-} != no:* ]]; then
    exec env -u ENVBUILD_SCCACHE "$ENVBUILD_SCCACHE" "$CUDA_HOME/bin/nvcc" "${args[@]}"
fi
exec "$CUDA_HOME/bin/nvcc" "${args[@]}"
