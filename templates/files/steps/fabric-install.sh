#!/usr/bin/env bash
# fabric-install.sh LD_CONF PREFIX...: a fabric built from source (fabric.sh) into its own
# prefixes becomes visible as the OS's packages would be: LD_CONF names each PREFIX/lib for the
# dynamic linker (NCCL dlopens "libnccl-net.so" and libfabric "libibverbs.so.1" by name, and a
# job's LD_LIBRARY_PATH is the user's to overwrite), and each PREFIX/bin's tools (fi_info,
# ibv_devinfo) get links in /usr/local/bin. Run by fabric.sh in the builder and after the
# runtime stage copied the prefixes; nothing here is downloaded.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

(( $# >= 2 )) || { log "usage: fabric-install.sh LD_CONF PREFIX..."; exit 2; }
conf=$1; shift
libs=()
for prefix in "$@"; do
    [[ -d $prefix ]] || { log "fabric-install: $prefix does not exist: the fabric was not built or not copied"; exit 1; }
    if [[ -d $prefix/lib ]]; then libs+=("$prefix/lib"); fi
done
(( ${#libs[@]} )) || { log "fabric-install: none of $* has a lib directory"; exit 1; }
mkdir -p "$(dirname "$conf")"
printf '%s\n' "${libs[@]}" > "$conf"
ldconfig
cache=$(ldconfig -p)
for dir in "${libs[@]}"; do
    [[ $cache == *" => $dir/"* ]] || { log "fabric-install: no library of $dir is in the loader's cache after ldconfig"; exit 1; }
done
for prefix in "$@"; do
    for tool in "$prefix"/bin/*; do
        [[ -x $tool && -f $tool ]] || continue
        link=/usr/local/bin/$(basename "$tool")
        [[ -e $link ]] || ln -s "$tool" "$link"
    done
done
log "fabric-install: ${libs[*]} in $conf; the tools of $* on PATH"
