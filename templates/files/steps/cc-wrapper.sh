#!/usr/bin/env bash
# Stands in for gcc/g++/cc/c++ while DeepSpeed's CPU ops compile: rewrites the flags that
# tie the code to the build machine's CPU to the declared CPU target in ENVBUILD_CPU_TARGET
# (gpus.yaml cpu_targets). DeepSpeed has no switch for this.
#   -march=native / -mcpu=native -> -march=x86-64-vN, -march=armvX-a or -mcpu=CPU
#   -D__AVX512__ / -D__AVX256__  -> the x86-64 level's SIMD width (v4: AVX-512, v3: AVX2)
#   on aarch64 targets, -D__AVX*__ / -D__SVE__ / -D__SCALAR__ -> -D__NEON__: NEON is in every
#   AArch64 CPU, and DeepSpeed's simd.h (>= 0.19.7) vectorises cpu_adam, cpu_adagrad and
#   cpu_lion with it (its SVE path covers cpu_adam only); older releases ignore the macro.
set -euo pipefail
target=${ENVBUILD_CPU_TARGET:-x86-64-v3}
case $target in
    x86-64 | x86-64-v[234] | armv[89]*-a) flag=-march=$target ;;
    *) flag=-mcpu=$target ;;
esac
case $target in
    x86-64-v4) simd=-D__AVX512__ ;;
    x86-64-v3) simd=-D__AVX256__ ;;
    x86-64*) simd= ;;
    *) simd=-D__NEON__ ;;
esac
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
exec "${ENVBUILD_CC:-/usr/bin/$(basename "$0")}" "${args[@]}"
