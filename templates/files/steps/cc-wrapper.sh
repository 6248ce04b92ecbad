#!/usr/bin/env bash
# Stands in for gcc/g++/cc/c++ while DeepSpeed's CPU ops compile: rewrites the flags that
# tie the code to the build machine's CPU (-march=native, -D__AVX512__) to the declared
# x86-64 level in ENVBUILD_CPU_TARGET. DeepSpeed has no switch for this.
set -euo pipefail
target=${ENVBUILD_CPU_TARGET:-x86-64-v3}
case $target in
    x86-64-v4) simd=-D__AVX512__ ;;
    x86-64-v3) simd=-D__AVX256__ ;;
    *) simd= ;;
esac
args=()
for arg in "$@"; do
    case $arg in
        -march=native) args+=("-march=$target") ;;
        -mtune=native) args+=("-mtune=generic") ;;
        -D__AVX512__ | -D__AVX256__) if [[ -n $simd ]]; then args+=("$simd"); fi ;;
        *) args+=("$arg") ;;
    esac
done
exec "/usr/bin/$(basename "$0")" "${args[@]}"
