#!/usr/bin/env bash
# fabric.sh NAME VERSION URL SHA256 [NAME VERSION URL SHA256 ...]: the AWS EFA user space,
# built from pinned sources: rdma-core (optional, see below), libfabric with the efa provider
# and aws-ofi-nccl, NCCL's net plugin for libfabric. NAME: rdma-core | libfabric | aws-ofi-nccl.
# URL: a GitHub /archive/COMMIT.tar.gz; SHA256: of its UNCOMPRESSED tar stream (GitHub makes
# the archive with `git archive`: the tar is reproducible, its gzip layer is not promised).
# The secret source_mirror (a base URL, e.g. http://127.0.0.1:8765) replaces https://github.com
# in every URL: a machine that cannot reach GitHub builds from a local copy
# (scripts/fabric-sources.sh), with the same hashes checked.
#
# Layout (AWS's): rdma-core and libfabric in ENVBUILD_EFA_PREFIX (/opt/amazon/efa), the plugin
# in ENVBUILD_OFI_NCCL_PREFIX (/opt/amazon/ofi-nccl); a file in /etc/ld.so.conf.d names both
# lib directories, so NCCL's dlopen("libnccl-net.so") and everything's dlopen("libibverbs.so.1")
# find them without LD_LIBRARY_PATH. The final image copies the two prefixes and that file, then
# runs ldconfig. Headers, static and libtool files, man pages are removed here.
#
# CUDA_HOME: CUDA headers (cuda.h, cuda_runtime_api.h, nvml.h) and lib/libcudart_static.a (the
# plugin links the CUDA runtime statically, as NCCL does: nothing to find at run time).
# ENVBUILD_FABRIC_CUDART: the libcudart.so.N the image's torch loads (default: found in the
# venv). libfabric's CUDA support dlopens the unversioned "libcudart.so", which CUDA wheels do
# not ship: a link to it in PREFIX/lib/cudart (on libfabric's RUNPATH only) turns GPU memory
# support on; without it libfabric says so only at FI_LOG_LEVEL=info and GPUDirect is off.
#
# Why rdma-core too: libfabric's efa provider checks, at build time, rdma-core's efadv.h for
# device RDMA write (rdma-core >= 46). Built against an older one (Debian 12: 44, Ubuntu 22.04:
# 39) it always emulates RDMA write, and aws-ofi-nccl, whose default protocol on p5/p5e/p5en/p6
# is RDMA write, refuses the endpoint. AWS's EFA installer replaces the distro's rdma-core for
# the same reason. Without a rdma-core source the OS's libibverbs-dev is used.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ca_bundle
efa=${ENVBUILD_EFA_PREFIX:-/opt/amazon/efa}
ofi=${ENVBUILD_OFI_NCCL_PREFIX:-/opt/amazon/ofi-nccl}
cuda=${CUDA_HOME:?the fabric step needs CUDA_HOME: CUDA headers and lib/libcudart_static.a}
jobs=$(nproc)
mirror=$(secret source_mirror)

fail() { log "fabric: $*"; exit 1; }

(( $# > 0 && $# % 4 == 0 )) || fail "usage: fabric.sh NAME VERSION URL SHA256 ... (got $# arguments)"
declare -A version=() url=() sha=()
while (( $# )); do
    case $1 in
        rdma-core | libfabric | aws-ofi-nccl) ;;
        *) fail "unknown source '$1': the sources are rdma-core (optional), libfabric, aws-ofi-nccl" ;;
    esac
    version[$1]=$2 url[$1]=$3 sha[$1]=$4
    shift 4
done
for name in libfabric aws-ofi-nccl; do
    [[ -n ${url[$name]:-} ]] || fail "no $name source given: the efa fabric needs libfabric and aws-ofi-nccl"
done
[[ -f $cuda/include/cuda.h && -f $cuda/include/cuda_runtime_api.h ]] \
    || fail "CUDA_HOME=$cuda has no include/cuda.h and include/cuda_runtime_api.h (the CUDA runtime headers; PyPI: cuda-toolkit[cudart])"
cuda_include=$cuda/include
if [[ ! -f $cuda_include/nvml.h && -n ${ENVBUILD_FABRIC_HEADERS:-} ]]; then
    # The headers the CUDA wheels lack (nvml.h: PyPI's nvidia-nvml-dev), hash-pinned, into a
    # scratch directory; the build sees CUDA_HOME's headers and these side by side.
    pip_env
    "$(venv_dir)/bin/pip" install -q --no-deps --require-hashes --target "$TMP/headers" -r "$ENVBUILD_FABRIC_HEADERS" \
        || fail "could not install the fabric's header wheels ($ENVBUILD_FABRIC_HEADERS)"
    cuda_include=$TMP/include
    mkdir -p "$cuda_include"
    cp -rs "$cuda/include/." "$cuda_include/"
    while IFS= read -r -d '' header; do
        ln -sf "$header" "$cuda_include/$(basename "$header")"
    done < <(find "$TMP/headers" -path '*/include/*.h' -print0)
fi
[[ -f $cuda_include/nvml.h ]] \
    || fail "CUDA_HOME=$cuda has no include/nvml.h and no header wheel gave one: libfabric's CUDA support includes it (PyPI: nvidia-nvml-dev)"
cuda_lib=
for dir in "$cuda/lib64" "$cuda/lib"; do
    if [[ -f $dir/libcudart_static.a ]]; then cuda_lib=$dir; break; fi
done
[[ -n $cuda_lib ]] || fail "CUDA_HOME=$cuda has no lib64/ or lib/libcudart_static.a (PyPI: nvidia-cuda-runtime carries it)"

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

flags=(CPPFLAGS= LDFLAGS=)
if [[ -n ${url[rdma-core]:-} ]]; then
    fetch rdma-core
    start=$SECONDS
    # Providers, libibverbs and librdmacm, plus the verbs tools (ibv_devinfo); no Python
    # bindings, no man pages (pandoc), no static libraries. RUNPATH so its tools load its libs;
    # its configuration (libibverbs.d: which providers to load) inside the prefix too (for a
    # prefix under /opt, GNUInstallDirs would put it in /etc/opt).
    cmake -S "$TMP/rdma-core" -B "$TMP/rdma-core/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_INSTALL_PREFIX="$efa" -DCMAKE_INSTALL_LIBDIR=lib -DCMAKE_INSTALL_SYSCONFDIR="$efa/etc" \
        -DCMAKE_INSTALL_RUNDIR=/run \
        -DCMAKE_INSTALL_RPATH="$efa/lib" -DNO_PYVERBS=1 -DNO_MAN_PAGES=1 -DENABLE_STATIC=0 \
        > "$TMP/rdma-core.log" 2>&1 \
        || { tail -n 40 "$TMP/rdma-core.log" >&2; fail "rdma-core: cmake failed"; }
    ninja -C "$TMP/rdma-core/build" -j "$jobs" install > "$TMP/rdma-core.log" 2>&1 \
        || { tail -n 40 "$TMP/rdma-core.log" >&2; fail "rdma-core: build failed"; }
    log "fabric: rdma-core ${version[rdma-core]} built in $((SECONDS - start)) s"
    flags=(CPPFLAGS="-I$efa/include -I$cuda_include" LDFLAGS="-L$efa/lib -Wl,-rpath,$efa/lib:$efa/lib/cudart")
    efa_dir=$efa
else
    [[ -f /usr/include/infiniband/efadv.h ]] || fail "no rdma-core source given and no OS libibverbs-dev (infiniband/efadv.h)"
    flags=(CPPFLAGS="-I$cuda_include" LDFLAGS="-Wl,-rpath,$efa/lib/cudart")
    efa_dir=yes
fi

fetch libfabric
start=$SECONDS
(
    # (a subshell on the left of || runs without errexit: each command is chained)
    cd "$TMP/libfabric" && ./autogen.sh &&
    # efa and shm only (efa moves intra-node traffic through shm); CUDA memory support with
    # the CUDA libraries dlopened, so libfabric loads on a machine without a GPU.
    ./configure --prefix="$efa" --libdir="$efa/lib" --disable-static --enable-only \
        --enable-efa="$efa_dir" --enable-shm --with-cuda="$cuda" --enable-cuda-dlopen \
        "${flags[@]}" &&
    make -j "$jobs" && make install
) > "$TMP/libfabric.log" 2>&1 || { tail -n 40 "$TMP/libfabric.log" >&2; fail "libfabric: build failed"; }
grep -E 'Built-in providers' "$TMP/libfabric.log" | tr -s '\t ' ' ' >&2 || true
grep -E '^#define (HAVE_CAPS_RDMA_WRITE|HAVE_CAPS_UNSOLICITED_WRITE_RECV|HAVE_EFADV_QUERY_MR|HAVE_EFA_DMABUF_MR|HAVE_CUDA|ENABLE_CUDA_DLOPEN) ' \
    "$TMP/libfabric/config.h" | sed 's/^#define /fabric: libfabric /' >&2
grep -q -E '^#define HAVE_CAPS_RDMA_WRITE 1' "$TMP/libfabric/config.h" \
    || fail "libfabric was built against an rdma-core without device RDMA write (rdma-core < 46, this OS's" \
            "libibverbs-dev): on p5, p5e, p5en and p6 aws-ofi-nccl's default RDMA protocol would refuse every" \
            "endpoint (FI_OPT_EFA_EMULATED_WRITE). Give the rdma-core source too (matrices/fabrics.yaml)."
grep -q -E '^#define HAVE_CUDA 1' "$TMP/libfabric/config.h" || fail "libfabric: configured without CUDA support"
log "fabric: libfabric ${version[libfabric]} built in $((SECONDS - start)) s"

fetch aws-ofi-nccl
start=$SECONDS
(
    cd "$TMP/aws-ofi-nccl" &&
    # A git archive has no .git and no release tarball's version file: m4/get_version.sh reads it.
    printf '%s\n' "${version[aws-ofi-nccl]#v}" > .release_version && ./autogen.sh &&
    # AWS's own package flags (contrib/debian-template/rules), but the CUDA runtime static:
    # --enable-platform-aws turns the AWS tuning on only where EFA devices are (dynamic
    # platform selection since 1.18); the build host is no EC2 instance, so it is forced.
    ./configure --prefix="$ofi" --libdir="$ofi/lib" --with-libfabric="$efa" --with-cuda="$cuda" \
        --enable-platform-aws --disable-tests --without-lttng --without-valgrind --without-nvcc \
        --disable-werror LDFLAGS="-L$cuda_lib -Wl,-rpath,$efa/lib" &&
    make -j "$jobs" && make install
) > "$TMP/aws-ofi-nccl.log" 2>&1 || { tail -n 40 "$TMP/aws-ofi-nccl.log" >&2; fail "aws-ofi-nccl: build failed"; }
sed -n '/Enabled Platforms/p' "$TMP/aws-ofi-nccl.log" >&2
grep -E '^#define (HAVE_CUDA|HAVE_GDAKI|HAVE_DECL_FI_OPT_EFA_EMULATED_WRITE|HAVE_CUDA_DMABUF_SUPPORT|ENABLE_CUDART_DYNAMIC) ' \
    "$TMP/aws-ofi-nccl/include/config.h" | sed 's/^#define /fabric: aws-ofi-nccl /' >&2
log "fabric: aws-ofi-nccl ${version[aws-ofi-nccl]} built in $((SECONDS - start)) s"

# Only what a job uses: no headers, static or libtool archives, pkg-config files, docs; none of
# rdma-core's daemons (ibacm, iwpmd, srp_daemon, rdma-ndd), their service and modprobe files,
# the fabric diagnostics in sbin, rsocket's preload library. Kept: the libraries, every verbs
# provider, ibv_* and rdma_* tools, fi_info/fi_pingpong. Libraries and tools stripped.
rm -rf "$efa/include" "$ofi/include" "$efa/lib/pkgconfig" "$ofi/lib/pkgconfig" "$efa/share" \
    "$ofi/share/doc" "$efa/lib/systemd" "$efa/lib/udev" "$efa/lib/ibacm" "$efa/lib/rsocket" \
    "$efa/sbin" "$efa/libexec" "$efa/etc/init.d" "$efa/etc/modprobe.d" "$efa/etc/rdma" \
    "$efa/etc/iwpmd.conf" "$efa/etc/srp_daemon.conf" "$efa/etc/infiniband-diags" "$efa/bin/ib_acme"
find "$efa" "$ofi" \( -name '*.la' -o -name '*.a' \) -delete
while IFS= read -r -d '' f; do
    if [[ $(head -c 4 "$f") == $'\177ELF' ]]; then strip --strip-unneeded "$f"; fi
done < <(find "$efa" "$ofi" -type f \( -name '*.so*' -o -perm -u+x \) -print0)

# libfabric dlopens "libcudart.so": point it at the runtime torch uses (see the header), in a
# directory only libfabric's RUNPATH names, so nothing else's dlopen("libcudart.so") changes.
cudart=${ENVBUILD_FABRIC_CUDART:-}
if [[ -z $cudart && -n ${VIRTUAL_ENV:-} ]]; then
    # A glob, not find: after the layers step the wheels' directories are symlinks (same path).
    for f in "$VIRTUAL_ENV"/lib/python3*/site-packages/nvidia/*/lib/libcudart.so.[0-9]*; do
        if [[ -e $f ]]; then cudart=$f; break; fi
    done
fi
if [[ -n $cudart ]]; then
    [[ -e $cudart ]] || fail "ENVBUILD_FABRIC_CUDART=$cudart does not exist"
    mkdir -p "$efa/lib/cudart"
    ln -sfn "$cudart" "$efa/lib/cudart/libcudart.so"
    log "fabric: libfabric's CUDA support loads $cudart"
else
    fail "no libcudart.so.N in the venv (no CUDA wheels?) and ENVBUILD_FABRIC_CUDART unset: libfabric would" \
         "load without CUDA memory support and GPUDirect RDMA would be off, said only at FI_LOG_LEVEL=info"
fi

bash "$STEPS_DIR/fabric-install.sh" "${ENVBUILD_FABRIC_LD_CONF:-/etc/ld.so.conf.d/000-aws-efa.conf}" "$efa/bin" \
    "$efa/lib" "$ofi/lib"

# Checks: every library and tool in both prefixes resolves every library (no LD_LIBRARY_PATH),
# the plugin exports the net interfaces NCCL 2.17 (v6) to 2.30 (v12) look for, libfabric lists
# the efa provider (registered: no device is needed for that).
missing=$(for f in "$ofi"/lib/*.so "$efa"/lib/*.so.* "$efa"/lib/libibverbs/*.so "$efa"/bin/*; do
    if [[ $(head -c 4 "$f") == $'\177ELF' ]]; then
        env -u LD_LIBRARY_PATH ldd "$f" | sed -n "s|^\s*\(\S*\) => not found|$f: \1|p"
    fi; done)
[[ -z $missing ]] || fail "libraries not found: $missing"
symbols=$(nm -D --defined-only "$ofi/lib/libnccl-net.so")
for sym in ncclNetPlugin_v6 ncclNetPlugin_v12; do
    [[ $symbols == *" $sym"* ]] || fail "the plugin does not export $sym"
done
"$efa/bin/fi_info" --version | sed 's/^/fabric: /' >&2
providers=$("$efa/bin/fi_info" -l)
[[ $providers == *efa:* ]] || fail "fi_info -l does not list the efa provider: $providers"
log "fabric: $(du -sh "$efa" | cut -f1) in $efa, $(du -sh "$ofi" | cut -f1) in $ofi"
