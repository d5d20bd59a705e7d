#!/usr/bin/env bash
# Run HERE (network to PyPI and Debian): fills build/gpu-wheels/ with what the lent GPU machine lacks, for the
# device tool's `carry`, then `bash scripts/gpu-check.sh` runs there (see that script).
#
# The GPU machine (Python 3.12, torch 2.11+cu130, grpcio, protobuf, uvloop, transformers 5.17, prometheus-client,
# xxhash, pytest, cuda-bindings, cuda-core ...; no network, no apt, no redis-server) gets py3.12 manylinux x86_64
# wheels, one folder per group, installed there with `pip install --no-index --no-deps`:
#
#   core            required  pyproject runtime pins it lacks: redis (+hiredis), gguf, grpcio-health-checking,
#                             grpcio-reflection, opentelemetry-*; protobuf 7.36.2 and grpcio 1.85.3 because
#                             proto/baton_pb2.py needs protobuf >= 7.35.1 (major 7) and proto/baton_pb2_grpc.py
#                             grpcio >= 1.85.1, newer than that image is likely to hold
#   redis           required  Debian's redis-server binary (from redis-tools) + libjemalloc/liblzf/libatomic,
#                             a wrapper that sets LD_LIBRARY_PATH
#   redis-fallback  optional  fakeredis (TcpFakeServer) + lupa (its Lua), used only if the binary will not load
#   nixl            optional  nixl-cu13, slimmed: without nixl_ep_cu13 (torch 2.12-2.14 builds), storage plugins
#                             (OBJ, AZURE_BLOB, GDS, ...), UCX's ib modules and their libraries
#   ucxx            optional  ucxx-cu13 and its libraries, slimmed: no static libraries, headers, perftest
#   flashinfer      optional  flashinfer-python (one ~97 MiB wheel before its own dependencies)
#
# Everything travels in 64 MiB, working tree included. Over budget, the optional groups are dropped in this order:
# flashinfer, ucxx, nixl, redis-fallback. Downloads are cached in build/gpu-cache/ (rerunning fetches nothing
# already there); build/gpu-wheels/ is rebuilt from that cache on every run.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=build/gpu-cache
DEST=build/gpu-wheels
BUDGET_BYTES=$((64 * 1024 * 1024))
MARGIN_BYTES=$((512 * 1024))  # what travels besides: the scripts' own outputs, rounding
DROP_ORDER=(flashinfer ucxx nixl redis-fallback)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
PIP_TARGET=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
            --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
            --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)

declare -A GROUP_PINS=(
    [core]="redis==8.1.0 hiredis==3.5.0 protobuf==7.36.2 grpcio==1.85.3 grpcio-health-checking==1.85.1
            grpcio-reflection==1.85.1 gguf==0.19.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
            opentelemetry-semantic-conventions==0.66b2"
    [redis-fallback]="fakeredis==2.41.0 lupa==2.8"
    [nixl]="nixl-cu13==1.5.1"
    [ucxx]="ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0 rmm-cu13==26.10.0 librmm-cu13==26.10.0
            rapids-logger==0.3.0"
    [flashinfer]="flashinfer-python==0.7.4"
)
REDIS_DEBS=(redis-tools libjemalloc2 liblzf1 libatomic1)

# Members left out of a slimmed wheel (fnmatch patterns on the names inside the zip).
NIXL_SLIM=('nixl_ep_cu13/*' '*.data/headers/*'
           '*/libplugin_OBJ.so' '*/libplugin_AZURE_BLOB.so' '*/libplugin_GDS.so' '*/libplugin_GDS_MT.so'
           '*/libplugin_GPUNETIO.so' '*/libplugin_GUSLI.so' '*/libplugin_INFINIA.so' '*/libplugin_LIBFABRIC.so'
           '*/libtelemetry_exporter_doca.so' '*/libnixl_test_utils.so' '*/libnixl_capi.so' '*/libobj_utils.so'
           'nixl_cu13.libs/libaws-*' 'nixl_cu13.libs/libazure-*' 'nixl_cu13.libs/libcurl-*'
           'nixl_cu13.libs/libxml2-*' 'nixl_cu13.libs/libs2n-*' 'nixl_cu13.libs/libgusli_clnt-*'
           'nixl_cu13.libs/libzstd-*' 'nixl_cu13.libs/libnuma-*' 'nixl_cu13.libs/libibverbs-*'
           'nixl_cu13.libs/libmlx5-*' 'nixl_cu13.libs/libnl-*'
           'nixl_cu13.libs/ucx/libuct_ib*' 'nixl_cu13.libs/ucx/libucx_perftest*')
UCX_SLIM=('*.a' '*/include/*' '*/cmake/*' '*/pkgconfig/*' '*/libucx_perftest*' 'libucx/bin/io_demo'
          'libucx/bin/ucx_perftest*' 'libucx/bin/ucx_read_profile')

log() { printf '%s\n' "$*" >&2; }
mib() { awk -v b="$1" 'BEGIN { printf "%.2f", b / 1048576 }'; }
bytes_of() { if [ -e "$1" ]; then du -sb "$1" | cut -f1; else echo 0; fi; }

wheel_glob() {  # the cached wheel file(s) of a pin NAME==VERSION, as a glob (wheel names: lower case, "_")
    local stem
    stem=$(printf '%s' "${1%%==*}" | tr '[:upper:]-' '[:lower:]_')
    echo "$CACHE/wheels/${stem}-${1#*==}-*.whl"
}

fetch_wheel() {  # pip download one pin into the cache unless it is there
    compgen -G "$(wheel_glob "$1")" >/dev/null && return 0
    log "  downloading $1"
    "$PY" -m pip download -q --disable-pip-version-check "${PIP_TARGET[@]}" -d "$CACHE/wheels" "$1" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

wheel_of() { compgen -G "$(wheel_glob "$1")" | head -1; }

# Copy of wheel $1 at $2 without the members matching the patterns after them (their RECORD lines too).
slim_wheel() {
    local src=$1 dst=$2
    shift 2
    "$PY" - "$src" "$dst" "$@" <<'PY'
import fnmatch, sys, zipfile

src, dst, patterns = sys.argv[1], sys.argv[2], sys.argv[3:]
dropped = lambda name: any(fnmatch.fnmatch(name, p) for p in patterns)
kept = removed = 0
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst + ".tmp", "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if dropped(info.filename):
            removed += 1
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(line for line in lines if not dropped(line.split(",", 1)[0])).encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
        kept += 1
print(f"  slimmed {src.rsplit('/', 1)[-1]}: kept {kept} members, left out {removed}", file=sys.stderr)
PY
    mv "$dst.tmp" "$dst"
}

# Libraries that an ELF file of an unpacked wheel cannot find, one per line: "file: library".
missing_libs() {
    local dir=$1 f
    find "$dir" -type f \( -name '*.so' -o -name '*.so.*' \) | while read -r f; do
        ldd "$f" 2>/dev/null | awk -v f="${f#"$dir"/}" '/not found/ { print f ": " $1 }'
    done
}

# Slim $1 into $2 and check that no library resolves any worse than in the original (ldd on both, unpacked);
# if one does, keep the original wheel and say so.
slim_checked() {
    local src=$1 dst=$2
    shift 2
    if [ -f "$dst" ] && [ "$dst" -nt "$src" ]; then return 0; fi
    slim_wheel "$src" "$dst" "$@"
    local work
    work=$(mktemp -d)
    "$PY" -m zipfile -e "$src" "$work/full"
    "$PY" -m zipfile -e "$dst" "$work/slim"
    missing_libs "$work/full" | LC_ALL=C sort >"$work/full.txt"
    missing_libs "$work/slim" | LC_ALL=C sort >"$work/slim.txt"
    local worse
    worse=$(LC_ALL=C comm -13 "$work/full.txt" "$work/slim.txt")
    rm -rf "$work"
    if [ -n "$worse" ]; then
        log "  slimming $(basename "$src") loses libraries something needs; keeping the full wheel:"
        log "$worse"
        cp "$src" "$dst"
    fi
}

fetch_group() {
    local group=$1 pin
    for pin in ${GROUP_PINS[$group]}; do fetch_wheel "$pin"; done
}

assemble_group() {  # $DEST/<group>/ from the cache
    local group=$1 pin wheel
    mkdir -p "$DEST/$group"
    for pin in ${GROUP_PINS[$group]}; do
        wheel=$(wheel_of "$pin")
        case "$pin" in
            nixl-cu13==*)
                slim_checked "$wheel" "$CACHE/slim/$(basename "$wheel")" "${NIXL_SLIM[@]}"
                wheel="$CACHE/slim/$(basename "$wheel")" ;;
            libucx-cu13==* | libucxx-cu13==* | librmm-cu13==* | rapids-logger==*)
                slim_checked "$wheel" "$CACHE/slim/$(basename "$wheel")" "${UCX_SLIM[@]}"
                wheel="$CACHE/slim/$(basename "$wheel")" ;;
        esac
        cp "$wheel" "$DEST/$group/"
    done
}

# Debian's redis-server: the binary is redis-tools' redis-check-rdb (it serves when argv[0] is not
# "redis-check-rdb"), copied as bin/redis-server; the small libraries it needs go to lib/. libssl3, libcrypto
# and libsystemd0 are left to the GPU machine (Ubuntu 24.04 has them; gpu-check.sh falls back if not).
assemble_redis() {
    mkdir -p "$CACHE/debs" "$DEST/redis/bin" "$DEST/redis/lib"
    local deb missing=()
    for deb in "${REDIS_DEBS[@]}"; do
        compgen -G "$CACHE/debs/${deb}_*.deb" >/dev/null || missing+=("$deb")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "  apt-get download ${missing[*]}"
        (cd "$CACHE/debs" && apt-get download -q -o APT::Sandbox::User=root "${missing[@]}" >&2)
    fi
    local root
    root=$(mktemp -d)
    for deb in "$CACHE"/debs/*.deb; do dpkg-deb -x "$deb" "$root"; done
    cp "$root/usr/bin/redis-check-rdb" "$DEST/redis/bin/redis-server"
    cp -L "$root"/usr/lib/x86_64-linux-gnu/{libjemalloc.so.2,liblzf.so.1,libatomic.so.1} "$DEST/redis/lib/"
    rm -rf "$root"
    cat >"$DEST/redis/redis-server" <<'SH'
#!/bin/sh
# Debian's redis-server with the libraries carried beside it.
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/bin/redis-server" "$@"
SH
    chmod +x "$DEST/redis/redis-server" "$DEST/redis/bin/redis-server"
    local needed
    needed=$(readelf -d "$DEST/redis/bin/redis-server" | awk '/NEEDED/ { gsub(/[][]/, "", $5); printf "%s ", $5 }')
    log "  redis-server needs: $needed"
    log "  carried: $(cd "$DEST/redis/lib" && echo *) (glibc, libssl.so.3, libcrypto.so.3, libsystemd.so.0:" \
        "the machine's)"
}

tree_bytes() {  # what travels besides the carried folder: tracked and untracked-not-ignored files
    git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null |
        awk '{ s += $1 } END { print s + 0 }'
}

print_table() {
    local group file
    printf '\n%8s  %-15s %s\n' MiB group file
    for group in core redis redis-fallback nixl ucxx flashinfer; do
        [ -d "$DEST/$group" ] || continue
        find "$DEST/$group" -type f | sort | while read -r file; do
            printf '%8s  %-15s %s\n' "$(mib "$(bytes_of "$file")")" "$group" "${file#"$DEST/$group/"}"
        done
    done
}

main() {
    mkdir -p "$CACHE/wheels" "$CACHE/slim"
    rm -rf "$DEST"
    mkdir -p "$DEST"
    local group
    for group in core redis-fallback nixl ucxx flashinfer; do
        log "[$group]"
        fetch_group "$group"
        assemble_group "$group"
    done
    log "[redis]"
    assemble_redis

    local tree budget total dropped=()
    tree=$(tree_bytes)
    budget=$((BUDGET_BYTES - tree - MARGIN_BYTES))
    total=$(bytes_of "$DEST")
    for group in "${DROP_ORDER[@]}"; do
        [ "$total" -le "$budget" ] && break
        dropped+=("$group ($(mib "$(bytes_of "$DEST/$group")") MiB)")
        rm -rf "${DEST:?}/$group"
        total=$(bytes_of "$DEST")
    done
    {
        echo "# what build/gpu-wheels holds (scripts/gpu-prepare.sh, $(date -u +%FT%TZ))"
        for group in core redis redis-fallback nixl ucxx flashinfer; do
            if [ -d "$DEST/$group" ]; then echo "$group carried"; else echo "$group dropped: over the 64 MiB budget"; fi
        done
    } >"$DEST/MANIFEST.txt"
    total=$(bytes_of "$DEST")

    print_table
    printf '\nworking tree %s MiB + build/gpu-wheels %s MiB = %s MiB of 64 MiB (budget for the wheels %s MiB)\n' \
        "$(mib "$tree")" "$(mib "$total")" "$(mib $((tree + total)))" "$(mib "$budget")"
    if [ ${#dropped[@]} -gt 0 ]; then
        printf 'dropped for the budget, in this order: %s\n' "${dropped[*]}"
    fi
    if [ "$total" -gt "$budget" ]; then
        echo "still over budget with every optional group dropped" >&2
        exit 1
    fi
    printf '\nrun tool:  command: bash scripts/gpu-check.sh\n           carry:   ["build/gpu-wheels"]\n'
}

main "$@"
