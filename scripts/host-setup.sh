#!/usr/bin/env bash
# Prepare a fresh Debian 12 machine (root, no systemd, no GPU) for real Docker tests:
#   - installs docker.io, docker-registry, debootstrap, binutils, curl
#   - starts dockerd (no iptables, no bridge, overlay2, builder cache kept to 20 GB) if it is
#     not answering
#   - starts a plain docker-registry on 127.0.0.1:5000 if nothing listens there
#   - builds the base image local/debian:bookworm with debootstrap if it is missing
#   - with ENVBUILD_REDIS=1: installs redis-server and starts it on 127.0.0.1:6379 (no
#     persistence), the compile cache `envbuild build --compile-cache redis://127.0.0.1:6379` uses
# Safe to run again: every step checks first and skips what is already done.
#
# Always uses Debian's own CLI /usr/bin/docker: another `docker` client that may be
# first on PATH does not drive BuildKit here.
set -euo pipefail

DOCKER=/usr/bin/docker
DOCKERD_LOG=/var/log/envbuild-dockerd.log
DOCKERD_STATE=/var/tmp/envbuild-dockerd
BUILD_CACHE_KEEP=${ENVBUILD_BUILD_CACHE_KEEP:-20GB}
REGISTRY_ADDR=127.0.0.1:5000
REGISTRY_LOG=/var/log/envbuild-registry.log
REGISTRY_STATE=/var/tmp/envbuild-registry
BASE_IMAGE=local/debian:bookworm
BASE_SUITE=bookworm
BASE_MIRROR=${ENVBUILD_DEBIAN_MIRROR:-http://deb.debian.org/debian}
WAIT_SECONDS=60

log() { printf '[host-setup] %s\n' "$*"; }
die() { printf '[host-setup] ERROR: %s\n' "$*" >&2; exit 1; }
# shellcheck source=scripts/lib/apt.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/apt.sh"

[[ ${EUID} -eq 0 ]] || die "must run as root"

# --- 1. packages --------------------------------------------------------------------
PACKAGES=(docker.io docker-registry debootstrap binutils curl ca-certificates procps apache2-utils openssl)

apt_install "${PACKAGES[@]}"
[[ -x ${DOCKER} ]] || die "${DOCKER} missing after install"

# --- 2. dockerd ---------------------------------------------------------------------
if "${DOCKER}" info >/dev/null 2>&1; then
    log "dockerd already answering"
else
    if pgrep -x dockerd >/dev/null; then
        log "dockerd process exists but does not answer yet; waiting"
    else
        # BuildKit keeps every layer it ever built unless its garbage collector is on (it is off
        # by default in 20.10): on a machine that runs the suite again and again (a CI runner
        # that keeps its disk) the cache grows by every image a changed step makes, until the
        # disk is full. The engine this script starts keeps at most BUILD_CACHE_KEEP of it;
        # a daemon.json the machine already has wins (its cache policy is its owner's).
        config=()
        if [[ -e /etc/docker/daemon.json ]]; then
            log "using /etc/docker/daemon.json (the builder cache is bounded, or not, by it)"
        else
            mkdir -p "${DOCKERD_STATE}"
            printf '{"builder": {"gc": {"enabled": true, "defaultKeepStorage": "%s"}}}\n' "${BUILD_CACHE_KEEP}" \
                >"${DOCKERD_STATE}/daemon.json"
            config=(--config-file "${DOCKERD_STATE}/daemon.json")
        fi
        log "starting dockerd (log: ${DOCKERD_LOG}; builder cache kept to ${BUILD_CACHE_KEEP})"
        nohup setsid /usr/sbin/dockerd --iptables=false --bridge=none \
            --storage-driver=overlay2 "${config[@]}" >>"${DOCKERD_LOG}" 2>&1 </dev/null &
    fi
    deadline=$((SECONDS + WAIT_SECONDS))
    until "${DOCKER}" info >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            tail -n 20 "${DOCKERD_LOG}" >&2 || true
            die "dockerd did not answer '${DOCKER} info' within ${WAIT_SECONDS}s (see ${DOCKERD_LOG})"
        fi
        sleep 1
    done
    log "dockerd is up"
fi

# --- 3. registry --------------------------------------------------------------------
port_open() {
    # true if something accepts TCP connections on REGISTRY_ADDR
    (exec 3<>"/dev/tcp/${REGISTRY_ADDR%:*}/${REGISTRY_ADDR#*:}") 2>/dev/null
}
registry_ok() { curl -sf -o /dev/null "http://${REGISTRY_ADDR}/v2/"; }

if registry_ok; then
    log "registry already answering on ${REGISTRY_ADDR}"
else
    if port_open; then
        die "something listens on ${REGISTRY_ADDR} but http://${REGISTRY_ADDR}/v2/ does not answer"
    fi
    mkdir -p "${REGISTRY_STATE}"
    # Storage of an earlier registry started by this script: none serves it now (nothing
    # answers), and each one held gigabytes of test images.
    for old in "${REGISTRY_STATE}"/storage.??????; do
        [[ -d ${old} ]] || continue
        log "removing ${old} (storage of a registry this script started earlier)"
        rm -rf -- "${old}"
    done
    storage=$(mktemp -d "${REGISTRY_STATE}/storage.XXXXXX")
    registry_config="${REGISTRY_STATE}/config.yml"
    cat >"${registry_config}" <<EOF
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: ${storage}
  delete:
    enabled: true
http:
  addr: ${REGISTRY_ADDR}
EOF
    log "starting docker-registry on ${REGISTRY_ADDR} (storage: ${storage}, log: ${REGISTRY_LOG})"
    nohup setsid /usr/bin/docker-registry serve "${registry_config}" \
        >>"${REGISTRY_LOG}" 2>&1 </dev/null &
    deadline=$((SECONDS + WAIT_SECONDS))
    until registry_ok; do
        if ((SECONDS >= deadline)); then
            tail -n 20 "${REGISTRY_LOG}" >&2 || true
            die "registry did not answer http://${REGISTRY_ADDR}/v2/ within ${WAIT_SECONDS}s"
        fi
        sleep 1
    done
    log "registry is up"
fi

# --- 4. base image ------------------------------------------------------------------
if "${DOCKER}" image inspect "${BASE_IMAGE}" >/dev/null 2>&1; then
    log "image ${BASE_IMAGE} already exists"
else
    rootfs=$(mktemp -d /var/tmp/envbuild-rootfs.XXXXXX)
    trap 'rm -rf "${rootfs}"' EXIT
    log "debootstrap ${BASE_SUITE} (minbase) from ${BASE_MIRROR}"
    debootstrap --variant=minbase "${BASE_SUITE}" "${rootfs}" "${BASE_MIRROR}" \
        >"${rootfs}.log" 2>&1 || {
        tail -n 20 "${rootfs}.log" >&2
        die "debootstrap failed (see ${rootfs}.log)"
    }
    rm -f "${rootfs}.log"
    # debootstrap writes only "<suite> main"; add updates and security like the
    # official image does, and drop the downloaded .debs it leaves behind.
    cat >"${rootfs}/etc/apt/sources.list" <<EOF
deb ${BASE_MIRROR} ${BASE_SUITE} main
deb ${BASE_MIRROR} ${BASE_SUITE}-updates main
deb http://deb.debian.org/debian-security ${BASE_SUITE}-security main
EOF
    rm -f "${rootfs}"/var/cache/apt/archives/*.deb
    rm -rf "${rootfs}"/var/lib/apt/lists/*
    log "importing ${BASE_IMAGE}"
    tar -C "${rootfs}" -c . | "${DOCKER}" import --change 'CMD ["bash"]' - "${BASE_IMAGE}" >/dev/null
    rm -rf "${rootfs}"
    trap - EXIT
    log "image ${BASE_IMAGE} built"
fi

# --- 5. a compile cache (opt-in) ----------------------------------------------------------
REDIS_ADDR=127.0.0.1:6379
if [[ ${ENVBUILD_REDIS:-} == 1 ]]; then
    command -v redis-server >/dev/null || apt_install redis-server
    if (exec 3<>"/dev/tcp/${REDIS_ADDR%:*}/${REDIS_ADDR#*:}") 2>/dev/null; then
        log "something already listens on ${REDIS_ADDR}; not starting redis-server"
    else
        log "starting redis-server on ${REDIS_ADDR} (no persistence; log /var/log/envbuild-redis.log)"
        redis-server --bind "${REDIS_ADDR%:*}" --port "${REDIS_ADDR#*:}" --save '' --appendonly no \
            --daemonize yes --logfile /var/log/envbuild-redis.log --dir /var/tmp >/dev/null
    fi
fi

log "ready: $("${DOCKER}" version --format 'docker {{.Server.Version}}'), registry ${REGISTRY_ADDR}, image ${BASE_IMAGE}"
