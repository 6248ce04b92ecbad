#!/usr/bin/env bash
# Prepare an x86-64 Debian 12 host (root, no systemd) to build and run linux/arm64 images
# under QEMU user-mode emulation, for the opt-in ARM64 build test (tests/builds/test_arm64_build.py,
# ENVBUILD_ARM64=1). Run scripts/host-setup.sh first (dockerd, the local registry).
#   - installs qemu-user-static, binfmt-support, and the aarch64 cross compiler (the fast
#     cc-wrapper test in tests/behaviour/test_arm64.py compiles NEON code with it)
#   - mounts binfmt_misc and enables the qemu-aarch64 handler (fix-binary: the emulator is
#     loaded at registration, so it works inside containers that do not have it)
#   - builds the arm64 Debian base with debootstrap and pushes it to the local registry as
#     127.0.0.1:5000/local/debian:bookworm-arm64 (Docker 20.10's `docker import` cannot mark
#     an image arm64; a `FROM scratch` + `ADD rootfs.tar /` build with --platform can)
# Safe to run again: every step checks first and skips what is already done. It never
# removes an image it did not build.
set -euo pipefail

DOCKER=/usr/bin/docker
REGISTRY_ADDR=127.0.0.1:5000
BASE_REPO=local/debian
BASE_TAG=bookworm-arm64
BASE_IMAGE=${REGISTRY_ADDR}/${BASE_REPO}:${BASE_TAG}
BASE_SUITE=bookworm
BASE_MIRROR=${ENVBUILD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
BINFMT=/proc/sys/fs/binfmt_misc

log() { printf '[host-setup-arm64] %s\n' "$*"; }
die() { printf '[host-setup-arm64] ERROR: %s\n' "$*" >&2; exit 1; }
# shellcheck source=scripts/lib/apt.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/apt.sh"

[[ ${EUID} -eq 0 ]] || die "must run as root"
curl -sf -o /dev/null "http://${REGISTRY_ADDR}/v2/" \
    || die "no registry answers on ${REGISTRY_ADDR}: run scripts/host-setup.sh first"

# --- 1. packages --------------------------------------------------------------------
PACKAGES=(qemu-user-static binfmt-support debootstrap file binutils g++-aarch64-linux-gnu)
apt_install "${PACKAGES[@]}"

# --- 2. binfmt ----------------------------------------------------------------------
if [[ ! -e ${BINFMT}/register ]]; then
    log "mounting binfmt_misc"
    mount -t binfmt_misc binfmt_misc "${BINFMT}"
fi
if [[ -e ${BINFMT}/qemu-aarch64 ]] && head -n 1 "${BINFMT}/qemu-aarch64" | grep -qx enabled; then
    log "qemu-aarch64 binfmt handler already enabled"
else
    log "enabling the qemu-aarch64 binfmt handler"
    update-binfmts --enable qemu-aarch64
fi
grep -q '^flags: .*F' "${BINFMT}/qemu-aarch64" \
    || die "the qemu-aarch64 handler lacks the F (fix-binary) flag: arm64 containers cannot find the emulator"

# --- 3. arm64 base in the local registry ----------------------------------------------
if curl -sf -o /dev/null \
    -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' \
    "http://${REGISTRY_ADDR}/v2/${BASE_REPO}/manifests/${BASE_TAG}"; then
    log "${BASE_IMAGE} already in the registry"
else
    work=$(mktemp -d /var/tmp/envbuild-arm64-rootfs.XXXXXX)
    trap 'rm -rf "${work}"' EXIT
    log "debootstrap --arch=arm64 ${BASE_SUITE} (minbase) from ${BASE_MIRROR}"
    debootstrap --arch=arm64 --variant=minbase "${BASE_SUITE}" "${work}/rootfs" "${BASE_MIRROR}" \
        >"${work}/debootstrap.log" 2>&1 || {
        tail -n 20 "${work}/debootstrap.log" >&2
        die "debootstrap failed"
    }
    cat >"${work}/rootfs/etc/apt/sources.list" <<EOF
deb ${BASE_MIRROR} ${BASE_SUITE} main
deb ${BASE_MIRROR} ${BASE_SUITE}-updates main
deb http://deb.debian.org/debian-security ${BASE_SUITE}-security main
EOF
    rm -f "${work}"/rootfs/var/cache/apt/archives/*.deb
    rm -rf "${work}"/rootfs/var/lib/apt/lists/*
    tar -C "${work}/rootfs" -cf "${work}/rootfs.tar" .
    rm -rf "${work}/rootfs"
    printf 'FROM scratch\nADD rootfs.tar /\nCMD ["bash"]\n' >"${work}/Dockerfile"
    log "building ${BASE_IMAGE} (FROM scratch, --platform linux/arm64)"
    DOCKER_BUILDKIT=1 "${DOCKER}" build -q --platform linux/arm64 -t "${BASE_IMAGE}" "${work}" >/dev/null
    "${DOCKER}" push -q "${BASE_IMAGE}" >/dev/null
    rm -rf "${work}"
    trap - EXIT
    log "${BASE_IMAGE} pushed"
fi
arch=$("${DOCKER}" run --rm --platform linux/arm64 "${BASE_IMAGE}" uname -m)
[[ ${arch} == aarch64 ]] || die "an arm64 container reports '${arch}', not aarch64"
log "ready: ${BASE_IMAGE} runs as ${arch} under qemu-aarch64"
