#!/usr/bin/env bash
# fabric-sources.sh make DIR | serve DIR PORT | list
#
# The aws-efa fabric builds rdma-core, libfabric and aws-ofi-nccl from source, and the FA3
# extension flash-attention's hopper/ with its cutlass, each pinned to a commit and the sha256
# of its source tar (matrices/fabrics.yaml, matrices/extensions.yaml `archives`). The published workflow
# downloads https://github.com/OWNER/REPO/archive/COMMIT.tar.gz; a machine that cannot reach
# GitHub builds from a local copy with the same paths, served on 127.0.0.1 (the way the tests
# use a local registry): the URL differs only in its base.
#
#   make DIR [NAME...]
#                   writes DIR/OWNER/REPO/archive/COMMIT.tar.gz for each pin (those NAMEd;
#                   default: every fabric's), made with `git archive` from local git mirrors,
#                   and DIR/SOURCES (one line each: name, URL, sha256 of the tar stream, sha256
#                   of our .tar.gz). Fails if a tar stream's sha256 is not the pinned one, and
#                   for a source with no pin yet says the sha256 to record.
#                   FA3's: `make DIR flash-attention cutlass`.
#   serve DIR PORT  python3 -m http.server on 127.0.0.1:PORT (foreground); the build then uses
#                   http://127.0.0.1:PORT/OWNER/REPO/archive/COMMIT.tar.gz
#   list            the pins, one line each: name OWNER/REPO COMMIT TAG TAR-SHA256 KIND
#                   (KIND: fabric or extension)
#
# The mirrors: git repositories (bare or not) holding the pinned commits, at
# $FABRIC_MIRRORS/OWNER+REPO/repo: `git clone --mirror https://github.com/OWNER/REPO
# $FABRIC_MIRRORS/OWNER+REPO/repo` wherever GitHub is reachable, then copy the directory over.
# FABRIC_MIRRORS has no default: `make` names it when it is not set.
#
# Why the sha256 is of the tar stream, not of the .tar.gz: GitHub makes /archive/ tarballs with
# `git archive` (prefix REPO-COMMIT/, export-ignore honoured), so the uncompressed tar is the
# same bytes here and there; the gzip layer is GitHub's and is not promised to be stable
# (https://github.blog/open-source/git/update-on-the-future-stability-of-source-code-archives-and-hashes/).
# templates/files/steps/fabric.sh checks the tar stream for that reason.
set -euo pipefail

MIRRORS=${FABRIC_MIRRORS:-}

# name owner/repo commit tag tar-sha256 (tar-sha256: the uncompressed `git archive` stream; '-'
# where none is recorded yet), one line per source of every fabric built from source and every
# GitHub archive an extension compiles from (FA3: flash-attention and its cutlass), read from
# matrices/fabrics.yaml and matrices/extensions.yaml (the one place the pins live;
# ENVBUILD_FABRICS_FILE and ENVBUILD_EXTENSIONS_FILE name other files).
MATRICES=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/matrices
FABRICS_FILE=${ENVBUILD_FABRICS_FILE:-$MATRICES/fabrics.yaml}
EXTENSIONS_FILE=${ENVBUILD_EXTENSIONS_FILE:-$MATRICES/extensions.yaml}
mapfile -t PINS < <(python3 - "$FABRICS_FILE" "$EXTENSIONS_FILE" <<'PY'
import re, sys
import yaml
sources = [(fabric["name"], src, "fabric") for fabric in yaml.safe_load(open(sys.argv[1], encoding="utf-8"))["fabrics"]
           for src in (fabric.get("build") or {}).get("sources", [])]
sources += [(ext["name"], src, "extension") for ext in yaml.safe_load(open(sys.argv[2], encoding="utf-8"))["extensions"]
            for src in ext.get("archives", [])]
for owner, src, kind in sources:
    if not src["url"].startswith("https://github.com/"):  # the source_mirror stands in for GitHub only
        print(f"fabric-sources: {owner} {src['name']}: not on GitHub, fetched from {src['url']} itself", file=sys.stderr)
        continue
    m = re.fullmatch(r"https://github\.com/([^/]+/[^/]+)/archive/([0-9a-f]{40})\.tar\.gz", src["url"])
    if not m or m.group(2) != src.get("commit"):
        sys.exit(f"fabric-sources: {owner} {src['name']}: {src['url']} is not a GitHub archive of {src.get('commit')}")
    print(src["name"], m.group(1), src["commit"], src["version"], src.get("tar_sha256") or "-", kind)
PY
)
(( ${#PINS[@]} > 0 )) || { printf 'fabric-sources: no fabric in %s is built from source\n' "$FABRICS_FILE" >&2; exit 1; }

die() { printf 'fabric-sources: %s\n' "$*" >&2; exit 1; }

make_dir() {
    local dir=$1 name slug commit tag want kind git_dir repo out tar_sha gz_sha made=0
    shift
    [[ -n $MIRRORS ]] || die "set FABRIC_MIRRORS to the directory of git mirrors holding OWNER+REPO/repo for each source"
    mkdir -p "$dir"
    : > "$dir/SOURCES.tmp"
    for pin in "${PINS[@]}"; do
        read -r name slug commit tag want kind <<<"$pin"
        if (( $# )); then [[ " $* " == *" $name "* ]] || continue; else [[ $kind == fabric ]] || continue; fi
        made=$((made + 1))
        git_dir=$MIRRORS/${slug/\//+}/repo
        [[ -d $git_dir ]] || die "no git mirror of $slug at $git_dir: \`git clone --mirror https://github.com/$slug $git_dir\`, or set FABRIC_MIRRORS to the directory holding OWNER+REPO/repo"
        git -C "$git_dir" cat-file -e "$commit^{commit}" 2>/dev/null \
            || die "the mirror of $slug at $git_dir lacks commit $commit ($tag): update the mirror"
        repo=${slug#*/}
        out=$dir/$slug/archive/$commit.tar.gz
        mkdir -p "$(dirname "$out")"
        # GitHub's archive of a commit: top directory REPO-COMMIT/, from git archive.
        tar_sha=$(git -C "$git_dir" archive --format=tar --prefix="$repo-$commit/" "$commit" | sha256sum | cut -d' ' -f1) \
            || die "$name $tag: git could not write the archive of $slug $commit (the mirror at $git_dir lacks an object of it?)"
        if [[ $want == - ]]; then
            die "$name $tag ($slug $commit): no pin is recorded; its tar stream's sha256 is $tar_sha (record it as tar_sha256)"
        fi
        if [[ $tar_sha != "$want" ]]; then
            die "$name $tag ($slug $commit): the tar stream's sha256 is $tar_sha, the pin says $want"
        fi
        git -C "$git_dir" archive --format=tar --prefix="$repo-$commit/" "$commit" | gzip -n -9 > "$out.tmp"
        mv "$out.tmp" "$out"
        gz_sha=$(sha256sum "$out" | cut -d' ' -f1)
        printf '%s https://github.com/%s/archive/%s.tar.gz %s %s\n' "$name" "$slug" "$commit" "$tar_sha" "$gz_sha" >> "$dir/SOURCES.tmp"
        printf 'fabric-sources: %s %s -> %s (%s bytes)\n' "$name" "$tag" "$out" "$(stat -c %s "$out")" >&2
    done
    (( made )) || die "no source is named $*: \`fabric-sources.sh list\` names them"
    mv "$dir/SOURCES.tmp" "$dir/SOURCES"
    cat "$dir/SOURCES"
}

case ${1:-} in
    make)
        [[ $# -ge 2 ]] || die "usage: fabric-sources.sh make DIR [NAME...]"
        make_dir "${@:2}" ;;
    serve)
        [[ $# -eq 3 ]] || die "usage: fabric-sources.sh serve DIR PORT"
        [[ -f $2/SOURCES ]] || die "$2 has no SOURCES: run \`fabric-sources.sh make $2\` first"
        exec python3 -m http.server --bind 127.0.0.1 --directory "$2" "$3" ;;
    list)
        printf '%s\n' "${PINS[@]}" ;;
    *)
        die "usage: fabric-sources.sh make DIR [NAME...] | serve DIR PORT | list" ;;
esac
