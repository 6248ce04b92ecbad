#!/usr/bin/env bash
# envbuild build steps, shared by the Dockerfile (RUN) and Singularity.standalone.def
# (%post), so both images are built by the same commands.
#
#   setup.sh os PACKAGE...            apt packages (optional mirror, extra CA)
#   setup.sh venv PYTHON              the virtual environment at /opt/venv
#   setup.sh torch INDEX|- SPEC...    torch and torchvision (INDEX: PyTorch's variant index)
#   setup.sh cuda-toolkit VERSION     nvcc from PyPI wheels into /opt/cuda-pypi (CUDA 13)
#   setup.sh deepspeed SPEC OP...     DeepSpeed with OP... pre-built, then checked
#
# Mirrors and the extra CA are read from secret files in /run/secrets (BuildKit secret
# mounts; `apptainer build --bind DIR:/run/secrets`): ca_cert, pip_index_url,
# torch_index_url, apt_mirror. They are used from a temporary directory that is removed
# before the step ends, so no layer, history entry or label ever holds them.
set -euo pipefail

SECRETS=${ENVBUILD_SECRETS_DIR:-/run/secrets}
SETUP_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=/opt/venv
export DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
TMP=$(mktemp -d /tmp/envbuild.XXXXXX)
trap 'rm -rf "$TMP"' EXIT

log() { printf 'envbuild: %s\n' "$*" >&2; }

# The first line of a secret file, or nothing.
secret() {
    if [[ -s "$SECRETS/$1" ]]; then head -n 1 "$SECRETS/$1" | tr -d '\r\n'; fi
}

# Trust the system CAs plus the extra one (a TLS-intercepting proxy's), for pip and apt.
ca_bundle() {
    [[ -s "$SECRETS/ca_cert" ]] || return 0
    local system=/etc/ssl/certs/ca-certificates.crt
    { if [[ -s $system ]]; then cat "$system"; fi; cat "$SECRETS/ca_cert"; } > "$TMP/ca.pem"
    export PIP_CERT="$TMP/ca.pem" SSL_CERT_FILE="$TMP/ca.pem" REQUESTS_CA_BUNDLE="$TMP/ca.pem"
}

pip_env() {
    ca_bundle
    local index
    index=$(secret pip_index_url)
    if [[ -n $index ]]; then export PIP_INDEX_URL="$index"; fi
}

step_os() {
    ca_bundle
    local -a opts=()
    local mirror
    mirror=$(secret apt_mirror)
    if [[ -n $mirror ]]; then
        # Rewrite copies of the sources, never the image's own files.
        mkdir -p "$TMP/apt/sources.list.d"
        local re='s#https?://(deb\.debian\.org|security\.debian\.org|archive\.ubuntu\.com|security\.ubuntu\.com)#'"${mirror%/}"'#g'
        if [[ -f /etc/apt/sources.list ]]; then sed -E "$re" /etc/apt/sources.list > "$TMP/apt/sources.list"; else : > "$TMP/apt/sources.list"; fi
        for f in /etc/apt/sources.list.d/*; do
            [[ -f $f ]] && sed -E "$re" "$f" > "$TMP/apt/sources.list.d/$(basename "$f")"
        done
        opts+=(-o "Dir::Etc::SourceList=$TMP/apt/sources.list" -o "Dir::Etc::SourceParts=$TMP/apt/sources.list.d")
    fi
    if [[ -n ${PIP_CERT:-} ]]; then opts+=(-o "Acquire::https::CAInfo=$PIP_CERT"); fi
    apt-get "${opts[@]}" update -qq
    apt-get "${opts[@]}" install -y -qq --no-install-recommends "$@"
    apt-get clean
    rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /var/log/apt /var/log/dpkg.log
}

step_venv() {
    "$1" -m venv "$VENV"
}

step_torch() {
    pip_env
    local index=$1; shift
    local override
    override=$(secret torch_index_url)
    if [[ -n $override ]]; then index=$override; fi
    if [[ $index != "-" ]]; then
        "$VENV/bin/pip" install --index-url "$index" "$@"
    else
        "$VENV/bin/pip" install "$@"
    fi
}

step_cuda_toolkit() {
    pip_env
    local version=$1 home=/opt/cuda-pypi/nvidia/cu${1%%.*}
    "$VENV/bin/pip" install --target /opt/cuda-pypi "cuda-toolkit[nvcc,nvvm,crt,cccl,cudart]==$version"
    # DeepSpeed and cpp_extension expect a classic CUDA_HOME: nvcc.profile and torch link
    # with -L$CUDA_HOME/lib64 and -lcudart.
    [[ -e $home/lib64 ]] || ln -s lib "$home/lib64"
    local lib
    for lib in "$home"/lib/lib*.so.*; do
        [[ -e $lib ]] || continue
        local plain=${lib%%.so.*}.so
        [[ -e $plain ]] || ln -s "$(basename "$lib")" "$plain"
    done
    # torch's headers include cublas/cusparse/cusolver headers, which the wheels torch
    # itself depends on carry (in the venv) but the nvcc extras do not: link them in.
    local site
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if [[ -d $site/nvidia/cu${1%%.*}/include ]]; then
        cp -rsn "$site/nvidia/cu${1%%.*}/include/." "$home/include/"
    fi
    "$home/bin/nvcc" --version | tail -n 2
}

# Wrap the host compilers so DeepSpeed's `-march=native` becomes a declared x86-64
# level: an image built on an AVX-512 runner must not die with SIGILL on older nodes.
cpu_target_wrappers() {
    local target=${ENVBUILD_CPU_TARGET:-}
    [[ -n $target ]] || return 0
    mkdir -p "$TMP/cc-bin"
    local name
    for name in cc c++ gcc g++ x86_64-linux-gnu-gcc x86_64-linux-gnu-g++; do
        if [[ -x /usr/bin/$name ]]; then ln -s "$SETUP_DIR/cc-wrapper.sh" "$TMP/cc-bin/$name"; fi
    done
    export PATH="$TMP/cc-bin:$PATH"
    log "CPU ops target $target (-march=native is rewritten)"
}

step_deepspeed() {
    pip_env
    local spec=$1; shift
    cpu_target_wrappers
    # With --no-build-isolation, setup.py imports DeepSpeed's dependencies before pip
    # resolves anything: install them first. ninja compiles the ops in parallel.
    "$VENV/bin/pip" install einops hjson msgpack ninja numpy "packaging>=20.0" psutil py-cpuinfo \
        "pydantic>=2.0.0" tqdm
    DS_ENABLE_NINJA=1 "$VENV/bin/pip" install --no-build-isolation "$spec"
    "$VENV/bin/python" "$SETUP_DIR/verify_ops.py" "$@"
    if [[ ${ENVBUILD_KEEP_TOOLCHAIN:-0} != 1 ]]; then
        # Without ninja nothing can JIT-compile at run time, even by accident.
        "$VENV/bin/pip" uninstall -y -q ninja
    fi
}

main() {
    local step=${1:?step}; shift
    case $step in
        os) step_os "$@" ;;
        venv) step_venv "$@" ;;
        torch) step_torch "$@" ;;
        cuda-toolkit) step_cuda_toolkit "$@" ;;
        deepspeed) step_deepspeed "$@" ;;
        *) log "unknown step '$step'"; exit 2 ;;
    esac
}

main "$@"
