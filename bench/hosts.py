"""``python -m bench.hosts``: Baton on several hosts of one machine (``tests/hosts.py``: a network and PID namespace
each, a bridge in a namespace of its own, every host's egress shaped with ``tc htb``), swept over link rates.

Redis, the router, the prefill workers and the decode workers each run on a host of their own, started with the
ordinary CLI (``tests/hosts_cluster.py``); a client host forwards the bench's requests. For each rate of
``--rates`` every host's egress is reshaped (the platform stays up: the router keeps what it learned), then
``--requests`` fresh prompts of ``--prompt-tokens`` run one after another. A row per rate: how the requests were
routed and over which transport, the KV moved per request, the pull's time and GB/s against the link's, time to
first token p50/p90 (a remote prefill's first token comes from P, before the pull), end-to-end p50 (which the pull
is part of), and pulls that fell back to local prefill (must be 0 when the link works).

    python -m bench.hosts --rates 10gbit,1gbit,100mbit --model small --prompt-tokens 2048

``--study`` is the cost model's link study (issue 21, item 3; ``bench/link_study.py``): one router per policy of
``--policies`` (the cost model, and the threshold-only baseline), each on a host of its own, take turns at every
rate (fastest first: the cost router learns the pair's link from the pulls it makes), while ``--background-streams``
long local streams keep the decode worker busy (a local prefill then stalls them, which the cost model prices). A
row per (rate, policy): routes, TTFT and the decode worker's first token p50/p90, the pull, both plans' predicted
costs, whether each route was the cheaper predicted plan, and the prediction's median error; ``--plot`` draws it.

    python -m bench.hosts --study --model small --prompt-tokens 2048 --rates 10gbit,1gbit,100mbit,50mbit,20mbit

Needs root (network namespaces). Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from proto import baton_pb2 as pb
from proto import baton_pb2_grpc as pb_grpc

from bench.link_study import Sample, as_dicts, plans, plot, summarise, table
from tests.hosts import HostProc, Network, rate_bits, unavailable_reason
from tests.hosts_cluster import HostsCluster

# --study: each policy's router flags. The cost router's ITL target is out of reach, so its choice is its cost
# comparison alone (remote ttft vs local ttft + stall); the baseline prefills remotely above 512 uncached tokens.
STUDY_ROUTERS = {"cost": "--policy cost --itl-target-ms 600000",
                 "threshold": "--policy least_loaded --disagg-threshold-tokens 512",
                 "local": "--policy least_loaded --disagg-threshold-tokens 1000000"}  # always local: the other side

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.hosts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="10gbit,1gbit,100mbit",
                        help="link rates to sweep, tc's units, comma-separated (default: %(default)s)")
    parser.add_argument("--model", default="tiny", help="tiny, small, or a checkpoint (default: %(default)s)")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers, a host each (default: %(default)s)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers, a host each (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=8, help="requests per rate (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per worker (default: %(default)s)")
    parser.add_argument("--kv-transport", default="auto", help="the workers' --kv-transport (default: %(default)s)")
    parser.add_argument("--router-args", default="--policy least_loaded --disagg-threshold-tokens 8",
                        help="extra router flags (default: %(default)r: every prompt prefilled remotely)")
    parser.add_argument("--study", action="store_true", help="the link study: a router per --policies, taking turns")
    parser.add_argument("--policies", default="cost,threshold,local",
                        help=f"--study: routers to compare, of {sorted(STUDY_ROUTERS)} (default: %(default)s)")
    parser.add_argument("--background-streams", type=int, default=1,
                        help="--study: long local streams kept running on the decode worker (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="--study: requests per router before the first rate, not counted (default: %(default)s)")
    parser.add_argument("--pause-s", type=float, default=2.5,
                        help="--study: pause before each request, longer than the workers' 2 s heartbeat, so the "
                        "router prices the load the previous request left, not a report that still counts it "
                        "(default: %(default)s)")
    parser.add_argument("--plot", type=Path, default=None, help="--study: a PNG of choice and latency vs rate")
    parser.add_argument("--out", type=Path, default=Path("bench/results/hosts.json"), help="JSON of the rows")
    parser.add_argument("--log-dir", type=Path, default=None, help="process logs (default: a temp folder)")
    return parser.parse_args(argv)


def start(net: Network, args: argparse.Namespace, model: Path, log_dir: Path,
          routers: dict[str, str]) -> tuple[HostsCluster, dict[str, HostProc]]:
    """The platform, with a router per entry of ``routers`` (its host -> its flags)."""
    cluster = HostsCluster(net, model, log_dir, client="client")
    cluster.start_redis("redis")
    worker_args = ("--kv-transport", args.kv_transport)
    for i in range(args.prefill):
        cluster.start_worker("prefill", f"p{i}", host=f"p{i}", extra=worker_args, num_blocks=args.num_blocks,
                             block_size=args.block_size)
    for i in range(args.decode):
        cluster.start_worker("decode", f"d{i}", host=f"d{i}", extra=worker_args, num_blocks=args.num_blocks,
                             block_size=args.block_size)
    cluster.wait_for_workers(set(cluster.workers), timeout_s=600)
    started = {host: cluster.start_router(host, *flags.split()) for host, flags in routers.items()}
    return cluster, started


def run_rate(cluster: HostsCluster, rate: str, args: argparse.Namespace, rng: random.Random) -> dict:
    for name in cluster.net.hosts:
        cluster.net.shape(name, rate)
    rows = []
    for _ in range(args.requests):
        prompt = [rng.randrange(10, 3000) for _ in range(args.prompt_tokens)]
        _, last = cluster.generate(prompt, args.max_tokens, timeout_s=600)
        rows.append(last.timings)
    pulled = [t for t in rows if t.transfer_bytes > 0]
    link_gbps = rate_bits(rate) / 8e9
    median = lambda values: statistics.median(values) if values else 0.0  # noqa: E731
    ttft = sorted(t.ttft_ms for t in rows)
    return {
        "rate": rate, "link_gbps": link_gbps, "requests": len(rows),
        "routes": dict(Counter(t.route_kind for t in rows)),
        "transports": dict(Counter(t.transport for t in pulled)),
        "fallbacks": sum(t.local_fallback for t in rows),
        "kv_mib": median([t.transfer_bytes / 2**20 for t in pulled]),
        "transfer_ms": median([t.transfer_ms for t in pulled]),
        "transfer_gbps": median([t.transfer_gbps for t in pulled]),
        "ttft_p50_ms": median(ttft), "ttft_p90_ms": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "e2e_p50_ms": median([t.e2e_ms for t in rows]),
    }


def timed(cluster: HostsCluster, prompt: list[int],
          max_tokens: int) -> tuple[float, list[float], float, pb.GenerateResponse]:
    """One request through ``cluster.router``: its start (perf_counter), each token-bearing message's arrival (s
    after it), the end (s after it), the last message."""
    started, stamps, last = time.perf_counter(), [], None
    for response in cluster.stream(prompt, max_tokens, timeout_s=900):
        if response.token_ids:
            stamps.append(time.perf_counter() - started)
        last = response
    return started, stamps, time.perf_counter() - started, last


def study_sample(rate: str, policy: str, stamps: list[float], e2e_s: float, last: pb.GenerateResponse,
                 stall_s: float) -> Sample:
    t = last.timings
    remote = t.route_kind == "remote" and len(stamps) > 1  # P's first token, then D's
    return Sample(rate=rate, link_mbit=rate_bits(rate) / 1e6, policy=policy, kind=t.route_kind,
                  ttft_ms=stamps[0] * 1e3, d_first_ms=stamps[1 if remote else 0] * 1e3, e2e_ms=e2e_s * 1e3,
                  stall_ms=stall_s * 1e3, predicted_ms=t.predicted_ttft_ms, transfer_ms=t.transfer_ms,
                  transfer_mib=t.transfer_bytes / 2**20, fallback=t.local_fallback, **plans(t.route_reason))


class Background:
    """``n`` long streams of short prompts through ``router`` (prefilled on the decode worker, then decoding), each
    started again when it ends, until ``close``: the decode worker's running sequences a local prefill stalls."""

    def __init__(self, cluster: HostsCluster, router: HostProc, n: int, rng: random.Random) -> None:
        self._stub = pb_grpc.GenerationStub(cluster.channel(router.address))
        self._stop, self._calls = threading.Event(), [None] * n
        self._arrivals: list[list[float]] = [[] for _ in range(n)]  # perf_counter of each message, per stream
        self._prompts = [[rng.randrange(10, 3000) for _ in range(16)] for _ in range(n)]
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n)]
        for thread in self._threads:
            thread.start()

    def _loop(self, i: int) -> None:
        params = pb.SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=self._prompts[i]), sampling=params)
        while not self._stop.is_set():
            self._calls[i] = call = self._stub.Generate(request, timeout=600)
            try:
                for _ in call:
                    self._arrivals[i].append(time.perf_counter())
            except grpc.RpcError:
                pass

    def stall_s(self, start_s: float, end_s: float) -> float:
        """How much later than their usual pace the streams' tokens came in ``(start_s, end_s]``: per stream, each
        gap ending then beyond the median gap before ``start_s``, summed (what the cost model's stall prices)."""
        total = 0.0
        for arrivals in self._arrivals:
            times = list(arrivals)
            gaps = [(b - a, b) for a, b in zip(times, times[1:])]
            before = [g for g, at in gaps if at <= start_s]
            base = statistics.median(before[-200:]) if before else 0.0
            total += sum(max(g - base, 0.0) for g, at in gaps if start_s < at <= end_s)
        return total

    def wait_streaming(self, cluster: HostsCluster, worker_id: str, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while cluster.stats(worker_id).num_running < len(self._calls):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self._calls)} background streams did not start on {worker_id}")
            time.sleep(0.2)

    def close(self) -> None:
        self._stop.set()
        for call in self._calls:
            if call is not None:
                call.cancel()
        for thread in self._threads:
            thread.join(30)


def run_study(cluster: HostsCluster, routers: dict[str, HostProc], background: Background, rates: list[str],
              args: argparse.Namespace, rng: random.Random) -> tuple[list[dict], list[Sample]]:
    """Per rate (as given: fastest first), ``--requests`` fresh prompts through each policy's router in turn."""
    rows, samples = [], []
    for name in cluster.net.hosts:
        cluster.net.shape(name, rates[0])
    for router in reversed(routers.values()):  # not counted: P's and D's first prompts run cold (the baseline's first)
        cluster.router = router
        for _ in range(args.warmup):
            timed(cluster, [rng.randrange(10, 3000) for _ in range(args.prompt_tokens)], args.max_tokens)
    print(f"{'link':>9} {'policy':>10} {'rem/loc':>8} {'TTFT p50':>9} {'p90':>8} {'D 1st p50':>9} {'p90':>8} "
          f"{'pull ms':>8} {'stall ms':>8} {'1st+stall':>9} {'pred rem/loc+stall s':>21} {'agree':>6} {'|err|':>6}",
          flush=True)
    for rate in rates:
        for name in cluster.net.hosts:
            cluster.net.shape(name, rate)
        for policy, router in routers.items():
            cluster.router = router
            cell = []
            for _ in range(args.requests):
                time.sleep(args.pause_s)  # the workers' next heartbeats report the previous request gone
                prompt = [rng.randrange(10, 3000) for _ in range(args.prompt_tokens)]
                started, stamps, e2e_s, last = timed(cluster, prompt, args.max_tokens)
                stall_s = background.stall_s(started, started + stamps[-1])  # to its last token
                cell.append(study_sample(rate, policy, stamps, e2e_s, last, stall_s))
            samples += cell
            rows.append(summarise(cell))
            print_study_row(rows[-1])
    return rows, samples


def print_study_row(r: dict) -> None:
    pr, pl = r["predicted_remote_s"], r["predicted_local_s"]
    predicted = f"{pr:.2f} / {pl:.2f}" if pr is not None and pl is not None else "-"
    error = f"{100 * r['median_abs_error']:.0f}%" if r["median_abs_error"] is not None else "-"
    print(f"{r['rate']:>9} {r['policy']:>10} {r['remote']:>3}/{r['local']:<4} {r['ttft_p50_ms']:>9,.0f} "
          f"{r['ttft_p90_ms']:>8,.0f} {r['d_first_p50_ms']:>9,.0f} {r['d_first_p90_ms']:>8,.0f} "
          f"{r['pull_ms'] or 0:>8,.0f} {r['stall_p50_ms']:>8,.0f} {r['cost_p50_ms']:>9,.0f} {predicted:>21} "
          f"{r['agrees']:>6} {error:>6}", flush=True)


def print_row(row: dict) -> None:
    routes = " ".join(f"{k}={v}" for k, v in sorted(row["routes"].items()))
    transports = " ".join(f"{k}={v}" for k, v in sorted(row["transports"].items())) or "-"
    print(f"{row['rate']:>9} {routes:>16} {transports:>10} {row['fallbacks']:>9} {row['kv_mib']:>8.2f} "
          f"{row['transfer_ms']:>9.1f} {row['transfer_gbps']:>7.3f} / {row['link_gbps']:<6.3f} "
          f"{row['ttft_p50_ms']:>8.1f} {row['ttft_p90_ms']:>8.1f} {row['e2e_p50_ms']:>8.1f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (why := unavailable_reason()) is not None:
        print(f"bench.hosts: {why}", file=sys.stderr)
        return 2
    from engine.model_source import resolve_model

    model = resolve_model(args.model).path  # built once here, not by every worker at once
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-hosts-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    workers = [*(f"p{i}" for i in range(args.prefill)), *(f"d{i}" for i in range(args.decode))]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()] if args.study else []
    if unknown := [p for p in policies if p not in STUDY_ROUTERS]:
        print(f"bench.hosts: unknown --policies {unknown}; known: {sorted(STUDY_ROUTERS)}", file=sys.stderr)
        return 2
    routers = {f"r-{p}": STUDY_ROUTERS[p] for p in policies} if args.study else {"router": args.router_args}
    names = ["redis", *routers, *workers, "client"]
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for rate in rates:
        rate_bits(rate)
    rows, samples, started = [], [], time.perf_counter()
    with Network.create(names) as net:
        cluster, started_routers = start(net, args, model, log_dir, routers)
        try:
            print(f"{len(names)} hosts up in {time.perf_counter() - started:.1f} s (logs: {log_dir})")
            rng = random.Random(0)
            if args.study:
                rows, samples = study(cluster, started_routers, policies, rates, args, rng)
            else:
                rows = sweep(cluster, rates, args, rng)
            cluster.assert_pools_full(timeout_s=60)
        finally:
            cluster.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                    "samples": as_dicts(samples)}, indent=2))
    print(f"wrote {args.out}")
    if args.study:
        print(table(rows))
        if args.plot is not None:
            if plot(rows, args.plot):
                print(f"wrote {args.plot}")
    return 0


def sweep(cluster: HostsCluster, rates: list[str], args: argparse.Namespace, rng: random.Random) -> list[dict]:
    print(f"{'rate':>9} {'routes':>16} {'transport':>10} {'fallbacks':>9} {'KV MiB':>8} {'pull ms':>9} "
          f"{'GB/s / link':>16} {'TTFT p50':>8} {'p90':>8} {'e2e p50':>8}")
    rows = []
    for rate in rates:
        rows.append(run_rate(cluster, rate, args, rng))
        print_row(rows[-1])
    return rows


def study(cluster: HostsCluster, routers: dict[str, HostProc], policies: list[str], rates: list[str],
          args: argparse.Namespace, rng: random.Random) -> tuple[list[dict], list[Sample]]:
    by_policy = {p: routers[f"r-{p}"] for p in policies}
    background = Background(cluster, next(iter(by_policy.values())), args.background_streams, rng)
    try:
        background.wait_streaming(cluster, "d0")
        return run_study(cluster, by_policy, background, rates, args, rng)
    finally:
        background.close()


if __name__ == "__main__":
    raise SystemExit(main())
