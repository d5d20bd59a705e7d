"""``python -m bench.soak --streams 256 --duration-s 300``: a soak of a real platform on loopback.

redis-server, a router, ``--prefill`` prefill and ``--decode`` decode workers (the integration tests'
cluster helper, tiny model), then ``--streams`` concurrent client loops for ``--duration-s``: each sends a
greedy Generate (prompt 8-96 tokens, 8-64 output tokens, a deadline), and ``--cancel-share`` of them are
cancelled mid-stream after a random number of tokens. Reports throughput, errors (0 expected: a
cancellation the client chose is not an error), and the RSS and open file descriptors of every process
before (after a warm-up) and after (once the pools are full again), plus whether every pool came back full
with no lease open. Run from the repository root.

Backpressure: ``--max-inflight-requests N`` starts the router with that admission limit; a refused request
(RESOURCE_EXHAUSTED) counts as refused, not as an error, and its client loop waits the retry hint the
router gave before sending again (a burst: ``--streams 1024 --max-inflight-requests 128``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc

log = logging.getLogger("bench.soak")
DEADLINE_S = 120.0
NUM_CHANNELS = 8


@dataclass
class Totals:
    completed: int = 0
    cancelled: int = 0  # by the client, on purpose
    refused: int = 0  # RESOURCE_EXHAUSTED from the router's admission limit (retried after its hint)
    tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    samples: list[tuple[float, dict]] = field(default_factory=list)  # (seconds in, usage of every process)


def process_usage(pid: int) -> dict[str, float]:
    """RSS (MiB) and open file descriptors of a live process, from /proc."""
    rss_kib = 0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
    return {"rss_mib": rss_kib / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


async def one_stream(stub: pb_grpc.GenerationStub, rng: random.Random, cancel_share: float, totals: Totals) -> None:
    prompt = [rng.randrange(10, 3010) for _ in range(rng.randint(8, 96))]
    max_tokens = rng.randint(8, 64)
    cancel_at = rng.randint(1, max_tokens - 1) if rng.random() < cancel_share else None
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    started, received = time.monotonic(), 0
    call = stub.Generate(request, timeout=DEADLINE_S)
    try:
        async for response in call:
            received += len(response.token_ids)
            if cancel_at is not None and received >= cancel_at:
                call.cancel()
                totals.cancelled += 1
                return
        totals.completed += 1
        totals.latencies_s.append(time.monotonic() - started)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and received == 0:
            totals.refused += 1
            await asyncio.sleep(retry_after_s(exc))
            return
        totals.errors[exc.code().name] += 1
        log.warning("stream failed: %s: %s", exc.code().name, exc.details())
    finally:
        totals.tokens += received


def retry_after_s(exc: grpc.aio.AioRpcError) -> float:
    """The router's hint: ``retry-after-ms`` trailing metadata, else the message's "retry after N ms"."""
    for key, value in exc.trailing_metadata() or ():
        if key == "retry-after-ms":
            return int(value) / 1e3
    match = re.search(r"retry after (\d+) ms", exc.details() or "")
    return int(match.group(1)) / 1e3 if match else 1.0


async def soak(address: str, streams: int, duration_s: float, cancel_share: float, seed: int,
               sample: Callable[[], dict] | None = None, sample_every_s: float = 30.0) -> tuple[Totals, float]:
    """Run the client loops; ``sample()`` (RSS and fds of every process) every ``sample_every_s`` into
    ``totals.samples``, as (seconds since the start, sample)."""
    channels = [grpc.aio.insecure_channel(address) for _ in range(NUM_CHANNELS)]
    stubs = [pb_grpc.GenerationStub(c) for c in channels]
    totals, end_s = Totals(), time.monotonic() + duration_s

    async def sampler() -> None:
        while sample is not None and time.monotonic() < end_s:
            await asyncio.sleep(min(sample_every_s, max(end_s - time.monotonic(), 0.0)))
            totals.samples.append((round(time.monotonic() - started, 1), sample()))

    async def client(i: int) -> None:
        rng = random.Random(seed * 100_003 + i)
        while time.monotonic() < end_s:
            await one_stream(stubs[i % NUM_CHANNELS], rng, cancel_share, totals)

    started = time.monotonic()
    sampling = asyncio.ensure_future(sampler())
    await asyncio.gather(*(client(i) for i in range(streams)))
    sampling.cancel()
    elapsed_s = time.monotonic() - started
    for channel in channels:
        await channel.close()
    return totals, elapsed_s


def usage_of(procs: dict[str, int]) -> dict[str, dict[str, float]]:
    return {name: process_usage(pid) for name, pid in procs.items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256, help="concurrent client streams (default: %(default)s)")
    parser.add_argument("--duration-s", type=float, default=300.0, help="how long (default: %(default)s)")
    parser.add_argument("--cancel-share", type=float, default=0.2,
                        help="share of requests cancelled mid-stream (default: %(default)s)")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (default: %(default)s)")
    parser.add_argument("--decode", type=int, default=2, help="decode workers (default: %(default)s)")
    parser.add_argument("--max-inflight-requests", type=int, default=None,
                        help="the router's admission limit (default: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    return parser.parse_args(argv)


def run(args: argparse.Namespace, work: Path) -> dict:
    from engine.tiny import build_model
    from tests.integration.test_e2e import assert_pools_full, start_cluster

    model_dir = build_model("tiny", work / "tiny", train_steps=20, progress=lambda _: None)
    (work / "logs").mkdir()
    limit = ("--max-inflight-requests", str(args.max_inflight_requests)) if args.max_inflight_requests else ()
    cluster, redis = start_cluster(model_dir, work / "logs", prefill=args.prefill, decode=args.decode,
                                   router_args=limit)
    try:
        procs = {p.name: p.popen.pid for p in cluster.procs} | {"redis": redis.pid}
        asyncio.run(soak(cluster.router.address, 16, 3.0, 0.0, args.seed + 1))  # warm-up
        assert_pools_full(cluster, timeout_s=30)
        before = usage_of(procs)
        log.info("soak: %d streams for %.0f s", args.streams, args.duration_s)
        totals, elapsed_s = asyncio.run(soak(cluster.router.address, args.streams, args.duration_s,
                                             args.cancel_share, args.seed, sample=lambda: usage_of(procs)))
        try:
            assert_pools_full(cluster, timeout_s=60)
            pools = "full, no lease open"
        except AssertionError as exc:
            pools = str(exc)
        after = usage_of(procs)
    finally:
        cluster.stop_all()
        redis.stop()
    return report(args, totals, elapsed_s, before, after, pools)


def report(args, totals: Totals, elapsed_s: float, before: dict, after: dict, pools: str) -> dict:
    latencies = sorted(totals.latencies_s) or [0.0]
    return {
        "streams": args.streams, "duration_s": round(elapsed_s, 1), "cancel_share": args.cancel_share,
        "max_inflight_requests": args.max_inflight_requests, "completed": totals.completed,
        "cancelled": totals.cancelled, "refused": totals.refused, "errors": dict(totals.errors),
        "tokens": totals.tokens, "tokens_per_s": round(totals.tokens / elapsed_s, 1),
        "requests_per_s": round((totals.completed + totals.cancelled) / elapsed_s, 2),
        "p50_latency_s": round(latencies[len(latencies) // 2], 3),
        "p99_latency_s": round(latencies[int(len(latencies) * 0.99)], 3),
        "pools_after": pools,
        "processes": {name: {"rss_mib_before": round(before[name]["rss_mib"], 1),
                             "rss_mib_after": round(after[name]["rss_mib"], 1),
                             "fds_before": before[name]["fds"], "fds_after": after[name]["fds"]} for name in before},
        "rss_mib_over_time": [{"t_s": t, **{name: round(u["rss_mib"], 1) for name, u in usage.items()}}
                              for t, usage in totals.samples],
    }


def print_report(result: dict) -> None:
    errors = sum(result["errors"].values())
    print(f"{result['streams']} streams, {result['duration_s']} s: {result['completed']} completed, "
          f"{result['cancelled']} cancelled on purpose, {result['refused']} refused (admission limit "
          f"{result['max_inflight_requests']}), {errors} errors {result['errors'] or ''}; "
          f"{result['tokens_per_s']} tok/s, {result['requests_per_s']} req/s, "
          f"latency p50 {result['p50_latency_s']} s p99 {result['p99_latency_s']} s; pools: {result['pools_after']}")
    print("| process | RSS before (MiB) | RSS after (MiB) | growth | fds before | fds after |")
    print("|---|---|---|---|---|---|")
    for name, p in result["processes"].items():
        growth = p["rss_mib_after"] - p["rss_mib_before"]
        print(f"| {name} | {p['rss_mib_before']} | {p['rss_mib_after']} | {growth:+.1f} | {p['fds_before']} "
              f"| {p['fds_after']} |")
    if result["rss_mib_over_time"]:  # does the growth level off?
        names = list(result["processes"])
        print("\nRSS (MiB) during the soak\n| t (s) | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
        for row in result["rss_mib_over_time"]:
            print(f"| {row['t_s']} | " + " | ".join(str(row[n]) for n in names) + " |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="baton-bench-soak-") as work:
        result = run(args, Path(work))
    print_report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 1 if result["errors"] or not result["pools_after"].startswith("full") else 0


if __name__ == "__main__":
    raise SystemExit(main())
