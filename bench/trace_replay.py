"""``python -m bench trace`` (``baton bench trace``): replay a Mooncake-format trace against a real Baton platform,
once per KV tier configuration, and report what the tiers reuse.

    python -m bench trace --trace conversation_trace.jsonl --limit 1000 --length-scale 32 --time-scale 0.25 \\
        [--model tiny] [--num-blocks 1024] [--host-blocks 4096] [--store-memory "1 GB"] \\
        [--configs none,host,host+store,oracle] [--passes N] [--client grpc|aiperf] [--out DIR]

The slice (``--start``, ``--limit``) is scaled to this machine with ``bench/trace.py``, the loader the simulator
uses: every length divided by ``--length-scale`` (32 makes one 512-token trace block one 16-token KV block; a
trace's partial last block stays partial, so it is never cached), arrival times multiplied by ``--time-scale``,
and each block's token ids generated from its hash id alone, so equal ids give equal tokens and a prefix cache
sees exactly the trace's sharing. A prompt longer than the model's context is cut at its end (its leading blocks,
what a cache can reuse, are kept); how many were cut is reported.

For each configuration a fresh platform is started with ``baton up`` (its own Redis, router, ``--prefill``
prefill and ``--decode`` decode workers; for ``host+store`` a Mooncake Store on loopback), the whole slice is
sent open-loop at its scaled arrival times, the workers' tier counters are read from their ``/metrics``, and the
platform is stopped (every process of it, by its process group):

- ``none``: each worker's KV pool only (``--num-blocks``, too small for the slice's working set);
- ``host``: the same pool plus a host-memory tier (``--kv-host-blocks``);
- ``host+store``: pool, host tier, and a shared Mooncake Store (``--kv-store``, ``--store-memory``);
- ``oracle``: a KV pool that holds the whole slice (its distinct blocks plus room for the longest requests in
  flight): the unbounded cache, measured on the same slice at the same load.

The cache hit rate is what the workers report, never what the trace predicts: per request, the prompt tokens
the worker that computed the prompt did not compute (``Usage.cached_prompt_tokens`` over gRPC; the OpenAI
front's ``usage.prompt_tokens_details.cached_tokens`` under aiperf), summed over the slice and divided by its
prompt tokens. It counts tokens served from any tier (the KV pool, the host tier, the store, another worker's
pool). The ceiling an unbounded cache can reach on the slice is computed beside it from the hash ids (leading
full blocks seen before, at most ``(prompt - 1) // block`` blocks, as the engine caps a hit). TTFT p50/p90 are
reported over every request and over the requests the trace lets reuse more than their first block (the same
ones in every configuration: the median request of a conversation trace reuses little, so its TTFT is the
machine's compute floor whatever the tiers do); throughput is completed requests and output tokens per second
from the first send to the last token (open loop: the offered load, unless the platform falls behind).
``--passes N`` runs the configurations N times, every other pass in reverse order; each run's row names the
machine's load average at its start and end.

Clients (``--client``): ``grpc`` (ours, the default) sends each prompt's exact token ids over Baton's gRPC
``Generate`` and reads each request's cached tokens and route from its final message; ``aiperf`` runs NVIDIA's
``aiperf profile --custom-dataset-type mooncake_trace`` against the OpenAI front on a trace file this module
writes already scaled (aiperf 0.13 has no length scale, and its ``--replay-speedup`` is for baseten traces only),
with the served model's tokenizer; aiperf sends text it generates per hash id, which the router tokenizes again,
so its prompts are close to, not exactly, the scaled lengths, and prompts past the context are refused (400)
rather than cut. What aiperf does not do, and this module does: exact token ids, a platform started per tier
configuration and an oracle pool sized from the slice, lengths scaled and over-long prompts cut, the workers' tier
counters, the ceiling from the hash ids. aiperf is not a dependency: ``make aiperf`` installs it into ``.venv-aiperf`` (it pulls ~1 GB,
and pins of its own that conflict with Baton's). ``--router`` replays once against a platform already running
instead (whatever its configuration; no tier counters).

Every request has a deadline (``--request-timeout-s``), every configuration a bound (``--max-run-s``: requests
still running then are cancelled and counted as failed), and every process started is stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.trace import Scale, TraceRequest, load_trace, prompt_token_ids

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("none", "host", "host+store", "oracle")
CLIENTS = ("grpc", "aiperf")
WARMUP_HASH_BASE = 1 << 40  # hash ids for warm-up prompts: far from any trace's ids, so they share nothing
_STORE_REASON = re.compile(r"fetched (\d+) prefix tokens from the store")


# ---- the slice, scaled (pure) -------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayRequest:
    index: int  # position in the trace file's slice
    arrival_s: float  # scaled offset from the first request's arrival
    prompt: list[int]
    max_tokens: int
    hash_ids: tuple[int, ...]
    cut: bool = False  # the scaled prompt was longer than the context allows and was cut at its end


def scaled_requests(trace: list[TraceRequest], scale: Scale, *, vocab_size: int,
                    max_model_len: int) -> list[ReplayRequest]:
    """The slice as this machine replays it: lengths divided, arrivals multiplied and made relative to the first
    request, token ids from the hash ids. A prompt that leaves no room for its output is cut at its end (to
    ``max_model_len - max_tokens`` tokens; the output too when it alone overflows): its leading blocks stay."""
    if not trace:
        return []
    t0 = scale.arrival_s(trace[0])
    out = []
    for i, request in enumerate(trace):
        max_tokens = min(scale.output_tokens(request), max_model_len // 2)
        prompt = prompt_token_ids(request, scale, vocab_size)
        room = max_model_len - max_tokens
        cut = len(prompt) > room
        out.append(ReplayRequest(index=i, arrival_s=scale.arrival_s(request) - t0, prompt=prompt[:room],
                                 max_tokens=max_tokens, hash_ids=request.hash_ids, cut=cut))
    return out


def reusable_blocks(requests: list[ReplayRequest], block_size: int, capacity: int | None = None) -> list[int]:
    """Per request, the leading full blocks a prefix cache over every earlier request can serve: unbounded
    (``capacity`` None: the ceiling) or an LRU of ``capacity`` blocks shared by all (one pool for everything).
    Requests are taken in arrival order, each cached entirely before the next arrives (no concurrency); a hit is
    capped at ``(prompt - 1) // block_size`` blocks, as the engine caps one. Needs one trace block per KV block."""
    from collections import OrderedDict

    seen: OrderedDict[tuple[int, ...], None] = OrderedDict()
    hits = []
    for r in requests:
        full = min(len(r.prompt) // block_size, len(r.hash_ids))
        chain = [r.hash_ids[:i + 1] for i in range(full)]
        limit = min(full, (len(r.prompt) - 1) // block_size)
        hit = next((i for i, key in enumerate(chain[:limit]) if key not in seen), limit)
        hits.append(hit)
        for key in chain:
            seen[key] = None
            seen.move_to_end(key)
        while capacity is not None and len(seen) > capacity:
            seen.popitem(last=False)
    return hits


def working_set_blocks(requests: list[ReplayRequest], block_size: int) -> int:
    """Distinct full blocks in the slice: the KV pool an unbounded cache needs (besides requests in flight)."""
    return len({r.hash_ids[:i + 1] for r in requests for i in range(min(len(r.prompt) // block_size,
                                                                       len(r.hash_ids)))})


def oracle_pool_blocks(requests: list[ReplayRequest], block_size: int, in_flight: int = 32) -> int:
    """A KV pool that never evicts on this slice: its working set plus ``in_flight`` of its longest requests."""
    longest = sorted((-(-(len(r.prompt) + r.max_tokens) // block_size) for r in requests), reverse=True)
    return working_set_blocks(requests, block_size) + sum(longest[:in_flight]) + 64


# ---- per-request results and the summary (pure) -------------------------------------------------
@dataclass(slots=True, kw_only=True)
class Outcome:
    index: int
    ok: bool
    prompt_tokens: int
    cached_tokens: int = 0  # as the worker that computed the prompt reported it
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    error: str = ""
    route_kind: str = ""
    prefill_worker: str = ""
    decode_worker: str = ""
    store_tokens: int = 0  # fetched from the store, when the route reason says so (D's local admissions)
    queue_ms: float = 0.0  # the router's timings: the engine queue before the prompt's first step
    prefill_ms: float = 0.0  # the prefilling worker's queue + compute (P's includes its store fetch, D's does not)
    transfer_ms: float = 0.0  # D's pull of the prompt's KV from P (remote prefills)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(outcomes: list[Outcome], duration_s: float, reusable: set[int] | None = None) -> dict:
    """Hit rate over the requests that completed (cached / prompt tokens, as the workers reported them), TTFT
    p50/p90 and throughput over the run (first send to last finish). ``reusable``: the indices of the requests
    the trace lets a cache serve more than their first block (the same requests in every configuration); their
    TTFT is reported apart, since the median request of a conversation trace reuses nothing past it."""
    done = [o for o in outcomes if o.ok]
    some = [o.ttft_s * 1e3 for o in done if reusable is not None and o.index in reusable]
    prompt = sum(o.prompt_tokens for o in done)
    cached = sum(o.cached_tokens for o in done)
    ttfts = [o.ttft_s * 1e3 for o in done]
    out_tokens = sum(o.output_tokens for o in done)
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            errors[o.error] = errors.get(o.error, 0) + 1
    return {
        "requests": len(outcomes), "completed": len(done), "errors": errors,
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else math.nan,
        "ttft_ms": {"p50": percentile(ttfts, 50), "p90": percentile(ttfts, 90), "mean": sum(ttfts) / len(ttfts)
                    if ttfts else math.nan},
        "ttft_reusable_ms": {"p50": percentile(some, 50), "p90": percentile(some, 90), "requests": len(some)},
        "duration_s": duration_s,
        "requests_per_s": len(done) / duration_s if duration_s > 0 else math.nan,
        "output_tokens_per_s": out_tokens / duration_s if duration_s > 0 else math.nan,
        "prompt_tokens_per_s": prompt / duration_s if duration_s > 0 else math.nan,
        "routes": _count(o.route_kind for o in done if o.route_kind),
    }


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def store_tokens_of(reason: str) -> int:
    match = _STORE_REASON.search(reason)
    return int(match.group(1)) if match else 0


# ---- worker counters (from /metrics) ------------------------------------------------------------
TIER_COUNTERS = ("baton:prefix_cache_queries_total", "baton:prefix_cache_hits_total",
                 "baton:kv_host_tier_saved_total", "baton:kv_host_tier_loaded_total",
                 "baton:kv_store_blocks_written_total", "baton:kv_store_blocks_fetched_total",
                 "baton:kv_store_writes_dropped_total", "baton:kv_store_fetch_failures_total",
                 "baton:num_preemptions_total")


def parse_counters(text: str) -> dict[str, float]:
    """The tier counters of one worker's Prometheus text (labels summed away)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in TIER_COUNTERS:
            out[name.removeprefix("baton:").removesuffix("_total")] = (
                out.get(name.removeprefix("baton:").removesuffix("_total"), 0.0) + float(line.rsplit(" ", 1)[1]))
    return out


def scrape(port: int, timeout_s: float = 5.0) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as resp:
            return parse_counters(resp.read().decode())
    except OSError as exc:
        return {"error": str(exc)}  # type: ignore[dict-item]


# ---- the platform (baton up, one per configuration) ---------------------------------------------
def config_flags(config: str, *, num_blocks: int, host_blocks: int, store_memory: str, oracle_blocks: int,
                 store_buffer_blocks: int) -> list[str]:
    if config == "none":
        return ["--num-blocks", str(num_blocks)]
    if config == "host":
        return ["--num-blocks", str(num_blocks), "--kv-host-blocks", str(host_blocks)]
    if config == "host+store":
        return ["--num-blocks", str(num_blocks), "--kv-host-blocks", str(host_blocks), "--kv-store",
                "--kv-store-memory", store_memory, "--kv-store-buffer-blocks", str(store_buffer_blocks)]
    if config == "oracle":
        return ["--num-blocks", str(oracle_blocks)]
    raise ValueError(f"unknown configuration {config!r}; choose from {CONFIGS}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Up:
    """One ``baton up`` in a process group of its own; ``stop`` ends the whole group."""

    popen: subprocess.Popen
    log_dir: Path
    grpc_port: int
    http_port: int
    metrics_port: int
    worker_ids: list[str]
    store: bool
    stdout: Path = field(default_factory=Path)

    @classmethod
    def start(cls, model: str, flags: list[str], log_dir: Path, *, prefill: int, decode: int,
              ready_timeout_s: float = 240.0) -> Up:
        log_dir.mkdir(parents=True, exist_ok=True)
        ports = [free_port() for _ in range(2)]
        metrics = _free_port_run(1 + prefill + decode)
        cmd = [sys.executable, "-m", "deploy.cli", "up", "--model", model, "--prefill", str(prefill),
               "--decode", str(decode), "--port", str(ports[0]), "--http-port", str(ports[1]),
               "--metrics-port", str(metrics), "--log-dir", str(log_dir), *flags]
        stdout = log_dir / "up.out"
        with stdout.open("wb") as out:
            popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        up = cls(popen, log_dir, ports[0], ports[1], metrics,
                 [f"prefill-{i}" for i in range(prefill)] + [f"decode-{i}" for i in range(decode)],
                 "--kv-store" in flags, stdout)
        try:
            up._wait_ready(time.monotonic() + ready_timeout_s)
        except BaseException:
            up.stop()
            raise
        return up

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def worker_metrics_ports(self) -> dict[str, int]:
        return {wid: self.metrics_port + 1 + i for i, wid in enumerate(self.worker_ids)}

    def _wait_ready(self, deadline: float) -> None:
        """Every worker registered (its log says so) and, with a store, connected to it; the router answers."""
        import grpc

        def logs_say(what: str) -> bool:
            return all(what in _read(self.log_dir / f"{wid}.log") for wid in self.worker_ids)

        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"baton up exited with {self.popen.returncode}:\n{_read(self.stdout)[-2000:]}")
            ready = (logs_say("registered worker_id=")
                     and (not self.store or logs_say("store tier: connected")))
            if ready:
                try:
                    with grpc.insecure_channel(self.grpc_address) as channel:
                        grpc.channel_ready_future(channel).result(timeout=1.0)
                    return
                except grpc.FutureTimeoutError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the platform was not ready in time (logs: {self.log_dir})")
            time.sleep(0.5)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to ``baton up`` (it stops its router, workers, Redis and store), then, past ``grace_s``,
        SIGKILL to its process group (every process it started, and nothing else)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # leftovers of this group only (start_new_session)
        except ProcessLookupError:
            pass
        self.popen.wait(10)


def _free_port_run(n: int, tries: int = 50) -> int:
    """A first port P with P..P+n-1 all free (``baton up`` gives workers the metrics ports after the router's)."""
    import socket

    for _ in range(tries):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


# ---- the gRPC client ----------------------------------------------------------------------------
async def replay_grpc(address: str, requests: list[ReplayRequest], *, vocab_size: int, request_timeout_s: float,
                      max_run_s: float, warmup: int = 2, label: str = "") -> tuple[list[Outcome], float]:
    """Send every request at its arrival offset (open loop), exact token ids; per request what the router
    reported. Requests still running ``max_run_s`` after the start are cancelled (failed, ``run bound``)."""
    import grpc

    from bench.client import greedy_request, stream_generate
    from bench.trace import block_token_ids
    from proto import baton_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for i in range(warmup):  # outside the clock: prompts that share nothing with the trace
            prompt = block_token_ids(WARMUP_HASH_BASE + i, 48, vocab_size).tolist()
            await stream_generate(stub, greedy_request(prompt, 2), request_timeout_s)

        async def one(r: ReplayRequest, start: float) -> tuple[Outcome, float]:
            await asyncio.sleep(max(0.0, start + r.arrival_s - time.perf_counter()))
            try:
                stream = await stream_generate(stub, greedy_request(r.prompt, r.max_tokens), request_timeout_s)
            except grpc.aio.AioRpcError as exc:
                return Outcome(index=r.index, ok=False, prompt_tokens=len(r.prompt), error=exc.code().name), 0.0
            last, times = stream.last, stream.token_times_s
            if not times:
                return Outcome(index=r.index, ok=False, prompt_tokens=len(r.prompt), error="no tokens"), 0.0
            t = last.timings
            return Outcome(index=r.index, ok=True, prompt_tokens=last.usage.prompt_tokens or len(r.prompt),
                           cached_tokens=last.usage.cached_prompt_tokens, output_tokens=len(times),
                           ttft_s=times[0] - stream.sent_s, e2e_s=times[-1] - stream.sent_s,
                           route_kind=t.route_kind, prefill_worker=t.prefill_worker, decode_worker=t.decode_worker,
                           store_tokens=store_tokens_of(t.route_reason), queue_ms=t.queue_ms,
                           prefill_ms=t.prefill_ms, transfer_ms=t.transfer_ms), times[-1]

        start = time.perf_counter()
        tasks = [asyncio.ensure_future(one(r, start)) for r in requests]
        progress = _Progress(label, len(tasks))
        for task in tasks:
            task.add_done_callback(progress.update)
        done, pending = await asyncio.wait(tasks, timeout=max_run_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        outcomes, end = [], start
        for r, task in zip(requests, tasks):
            if task in done and not task.cancelled() and task.exception() is None:
                outcome, finished = task.result()
                end = max(end, finished)
            else:
                outcome = Outcome(index=r.index, ok=False, prompt_tokens=len(r.prompt), error="run bound")
                end = start + max_run_s
            outcomes.append(outcome)
        return outcomes, end - start


class _Progress:
    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.start = label, total, 0, time.perf_counter()
        self.every = max(1, total // 10)

    def update(self, _task) -> None:
        self.done += 1
        if self.done % self.every == 0 or self.done == self.total:
            print(f"[{self.label}] {self.done}/{self.total} done, {time.perf_counter() - self.start:.0f} s",
                  file=sys.stderr, flush=True)


# ---- the aiperf client --------------------------------------------------------------------------
def scaled_trace_lines(requests: list[ReplayRequest], scale: Scale) -> list[str]:
    """The scaled slice as a Mooncake-format trace for aiperf (one hash id per ``scale.block_tokens`` tokens, so
    ``--prompt-input-tokens-block-size`` is ``scale.block_tokens``): lengths as our replay sends them (cut ones
    included), timestamps in ms from the first request. aiperf refuses a hash id met at two sizes (a partial last
    block here, full or of another length there; scaling makes more of them), so each (id, size) of a partial last
    block gets an id of its own past the trace's: no reuse is lost, since only full blocks are ever cached."""
    top = max((i for r in requests for i in r.hash_ids), default=0)
    partial_ids: dict[tuple[int, int], int] = {}
    lines = []
    for r in requests:
        blocks = -(-len(r.prompt) // scale.block_tokens)
        ids = list(r.hash_ids[:blocks])
        tail = len(r.prompt) % scale.block_tokens
        if tail and ids:
            ids[-1] = partial_ids.setdefault((ids[-1], tail), top + 1 + len(partial_ids))
        lines.append(json.dumps({"timestamp": round(r.arrival_s * 1e3), "input_length": len(r.prompt),
                                 "output_length": r.max_tokens, "hash_ids": ids}))
    return lines


def hf_cache_for(model_dir: Path, cache: Path, repo: str = "baton/model") -> str:
    """A private Hugging Face cache holding ``model_dir``'s tokenizer as repo ``repo``: aiperf 0.13 loads a
    tokenizer from a local folder only online, and its decoding worker processes force offline mode, where it
    looks a name up in the cache. Nothing is downloaded."""
    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"--client aiperf needs a Hugging Face folder with tokenizer.json, not {model_dir}")
    snapshot = cache / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        if (model_dir / name).exists():
            shutil.copyfile(model_dir / name, snapshot / name)
    (snapshot.parents[1] / "refs").mkdir(exist_ok=True)
    (snapshot.parents[1] / "refs" / "main").write_text("local")
    return repo


def aiperf_binary(given: str | None) -> str:
    for candidate in (given, str(ROOT / ".venv-aiperf" / "bin" / "aiperf"), shutil.which("aiperf")):
        if candidate and Path(candidate).exists():
            return candidate
    raise FileNotFoundError("aiperf is not installed: `make aiperf` installs it into .venv-aiperf "
                            "(or give --aiperf PATH)")


def aiperf_outcomes(records: list[dict]) -> tuple[list[Outcome], float]:
    """Outcomes from aiperf's ``profile_export.jsonl`` records (profiling phase): TTFT, server-reported usage
    (prompt and cached tokens), errors; the duration from the first request's start to the last one's end."""
    outcomes, starts, ends = [], [], []
    for i, rec in enumerate(records):
        meta, metrics = rec.get("metadata", {}), rec.get("metrics", {})
        if meta.get("benchmark_phase", "profiling") != "profiling":
            continue

        def value(name: str, default=0):
            return (metrics.get(name) or {}).get("value", default)

        i = meta.get("session_num", i)  # the line of the scaled trace (aiperf's session per request)
        starts.append(meta.get("request_start_ns", 0))
        ends.append(meta.get("request_end_ns", 0))
        error = rec.get("error")
        if error or "time_to_first_token" not in metrics:
            code = (error or {}).get("code", "") if isinstance(error, dict) else ""
            prompt = value("error_isl") or value("input_sequence_length")  # what aiperf meant to send
            outcomes.append(Outcome(index=i, ok=False, prompt_tokens=int(prompt),
                                    error=f"HTTP {code}" if code else "error"))
            continue
        outcomes.append(Outcome(index=i, ok=True, prompt_tokens=int(value("usage_prompt_tokens")),
                                cached_tokens=int(value("usage_prompt_cache_read_tokens")),
                                output_tokens=int(value("usage_completion_tokens") or value("output_token_count")),
                                ttft_s=value("time_to_first_token") / 1e3, e2e_s=value("request_latency") / 1e3))
    duration = (max(ends) - min(starts)) / 1e9 if starts and ends else 0.0
    return outcomes, duration


def replay_aiperf(binary: str, http_port: int, model_name: str, model_dir: Path, requests: list[ReplayRequest],
                  scale: Scale, work: Path, *, request_timeout_s: float,
                  max_run_s: float) -> tuple[list[Outcome], float]:
    work.mkdir(parents=True, exist_ok=True)
    trace_file = work / "scaled_trace.jsonl"
    trace_file.write_text("\n".join(scaled_trace_lines(requests, scale)) + "\n")
    cache = work / "hf"
    repo = hf_cache_for(model_dir, cache)
    out = work / "aiperf"
    cmd = [binary, "profile", "--model", model_name, "--tokenizer", repo, "--url", f"http://127.0.0.1:{http_port}",
           "--endpoint-type", "completions", "--streaming", "--custom-dataset-type", "mooncake_trace",
           "--input-file", str(trace_file), "--prompt-input-tokens-block-size", str(scale.block_tokens),
           "--fixed-schedule", "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
           "--request-timeout-seconds", str(request_timeout_s), "--output-artifact-dir", str(out),
           "--random-seed", "0"]
    env = dict(os.environ, HF_HOME=str(cache), HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)  # aiperf runs in its own environment
    with (work / "aiperf.log").open("wb") as log:
        try:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=max_run_s + 120,
                           start_new_session=True, check=False)
        except subprocess.TimeoutExpired:
            print(f"aiperf ran past {max_run_s + 120:.0f} s; stopped", file=sys.stderr)
    export = out / "profile_export.jsonl"
    if not export.exists():
        raise RuntimeError(f"aiperf wrote no records (log: {work / 'aiperf.log'})")
    records = [json.loads(line) for line in export.read_text().splitlines() if line.strip()]
    return aiperf_outcomes(records)


# ---- one run of every configuration -------------------------------------------------------------
def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="baton bench trace", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    p.add_argument("--start", type=int, default=0, help="skip the trace's first N requests")
    p.add_argument("--limit", type=int, default=300, help="replay N requests (default: %(default)s)")
    p.add_argument("--length-scale", type=int, default=32, help="divide lengths (default: %(default)s: a trace "
                   "block is one 16-token KV block)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (< 1: faster)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV pool blocks per worker (not the oracle's)")
    p.add_argument("--host-blocks", type=int, default=4096, help="host-tier blocks per worker")
    p.add_argument("--store-memory", default="1 GB", help="the store's memory (Mooncake's spelling)")
    p.add_argument("--store-buffer-blocks", type=int, default=256, help="--kv-store-buffer-blocks per worker")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS))
    p.add_argument("--passes", type=int, default=1, help="run the configurations this many times, every other pass "
                   "in reverse order (ABBA: a machine whose load drifts favours no configuration)")
    p.add_argument("--client", choices=CLIENTS, default="grpc")
    p.add_argument("--aiperf", default=None, help="the aiperf binary (default: .venv-aiperf/bin/aiperf, PATH)")
    p.add_argument("--router", default=None, help="replay once against this running router's gRPC address "
                   "(with --client aiperf: its OpenAI HTTP port's address) instead of starting platforms")
    p.add_argument("--extra", default="", help="more `baton up` flags for every configuration (one string)")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--max-run-s", type=float, default=900.0, help="bound on one configuration's replay")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "trace")
    return p.parse_args(argv)


def _model(model: str) -> tuple[Path, str]:
    from engine.model_source import resolve_model

    source = resolve_model(model)
    return Path(source.path), source.name


def _model_info(model_dir: Path, extra: list[str]) -> tuple[int, int, int]:
    """(vocab size, context, KV block size) as the platform will serve them: the checkpoint's (a folder's
    config.json or a GGUF file's metadata; no torch), ``--max-model-len`` and ``--block-size`` when ``--extra``
    sets them."""
    from router.config import ModelCard

    card = ModelCard.from_path(model_dir)

    def flag(name: str, default: int) -> int:
        return int(extra[extra.index(name) + 1]) if name in extra[:-1] else default

    context = min(card.max_position_embeddings, flag("--max-model-len", card.max_position_embeddings))
    return card.vocab_size, context, flag("--block-size", 16)


def run(args: argparse.Namespace) -> dict:
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"unknown configuration {c!r}; choose from {', '.join(CONFIGS)}")
    trace = load_trace(args.trace, limit=args.start + args.limit)[args.start:]
    scale = Scale(length_scale=args.length_scale, time_scale=args.time_scale)
    model_dir, model_name = _model(args.model)
    vocab_size, max_model_len, block_size = _model_info(model_dir, args.extra.split())
    requests = scaled_requests(trace, scale, vocab_size=vocab_size, max_model_len=max_model_len)
    ceiling = reusable_blocks(requests, block_size) if scale.block_tokens == block_size else []
    prompt_tokens = sum(len(r.prompt) for r in requests)
    slice_info = {
        "trace": str(args.trace), "start": args.start, "requests": len(requests),
        "length_scale": args.length_scale, "time_scale": args.time_scale,
        "span_s": requests[-1].arrival_s if requests else 0.0, "prompt_tokens": prompt_tokens,
        "output_tokens": sum(r.max_tokens for r in requests), "cut": sum(r.cut for r in requests),
        "working_set_blocks": working_set_blocks(requests, block_size),
        "ceiling_hit_rate": sum(ceiling) * block_size / prompt_tokens if ceiling else None,
        "lru_hit_rate_at_pool": (sum(reusable_blocks(requests, block_size, args.num_blocks)) * block_size
                                 / prompt_tokens) if ceiling else None,
    }
    reusable = {r.index for r, hit in zip(requests, ceiling) if hit > 1}
    slice_info["reusable_requests"] = len(reusable)
    oracle_blocks = oracle_pool_blocks(requests, block_size)
    print(f"slice: {len(requests)} requests over {slice_info['span_s']:.0f} s, {prompt_tokens} prompt tokens, "
          f"working set {slice_info['working_set_blocks']} blocks, ceiling hit rate "
          f"{slice_info['ceiling_hit_rate']}, {slice_info['cut']} prompts cut to the context", flush=True)
    report = {"command": "python -m bench trace " + " ".join(sys.argv[1:] if args._argv is None else args._argv),
              "model": model_name, "client": args.client, "slice": slice_info, "oracle_blocks": oracle_blocks,
              "num_blocks": args.num_blocks, "host_blocks": args.host_blocks, "store_memory": args.store_memory,
              "layout": {"prefill": args.prefill, "decode": args.decode}, "runs": []}
    args.out.mkdir(parents=True, exist_ok=True)
    order = [(k, c) for k in range(args.passes) for c in (configs if k % 2 == 0 else configs[::-1])]
    for pass_, config in order if args.router is None else [(0, "running")]:
        load_before = _loadavg()
        up = None
        try:
            if args.router is None:
                flags = config_flags(config, num_blocks=args.num_blocks, host_blocks=args.host_blocks,
                                     store_memory=args.store_memory, oracle_blocks=oracle_blocks,
                                     store_buffer_blocks=args.store_buffer_blocks) + args.extra.split()
                log_dir = Path(tempfile.mkdtemp(prefix=f"bench-trace-{config.replace('+', '-')}-"))
                print(f"[{config}] baton up {' '.join(flags)} (logs: {log_dir})", flush=True)
                up = Up.start(args.model, flags, log_dir, prefill=args.prefill, decode=args.decode)
                address, http_port = up.grpc_address, up.http_port
            else:
                address, http_port = args.router, int(args.router.rsplit(":", 1)[1])
            if args.client == "grpc":
                outcomes, duration = asyncio.run(replay_grpc(
                    address, requests, vocab_size=vocab_size, request_timeout_s=args.request_timeout_s,
                    max_run_s=args.max_run_s, label=config))
            else:
                outcomes, duration = replay_aiperf(
                    aiperf_binary(args.aiperf), http_port, model_name, model_dir, requests, scale,
                    args.out / f"aiperf-{config.replace('+', '-')}", request_timeout_s=args.request_timeout_s,
                    max_run_s=args.max_run_s)
            if up is not None:
                time.sleep(1.0)  # the workers refresh their counters every 0.25 s; writes still queued land
            counters = {wid: scrape(port) for wid, port in up.worker_metrics_ports().items()} if up else {}
        finally:
            if up is not None:
                up.stop()
        summary = summarize(outcomes, duration, reusable)
        summary.update(config=config, passes=args.passes, pass_=pass_ + 1, counters=counters,
                       loadavg_before=load_before, loadavg_after=_loadavg(),
                       store_tokens_local=sum(o.store_tokens for o in outcomes))
        report["runs"].append(summary)
        suffix = f"-{pass_ + 1}" if args.passes > 1 else ""
        (args.out / f"outcomes-{args.client}-{config.replace('+', '-')}{suffix}.jsonl").write_text(
            "\n".join(json.dumps(asdict(o)) for o in outcomes) + "\n")
        print(line_of(summary, block_size), flush=True)
    return report


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return ""


def line_of(run_: dict, block_size: int = 16) -> str:
    c = run_.get("counters", {})
    host = sum(w.get("kv_host_tier_loaded", 0) for w in c.values() if isinstance(w, dict)) * block_size
    store = sum(w.get("kv_store_blocks_fetched", 0) for w in c.values() if isinstance(w, dict)) * block_size
    return (f"[{label(run_)}] {run_['completed']}/{run_['requests']} ok, hit rate {run_['hit_rate']:.3f} "
            f"({run_['cached_tokens']}/{run_['prompt_tokens']} prompt tokens; host loads {host:.0f}, store fetches "
            f"{store:.0f} tokens), TTFT p50 {run_['ttft_ms']['p50']:.1f} ms p90 {run_['ttft_ms']['p90']:.1f} ms, "
            f"{run_['requests_per_s']:.2f} req/s, {run_['output_tokens_per_s']:.1f} out tok/s over "
            f"{run_['duration_s']:.0f} s; load {run_['loadavg_before']} -> {run_['loadavg_after']}"
            + (f"; errors {run_['errors']}" if run_["errors"] else ""))


def label(run_: dict) -> str:
    return f"{run_['config']} #{run_['pass_']}" if run_.get("passes", 1) > 1 else run_["config"]


def table(report: dict) -> str:
    """The runs as a markdown table, the oracle's hit rate and TTFT as the reference."""
    runs = {(r["config"], r.get("pass_", 1)): r for r in report["runs"]}
    rows = ["| configuration | hit rate | vs (a) | vs oracle | TTFT p50 ms | p90 ms | p50 vs oracle | reusable p50 ms "
            "| vs oracle | req/s | out tok/s | failed | load avg |", "|---" * 13 + "|"]
    def reuse(r):
        return r.get("ttft_reusable_ms", {}).get("p50", math.nan)

    for r in report["runs"]:
        def ratio(a, b):
            return f"{a / b:.2f}x" if b and not math.isnan(b) and not math.isnan(a) else "-"
        base, oracle = runs.get(("none", r.get("pass_", 1))), runs.get(("oracle", r.get("pass_", 1)))
        rows.append(
            f"| {label(r)} | {r['hit_rate']:.1%} | {ratio(r['hit_rate'], base['hit_rate']) if base else '-'} | "
            f"{ratio(r['hit_rate'], oracle['hit_rate']) if oracle else '-'} | {r['ttft_ms']['p50']:.1f} | "
            f"{r['ttft_ms']['p90']:.1f} | {ratio(r['ttft_ms']['p50'], oracle['ttft_ms']['p50']) if oracle else '-'} | "
            f"{reuse(r):.1f} | {ratio(reuse(r), reuse(oracle)) if oracle else '-'} | "
            f"{r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | {r['requests'] - r['completed']} | "
            f"{r['loadavg_before']} -> {r['loadavg_after']} |")
    return "\n".join(rows)


def plot(report: dict, path: Path) -> Path | None:
    """Hit rate (with the trace's ceiling), TTFT p50/p90 (with the load average at each run's start and end: this
    machine is shared) and output throughput, one bar per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = report["runs"]
    names = [label(r) for r in runs]
    x = list(range(len(runs)))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(max(15, 2.2 * len(runs)), 4.5))
    a.bar(x, [r["hit_rate"] * 100 for r in runs], color="tab:blue")
    ceiling = report["slice"].get("ceiling_hit_rate")
    if ceiling:
        a.axhline(ceiling * 100, color="k", ls="--", lw=1, label="unbounded-cache ceiling (from the trace)")
        a.legend(loc="upper left", fontsize=8)
    a.set(ylabel="prompt tokens served from cache (%)", title="cache hit rate (as the workers report it)")
    b.bar([i - 0.2 for i in x], [r["ttft_ms"]["p50"] for r in runs], 0.4, label="p50")
    b.bar([i + 0.2 for i in x], [r["ttft_ms"]["p90"] for r in runs], 0.4, label="p90")
    for i, r in enumerate(runs):
        loads = f"{r['loadavg_before'].split()[0]}-{r['loadavg_after'].split()[0]}"
        b.annotate(f"load\n{loads}", (i, r["ttft_ms"]["p90"]), ha="center", va="bottom", fontsize=7)
    b.set(ylabel="TTFT (ms)", title="TTFT (1-min load average of the machine, start-end)")
    b.set_ylim(0, 1.25 * max(r["ttft_ms"]["p90"] for r in runs))
    b.legend(loc="upper left", fontsize=8)
    c.bar(x, [r["output_tokens_per_s"] for r in runs], color="tab:green")
    c.set(ylabel="output tokens/s", title="throughput (open loop: the offered load unless saturated)")
    s = report["slice"]
    fig.suptitle(f"{s['requests']} requests of {Path(s['trace']).name} from #{s['start']}, lengths / "
                 f"{s['length_scale']}, time x {s['time_scale']}; model {report['model']}, KV pool "
                 f"{report['num_blocks']} blocks/worker, host tier {report['host_blocks']}; client "
                 f"{report.get('client', 'grpc')}", fontsize=9)
    for ax in (a, b, c):
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    args._argv = argv
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"trace-{args.client}.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    png = plot(report, args.out / f"trace-{args.client}.png")
    print(f"wrote {args.out / f'trace-{args.client}.json'}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
