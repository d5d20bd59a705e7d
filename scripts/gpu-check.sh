#!/usr/bin/env bash
# Run THERE, on a lent GPU machine (issue 20): `bash scripts/gpu-check.sh`, with the device tool's carry
# ["build/gpu-wheels"] (scripts/gpu-prepare.sh fills it here). `--dry-run` prints the plan and checks the files,
# nothing else (runs anywhere); `--only STEP,STEP` runs those steps alone (setup first, if later ones need it).
#
# No step stops the script; each has its own timeout, and a step is skipped ("time budget") once less than its
# timeout is left of the 8 minutes. The end is one table (step, PASS/FAIL/SKIP, seconds, detail), also written
# as JSON to $OUT/gpu-check.json when $OUT is set, with each step's log in $OUT/logs/ (rows that share a log
# name it: the device tool brings back 8 files at most). The steps, cheap and certain first, flashinfer's JIT
# compiles last:
#   env              nvidia-smi -L, Python, torch and CUDA, the machine's own grpcio and protobuf
#   setup            the carried wheels into $TMP/site (one target per wheel), repo + them on PYTHONPATH;
#                    redis-server (Debian's, carried) on a free port, else fakeredis' TcpFakeServer
#   parity-devices   greedy CPU fp32 == GPU fp32, tiny and SmolLM2-135M-shaped (scripts/gpu_parity.py devices)
#   up               `baton up --device cuda` 1 P + 1 D on the one GPU, a greedy generate == CPU, KV moved
#   kv-device        bench.kv_transfer --device cuda: KV between two processes' CUDA tensors (nixl VRAM, ucx
#                    cuda_ipc, tcp through pinned staging) beside the device's own D2D copy (its memcpy row)
#   kv-nccl          SKIP: NCCL refuses two ranks on one device
#   kv-host          bench.kv_transfer on host memory (tcp cma nixl ucx, NIXL as a peer), isolated
#   d2d-copy         128 MiB device->device and pinned host<->device copies: the machine's ceilings
#   throughput       bench.throughput on the GPU, bf16: Baton (CUDA graphs), Baton eager and transformers
#   gpu-tests        pytest -m gpu over the modules that mark tests gpu
#   parity-backends  greedy torch == flashinfer attention on the GPU (SKIP without flashinfer)
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
WHEELS=build/gpu-wheels
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}  # 8 minutes, less the summary
DRY_RUN=0
ONLY=""
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --only) ONLY=",${2:-},"; shift ;;
        *) echo "usage: $0 [--dry-run] [--only STEP,STEP...]" >&2; exit 2 ;;
    esac
    shift
done
TMP=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
LOG_DIR=${OUT:+$OUT/logs}
LOG_DIR=${LOG_DIR:-$TMP/logs}
mkdir -p "$LOG_DIR"
ROWS=$TMP/rows.tsv
: >"$ROWS"
STARTED=$SECONDS
REDIS_URL=""
REDIS_REASON="setup did not run"
REDIS_PID=""
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1 BATON_CACHE_DIR=$TMP/cache
export FLASHINFER_WORKSPACE_BASE=$TMP FLASHINFER_CUDA_ARCH_LIST=9.0a  # JIT for the H200 only, cached in $TMP

cleanup() {
    [ -f "$TMP/up.pid" ] && kill -KILL -- "-$(cat "$TMP/up.pid")" 2>/dev/null
    [ -n "$REDIS_PID" ] && kill "$REDIS_PID" 2>/dev/null
}
trap cleanup EXIT

# ---- steps and the table -------------------------------------------------------------------------------
record() {  # step status seconds detail; the JSON is rewritten after every row (a killed run keeps its rows)
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | tr '\t\n' '  ' | cut -c1-400)" >>"$ROWS"
    write_json
}

write_json() {
    [ -n "${OUT:-}" ] || return 0
    "$PY" - "$ROWS" "$OUT/gpu-check.json" $((SECONDS - STARTED)) <<'PY'
import json, sys

rows, out, total_s = sys.argv[1], sys.argv[2], int(sys.argv[3])
steps = []
for line in open(rows, encoding="utf-8", errors="replace"):
    step, status, seconds, detail = line.rstrip("\n").split("\t", 3)
    steps.append({"step": step, "status": status, "seconds": int(seconds), "detail": detail})
with open(out, "w") as f:
    json.dump({"total_s": total_s, "steps": steps}, f, indent=2)
PY
}

# run_step STEP LOG TIMEOUT_S FUNCTION: FUNCTION gets the timeout, writes to logs/LOG.log and sets STATUS, DETAIL.
run_step() {
    local step=$1 log=$2 timeout_s=$3 fn=$4 left=$((BUDGET_S - (SECONDS - STARTED))) began=$SECONDS
    if [ -n "$ONLY" ] && [[ $ONLY != *",$step,"* ]]; then
        record "$step" SKIP 0 "not selected (--only)"
        return
    fi
    if [ "$DRY_RUN" = 1 ]; then
        printf '%-17s timeout %3s s  log logs/%s.log\n' "$step" "$timeout_s" "$log"
        record "$step" SKIP 0 "dry run"
        return
    fi
    if [ "$left" -lt "$timeout_s" ]; then
        record "$step" SKIP 0 "time budget ($left s left, the step may take $timeout_s s)"
        return
    fi
    STATUS=FAIL
    DETAIL="no result"
    printf '%-17s ... (timeout %s s, %s s left)\n' "$step" "$timeout_s" "$left"
    echo "===== $step (timeout $timeout_s s)" >>"$LOG_DIR/$log.log"
    "$fn" "$timeout_s" >>"$LOG_DIR/$log.log" 2>&1
    record "$step" "$STATUS" $((SECONDS - began)) "$DETAIL"
    printf '%-17s %-4s %4s s  %s\n' "$step" "$STATUS" $((SECONDS - began)) "$DETAIL"
}

skip_step() {  # step reason...
    local step=$1
    shift
    record "$step" SKIP 0 "$*"
}

# Run a command under `timeout`, its output to the log as it comes and to $TMP/last.out; returns its exit code.
bounded() {
    local timeout_s=$1
    shift
    timeout -k 10 "$timeout_s" "$@" 2>&1 | tee "$TMP/last.out"
    return "${PIPESTATUS[0]}"
}

# STATUS and DETAIL from a scripts/gpu_parity.py run: its exit code and its last "RESULT:" line.
from_result() {
    local rc=$1 timeout_s=$2 line
    line=$(grep '^RESULT:' "$TMP/last.out" | tail -1)
    DETAIL=${line#RESULT: * }
    case $rc in
        0) STATUS=PASS ;;
        3) STATUS=SKIP ;;
        124 | 137) STATUS=FAIL DETAIL="timed out after $timeout_s s; ${line:+last: $DETAIL}" ;;
        *) STATUS=FAIL; [ -n "$line" ] || DETAIL="exit $rc: $(tail -1 "$TMP/last.out")" ;;
    esac
}

summary() {
    printf '\n%-17s %-6s %6s  %s\n' step status s detail
    while IFS=$'\t' read -r step status seconds detail; do
        printf '%-17s %-6s %6s  %s\n' "$step" "$status" "$seconds" "$detail"
    done <"$ROWS"
    printf 'total %s s of %s s\n' $((SECONDS - STARTED)) "$BUDGET_S"
    write_json
}

# ---- env and setup ---------------------------------------------------------------------------------
step_env() {
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    ldd --version | head -1
    command -v nvcc && nvcc --version | tail -2
    bounded "$1" "$PY" - <<'PY'
import importlib, platform, torch

def version(module: str) -> str:  # the machine's own, before setup puts the carried ones first
    try:
        return importlib.import_module(module).__version__
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return f"? ({type(exc).__name__})"

cuda = torch.cuda.is_available()
name = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
cap = ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else "-"
print(f"RESULT: {'PASS' if cuda else 'FAIL'} {name} (sm {cap}, {torch.cuda.device_count()} device(s)), "
      f"torch {torch.__version__} CUDA {torch.version.cuda}, Python {platform.python_version()}; "
      f"machine's grpcio {version('grpc')} protobuf {version('google.protobuf')}")
raise SystemExit(0 if cuda else 1)
PY
    from_result $? "$1"
}

install_wheels() {  # all in one target; if that fails, one target per wheel (namespaces merge across them)
    local pip=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check)
    local wheels=("$WHEELS"/*/*.whl) whl target ok=0 failed=() path=$ROOT
    if "${pip[@]}" --target "$TMP/site/all" "${wheels[@]}"; then
        export PYTHONPATH="$ROOT:$TMP/site/all${PYTHONPATH:+:$PYTHONPATH}"
        WHEELS_DETAIL="${#wheels[@]} wheels installed"
        return
    fi
    echo "one pip install of every wheel failed; installing them one by one"
    for whl in "${wheels[@]}"; do
        target="$TMP/site/$(basename "$whl" .whl)"
        if "${pip[@]}" --target "$target" "$whl"; then
            ok=$((ok + 1))
            path="$path:$target"
        else
            failed+=("$(basename "$whl" | cut -d- -f1-2)")
        fi
    done
    export PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}"
    WHEELS_DETAIL="$ok of ${#wheels[@]} wheels installed${failed[*]:+, failed: ${failed[*]}}"
}

cuda_runtime_on_path() {  # nixl's and UCX's CUDA modules need libcudart.so.13; torch's wheels carry one
    ldconfig -p | grep -q 'libcudart.so.13' && return
    local dir
    dir=$("$PY" -c 'import nvidia, os; print(os.pathsep.join(nvidia.__path__))' 2>/dev/null | tr ':' '\n' |
          while read -r d; do find "$d" -name 'libcudart.so.13*' -printf '%h\n' 2>/dev/null; done | head -1)
    [ -n "$dir" ] && export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && echo "libcudart from $dir"
}

wait_for_redis() {  # url: true once it answers PING
    "$PY" - "$1" <<'PY'
import sys, time, redis
client = redis.Redis.from_url(sys.argv[1], socket_timeout=1)
for _ in range(100):
    try:
        sys.exit(0 if client.ping() else 1)
    except redis.ConnectionError:
        time.sleep(0.1)
sys.exit(1)
PY
}

start_redis() {
    local port
    port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    mkdir -p "$TMP/redis"
    local binary=$ROOT/$WHEELS/redis/redis-server
    if [ -x "$binary" ] && "$binary" --version; then
        "$binary" --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$TMP/redis" >"$TMP/redis/log" 2>&1 &
        REDIS_PID=$!
        if wait_for_redis "redis://127.0.0.1:$port"; then
            REDIS_URL="redis://127.0.0.1:$port"
            REDIS_REASON="redis-server $("$binary" --version | grep -o 'v=[0-9.]*')"
            export BATON_REDIS_SERVER=$binary PATH="$ROOT/$WHEELS/redis:$PATH"  # the tests' and `baton up`'s
            return
        fi
        cat "$TMP/redis/log"
        kill "$REDIS_PID" 2>/dev/null
    fi
    echo "Debian's redis-server does not run here; trying fakeredis"
    if ! "$PY" -c 'import fakeredis, lupa'; then
        REDIS_REASON="no Redis: redis-server did not load and fakeredis/lupa are not carried"
        return
    fi
    "$PY" -c 'import sys; from fakeredis import TcpFakeServer
TcpFakeServer(("127.0.0.1", int(sys.argv[1]))).serve_forever()' "$port" >"$TMP/redis/log" 2>&1 &
    REDIS_PID=$!
    if wait_for_redis "redis://127.0.0.1:$port" && "$PY" - "redis://127.0.0.1:$port" <<'PY'
import sys, redis  # what Baton's index and registry use: Lua scripts, streams, MULTI/EXEC, PEXPIRE
r = redis.Redis.from_url(sys.argv[1])
assert r.eval("return redis.call('EXISTS', KEYS[1])", 1, "k") == 0
r.xadd("s", {"a": 1}); assert r.xread({"s": "0"}, count=1, block=10)
with r.pipeline(transaction=True) as p:
    p.hset("h", mapping={"a": 1}).pexpire("h", 1000).execute()
PY
    then
        REDIS_URL="redis://127.0.0.1:$port"
        REDIS_REASON="fakeredis $("$PY" -c 'import fakeredis; print(fakeredis.__version__)') (Lua via lupa)"
    else
        REDIS_REASON="no Redis: redis-server did not load and fakeredis failed its smoke test (see setup.log)"
    fi
}

step_setup() {
    if [ ! -d "$WHEELS" ]; then
        DETAIL="$WHEELS missing: run scripts/gpu-prepare.sh on the CPU machine and carry [\"$WHEELS\"]"
        return
    fi
    cat "$WHEELS/MANIFEST.txt" 2>/dev/null
    install_wheels
    cuda_runtime_on_path
    local nvcc
    nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
    [ -n "$nvcc" ] && export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")}  # flashinfer's JIT
    start_redis
    bounded "$1" "$PY" -c '
import grpc, google.protobuf, redis, gguf, opentelemetry.sdk, grpc_health, grpc_reflection
import proto.baton_pb2_grpc  # checks the protobuf and grpcio versions its generated code needs
print(f"RESULT: PASS grpcio {grpc.__version__} protobuf {google.protobuf.__version__} redis-py {redis.__version__}")'
    local rc=$?
    from_result "$rc" "$1"
    DETAIL="$WHEELS_DETAIL; $DETAIL; redis: ${REDIS_URL:+$REDIS_URL, }$REDIS_REASON"
    [ -n "$REDIS_URL" ] || STATUS=FAIL
}

# ---- the checks -------------------------------------------------------------------------------------
step_parity_devices() {
    bounded "$1" "$PY" scripts/gpu_parity.py devices --work-dir "$TMP/parity"
    from_result $? "$1"
}

step_parity_backends() {
    bounded "$1" "$PY" scripts/gpu_parity.py backends --work-dir "$TMP/parity"
    from_result $? "$1"
}

step_up() {
    if [ -z "$REDIS_URL" ]; then
        STATUS=SKIP DETAIL="needs Redis: $REDIS_REASON"
        return
    fi
    local help
    if ! help=$("$PY" -m deploy.cli up --help 2>&1); then
        DETAIL="baton up --help failed: $(tail -1 <<<"$help")"
        return
    fi
    if ! grep -q -- '--device' <<<"$help"; then
        DETAIL="baton up has no way to pass --device to its workers"
        return
    fi
    bounded "$1" "$PY" scripts/gpu_parity.py serve --redis-url "$REDIS_URL" --pid-file "$TMP/up.pid" \
        --work-dir "$TMP/up" --ready-timeout-s $(($1 - 60))
    from_result $? "$1"
    [ -f "$TMP/up.pid" ] && kill -KILL -- "-$(cat "$TMP/up.pid")" 2>/dev/null && echo "killed what was left of baton up"
    rm -f "$TMP/up.pid"
}

step_kv_host() {
    bounded "$1" "$PY" -m bench.kv_transfer --isolate --tokens 1024 16384 --runs 5 --transports tcp cma nixl ucx \
        --peers nixl --out "$TMP/kv/kv_transfer.json"
    local rc=$?
    STATUS=FAIL
    [ $rc -eq 0 ] && STATUS=PASS
    DETAIL=$("$PY" - "$TMP/kv/kv_transfer.json" <<'PY' 2>&1 | tail -1
import json, sys
doc = json.load(open(sys.argv[1]))
last = doc["results"][-1]
rates = ", ".join(f"{name} {s['gbps']:.2f}" for name, s in last["systems"].items() if "/" not in name)
skipped = "; skipped " + ", ".join(f"{k}: {v}"[:80] for k, v in doc["skipped"].items()) if doc["skipped"] else ""
print(f"host memory, {last['tokens']} tokens ({last['num_bytes'] / 2**20:.0f} MiB), GB/s: {rates}{skipped}")
PY
)
    [ $rc -eq 0 ] || DETAIL="exit $rc; $DETAIL"
}

step_kv_device() {
    bounded "$1" "$PY" -m bench.kv_transfer --device cuda --tokens 1024 16384 --runs 3 --transports nixl ucx tcp \
        --peers --out "$TMP/kv/kv_device.json"
    local rc=$?
    STATUS=FAIL
    [ $rc -eq 0 ] && STATUS=PASS
    DETAIL=$("$PY" - "$TMP/kv/kv_device.json" <<'PY' 2>&1 | tail -1
import json, sys
doc = json.load(open(sys.argv[1]))
last = doc["results"][-1]
rates = ", ".join(f"{name} {s['gbps']:.2f}" for name, s in last["systems"].items()
                  if name.endswith("/contiguous") or name in ("raw", "memcpy"))
skipped = "; skipped " + ", ".join(f"{k}: {v}"[:80] for k, v in doc["skipped"].items()) if doc["skipped"] else ""
print(f"device memory, {last['tokens']} tokens ({last['num_bytes'] / 2**20:.0f} MiB), GB/s (memcpy = D2D): "
      f"{rates}{skipped}")
PY
)
    [ $rc -eq 0 ] || DETAIL="exit $rc; $DETAIL"
}

step_d2d_copy() {
    bounded "$1" "$PY" scripts/gpu_parity.py copy
    from_result $? "$1"
}

step_throughput() {
    bounded "$1" "$PY" -m bench.throughput --device cuda --compare-eager --requests 128 --concurrency 64 \
        --hf-batch 32 --threads 4
    local rc=$? line
    line=$(grep -E '^(baton|baton-eager|transformers) ' "$TMP/last.out" | awk '{ printf "%s%s %s tok/s", sep, $1, $5; sep = ", " }')
    if [ $rc -eq 0 ] && [ -n "$line" ]; then
        STATUS=PASS
        DETAIL="bf16 on the GPU, concurrency 64 (HF: static batches of 32): $line"
    else
        DETAIL="exit $rc: $(tail -1 "$TMP/last.out")"
    fi
}

step_gpu_tests() {
    local modules
    modules=$(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | sort | tr '\n' ' ')
    # shellcheck disable=SC2086 # the module list splits on purpose
    bounded "$1" "$PY" -m pytest -m gpu -p no:cacheprovider -q -rs $modules
    local rc=$? counts reasons
    counts=$(grep -E '[0-9]+ (passed|failed|skipped|deselected|error)' "$TMP/last.out" | tail -1 | tr -d '=' |
             sed 's/ in [0-9.]*s.*//; s/^ *//')
    reasons=$(sed -nE 's/^SKIPPED \[([0-9]+)\] [^:]+:[0-9]+: (.*)/\1\t\2/p' "$TMP/last.out" |
              awk -F'\t' '{ n[$2] += $1 } END { for (r in n) { printf "%s%s (%d)", sep, r, n[r]; sep = "; " } }')
    DETAIL="${counts:-no summary line}${reasons:+; skipped: $reasons}"
    case $rc in
        0) if grep -qE '[0-9]+ passed' <<<"$counts"; then STATUS=PASS; else STATUS=SKIP; fi ;;
        5) STATUS=SKIP ;;
        124 | 137) STATUS=FAIL DETAIL="timed out after $1 s (flashinfer JIT?); $DETAIL" ;;
        *) STATUS=FAIL ;;
    esac
}

dry_run_checks() {
    local missing=() f
    for f in scripts/gpu_parity.py bench/kv_transfer.py bench/throughput.py "$WHEELS" "$WHEELS/redis/redis-server"; do
        [ -e "$f" ] || missing+=("$f")
    done
    echo "python: $PY; budget $BUDGET_S s; logs in $LOG_DIR${OUT:+; JSON $OUT/gpu-check.json}"
    echo "wheels: $(compgen -G "$WHEELS/*/*.whl" | wc -l) in $WHEELS ($(du -sh "$WHEELS" 2>/dev/null | cut -f1))"
    cat "$WHEELS/MANIFEST.txt" 2>/dev/null
    echo "gpu test modules: $(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | sort | tr '\n' ' ')"
    [ ${#missing[@]} -eq 0 ] || echo "MISSING: ${missing[*]}"
    echo
}

main() {
    [ "$DRY_RUN" = 1 ] && dry_run_checks
    local fi_timeout=60
    [ -d "$WHEELS/flashinfer" ] && fi_timeout=300  # flashinfer JIT-compiles each kernel variant on first use
    run_step env env 30 step_env
    run_step setup setup 120 step_setup
    run_step parity-devices parity 180 step_parity_devices
    run_step up up 150 step_up
    run_step kv-device kv 120 step_kv_device
    skip_step kv-nccl "NCCL refuses two ranks on one device"
    run_step kv-host kv 180 step_kv_host
    run_step d2d-copy kv 60 step_d2d_copy
    run_step throughput throughput 150 step_throughput
    run_step gpu-tests gpu-tests $((fi_timeout + 60)) step_gpu_tests
    run_step parity-backends parity "$fi_timeout" step_parity_backends
    summary
}

main
