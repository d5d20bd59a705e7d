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

Needs root (network namespaces). Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from tests.hosts import Network, rate_bits, unavailable_reason
from tests.hosts_cluster import HostsCluster

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
    parser.add_argument("--out", type=Path, default=Path("bench/results/hosts.json"), help="JSON of the rows")
    parser.add_argument("--log-dir", type=Path, default=None, help="process logs (default: a temp folder)")
    return parser.parse_args(argv)


def start(net: Network, args: argparse.Namespace, model: Path, log_dir: Path) -> HostsCluster:
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
    cluster.start_router("router", *args.router_args.split())
    return cluster


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
    names = ["redis", "router", *workers, "client"]
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for rate in rates:
        rate_bits(rate)
    rows, started = [], time.perf_counter()
    with Network.create(names) as net:
        cluster = start(net, args, model, log_dir)
        try:
            print(f"{len(names)} hosts up in {time.perf_counter() - started:.1f} s (logs: {log_dir})")
            print(f"{'rate':>9} {'routes':>16} {'transport':>10} {'fallbacks':>9} {'KV MiB':>8} {'pull ms':>9} "
                  f"{'GB/s / link':>16} {'TTFT p50':>8} {'p90':>8} {'e2e p50':>8}")
            rng = random.Random(0)
            for rate in rates:
                rows.append(run_rate(cluster, rate, args, rng))
                print_row(rows[-1])
            cluster.assert_pools_full()
        finally:
            cluster.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
