#!/usr/bin/env bash
# Stands in for gcc/g++/cc/c++ while DeepSpeed's CPU ops compile: rewrites the flags that
# tie the code to the build machine's CPU to the declared CPU target. DeepSpeed has no switch
# for this. The build plan passes the target's facts (gpus.yaml cpu_targets):
#   ENVBUILD_CPU_FLAG  replaces -march=native / -mcpu=native (-march=x86-64-v3, -mcpu=neoverse-v2)
#   ENVBUILD_CPU_SIMD  replaces -D__AVX512__ / -D__AVX256__ (the build machine's SIMD width);
#                      on aarch64 (-D__NEON__) also -D__SVE__ / -D__SCALAR__: NEON is in every
#                      AArch64 CPU, and DeepSpeed's simd.h (>= 0.19.7) vectorises cpu_adam,
#                      cpu_adagrad and cpu_lion with it; empty: the macro is dropped (scalar).
set -euo pipefail
flag=${ENVBUILD_CPU_FLAG:?the build plan names the CPU target flag}
simd=${ENVBUILD_CPU_SIMD-}
args=()
for arg in "$@"; do
    case $arg in
        -march=native | -mcpu=native) args+=("$flag") ;;
        -mtune=native) args+=("-mtune=generic") ;;
        -D__AVX512__ | -D__AVX256__) if [[ -n $simd ]]; then args+=("$simd"); fi ;;
        -D__SVE__ | -D__NEON__ | -D__SCALAR__)
            if [[ $simd == -D__NEON__ ]]; then args+=("$simd"); else args+=("$arg"); fi ;;
        *) args+=("$arg") ;;
    esac
done
# ENVBUILD_CC: the real compiler (tests point it at a cross compiler); default /usr/bin/<name>.
compiler=${ENVBUILD_CC:-/usr/bin/$(basename "$0")}
# Counted (lib.sh compile_cache_report), and served through the compile cache when the step has
# one (ENVBUILD_SCCACHE, lib.sh compile_cache_start). Under nvcc the host compiles come without it:
# sccache runs nvcc's phases itself, its host compiles included.
if [[ -n ${ENVBUILD_COMPILES:-} ]]; then printf '%s\n' "${compiler##*/}" >> "$ENVBUILD_COMPILES"; fi
if [[ -n ${ENVBUILD_SCCACHE:-} ]]; then exec "$ENVBUILD_SCCACHE" "$compiler" "${args[@]}"; fi
exec "$compiler" "${args[@]}"
