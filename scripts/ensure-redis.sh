#!/usr/bin/env bash
# Make sure a `redis-server` binary exists (Baton's KV index and registry; `baton up` starts a private one).
# Present: prints where and exits 0. Missing and running as root with apt-get: installs Debian's
# redis-server (nothing is started: `baton up` and the tests start their own). Otherwise prints exactly
# what to install and exits 1.
set -euo pipefail

find_redis() {
    if [ -n "${BATON_REDIS_SERVER:-}" ] && [ -x "${BATON_REDIS_SERVER}" ]; then echo "${BATON_REDIS_SERVER}"; return 0; fi
    command -v redis-server 2>/dev/null && return 0
    for candidate in /usr/bin/redis-server /usr/sbin/redis-server /usr/local/bin/redis-server /opt/homebrew/bin/redis-server; do
        if [ -x "$candidate" ]; then echo "$candidate"; return 0; fi
    done
    return 1
}

report() {
    echo "redis-server: $1 ($("$1" --version 2>/dev/null || echo "version unknown"))"
}

if binary="$(find_redis)"; then
    report "$binary"
    exit 0
fi

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "redis-server not found; installing Debian's redis-server with apt-get ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends redis-server >/dev/null
    if binary="$(find_redis)"; then
        report "$binary"
        exit 0
    fi
    echo "apt-get install redis-server finished but no redis-server binary was found" >&2
    exit 1
fi

cat >&2 <<'MSG'
redis-server not found. Baton needs the Redis server binary (5.0 or newer; no service has to run). Install it with:
  Debian/Ubuntu:  sudo apt-get update && sudo apt-get install -y redis-server
  Fedora/RHEL:    sudo dnf install -y redis
  macOS:          brew install redis
or point BATON_REDIS_SERVER at an existing binary, or pass --redis-url to use a running Redis.
MSG
exit 1
