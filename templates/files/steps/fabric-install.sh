#!/usr/bin/env bash
# fabric-install.sh LD_CONF BIN_DIR LIB_DIR...: a fabric built from source (fabric.sh) into its
# own prefixes becomes visible as the OS's packages would be: LD_CONF names each LIB_DIR for the
# dynamic linker (NCCL dlopens "libnccl-net.so" and libfabric "libibverbs.so.1" by name, and a
# job's LD_LIBRARY_PATH is the user's to overwrite), and BIN_DIR's tools (fi_info, ibv_devinfo)
# get links in /usr/local/bin. Run by fabric.sh in the builder and after the runtime stage
# copied the prefixes; nothing here is downloaded.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

(( $# >= 3 )) || { log "usage: fabric-install.sh LD_CONF BIN_DIR LIB_DIR..."; exit 2; }
conf=$1 bin=$2; shift 2
for dir in "$@"; do
    [[ -d $dir ]] || { log "fabric-install: $dir does not exist: the fabric was not built or not copied"; exit 1; }
done
mkdir -p "$(dirname "$conf")"
printf '%s\n' "$@" > "$conf"
ldconfig
cache=$(ldconfig -p)
for dir in "$@"; do
    [[ $cache == *" => $dir/"* ]] || { log "fabric-install: no library of $dir is in the loader's cache after ldconfig"; exit 1; }
done
for tool in "$bin"/*; do
    [[ -x $tool && -f $tool ]] || continue
    link=/usr/local/bin/$(basename "$tool")
    [[ -e $link ]] || ln -s "$tool" "$link"
done
log "fabric-install: $* in $conf; tools of $bin on PATH"
