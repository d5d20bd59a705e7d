#!/usr/bin/env bash
# Make sure Debian's libibverbs1 (libibverbs.so.1) is there: Mooncake Store (the `--kv-store` tier, pip package
# mooncake-transfer-engine-non-cuda) links it even on TCP, and without it both `import mooncake.store` and
# `mooncake_master` fail on "libibverbs.so.1: cannot open shared object file". Present: prints where and exits 0.
# Missing and running as root with apt-get: installs it. Otherwise prints exactly what to install and exits 1.
set -euo pipefail

find_lib() {
    if command -v ldconfig >/dev/null 2>&1 && ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
        ldconfig -p | awk '/libibverbs\.so\.1 / {print $NF; exit}'
        return 0
    fi
    for dir in /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /lib/aarch64-linux-gnu /usr/lib/aarch64-linux-gnu \
               /usr/lib64 /usr/lib /lib64 /lib; do
        if [ -e "$dir/libibverbs.so.1" ]; then echo "$dir/libibverbs.so.1"; return 0; fi
    done
    return 1
}

if lib="$(find_lib)"; then
    echo "libibverbs: $lib"
    exit 0
fi

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "libibverbs.so.1 not found; installing Debian's libibverbs1 with apt-get ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
    if lib="$(find_lib)"; then
        echo "libibverbs: $lib"
        exit 0
    fi
    echo "apt-get install libibverbs1 finished but no libibverbs.so.1 was found" >&2
    exit 1
fi

cat >&2 <<'MSG'
libibverbs.so.1 not found. Baton's KV store tier (--kv-store: Mooncake Store) needs it, even over TCP, without
any RDMA device. Install it with:
  Debian/Ubuntu:  sudo apt-get update && sudo apt-get install -y libibverbs1
  Fedora/RHEL:    sudo dnf install -y libibverbs
Everything else in Baton runs without it (the store tier's tests skip, `baton up --kv-store` says why).
MSG
exit 1
