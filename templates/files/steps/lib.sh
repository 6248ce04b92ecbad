# shellcheck shell=bash
# Shared by every envbuild build step (sourced, never run): secrets, the CA bundle, pip's
# index. Mirrors and the extra CA are read from secret files in /run/secrets (BuildKit
# secret mounts; `apptainer build --bind DIR:/run/secrets`): ca_cert, pip_index_url,
# torch_index_url, apt_mirror, source_mirror. They are used from a temporary directory removed before the
# step ends, so no layer, history entry or label ever holds them.
set -euo pipefail

SECRETS=${ENVBUILD_SECRETS_DIR:-/run/secrets}
ENVBUILD_SCCACHE_PID=  # the compile cache's server, when compile_cache_start started one
# shellcheck disable=SC2034  # read by the steps that source this file
STEPS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The same content from the same inputs (reproducible-builds.org): with SOURCE_DATE_EPOCH set,
# Python byte-compiles to hash-checked .pyc files (no source mtime inside) and tools that stamp a
# time write this one (1980-01-01, the earliest a zip can hold); a fixed hash seed orders the
# sets that byte-compiled constants hold. Build steps only: the image's own environment keeps neither.
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-315532800} PYTHONHASHSEED=0
TMP=$(mktemp -d /tmp/envbuild.XXXXXX)
# Every file this step writes ends it with one fixed mtime (SOURCE_DATE_EPOCH): compilers write
# the mtime of the headers they read into what they make (nvcc into a CUDA op's line table), and
# pip stamps every file it installs with the time of the install. What dpkg unpacks keeps the
# package's own times (older than the step: untouched). The marker lives on /dev/shm and the walk
# stays on the image's filesystem (-xdev): secrets, cache mounts and bound folders are not touched.
# Only in a build, where the steps run from /opt/envbuild-setup (envbuild/image/paths.py SETUP_DIR):
# a step run anywhere else (one step tested on a developer's machine) would restamp every file the
# machine wrote meanwhile, another process's included.
STEP_STARTED=
if [[ $STEPS_DIR == /opt/envbuild-setup ]]; then
    STEP_STARTED=$(mktemp /dev/shm/envbuild-step.XXXXXX 2> /dev/null || true)
fi
finish_step() {
    if [[ -n ${ENVBUILD_SCCACHE_PID:-} ]]; then  # its writes finished first (--stop-server), then it is gone
        if [[ -n ${ENVBUILD_SCCACHE:-} ]]; then timeout 120 "$ENVBUILD_SCCACHE" --stop-server > /dev/null 2>&1 || true; fi
        kill "$ENVBUILD_SCCACHE_PID" 2> /dev/null || true
        wait "$ENVBUILD_SCCACHE_PID" 2> /dev/null || true
    fi
    rm -rf "$TMP"
    if [[ -n $STEP_STARTED ]]; then
        find / -xdev -newer "$STEP_STARTED" -print0 2> /dev/null | xargs -0r touch -h -d "@$SOURCE_DATE_EPOCH" 2> /dev/null || true
        rm -f "$STEP_STARTED"
    fi
}
trap finish_step EXIT

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

# The stack's virtual environment: the stage sets VIRTUAL_ENV (one place: the build plan).
venv_dir() {
    printf '%s' "${VIRTUAL_ENV:?the build stage sets VIRTUAL_ENV}"
}

# BuildKit cache mounts of the downloads (envbuild/plan/blocks.py APT_CACHE, PY_CACHE): a step uses
# one only where the build mounted it (Docker); an Apptainer build has none and downloads as before.
# Nothing under them reaches a layer, and the end-of-step stamp (-xdev) does not walk them.
# shellcheck disable=SC2034  # read by the steps that source this file
APT_CACHE=/var/cache/envbuild-apt
PY_CACHE=/var/cache/envbuild-py
cache_mounted() {
    [[ -d $1 ]] && { ! command -v mountpoint > /dev/null || mountpoint -q "$1"; }
}

# pip's download cache on the cache mount, as a prefix for one pip command: "${PIP_CACHED[@]}" pip ...
# Only for downloads of hash-pinned files: pip would also cache the wheels it builds from an sdist,
# and a DeepSpeed wheel built for other ops must never be taken from a cache.
PIP_CACHED=(env)
if cache_mounted "$PY_CACHE"; then
    # shellcheck disable=SC2034  # read by the steps that source this file
    PIP_CACHED=(env -u PIP_NO_CACHE_DIR "PIP_CACHE_DIR=$PY_CACHE/pip")
fi

# uv_pip COMMAND ARG...: `uv pip COMMAND` with the matrix's uv (ENVBUILD_UV, installed by uv.sh),
# none of the machine's configuration (no uv.toml or pyproject.toml, no UV_* variable but these),
# the step's CA bundle (pip_env), its cache on the cache mount (else none), and files copied into
# place (a link into a cache would not survive the step).
uv_pip() (
    for name in $(compgen -e); do
        if [[ $name == UV_* ]]; then unset "$name"; fi
    done
    uv_cache=(--no-cache)
    if cache_mounted "$PY_CACHE"; then uv_cache=(--cache-dir "$PY_CACHE/uv"); fi
    uv_cert=()
    if [[ -n ${PIP_CERT:-} ]]; then uv_cert=(--cert "$PIP_CERT"); fi
    export UV_NO_CONFIG=1 UV_PYTHON_DOWNLOADS=never UV_NO_PROGRESS=1
    subcommand=$1; shift
    "${ENVBUILD_UV:?the step installs with uv but the plan named none}" pip "$subcommand" --no-config "${uv_cache[@]}" \
        "${uv_cert[@]}" --link-mode copy "$@"
)

# The index options of a uv install: INDEX (PyTorch's, or - for none) searched first, then PyPI
# or the pip_index_url secret (pip_env), as `envbuild lock` resolved the lock (uv's first-index
# strategy: a package comes from the first index that has it).
uv_indexes() {
    printf '%s\n' --index-url "${PIP_INDEX_URL:-https://pypi.org/simple}"
    if [[ $1 != "-" ]]; then printf '%s\n' --extra-index-url "$1"; fi
}

# After a failed install: when it installed from a lock part, say so in envbuild's words (pip's or
# uv's own lines above name the package and both hashes), then fail the step.
lock_failed() {
    local arg
    for arg in "$@"; do
        if [[ $arg == --require-hashes ]]; then
            log "the install from the stack's lock failed. If pip says THESE PACKAGES DO NOT MATCH THE" \
                "HASHES (uv: Hash mismatch), the package it names is not the file the lock pinned (a changed" \
                "upload, a mirror serving another file, or an edited lock): the build stops and no tag is applied." \
                "Refresh the lock with \`envbuild lock --stack ID\` only if the change is expected."
        fi
    done
    return 1
}

# nvcc names its intermediate files after its process ID (tmpxft_<pid>_...) and those names reach
# the object's symbols and module ID, so two compiles of one source differ; with --keep they are
# named after the source, in a directory of their own. One directory serves a whole step: the
# compiles of one extension run at once, and none of DeepSpeed's or an extension's has two
# sources of one name (two ops share dequantize.cu, and ops are built one after another).
nvcc_reproducible() {
    mkdir -p "$TMP/nvcc-keep"
    export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }--keep --keep-dir $TMP/nvcc-keep"
}

# cuda_link_stubs: the toolkit's link stubs (libcuda.so: the driver's, absent at build time) on
# the linker's search path, as NVIDIA's devel images set LIBRARY_PATH; nothing if there are none.
cuda_link_stubs() {
    if [[ -n ${CUDA_HOME:-} && -d $CUDA_HOME/lib64/stubs ]]; then
        export LIBRARY_PATH="$CUDA_HOME/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
    fi
}

# compile_cache_start: every compile of this step counted (the wrappers append their name to
# ENVBUILD_COMPILES) and, when the build was handed a compile cache (the compile_cache secret:
# lines NAME=VALUE of sccache's storage variables, `envbuild build --compile-cache`), served
# through the matrix's sccache (ENVBUILD_SCCACHE_BIN, sccache.sh): its server on a socket of this
# step, its storage checked by one probe compile, so a cache that does not answer fails the step
# here, naming it, and not every compile later. A unit served from the cache is the bytes the
# compile writes, so the image is the same with or without it.
compile_cache_start() {
    export ENVBUILD_COMPILES="$TMP/compiles"
    : > "$ENVBUILD_COMPILES"
    if [[ ! -s $SECRETS/compile_cache ]]; then
        log "compile cache: none (the build was handed no --compile-cache): every unit is compiled"
        return 0
    fi
    local bin=${ENVBUILD_SCCACHE_BIN:-} line name
    if [[ -z $bin || ! -x $bin ]]; then
        log "compile cache: handed one, but this build has no sccache (matrices/bases.yaml compile_cache): every unit is compiled"
        return 0
    fi
    while IFS= read -r line || [[ -n $line ]]; do
        line=${line%$'\r'}
        [[ -n $line && $line != \#* ]] || continue
        name=${line%%=*}
        case $name in
            SCCACHE_REDIS_ENDPOINT | SCCACHE_REDIS_USERNAME | SCCACHE_REDIS_PASSWORD | SCCACHE_REDIS_DB \
            | SCCACHE_REDIS_KEY_PREFIX | SCCACHE_REDIS_EXPIRATION | SCCACHE_GHA_ENABLED | SCCACHE_GHA_VERSION \
            | ACTIONS_RESULTS_URL | ACTIONS_RUNTIME_TOKEN | ACTIONS_CACHE_URL | ACTIONS_CACHE_SERVICE_V2 | SCCACHE_BUCKET \
            | SCCACHE_REGION | SCCACHE_ENDPOINT | SCCACHE_S3_KEY_PREFIX | SCCACHE_S3_USE_SSL | AWS_ACCESS_KEY_ID \
            | AWS_SECRET_ACCESS_KEY | AWS_SESSION_TOKEN) export "$name=${line#*=}" ;;
            *) log "compile cache: the compile_cache secret sets '$name', which is not one of sccache's storage variables envbuild passes"
               return 1 ;;
        esac
    done < "$SECRETS/compile_cache"
    export SCCACHE_SERVER_UDS="$TMP/sccache.sock" SCCACHE_IDLE_TIMEOUT=0 SCCACHE_DIR="$TMP/sccache" \
        SCCACHE_ERROR_LOG="$TMP/sccache.log" SCCACHE_LOG=warn SCCACHE_CONF=/dev/null
    printf 'int envbuild_probe(void) { return %s; }\n' "$RANDOM" > "$TMP/probe.c"
    # The server in the foreground of a child of this step (not sccache's own daemon), so the step
    # can stop it whatever happens: one whose storage does not answer never opens its socket.
    SCCACHE_START_SERVER=1 SCCACHE_NO_DAEMON=1 "$bin" > "$TMP/probe.out" 2>&1 &
    ENVBUILD_SCCACHE_PID=$!
    # How long sccache may take to open its socket, in tenths of a second: 30 s (the tests shorten
    # it with ENVBUILD_COMPILE_CACHE_WAIT, digits only, to see a dead cache refused quickly)
    local waited=0 limit=300
    if [[ ${ENVBUILD_COMPILE_CACHE_WAIT:-} =~ ^[0-9]{1,4}$ ]]; then limit=$ENVBUILD_COMPILE_CACHE_WAIT; fi
    while [[ ! -S $SCCACHE_SERVER_UDS ]] && kill -0 "$ENVBUILD_SCCACHE_PID" 2> /dev/null && ((waited < limit)); do
        sleep 0.1
        waited=$((waited + 1))
    done
    if [[ ! -S $SCCACHE_SERVER_UDS ]] \
        || ! (cd "$TMP" && "$bin" /usr/bin/gcc -c probe.c -o probe.o) >> "$TMP/probe.out" 2>&1; then
        local said value
        said=$(tail -n 3 "$TMP/probe.out" "$SCCACHE_ERROR_LOG" 2> /dev/null | tr '\n' ' ')
        for value in "${SCCACHE_REDIS_PASSWORD:-}" "${AWS_SECRET_ACCESS_KEY:-}" "${AWS_SESSION_TOKEN:-}" "${ACTIONS_RUNTIME_TOKEN:-}"; do
            if [[ -n $value ]]; then said=${said//"$value"/***}; fi
        done
        kill "$ENVBUILD_SCCACHE_PID" 2> /dev/null || true
        wait "$ENVBUILD_SCCACHE_PID" 2> /dev/null || true
        log "compile cache: sccache did not start or a probe compile through it failed within $((limit / 10)) s; the cache it was handed does not answer" \
            "(sccache: $said). Check it from this machine (redis-cli -u URL ping), or build without --compile-cache"
        return 1
    fi
    "$bin" --zero-stats > /dev/null 2>&1
    export ENVBUILD_SCCACHE="$bin"
    if [[ ${ENVBUILD_SCCACHE_NVCC:-} == no:* ]]; then
        log "compile cache: g++ only; nvcc is not cached (${ENVBUILD_SCCACHE_NVCC#no: })"
    fi
    # the storage's kind only: sccache's own line names the URL, password included
    log "compile cache: sccache $("$bin" --version | cut -d' ' -f2) under g++ and nvcc" \
        "($("$bin" --show-stats | sed -n 's/^Cache location *\([A-Za-z0-9]*\).*/\1/p'))"
}

# compile_cache_report STEP: one line of what STEP (deepspeed, extensions) compiled: the
# compilers' runs and, with a compile cache, its hits and misses by category the way they are true for CUDA (host C/C++,
# nvcc's phases: cudafe++, cicc's PTX, ptxas's CUBIN), not the request count alone.
compile_cache_report() {
    local stats=""
    if [[ -n ${ENVBUILD_SCCACHE:-} ]]; then stats=$("$ENVBUILD_SCCACHE" --show-stats --stats-format=json); fi
    ENVBUILD_STATS=$stats "$(venv_dir)/bin/python" - "$ENVBUILD_COMPILES" "${1:?compile_cache_report names its step}" << 'PY'
import collections, json, os, sys
runs = collections.Counter(line.strip() for line in open(sys.argv[1]) if line.strip())
# the step by name: BuildKit runs the DeepSpeed and the extensions steps side by side, so the
# order of their lines in the log says nothing
out = {"step": sys.argv[2], "runs": dict(sorted(runs.items()))}
if os.environ.get("ENVBUILD_STATS"):
    stats = json.loads(os.environ["ENVBUILD_STATS"])["stats"]
    for name in ("cache_hits", "cache_misses", "cache_errors"):
        out[name.replace("cache_", "")] = dict(sorted(stats.get(name, {}).get("adv_counts", {}).items()))
print("envbuild: compiles " + json.dumps(out, sort_keys=True), file=sys.stderr)
PY
}
