#!/usr/bin/env bash
# deepspeed.sh LOCK-PART|SPEC OP...: DeepSpeed with OP... pre-built, then checked (finish.sh
# then writes the guard and drops what only the builds needed).
# LOCK-PART: DeepSpeed's part of the stack's lock (its sdist's hash); its dependencies and
# build requirements are in the venv already, from the lock. Without a lock, SPEC
# (deepspeed==X) and ENVBUILD_DS_BUILD_REQUIRES: what setup.py imports before pip resolves
# anything (deepspeed.yaml build_requires); with --no-build-isolation they must be there first.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

pip_env
cuda_link_stubs
nvcc_reproducible
compile_cache_start
spec=$1; shift
venv=$(venv_dir)
# cpp_extension runs this instead of nvcc (PYTORCH_NVCC, with ninja): it counts each compile and
# puts the compile cache under it; with ENVBUILD_CUDA_ARCHS unset it keeps every -gencode pair.
if [[ -n ${CUDA_HOME:-} ]]; then export PYTORCH_NVCC="$STEPS_DIR/nvcc-arch.sh"; fi

# Wrap the host compilers so DeepSpeed's `-march=native` becomes the declared CPU target:
# an image built on an AVX-512 runner must not die with SIGILL on older nodes.
if [[ -n ${ENVBUILD_CPU_TARGET:-} ]]; then
    mkdir -p "$TMP/cc-bin"
    for name in cc c++ gcc g++ x86_64-linux-gnu-gcc x86_64-linux-gnu-g++ aarch64-linux-gnu-gcc aarch64-linux-gnu-g++; do
        if [[ -x /usr/bin/$name ]]; then ln -s "$STEPS_DIR/cc-wrapper.sh" "$TMP/cc-bin/$name"; fi
    done
    export PATH="$TMP/cc-bin:$PATH"
    log "CPU ops target $ENVBUILD_CPU_TARGET (-march=native is rewritten)"
fi
EXT_CACHE=/var/cache/envbuild-ext  # envbuild/image/paths.py EXTENSION_CACHE, a BuildKit cache mount
# ds_cached_wheel DIR: the key's wheel, its sha256 stamp checked, copied into DIR; false if none.
ds_cached_wheel() {
    local key=${ENVBUILD_DS_CACHE_KEY:-} w
    [[ -n $key ]] && cache_mounted "$EXT_CACHE" || return 1
    for w in "$EXT_CACHE/$key"/*.whl; do
        [[ -f $w && -f ${w%.whl}.sha256 ]] || continue
        if [[ "$(sha256sum "$w" | cut -d' ' -f1)" == "$(head -c 64 "${w%.whl}.sha256")" ]]; then
            cp "$w" "$1/"
            log "DeepSpeed: cached wheel ${w##*/} (key $key): not compiled again"
            return 0
        fi
        log "DeepSpeed: cached wheel ${w##*/} does not match its stamp: compiled again"
    done
    return 1
}
# ds_store_wheel WHEEL: into the cache under its key, the wheel then its stamp, each moved into place.
ds_store_wheel() {
    local key=${ENVBUILD_DS_CACHE_KEY:-} dest name
    [[ -n $key ]] && cache_mounted "$EXT_CACHE" || return 0
    dest=$EXT_CACHE/$key name=${1##*/}
    mkdir -p "$dest"
    cp "$1" "$dest/.$name.envbuild-tmp"
    sha256sum "$1" | cut -d' ' -f1 > "$dest/.${name%.whl}.sha256.envbuild-tmp"
    mv "$dest/.$name.envbuild-tmp" "$dest/$name"
    mv "$dest/.${name%.whl}.sha256.envbuild-tmp" "$dest/${name%.whl}.sha256"
}
if [[ -f $spec ]]; then
    # The sdist by its locked hash, compiled in a directory of a fixed name (pip's own build
    # directory has a random one, which the compilers write into the libraries: two builds
    # would differ), then installed by the wheel's hash from that directory only.
    # pip, not uv: uv has no download without an install, and builds an sdist in a directory of
    # its own choosing (the compilers would write its name into the ops).
    # The wheel is kept in the extension cache under a key of everything that decides its bytes
    # (ENVBUILD_DS_CACHE_KEY: deepspeed/KEY, envbuild/deepspeed.json), beside the CUDA extensions'
    # wheels, so `ext-cache save`/`load` carry it to another machine and an unchanged key never compiles.
    mkdir -p "$TMP/wheel"
    tree=/tmp/envbuild-build
    if ! ds_cached_wheel "$TMP/wheel"; then
        "${PIP_CACHED[@]}" "$venv/bin/pip" download --require-hashes --no-deps --no-build-isolation --no-binary :all: -r "$spec" \
            -d "$TMP/sdist" || lock_failed --require-hashes
        rm -rf "$tree" && mkdir -p "$tree"
        tar -xzf "$TMP"/sdist/*.tar.gz -C "$tree"
        DS_ENABLE_NINJA=1 "$venv/bin/pip" wheel --no-deps --no-build-isolation -w "$TMP/wheel" "$tree"/*/
        ds_store_wheel "$TMP"/wheel/*.whl
    fi
    wheel=("$TMP"/wheel/*.whl)
    name=${wheel[0]##*/}
    printf '%s==%s --hash=sha256:%s\n' "${name%%-*}" "$(cut -d- -f2 <<< "$name")" "$(sha256sum "${wheel[0]}" | cut -d' ' -f1)" \
        > "$TMP/wheel.txt"
    "$venv/bin/pip" install --no-deps --require-hashes --no-index --find-links "$TMP/wheel" -r "$TMP/wheel.txt"
    rm -rf "$tree"
else
    # shellcheck disable=SC2086  # a list of requirement strings without spaces
    "$venv/bin/pip" install ${ENVBUILD_DS_BUILD_REQUIRES:?without a lock the deepspeed step needs its build requirements}
    DS_ENABLE_NINJA=1 "$venv/bin/pip" install --no-build-isolation "$spec"
fi
compile_cache_report deepspeed
"$venv/bin/python" "$STEPS_DIR/verify_ops.py" "$@"
# Every op library carries SASS for the GPU's arches (NVIDIA's cuobjdump, no GPU needed): an op
# compiled for another arch would fail at run time with "no kernel image is available".
if [[ -n ${ENVBUILD_SASS_AUDIT:-} ]]; then
    log "SASS audit of the ops $ENVBUILD_SASS_AUDIT"
elif [[ -n ${CUDA_HOME:-} && -n ${TORCH_CUDA_ARCH_LIST:-} ]]; then
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mapfile -t op_libs < <(find "$site/deepspeed" -name '*.so' | LC_ALL=C sort)
    "$venv/bin/python" "$STEPS_DIR/sass_audit.py" "$TORCH_CUDA_ARCH_LIST" "$CUDA_HOME" "${op_libs[@]}"
fi
