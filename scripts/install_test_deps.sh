#!/usr/bin/env bash
# System packages the test suite needs beyond the Python venv: Debian's `prometheus` (a real
# Prometheus server and promtool, for tests/e2e/test_prometheus_e2e.py) and `redis-server`
# (the fleet's shared session store, for tests/server/test_fleet_store.py and
# tests/e2e/test_fleet_e2e.py). Idempotent: installs only what is missing, runs
# `apt-get update` only when the package lists are missing or older than a day. Safe to run
# as root in CI; prints what it did.
set -euo pipefail

log() { printf 'install_test_deps: %s\n' "$*"; }

missing=()
[[ -x /usr/bin/prometheus && -x /usr/bin/promtool ]] || missing+=(prometheus)
[[ -x /usr/bin/redis-server ]] || missing+=(redis-server)

if [[ ${#missing[@]} -eq 0 ]]; then
    log "prometheus and redis-server already installed; nothing to do"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    log "no apt-get on this system: install ${missing[*]} yourself; the tests that need them are skipped"
    exit 0
fi

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo)
    else
        log "not root and no sudo: cannot install ${missing[*]}; the tests that need them will be skipped"
        exit 0
    fi
fi

export DEBIAN_FRONTEND=noninteractive
lists=/var/lib/apt/lists
# Update when no package list exists yet, or the newest is over a day old.
if [[ -z $(find "$lists" -maxdepth 1 -name '*_Packages*' -mmin -1440 -print -quit 2>/dev/null) ]]; then
    log "apt-get update (package lists missing or older than a day)"
    "${SUDO[@]}" apt-get update -qq
else
    log "apt package lists are fresh; skipping apt-get update"
fi

log "apt-get install -y ${missing[*]}"
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
log "installed: $(/usr/bin/prometheus --version 2>&1 | head -n1); $(/usr/bin/redis-server --version)"
