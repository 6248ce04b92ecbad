#!/usr/bin/env bash
# os.sh PACKAGE...: apt packages.
# Locked (ENVBUILD_OS_LOCK names this stage's part of the stack's OS lock, envbuild/knowledge/oslock.py):
# only the lock's archives at the lock's moment (its snapshot, or the apt_snapshot secret: a
# mirror of it, {archive} and {timestamp} in the URL), apt pinned to the lock's versions, every
# .deb checked against the lock's sha256 before dpkg sees it, and the base checked to be the one
# the lock was resolved on, before and after. Unlocked: the base's own sources, through the
# apt_mirror secret when one is given (ENVBUILD_APT_HOSTS: the distro's hosts it replaces).
# Where the build mounts apt's cache (Docker: lib.sh APT_CACHE), the index files and the .debs
# come from it and what is fetched joins it (locked: only files that matched the lock); nothing
# of it reaches the layer, and the image's apt configuration is not touched.
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ca_bundle
# apt fetches as root (APT::Sandbox::User): its _apt user could not write into the private $TMP.
opts=(-o "Acquire::Languages=none" -o "APT::Sandbox::User=root")
if [[ -n ${PIP_CERT:-} ]]; then opts+=(-o "Acquire::https::CAInfo=$PIP_CERT"); fi

# The installed packages as 'NAME ARCH VERSION' lines, sorted.
installed() {
    dpkg-query -W -f='${db:Status-Abbrev} ${Package} ${Architecture} ${Version}\n' | awk '$1 ~ /^ii/ {print $2, $3, $4}' \
        | LC_ALL=C sort
}

# Every installed package must be the base's (as the lock recorded it) or the lock's, and every
# package of the base must still be there: otherwise this is not the base the lock was resolved on.
check_base() {  # check_base PART WHEN
    local part=$1 when=$2
    installed > "$TMP/installed"
    awk '$1 == "base" || $1 == "deb" {print $2, $3, $4}' "$part" | LC_ALL=C sort -u > "$TMP/allowed"
    LC_ALL=C comm -23 "$TMP/installed" "$TMP/allowed" > "$TMP/strange"
    awk '$1 == "base" {print $2, $3}' "$part" | LC_ALL=C sort -u > "$TMP/base-names"
    awk '{print $1, $2}' "$TMP/installed" | LC_ALL=C sort -u > "$TMP/names"
    LC_ALL=C comm -23 "$TMP/base-names" "$TMP/names" > "$TMP/gone"
    if [[ -s $TMP/strange || -s $TMP/gone ]]; then
        log "$when, this stage does not match its OS lock ($(head -n 1 "$part" | cut -c3-)):" \
            "$(wc -l < "$TMP/strange") installed package(s) the lock does not know (the base image is not the one it" \
            "was resolved on, or something else installed them), e.g. '$(head -n 1 "$TMP/strange")';" \
            "$(wc -l < "$TMP/gone") of the lock's base package(s) missing, e.g. '$(head -n 1 "$TMP/gone")'." \
            "Build FROM the base the lock names (by digest), or resolve a lock for this base:" \
            "envbuild lock --os --stack STACK --base-image THIS-BASE --matrix-dir YOUR-MATRIX."
        return 1
    fi
}

# Whether the archive's index has NAME at VERSION. apt-cache exits 0 for a version it does not
# know, and takes a name it does not know for a pattern (g++ matches other packages): only a
# stanza of exactly that package and version counts.
in_index() {
    apt-cache "${opts[@]}" show "$1=$2" 2> /dev/null \
        | awk -v n="$1" -v v="$2" '/^Package: / {p = $2} /^Version: / && p == n && $2 == v {found = 1} END {exit !found}'
}

# apt's index files for SOURCES (a sources.list): on the cache mount, in a directory of that
# list's own (a second build asks only whether each Release file changed), else a private one.
apt_lists() {
    local dir=$TMP/lists
    if cache_mounted "$APT_CACHE"; then
        # keyed by the sources without a mirror's credentials: a new token is the same archive
        dir=$APT_CACHE/lists/$({ cat -- "$@" 2> /dev/null || true; } | sed -E 's#//[^/@]*@#//#g' | sha256sum | cut -c1-16)
    fi
    mkdir -p "$dir/partial"
    printf '%s' "$dir"
}

# The lock's .deb files the cache mount holds, each checked against the lock's sha256, copied into
# apt's archive directory DIR: apt fetches only the others. $TMP/want lists 'FILE SHA256' lines.
cached_debs_in() {
    cache_mounted "$APT_CACHE" || return 0
    local name sha from found=0
    while read -r name sha; do
        from=$APT_CACHE/archives/$name
        if [[ -f $from && $(sha256sum "$from" | cut -d' ' -f1) == "$sha" ]]; then cp "$from" "$1/"; found=$((found + 1)); fi
    done < "$TMP/want"
    log "apt's cache mount holds $found of the lock's $(wc -l < "$TMP/want") .deb files"
}

locked_install() {
    local part=$ENVBUILD_OS_LOCK url moment keyring valid override
    url=$(awk '$1 == "snapshot" {print $2}' "$part")
    moment=$(awk '$1 == "moment" {print $2}' "$part")
    keyring=$(awk '$1 == "keyring" {print $2}' "$part")
    valid=$(awk '$1 == "valid-until" {print $2}' "$part")
    override=$(secret apt_snapshot)
    if [[ -n $override ]]; then
        url=${override//\{timestamp\}/$moment}
        valid=no  # a mirror of a moment serves that moment's Release files
    fi
    if [[ -n $(secret apt_mirror) ]]; then
        log "--apt-mirror replaces the live archive's host, but this stage installs from its OS lock's moment" \
            "($moment): give a mirror of that snapshot as --apt-snapshot instead."
        return 2
    fi
    if [[ -s $SECRETS/apt_key ]]; then  # the lab mirror's own signing key (a public key: signed-by)
        if grep -q -- '-----BEGIN PGP PUBLIC KEY BLOCK-----' "$SECRETS/apt_key"; then keyring=$TMP/apt-key.asc
        else keyring=$TMP/apt-key.gpg; fi
        cp "$SECRETS/apt_key" "$keyring"
        chmod 644 "$keyring"
    fi
    check_base "$part" "before installing"
    local option="signed-by=$keyring"
    if [[ $valid == no ]]; then option+=" check-valid-until=no"; fi
    option="[$option]"
    mkdir -p "$TMP/parts" "$TMP/archives/partial"
    awk -v option="$option" -v url="$url" '$1 == "source" {
            root = url; gsub(/\{archive\}/, $2, root)
            line = "deb " option " " root " " $3
            for (i = 4; i <= NF; i++) line = line " " $i
            print line }' "$part" > "$TMP/sources.list"
    local lists
    lists=$(apt_lists "$TMP/sources.list")
    # apt may choose only the lock's version of each package, and nothing the lock does not hold.
    {
        awk '$1 == "deb" {printf "Package: %s\nPin: version %s\nPin-Priority: 1001\n\n", $2, $4}' "$part"
        printf 'Package: *\nPin: release *\nPin-Priority: -1\n'
    } > "$TMP/preferences"
    opts+=(-o "Dir::Etc::SourceList=$TMP/sources.list" -o "Dir::Etc::SourceParts=$TMP/parts"
           -o "Dir::Etc::Preferences=$TMP/preferences" -o "Dir::Etc::PreferencesParts=$TMP/parts"
           -o "Dir::State::Lists=$lists" -o "Dir::Cache::Archives=$TMP/archives"
           -o "APT::Install-Recommends=false")
    # Each package asked for, as NAME=VERSION: apt then takes no name for a pattern (g++ is also a
    # regular expression), and a version the archive lacks is an error naming it.
    local wanted=() package version
    for package in "$@"; do
        version=$(awk -v n="$package" '$1 == "deb" && $2 == n {print $4; exit}' "$part")
        if [[ -n $version ]]; then
            wanted+=("$package=$version")
        elif ! awk -v n="$package" '$1 == "base" && $2 == n {found = 1} END {exit !found}' "$part"; then
            log "$package is neither in this stage's OS lock nor in its base: the lock was resolved for other" \
                "packages. Resolve it again: envbuild lock --os --stack STACK."
            return 1
        fi
    done
    ((${#wanted[@]})) || { log "every package asked for is in the base already"; return 0; }
    log "OS packages from the OS lock: $(grep -c '^deb ' "$part") pinned, archive as of $moment ($(sed -E 's#//[^/@]*@#//***@#' <<< "$url"))"
    # apt-get update warns and goes on when an index cannot be fetched: here that ends the step.
    apt-get "${opts[@]}" update -qq > "$TMP/update" 2>&1 || true
    if grep -qE '^(E:|Err:|W: Failed to fetch|W: GPG error|W: The repository)' "$TMP/update"; then
        cat "$TMP/update" >&2
        log "the archive as of $moment could not be read (apt's reason is above): the build needs it reachable," \
            "or --apt-snapshot a mirror of that moment. Nothing was installed."
        return 1
    fi
    # A name the index lacks altogether is taken for a pattern by apt-get (g++ matches other
    # packages, and the install "succeeds" without it): each one asked for must be there first.
    # Each .deb the lock pins, as apt names it, with its sha256.
    awk '$1 == "deb" {v = $4; gsub(/:/, "%3a", v); print $2 "_" v "_" $3 ".deb", $5}' "$part" | LC_ALL=C sort > "$TMP/want"
    cached_debs_in "$TMP/archives"
    local pin failed=0
    for pin in "${wanted[@]}"; do
        in_index "${pin%%=*}" "${pin#*=}" || failed=1
    done
    if ((failed == 0)) && ! apt-get "${opts[@]}" install --download-only -y -qq "${wanted[@]}"; then
        failed=1
    fi
    if ((failed)); then
        local missing=()
        while read -r kind name _ version _; do
            if [[ $kind == deb ]] && ! in_index "$name" "$version"; then
                missing+=("$name=$version")
            fi
        done < "$part"
        if ((${#missing[@]})); then
            log "the archive as of $moment lacks ${#missing[@]} version(s) the OS lock pins: ${missing[*]:0:5}." \
                "The snapshot service keeps every version it ever served: build from it (the default), or give" \
                "--apt-snapshot a mirror of that moment that has them. Nothing was installed."
        else
            log "apt could not fetch the locked packages (its reason is above). Nothing was installed."
        fi
        return 1
    fi
    # Each .deb is the file the lock pinned, before dpkg sees any of them.
    local file name sha expected bad=0
    for file in "$TMP"/archives/*.deb; do
        [[ -e $file ]] || continue
        name=${file##*/}
        expected=$(awk -v n="$name" '$1 == n {print $2}' "$TMP/want")
        sha=$(sha256sum "$file" | cut -d' ' -f1)
        if [[ -z $expected ]]; then
            log "apt fetched $name, which the OS lock does not pin"; bad=1
        elif [[ $sha != "$expected" ]]; then
            log "$name is not the file the OS lock pinned: sha256 $sha, the lock says $expected (a changed" \
                "archive, a mirror serving another file, or an edited lock). Nothing was installed."; bad=1
        fi
    done
    ((bad == 0)) || return 1
    if cache_mounted "$APT_CACHE"; then  # checked: they join the cache for the next build
        mkdir -p "$APT_CACHE/archives"
        cp -n "$TMP"/archives/*.deb "$APT_CACHE/archives/" 2> /dev/null || true
    fi
    apt-get "${opts[@]}" install --no-download -y -qq "${wanted[@]}"
    check_base "$part" "after installing"
}

if [[ -n ${ENVBUILD_OS_LOCK:-} ]]; then
    locked_install "$@"
else
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
    if cache_mounted "$APT_CACHE"; then  # the downloads stay on the cache mount (no lock: nothing to check)
        sources=(/etc/apt/sources.list /etc/apt/sources.list.d/*)
        if [[ -n $mirror ]]; then sources=("$TMP/apt/sources.list" "$TMP"/apt/sources.list.d/*); fi
        mkdir -p "$APT_CACHE/archives/partial"
        opts+=(-o "Dir::State::Lists=$(apt_lists "${sources[@]}")"
               -o "Dir::Cache::Archives=$APT_CACHE/archives")
        cached=$(find "$APT_CACHE/archives" -maxdepth 1 -name '*.deb' | wc -l)
    fi
    apt-get "${opts[@]}" update -qq
    apt-get "${opts[@]}" install -y -qq --no-install-recommends "$@"
    if cache_mounted "$APT_CACHE"; then
        now=$(find "$APT_CACHE/archives" -maxdepth 1 -name '*.deb' | wc -l)
        log "apt's cache mount holds $now .deb files, $((now - cached)) of them fetched by this step"
    fi
fi
apt-get clean
# What apt and dpkg log, cache and keep of the inode times: not the image's content.
rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log \
    /var/log/alternatives.log /var/cache/ldconfig/aux-cache
