#!/usr/bin/env bash
# cuda-toolkit.sh PREFIX CUDA_HOME PIP_ARG...: nvcc from PyPI's cuda-toolkit wheels (from a
# lock: `--require-hashes --no-deps -r PART`), installed outside the venv into PREFIX (by the
# matrix's uv where the plan names it: ENVBUILD_UV, else pip);
# CUDA_HOME is where the wheels put the toolkit.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

pip_env
prefix=$1 home=$2; shift 2
if [[ -n ${ENVBUILD_UV:-} ]]; then  # the matrix's uv (uv.sh), as the venv's lock part
    mapfile -t indexes < <(uv_indexes -)
    uv_pip install --python "$(venv_dir)/bin/python" --target "$prefix" "${indexes[@]}" "$@" || lock_failed "$@"
else
    "$(venv_dir)/bin/pip" install --target "$prefix" "$@" || lock_failed "$@"
fi
# DeepSpeed and cpp_extension expect a classic CUDA_HOME: nvcc.profile and torch link
# with -L$CUDA_HOME/lib64 and -lcudart.
[[ -e $home/lib64 ]] || ln -s lib "$home/lib64"
for lib in "$home"/lib/lib*.so.*; do
    [[ -e $lib ]] || continue
    plain=${lib%%.so.*}.so
    [[ -e $plain ]] || ln -s "$(basename "$lib")" "$plain"
done
# torch's headers include cublas/cusparse/cusolver headers, and c10d's NCCLUtils.hpp nccl.h
# (DeepSpeed's dc op includes it), which the wheels torch itself depends on carry (in the venv)
# but the nvcc extras do not: link them in.
site=$("$(venv_dir)/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for wheel_include in "$site/nvidia/$(basename "$home")/include" "$site/nvidia/nccl/include"; do
    if [[ -d $wheel_include ]]; then
        cp -rsn "$wheel_include/." "$home/include/"
    fi
done
# What an extra of the toolkit added to the venv for the chosen ops (ENVBUILD_TOOLCHAIN_ADDS:
# libcurand, from the lock's [curand] section): its headers came with the include directory
# above; its library, under the name the linker looks for (-lcurand: libcurand.so).
for name in ${ENVBUILD_TOOLCHAIN_ADDS:-}; do
    found=("$site/nvidia/$(basename "$home")/lib/$name".so.*)
    [[ -e ${found[0]} ]] || { log "cuda-toolkit: $name is not in $site/nvidia/$(basename "$home")/lib; the venv's lock part lacks it"; exit 1; }
    ln -sfn "${found[0]}" "$home/lib/$name.so"
done
# The driver's link stub, as NVIDIA's toolkit has it in lib64/stubs and no PyPI wheel does: ops
# that link -lcuda (DeepSpeed's async_io) find it through LIBRARY_PATH (lib.sh cuda_link_stubs).
# Empty, with the driver's soname: an op that uses no driver symbol (async_io) records no
# libcuda at all (ldd of the CI stack's image); one that does would record libcuda.so.1 and take
# it from the driver on a GPU node, as a shared object may leave those symbols undefined.
mkdir -p "$home/lib/stubs"
gcc -shared -nostdlib -Wl,-soname,libcuda.so.1 -o "$home/lib/stubs/libcuda.so" -x c /dev/null
"$home/bin/nvcc" --version | tail -n 2
