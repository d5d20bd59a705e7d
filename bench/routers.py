"""Several routers in front of the same workers: a burst split across them, with their books shared or not.

    python -m bench.routers [--routers 3] [--decode 3] [--prefill 0] [--busy 0] [--requests 24]
                            [--gap-ms 40] [--prompt-tokens 400] [--max-tokens 64] [--policy cost]
                            [--repeats 3] [--model tiny|small|PATH] [--threads 1]

Starts a private redis-server; for each mode (``shared``: the routers' default, each prices the others' books;
``alone``: ``--no-shared-books``) and repeat, a fresh namespace with ``--decode`` decode (and ``--prefill``
prefill) workers and ``--routers`` routers, so no run inherits another's caches or learned rates. Before the burst,
another client's ``--busy`` long streams run on every decode worker but the first, sent straight to the workers
(the heartbeats then show one idle worker: where a burst herds); ``--busy 0`` leaves every worker idle. The burst:
``--requests`` prompts of ``--prompt-tokens`` fresh random tokens (no shared prefix), greedy, ``--max-tokens``
each, one every ``--gap-ms``, round-robin across the routers. Reports per mode: where the burst was decoded (per
worker, and the largest share), the peak of prompts waiting for their first token on one worker at once (per run,
averaged), TTFT p50/p90 and E2E p50 as the client measured them, pooled over the repeats (modes alternate which
goes first). Writes bench/results/routers.json (``--out``).

With every worker idle, each router alone sends the worker its cost model prices cheapest the first few of its
share, as every other router does at the same moment: the burst piles onto one or two workers while each router's
own spread looks even. With ``--busy``, the one idle worker is where the routers alone pile it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench.client import greedy_request, stream_generate
from bench.routing import wait_for_workers
from workload.stats import percentile
from deploy.up import Child, spawn, start_redis, stop_all
from kv_transfer.ports import free_port
from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc
from router.routing.policy import POLICIES

RESULTS = Path(__file__).parent / "results"
MODES = ("shared", "alone")
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Sent:
    router: int
    decode_worker: str
    route_kind: str
    ttft_s: float
    e2e_s: float
    sent_at_s: float  # from the burst's start


@dataclass(slots=True)
class Platform:
    routers: list[str]  # addresses
    decode: list[str]  # decode workers' addresses, d0 first
    children: list[Child]


def start_platform(args: argparse.Namespace, model: str, redis_url: str, mode: str, tag: str,
                   log_dir: Path) -> Platform:
    """Workers and routers in namespace ``bench-{tag}``; ``mode`` 'alone' starts the routers with
    ``--no-shared-books``."""
    children: list[Child] = []
    common = ["--redis-url", redis_url, "--model", model, "--namespace", f"bench-{tag}"]
    decode = []
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        for i in range(count):
            port, worker_id = free_port(), f"{role[0]}{i}"
            spawn(f"{tag}-{worker_id}", [role, *common, "--port", str(port), "--worker-id", worker_id,
                                         "--num-threads", str(args.threads), "--block-size", str(BLOCK_SIZE),
                                         "--num-blocks", str(args.num_blocks)], log_dir, children)
            if role == "decode":
                decode.append(f"127.0.0.1:{port}")
    routers = []
    sharing = [] if mode == "shared" else ["--no-shared-books"]
    for i in range(args.routers):
        port = free_port()
        spawn(f"{tag}-router{i}", ["router", *common, "--port", str(port), "--policy", args.policy,
                                   "--http-port", "0", "--metrics-port", "0", *sharing], log_dir, children)
        routers.append(f"127.0.0.1:{port}")
    platform = Platform(routers, decode, children)
    try:
        asyncio.run(wait_for_workers(redis_url, f"bench-{tag}", args.prefill + args.decode, children))
        for address in routers:
            grpc.channel_ready_future(grpc.insecure_channel(address)).result(timeout=60)
    except BaseException:
        stop_all(children)
        raise
    return platform


def keep_busy(platform: Platform, streams: int, redis_url: str, ns: str) -> list:
    """``streams`` long decodes on every decode worker but the first, straight to the workers, then wait until
    their heartbeats report them and the routers' listings caught up."""
    from kv_transfer.registry import Registry, connect

    params = pb.SamplingParams(temperature=0.0, max_tokens=1800, ignore_eos=True)
    calls = []
    for n, address in enumerate(platform.decode[1:]):
        stub = pb_grpc.WorkerStub(grpc.insecure_channel(address))
        calls += [stub.Decode(pb.DecodeRequest(request_id=f"busy-{n}-{i}", token_ids=[40 + i, 41, 42, 43],
                                               prompt_len=4, sampling=params), timeout=120) for i in range(streams)]

    async def reported() -> list[int]:
        redis = connect(redis_url)
        try:
            return [load.running + load.waiting if load else 0
                    for info, load in await Registry(redis, ns).list_workers() if info.role == "decode"]
        finally:
            await redis.aclose()

    deadline = time.monotonic() + 30
    while streams and sorted(asyncio.run(reported())) != [0] + [streams] * (len(platform.decode) - 1):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the busy streams never showed in the heartbeats: {asyncio.run(reported())}")
        time.sleep(0.1)
    time.sleep(0.6)  # the routers' listings (0.5 s)
    return calls


async def send_burst(platform: Platform, prompts: list[list[int]], gap_s: float, max_tokens: int) -> list[Sent]:
    channels = [grpc.aio.insecure_channel(a) for a in platform.routers]
    stubs = [pb_grpc.GenerationStub(c) for c in channels]
    start_s = time.perf_counter()

    async def one(i: int) -> Sent:
        await asyncio.sleep(max(0.0, start_s + i * gap_s - time.perf_counter()))
        router = i % len(stubs)
        stream = await stream_generate(stubs[router], greedy_request(prompts[i], max_tokens), timeout_s=300)
        t = stream.last.timings
        return Sent(router, t.decode_worker, t.route_kind, stream.token_times_s[0] - stream.sent_s,
                    stream.token_times_s[-1] - stream.sent_s, stream.sent_s - start_s)

    try:
        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
    finally:
        await asyncio.gather(*(c.close() for c in channels))


def run_one(args: argparse.Namespace, model: str, redis_url: str, mode: str, repeat: int, log_dir: Path) -> list[Sent]:
    tag = f"{mode}-{repeat}"
    rng = random.Random(args.seed + repeat)  # the same prompts for both modes of a repeat
    prompts = [[rng.randrange(20, 4000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    started = time.monotonic()
    platform = start_platform(args, model, redis_url, mode, tag, log_dir)
    calls: list = []
    try:
        print(f"[{tag}] platform up in {time.monotonic() - started:.1f} s", flush=True)
        calls = keep_busy(platform, args.busy, redis_url, f"bench-{tag}")
        sent = asyncio.run(send_burst(platform, prompts, args.gap_ms / 1e3, args.max_tokens))
        s = summarize(sent)
        print(f"[{tag}] per worker {s['per_worker']}, peak {s['peak_prefills_mean']:.0f} prefills on one worker, "
              f"ttft p50 {s['ttft_p50_ms']:.1f} p90 {s['ttft_p90_ms']:.1f} ms", flush=True)
        return sent
    finally:
        for call in calls:
            call.cancel()
        stop_all(platform.children)


def peak_prefills(sent: list[Sent]) -> int:
    """The most prompts of one run waiting for their first token on one worker at once (a herd, even where the
    burst's totals come out even: three routers sending one worker their next request at the same moment)."""
    peak = 0
    for worker in {s.decode_worker for s in sent}:
        edges = sorted(e for s in sent if s.decode_worker == worker
                       for e in ((s.sent_at_s, 1), (s.sent_at_s + s.ttft_s, -1)))
        depth = 0
        for _, step in edges:
            depth += step
            peak = max(peak, depth)
    return peak


def summarize(sent: list[Sent], runs: list[list[Sent]] | None = None) -> dict:
    """``runs``: the runs ``sent`` pools (a peak is a run's)."""
    ttft, e2e = [s.ttft_s for s in sent], [s.e2e_s for s in sent]
    per_worker = dict(sorted(Counter(s.decode_worker for s in sent).items()))
    peaks = [peak_prefills(run) for run in (runs or [sent])]
    return {
        "requests": len(sent), "per_worker": per_worker, "peak_prefills_mean": sum(peaks) / len(peaks),
        "max_share": max(per_worker.values()) / len(sent) if sent else 0.0,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p90_ms": percentile(ttft, 90) * 1e3,
        "e2e_p50_ms": percentile(e2e, 50) * 1e3, "routes": dict(Counter(s.route_kind for s in sent)),
        "runs": len(peaks),
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.routers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routers", type=int, default=3)
    p.add_argument("--decode", type=int, default=3)
    p.add_argument("--prefill", type=int, default=0)
    p.add_argument("--busy", type=int, default=0, help="long streams on every decode worker but the first")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--gap-ms", type=float, default=40.0, help="between two requests of the burst")
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--policy", default="cost", choices=POLICIES)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per worker (block size 16)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--model", default="tiny", help="tiny | small (built offline on first use) | a checkpoint folder")
    p.add_argument("--out", default="routers", help="results file: bench/results/OUT.json")
    args = p.parse_args(argv)
    if min(args.routers, args.decode, args.requests, args.repeats) < 1 or args.busy < 0:
        p.error("--routers, --decode, --requests and --repeats must be >= 1, --busy >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    from engine.tiny import ensure_model

    args = _parse(argv)
    model = str(ensure_model(args.model)) if args.model in ("tiny", "small") else args.model
    log_dir = Path(tempfile.mkdtemp(prefix="baton-bench-routers-"))
    print(f"{args.requests} requests over {args.requests * args.gap_ms / 1e3:.2f} s across {args.routers} routers, "
          f"{args.decode} decode + {args.prefill} prefill workers, {args.busy} busy streams on all but d0; "
          f"load {os.getloadavg()[0]:.2f}; logs in {log_dir}", flush=True)
    redis_children: list[Child] = []
    runs: dict[str, list[list[Sent]]] = {mode: [] for mode in MODES}
    try:
        redis_url = start_redis(log_dir, redis_children)
        for r in range(args.repeats):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):  # neither always first on the machine
                runs[mode].append(run_one(args, model, redis_url, mode, r, log_dir))
    finally:
        stop_all(redis_children)
    report = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "load_after": os.getloadavg()[0],
              "modes": {m: summarize([s for run in runs[m] for s in run], runs[m]) for m in MODES},
              "per_run": {m: [summarize(run) for run in runs[m]] for m in MODES},
              "per_request": {m: [[asdict(s) for s in run] for run in runs[m]] for m in MODES}}
    print(f"\n{'mode':<8} {'max share':>9} {'peak':>5} {'ttft p50':>9} {'ttft p90':>9} {'e2e p50':>9}  per worker")
    for mode in MODES:
        s = report["modes"][mode]
        print(f"{mode:<8} {s['max_share']:>9.2f} {s['peak_prefills_mean']:>5.1f} {s['ttft_p50_ms']:>7.1f}ms "
              f"{s['ttft_p90_ms']:>7.1f}ms {s['e2e_p50_ms']:>7.1f}ms  {s['per_worker']}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.out}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
