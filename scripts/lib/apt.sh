# shellcheck shell=bash
# The one way envbuild's set-up scripts install Debian packages (sourced by host-setup.sh,
# host-setup-arm64.sh, slurm-setup.sh and test.sh): only what dpkg does not already have,
# non-interactively, without recommends; a failure shows apt's last lines and stops the script.
# The caller may define log() and die(); these are used otherwise.
declare -F log >/dev/null || log() { printf '[apt] %s\n' "$*"; }
declare -F die >/dev/null || die() { printf '[apt] ERROR: %s\n' "$*" >&2; exit 1; }

# apt_missing PKG...: the packages dpkg does not list as installed, one per line.
apt_missing() {
    local pkg
    for pkg in "$@"; do
        dpkg-query -W -f='${db:Status-Status}' "${pkg}" 2>/dev/null | grep -qx installed || printf '%s\n' "${pkg}"
    done
}

# apt_install PKG...: install those of PKG... that are missing (the index is refreshed first).
apt_install() {
    local missing apt_log
    mapfile -t missing < <(apt_missing "$@")
    if ((${#missing[@]} == 0)); then
        log "packages already installed: $*"
        return 0
    fi
    log "installing: ${missing[*]}"
    apt_log=$(mktemp /var/tmp/envbuild-apt.XXXXXX)
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}"; } >"${apt_log}" 2>&1; then
        tail -n 20 "${apt_log}" >&2
        die "apt-get failed (see ${apt_log})"
    fi
    rm -f "${apt_log}"
}
