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
spec=$1; shift
venv=$(venv_dir)

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
if [[ -f $spec ]]; then
    # The sdist by its locked hash, compiled in a directory of a fixed name (pip's own build
    # directory has a random one, which the compilers write into the libraries: two builds
    # would differ), then installed by the wheel's hash from that directory only.
    # pip, not uv: uv has no download without an install, and builds an sdist in a directory of
    # its own choosing (the compilers would write its name into the ops).
    "${PIP_CACHED[@]}" "$venv/bin/pip" download --require-hashes --no-deps --no-build-isolation --no-binary :all: -r "$spec" \
        -d "$TMP/sdist" || lock_failed --require-hashes
    tree=/tmp/envbuild-build
    rm -rf "$tree" && mkdir -p "$tree" "$TMP/wheel"
    tar -xzf "$TMP"/sdist/*.tar.gz -C "$tree"
    DS_ENABLE_NINJA=1 "$venv/bin/pip" wheel --no-deps --no-build-isolation -w "$TMP/wheel" "$tree"/*/
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
