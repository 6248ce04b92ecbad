#!/usr/bin/env bash
# fabric.sh KEY VALUE...: a fabric's user space built from pinned sources, as fabrics.yaml's
# `build:` declares it (envbuild/plan/components/fabric.py writes the words; each value passed
# its grammar at load). One loop over the sources, in order; this script knows no fabric by name.
#
#   ld-conf FILE                 the ld.so.conf.d file naming every prefix's lib directory
#   source NAME                  opens a source; the keys up to the next `source` are its own:
#     version V  url URL  sha256 SHA (of the UNCOMPRESSED tar stream: GitHub makes /archive/
#       tarballs with `git archive`, so the tar is reproducible; its gzip layer is not promised)
#     build autotools|cmake|make  prefix DIR  option WORD (repeated)  version-file FILE
#     config-header FILE  define MACRO WHY (configure must have set MACRO to 1; WHY if not)
#   drop PATH                    removed before the runtime stage copies the prefixes
#   link PATH GLOB               PATH -> the first file matching GLOB ({venv}: the venv)
#   export FILE SYMBOL           FILE must export SYMBOL
#   probe "TOOL ARGS" EXPECT     run (split at spaces, no shell); its output must hold EXPECT
#
# Placeholders the builder fills in an option: {cuda} (CUDA_HOME), {cuda_include} (its headers,
# with the header wheels of ENVBUILD_FABRIC_HEADERS beside them), {cuda_lib} (its lib64 or lib
# holding libcudart_static.a), {venv} (VIRTUAL_ENV). ({prefix} and {prefix:NAME} were filled in
# at render time.)
#
# The secret source_mirror (a base URL, e.g. http://127.0.0.1:8765) replaces https://github.com
# in every URL: a machine that cannot reach GitHub builds from a local copy
# (scripts/fabric-sources.sh), with the same hashes checked.
#
# After the builds: static and libtool archives and every `drop` go, libraries and tools are
# stripped, the links made, fabric-install.sh registers each prefix's lib/ with the dynamic
# linker and puts its bin/ on PATH (as again in the final image after it copied the prefixes),
# then every library and tool must resolve every library without LD_LIBRARY_PATH, and the
# exports and probes must hold.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ca_bundle
jobs=$(nproc)
mirror=$(secret source_mirror)

fail() { log "fabric: $*"; exit 1; }

names=() prefixes=() drops=() links=() exports=() probes=() ld_conf=
declare -A version=() url=() sha=() system=() prefix=() options=() version_file=() header=() defines=()
SEP=$'\x1f'  # between the words of a list kept in one string (no value holds a control character)
current=
while (( $# )); do
    key=$1
    case $key in
        define | link | export | probe) (( $# >= 3 )) || fail "'$key' takes two values"; two=$3 width=3 ;;
        *) (( $# >= 2 )) || fail "'$key' takes a value"; two='' width=2 ;;
    esac
    value=$2
    case $key in
        source) current=$value; names+=("$value") ;;
        ld-conf) ld_conf=$value ;;
        drop) drops+=("$value") ;;
        link) links+=("$value$SEP$two") ;;
        export) exports+=("$value$SEP$two") ;;
        probe) probes+=("$value$SEP$two") ;;
        version | url | sha256 | build | prefix | option | version-file | config-header | define)
            [[ -n $current ]] || fail "'$key' before any 'source'"
            case $key in
                version) version[$current]=$value ;;
                url) url[$current]=$value ;;
                sha256) sha[$current]=$value ;;
                build) system[$current]=$value ;;
                prefix) prefix[$current]=$value; [[ " ${prefixes[*]} " == *" $value "* ]] || prefixes+=("$value") ;;
                option) options[$current]+=$value$SEP ;;
                version-file) version_file[$current]=$value ;;
                config-header) header[$current]=$value ;;
                define) defines[$current]+=$value$SEP$two$SEP ;;
            esac ;;
        *) fail "unknown key '$key': the keys are source, version, url, sha256, build, prefix, option," \
                "version-file, config-header, define, ld-conf, drop, link, export, probe" ;;
    esac
    shift "$width"
done
(( ${#names[@]} )) || fail "no source given"
[[ -n $ld_conf ]] || fail "no ld-conf given"
for name in "${names[@]}"; do
    for field in version url sha system prefix; do
        declare -n got=$field
        [[ -n ${got[$name]:-} ]] || fail "source $name has no ${field/sha/sha256}"
        unset -n got
    done
done

# The builder's placeholders, each found only when an option uses it.
cuda_ready=
cuda_setup() {
    [[ -z $cuda_ready ]] || return 0
    [[ -n ${CUDA_HOME:-} ]] || fail "an option names {cuda...} and the fabric step has no CUDA_HOME"
    cuda=$CUDA_HOME
    [[ -f $cuda/include/cuda.h && -f $cuda/include/cuda_runtime_api.h ]] \
        || fail "CUDA_HOME=$cuda has no include/cuda.h and include/cuda_runtime_api.h (the CUDA runtime headers; PyPI: cuda-toolkit[cudart])"
    cuda_include=$cuda/include
    if [[ -n ${ENVBUILD_FABRIC_HEADERS:-} ]]; then
        # Headers the CUDA wheels lack (nvml.h: PyPI's nvidia-nvml-dev), hash-pinned, into a
        # scratch directory; the build sees CUDA_HOME's headers and these side by side.
        pip_env
        "$(venv_dir)/bin/pip" install -q --no-deps --require-hashes --target "$TMP/headers" -r "$ENVBUILD_FABRIC_HEADERS" \
            || fail "could not install the fabric's header wheels ($ENVBUILD_FABRIC_HEADERS)"
        cuda_include=$TMP/include
        mkdir -p "$cuda_include"
        cp -rs "$cuda/include/." "$cuda_include/"
        while IFS= read -r -d '' h; do
            ln -sf "$h" "$cuda_include/$(basename "$h")"
        done < <(find "$TMP/headers" -path '*/include/*.h' -print0)
    fi
    cuda_lib=
    for dir in "$cuda/lib64" "$cuda/lib"; do
        if [[ -f $dir/libcudart_static.a ]]; then cuda_lib=$dir; break; fi
    done
    cuda_ready=1
}

# FILLED: `$1` with the builder's placeholders filled in (text replaced: nothing is evaluated).
# In this shell, not a $(...): a failure here stops the step.
fill() {
    local v=$1
    if [[ $v == *"{cuda"* ]]; then
        cuda_setup
        if [[ $v == *"{cuda_lib}"* && -z $cuda_lib ]]; then
            fail "CUDA_HOME=$cuda has no lib64/ or lib/libcudart_static.a (PyPI: nvidia-cuda-runtime carries it)"
        fi
        v=${v//\{cuda_include\}/$cuda_include} v=${v//\{cuda_lib\}/$cuda_lib} v=${v//\{cuda\}/$cuda}
    fi
    if [[ $v == *"{venv}"* ]]; then
        [[ -n ${VIRTUAL_ENV:-} ]] || fail "'$1' names {venv} and VIRTUAL_ENV is not set"
        v=${v//\{venv\}/$VIRTUAL_ENV}
    fi
    FILLED=$v
}

# Download, check the tar stream's sha256, unpack into $TMP/NAME.
fetch() {
    local name=$1 from=${url[$1]} got
    if [[ -n $mirror && $from == https://github.com/* ]]; then from=${mirror%/}/${from#https://github.com/}; fi
    log "fabric: $name ${version[$name]} from $from"
    curl -fsSL --retry 3 ${PIP_CERT:+--cacert "$PIP_CERT"} -o "$TMP/$name.tar.gz" "$from" \
        || fail "could not download $name from $from"
    got=$(gzip -dc "$TMP/$name.tar.gz" | sha256sum | cut -d' ' -f1) \
        || fail "$name from $from is not a gzip-compressed tar"
    [[ $got == "${sha[$name]}" ]] || fail "$name ${version[$name]} from $from: the tar's sha256 is $got," \
        "the pin is ${sha[$name]}: not the pinned source (a changed or wrong archive); the build stops."
    mkdir -p "$TMP/$name"
    tar -xzf "$TMP/$name.tar.gz" -C "$TMP/$name" --strip-components=1 --no-same-owner
    rm -f "$TMP/$name.tar.gz"
}

# Configure, build and install one unpacked source in $TMP/NAME by its build system, with the
# options in `opts` (a subshell: its cd is its own; on the left of || it runs without errexit,
# so each command is chained).
build() (
    name=$1
    cd "$TMP/$name" || exit 1
    if [[ -n ${version_file[$name]:-} ]]; then printf '%s\n' "${version[$name]#v}" > "${version_file[$name]}" || exit 1; fi
    case ${system[$name]} in
        autotools)
            if [[ ! -x configure ]]; then if [[ -x autogen.sh ]]; then ./autogen.sh; else autoreconf -fi; fi || exit 1; fi
            ./configure --prefix="${prefix[$name]}" "${opts[@]}" && make -j "$jobs" && make install ;;
        cmake)
            cmake -S . -B build -DCMAKE_INSTALL_PREFIX="${prefix[$name]}" "${opts[@]}" &&
            cmake --build build --parallel "$jobs" --target install ;;
        make) make -j "$jobs" "${opts[@]}" && make "${opts[@]}" install ;;
        *) echo "unknown build system '${system[$name]}' (autotools, cmake or make)"; exit 1 ;;
    esac
)

# The macros configure must have set, each with why the build stops without it.
check_defines() {
    local name=$1 file=$TMP/$1/${header[$1]:-config.h} macro why
    while IFS= read -r -d "$SEP" macro && IFS= read -r -d "$SEP" why; do
        [[ -f $file ]] || fail "$name: no ${header[$name]:-config.h} to read $macro from"
        if grep -q -E "^#define $macro 1( |\$)" "$file"; then
            log "fabric: $name $macro 1"
        else
            fail "$name: $macro is not 1 in ${header[$name]:-config.h}: $why"
        fi
    done <<< "${defines[$name]:-}"
}

for name in "${names[@]}"; do
    opts=()
    while IFS= read -r -d "$SEP" word; do fill "$word"; opts+=("$FILLED"); done <<< "${options[$name]:-}"
    fetch "$name"
    start=$SECONDS
    build "$name" > "$TMP/$name.log" 2>&1 || { tail -n 40 "$TMP/$name.log" >&2; fail "$name: build failed"; }
    check_defines "$name"
    log "fabric: $name ${version[$name]} built in $((SECONDS - start)) s"
done

# Only what a job uses: every `drop`, static and libtool archives; libraries and tools stripped.
for path in "${drops[@]}"; do rm -rf "$path"; done
find "${prefixes[@]}" \( -name '*.la' -o -name '*.a' \) -delete
while IFS= read -r -d '' f; do
    if [[ $(head -c 4 "$f") == $'\177ELF' ]]; then strip --strip-unneeded "$f"; fi
done < <(find "${prefixes[@]}" -type f \( -name '*.so*' -o -perm -u+x \) -print0)

for entry in "${links[@]}"; do
    path=${entry%%"$SEP"*}
    fill "${entry#*"$SEP"}"
    pattern=$FILLED
    # A glob, not find: after the layers step the wheels' directories are symlinks (same path).
    target=$(compgen -G "$pattern" | head -n 1) || true
    [[ -n $target ]] || fail "nothing matches $pattern for the link $path (fabrics.yaml links)"
    mkdir -p "$(dirname "$path")"
    ln -sfn "$target" "$path"
    log "fabric: $path -> $target"
done

bash "$STEPS_DIR/fabric-install.sh" "$ld_conf" "${prefixes[@]}"

# Every library and tool in the prefixes resolves every library (no LD_LIBRARY_PATH).
missing=$(for p in "${prefixes[@]}"; do
    for f in "$p"/lib/*.so* "$p"/lib/*/*.so "$p"/bin/*; do
        if [[ -f $f && $(head -c 4 "$f") == $'\177ELF' ]]; then
            env -u LD_LIBRARY_PATH ldd "$f" | sed -n "s|^\s*\(\S*\) => not found|$f: \1|p"
        fi
    done; done)
[[ -z $missing ]] || fail "libraries not found: $missing"
for entry in "${exports[@]}"; do
    file=${entry%%"$SEP"*} symbol=${entry#*"$SEP"}
    [[ $(nm -D --defined-only "$file") == *" $symbol"* ]] || fail "$file does not export $symbol"
done
for entry in "${probes[@]}"; do
    read -r -a argv <<< "${entry%%"$SEP"*}"
    expect=${entry#*"$SEP"}
    said=$(env -u LD_LIBRARY_PATH "${argv[@]}" 2>&1) || fail "${argv[*]} failed: $said"
    printf '%s\n' "$said" | sed "s|^|fabric: ${argv[0]##*/}: |" >&2
    [[ -z $expect || $said == *"$expect"* ]] || fail "${argv[*]} does not say '$expect': $said"
done
for p in "${prefixes[@]}"; do log "fabric: $(du -sh "$p" | cut -f1) in $p"; done
