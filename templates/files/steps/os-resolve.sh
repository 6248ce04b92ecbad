#!/usr/bin/env bash
# os-resolve.sh PACKAGE...: what apt would install for PACKAGE... on this base image, dependencies
# included: run by `envbuild lock --os` in a throwaway container of the base (envbuild/resolve/oslocking.py
# reads what it prints). It installs nothing: apt only simulates, from the archive that
# ENVBUILD_APT_SOURCES names (sources.list lines) instead of the base's own sources.
#   @@apt VERSION                                     the apt that resolved
#   @@base NAME ARCH VERSION                          each package the base has installed
#   @@deb NAME ARCH VERSION SHA256 SIZE POOL-PATH     each package apt would install or upgrade
#   @@uri URL                                         where apt would fetch each .deb from
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/parts" "$tmp/lists" "$tmp/cache"
printf '%s\n' "${ENVBUILD_APT_SOURCES:?the archive to resolve from}" > "$tmp/sources.list"
opts=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o "Dir::Etc::SourceParts=$tmp/parts"
      -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o "Acquire::Languages=none"
      -o "APT::Install-Recommends=false" -o "APT::Install-Suggests=false" -o "APT::Sandbox::User=root")

printf '@@apt %s\n' "$(dpkg-query -W -f='${Version}' apt)"
dpkg-query -W -f='${db:Status-Abbrev} ${Package} ${Architecture} ${Version}\n' \
    | awk '$1 ~ /^ii/ {print "@@base", $2, $3, $4}'
# apt-get update warns and goes on when an index cannot be fetched: here that is the answer.
apt-get "${opts[@]}" update -qq > "$tmp/update" 2>&1 || true
if grep -qE '^(E:|W: Failed to fetch|Err:)' "$tmp/update" || grep -q 'Could not resolve' "$tmp/update"; then
    grep -E '^(E|W|Err):' "$tmp/update" >&2
    exit 1
fi
# Inst NAME [OLD] (VERSION SUITE [ARCH]): every package the install would unpack.
apt-get "${opts[@]}" install -s -y "$@" > "$tmp/plan"
sed -nE 's/^Inst ([^ ]+) (\[[^]]*\] )?\(([^ ]+) .*\[([^]]+)\]\)$/\1=\3/p' "$tmp/plan" > "$tmp/pins"
if [[ ! -s $tmp/pins ]]; then
    exit 0  # the base has everything already
fi
mapfile -t pins < "$tmp/pins"
apt-cache "${opts[@]}" show --no-all-versions "${pins[@]}" | awk '
    /^Package: / {name = $2} /^Architecture: / {arch = $2} /^Version: / {version = $2}
    /^SHA256: / {sha = $2} /^Size: / {size = $2} /^Filename: / {file = $2}
    /^$/ { if (name != "") print "@@deb", name, arch, version, sha, size, file; name = "" }
    END { if (name != "") print "@@deb", name, arch, version, sha, size, file }'
apt-get "${opts[@]}" install --print-uris -qq -y "$@" | sed -nE "s/^'([^']+)'.*/@@uri \1/p"
