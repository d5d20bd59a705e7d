"""Routing across KV pool sizes: where a KV-aware router pays off and where it cannot.

    python -m bench.routing_sweep --sizes 256,320,448,640,1024 [any ``bench.routing`` option]

Runs the routing benchmark (``bench.routing``: same workload, same arrivals, every policy on a fresh 2P+2D
platform with cold caches) once per KV pool size, in KV blocks of 16 tokens per worker. While every system
prompt fits in every worker's pool, round-robin hits nearly as often as a KV-aware router and the TTFT
ratio is bounded by what the hits still compute (the oracle's floor). Once a worker holds only some of them,
round-robin evicts what it needs next while a router that keeps each prefix on the workers that hold it does
not. Reports per size and policy the hit rate (and its fraction of the oracle's), TTFT p50/p90, ITL p50/p99,
each policy's TTFT p50 over round-robin's and the oracle's floor; writes bench/results/routing_sweep.json
and routing_sweep.png (TTFT p50 and hit rate against pool size). Each size's full report (per request) is
bench/results/routing_sweep_<size>.json.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from bench import routing
from workload.plots import pyplot

RESULTS = routing.RESULTS
FIGURES = ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p99_ms")


def prompt_blocks_per_worker(systems: int, system_tokens: int, block_size: int = routing.BLOCK_SIZE) -> int:
    """KV blocks one worker needs to hold every system prompt at once (conversation tails not counted)."""
    return systems * math.ceil(system_tokens / block_size)


def sweep_rows(reports: dict[int, dict], baseline: str = "round_robin") -> list[dict]:
    """One row per (pool size, policy): its figures, the hit rate over the oracle's, TTFT p50 over the
    baseline's (None without the baseline) and the oracle's TTFT floor over the baseline's."""
    rows = []
    for size in sorted(reports):
        report = reports[size]
        policies = report["policies"]
        base = policies.get(baseline)
        floor = (report.get("oracle_ttft_floor") or {}).get("ttft_p50_ms")
        for name, s in policies.items():
            row = {"num_blocks": size, "policy": name, **{k: s[k] for k in FIGURES},
                   "hit_of_oracle": s["hit_rate"] / report["oracle_hit_rate"] if report["oracle_hit_rate"] else None,
                   "ttft_p50_vs_baseline": s["ttft_p50_ms"] / base["ttft_p50_ms"] if base else None,
                   "floor_vs_baseline": floor / base["ttft_p50_ms"] if base and floor else None}
            rows.append(row)
    return rows


def print_rows(rows: list[dict], baseline: str) -> None:
    print(f"\n{'blocks':>7} {'policy':<16}{'hit':>7}{'/oracle':>9}{'ttft p50':>10}{'p90':>8}{'itl p50':>9}"
          f"{'p99':>8}{'p50 / ' + baseline:>24}{'floor / ' + baseline:>26}")
    for r in rows:
        ratio = "-" if r["ttft_p50_vs_baseline"] is None else f"{r['ttft_p50_vs_baseline']:.2f}"
        floor = "-" if r["floor_vs_baseline"] is None else f"{r['floor_vs_baseline']:.2f}"
        of_oracle = float("nan") if r["hit_of_oracle"] is None else r["hit_of_oracle"]
        print(f"{r['num_blocks']:>7} {r['policy']:<16}{r['hit_rate']:>7.3f}{of_oracle:>9.2f}"
              f"{r['ttft_p50_ms']:>10.1f}{r['ttft_p90_ms']:>8.1f}{r['itl_p50_ms']:>9.1f}{r['itl_p99_ms']:>8.1f}"
              f"{ratio:>24}{floor:>26}")


def plot(rows: list[dict], path: Path, fits_at: int, title: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    from matplotlib.ticker import FuncFormatter

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == name]
        sizes = [r["num_blocks"] for r in mine]
        left.plot(sizes, [r["ttft_p50_ms"] for r in mine], marker="o", label=name)
        right.plot(sizes, [r["hit_of_oracle"] or 0.0 for r in mine], marker="o", label=name)
    floors = {r["num_blocks"]: r["floor_vs_baseline"] for r in rows if r["floor_vs_baseline"] is not None}
    base = {r["num_blocks"]: r["ttft_p50_ms"] / r["ttft_p50_vs_baseline"] for r in rows
            if r["ttft_p50_vs_baseline"]}
    if floors:
        sizes = sorted(floors)
        left.plot(sizes, [floors[s] * base[s] for s in sizes], "k--", label="oracle floor")
    for ax in (left, right):
        ax.axvline(fits_at, color="grey", linestyle=":", label="every system prompt fits one worker")
        ax.set_xlabel("KV blocks per worker (16 tokens each)")
        ax.grid(alpha=0.3)
    left.set(ylabel="TTFT p50 (ms)", yscale="log", title="TTFT p50")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    left.yaxis.set_major_formatter(plain)
    left.yaxis.set_minor_formatter(plain)
    right.set(ylabel="prefix cache hit rate / oracle's", title="Hit rate", ylim=(0, 1.05))
    left.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.routing_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256,320,448,640,1024", help="KV blocks per worker, comma-separated")
    p.add_argument("--baseline", default="round_robin", help="the policy TTFT ratios are taken over")
    ours, rest = p.parse_known_args(argv)
    sizes = [int(s) for s in ours.sizes.split(",")]
    if not sizes or min(sizes) < 1:
        p.error(f"--sizes needs positive block counts, got {ours.sizes!r}")
    reports: dict[int, dict] = {}
    for i, size in enumerate(sizes):
        args = routing._parse([*rest, "--num-blocks", str(size), "--out", f"routing_sweep_{size}"])
        print(f"\n=== pool size {i + 1}/{len(sizes)}: {size} KV blocks per worker ===", flush=True)
        report, _, model = routing.run(args)
        routing.print_table(report)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"routing_sweep_{size}.json").write_text(json.dumps(report, indent=2))
        reports[size] = report
    rows = sweep_rows(reports, ours.baseline)
    print_rows(rows, ours.baseline)
    workload = {k: v for k, v in reports[sizes[0]]["workload"].items() if k != "num_blocks"}
    fits_at = prompt_blocks_per_worker(workload["systems"], workload["system_tokens"])
    (RESULTS / "routing_sweep.json").write_text(json.dumps(
        {"workload": workload, "sizes": sizes, "prompt_blocks_per_worker": fits_at, "rows": rows}, indent=2))
    title = (f"{workload['systems']} system prompts x {workload['system_tokens']} tokens, "
             f"{workload['conversations']} conversations x {workload['turns']} turns, 2P+2D ({Path(model).name})")
    if plot(rows, RESULTS / "routing_sweep.png", fits_at, title):
        print(f"wrote {RESULTS / 'routing_sweep.json'} and {RESULTS / 'routing_sweep.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
