#!/usr/bin/env bash
# os.sh PACKAGE...: apt packages, through the apt mirror secret when one is given.
# ENVBUILD_APT_HOSTS: the distro's mirror hosts the mirror replaces (bases.yaml).
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ca_bundle
opts=()
mirror=$(secret apt_mirror)
if [[ -n $mirror ]]; then
    # Rewrite copies of the sources, never the image's own files.
    mkdir -p "$TMP/apt/sources.list.d"
    hosts=${ENVBUILD_APT_HOSTS:?the os step needs the distro mirror hosts}
    re='s#https?://('"$(printf '%s' "$hosts" | sed -e 's/\./\\./g' -e 's/ /|/g')"')#'"${mirror%/}"'#g'
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
