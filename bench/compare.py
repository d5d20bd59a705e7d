"""Aggregated vs disaggregated serving at equal cores: the same workload, a sweep of rates, both layouts.

    python -m bench compare [--cores 2 --prefill 1] [--preset tiny|small | --model DIR]
                            [--workload long-prompt] [--rates 0.5,1,2] [--duration-s 30 | --num-requests N]
                            [--slo-ttft-ms 1000] [--slo-tpot-ms 100] [--protocol grpc|http] [--out DIR]

Starts two private platforms one after the other (``bench/launcher.py``), each worker pinned to its own core:
**aggregated** — ``--cores`` decode workers and no prefill worker, so the router has every decode worker
prefill locally (the policy's "no prefill workers" branch; no router flag needed) — and **disaggregated** —
``--prefill`` prefill + (cores - prefill) decode workers. Router and redis share one core (the first core no
worker uses, else the last worker's: a decode worker's in both layouts); the benchmark client is not pinned.
At each rate both layouts get the same requests (seeded per rate, so no rate reuses another's prefixes).
The router is told the SLOs it is judged by: ``--ttft-target-ms`` = ``--slo-ttft-ms`` and ``--itl-target-ms``
= ``--slo-tpot-ms`` (the cost policy's targets; ``--router-args`` adds or overrides router flags).

Prints, per rate, p99 ITL of each layout and their ratio (target disaggregated/aggregated <= 0.5), goodput
of each, and the goodput ratio at the first rate where aggregated falls below ``--attainment`` (0.9) SLO
attainment (target >= 1.5). ``--out`` (default ``bench/results/compare``) gets compare.json,
compare_itl.png (p99 ITL and p99 TTFT vs rate) and compare_goodput.png (goodput and SLO attainment vs rate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import time
from dataclasses import asdict
from pathlib import Path

from bench import serve
from bench.client import PROTOCOLS, Planned, Result, model_info, run_once
from bench.launcher import CorePlan, Layout, Platform, core_plan
from workload.plots import pyplot
from workload.synthetic import sharegpt_like

ITL_TARGET_RATIO = 0.5  # disaggregated p99 ITL / aggregated, at most
GOODPUT_TARGET_RATIO = 1.5  # disaggregated goodput / aggregated where aggregated first misses attainment


# ---- workload (pure) ----------------------------------------------------------------------------
def plan_requests(args: argparse.Namespace, rate: float, seed: int, vocab_size: int,
                  max_model_len: int) -> list[Planned]:
    """The requests for one rate: ``--num-requests`` or rate x ``--duration-s`` of them, seeded."""
    n = args.num_requests or max(1, round(rate * args.duration_s))
    if args.workload == "long-prompt":
        planned = serve.long_prompt(n, vocab_size, seed, args.long_tokens, args.long_fraction)
    elif args.workload == "shared-prefix":
        planned = serve.shared_prefix(n, vocab_size, seed)
    else:
        planned = [Planned(None, r.prompt_token_ids, r.max_tokens)
                   for r in sharegpt_like(n, vocab_size=vocab_size, seed=seed)]
    return serve.fit(planned, max_model_len, args.max_prompt_len, args.max_output_len)


# ---- comparison (pure) --------------------------------------------------------------------------
def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 and not math.isnan(num) and not math.isnan(den) else None


def compare(agg: list[dict], disagg: list[dict], attainment: float) -> dict:
    """Per-rate ratios and the goodput ratio at the first rate (ascending) where aggregated attainment
    falls below ``attainment``; ``knee`` is None when it never does. Runs are matched by position."""
    per_rate = [{
        "rate": a["rate"],
        "p99_itl_ms": {"aggregated": a["itl_ms"]["p99"], "disaggregated": d["itl_ms"]["p99"]},
        "p99_itl_ratio": _ratio(d["itl_ms"]["p99"], a["itl_ms"]["p99"]),
        "goodput": {"aggregated": a["goodput"], "disaggregated": d["goodput"]},
        "goodput_ratio": _ratio(d["goodput"], a["goodput"]),
        "slo_attainment": {"aggregated": a["slo_attainment"], "disaggregated": d["slo_attainment"]},
    } for a, d in zip(agg, disagg)]
    knee = next((row for row in sorted(per_rate, key=lambda r: r["rate"])
                 if row["slo_attainment"]["aggregated"] < attainment), None)
    return {"per_rate": per_rate, "attainment": attainment, "knee": knee,
            "max_rate_meeting_attainment": {name: _max_rate(runs, attainment)
                                            for name, runs in (("aggregated", agg), ("disaggregated", disagg))}}


def _meets(record: dict, ttft_ms: float, tpot_ms: float) -> bool:
    """``serve.meets_slo`` on a stored request record (no ITLs kept)."""
    if not record["ok"] or record["ttft_s"] * 1e3 > ttft_ms:
        return False
    n = record["output_tokens"]
    return n < 2 or (record["e2e_s"] - record["ttft_s"]) / (n - 1) * 1e3 <= tpot_ms


def slo_grid(agg: list[dict], disagg: list[dict], ttfts_ms: list[float], tpots_ms: list[float],
             attainment: float) -> list[dict]:
    """The same runs judged by other SLOs: per (TTFT, TPOT) pair, each rate's attainment and goodput of both
    layouts (the run's own duration) and the goodput ratio at the first rate where aggregated falls below
    ``attainment`` (None: it never does in this sweep)."""
    out = []
    for ttft in ttfts_ms:
        for tpot in tpots_ms:
            rows = []
            for a, d in zip(agg, disagg):
                row = {"rate": a["rate"]}
                for name, run in (("aggregated", a), ("disaggregated", d)):
                    good = sum(_meets(r, ttft, tpot) for r in run["requests"])
                    row[name] = {"attainment": good / max(1, len(run["requests"])),
                                 "goodput": good / run["duration_s"] if run["duration_s"] > 0 else 0.0}
                row["goodput_ratio"] = _ratio(row["disaggregated"]["goodput"], row["aggregated"]["goodput"])
                rows.append(row)
            ordered = sorted(rows, key=lambda r: r["rate"])
            knee = next((r for r in ordered if r["aggregated"]["attainment"] < attainment), None)
            sustained = {name: _max_rate([{"rate": r["rate"], "slo_attainment": r[name]["attainment"]}
                                          for r in ordered], attainment) for name in ("aggregated", "disaggregated")}
            out.append({"slo_ttft_ms": ttft, "slo_tpot_ms": tpot, "per_rate": rows,
                        "knee_rate": knee and knee["rate"], "goodput_ratio_at_knee": knee and knee["goodput_ratio"],
                        "max_rate_meeting_attainment": sustained})
    return out


def print_slo_grid(grid: list[dict]) -> None:
    tpots = sorted({g["slo_tpot_ms"] for g in grid})
    print("\ngoodput ratio (disaggregated / aggregated) where aggregated first falls below the attainment, per SLO:")
    print(f"{'TTFT SLO':>10} | " + " ".join(f"{f'TPOT {t:g} ms':>24}" for t in tpots))
    for ttft in sorted({g["slo_ttft_ms"] for g in grid}):
        cells = []
        for tpot in tpots:
            g = next(x for x in grid if x["slo_ttft_ms"] == ttft and x["slo_tpot_ms"] == tpot)
            rates = g["max_rate_meeting_attainment"]
            knee = "no knee" if g["knee_rate"] is None else f"{_fmt(g['goodput_ratio_at_knee'])} @ {g['knee_rate']:g}"
            cells.append(f"{knee}; {_fmt(rates['aggregated'], 'g')}/{_fmt(rates['disaggregated'], 'g')}")
        print(f"{ttft:>8g} ms | " + " ".join(f"{c:>24}" for c in cells))
    print("cell: goodput ratio @ the rate where aggregated first falls below the attainment; then the highest rate "
          "(req/s) each layout sustains at that attainment, aggregated/disaggregated (DistServe's goodput)")


def _max_rate(runs: list[dict], attainment: float) -> float | None:
    """The highest rate below which every run met ``attainment`` (None: not even the lowest)."""
    best = None
    for run in sorted(runs, key=lambda r: r["rate"]):
        if run["slo_attainment"] < attainment:
            break
        best = run["rate"]
    return best


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None or math.isnan(value) else format(value, spec)


def print_table(result: dict) -> None:
    print(f"\n{'rate':>6} | {'p99 ITL agg':>11} {'disagg':>8} {'ratio':>6} | {'goodput agg':>11} {'disagg':>7} "
          f"{'ratio':>6} | {'SLO att. agg':>12} {'disagg':>7}")
    for row in result["per_rate"]:
        itl, good, att = row["p99_itl_ms"], row["goodput"], row["slo_attainment"]
        print(f"{row['rate']:>6g} | {_fmt(itl['aggregated'], '.1f'):>11} {_fmt(itl['disaggregated'], '.1f'):>8} "
              f"{_fmt(row['p99_itl_ratio']):>6} | {good['aggregated']:>11.2f} {good['disaggregated']:>7.2f} "
              f"{_fmt(row['goodput_ratio']):>6} | {att['aggregated']:>12.0%} {att['disaggregated']:>7.0%}")
    print("(p99 ITL in ms; goodput in req/s meeting both SLOs; ratio = disaggregated / aggregated)")
    itl_ratios = [r["p99_itl_ratio"] for r in result["per_rate"] if r["p99_itl_ratio"] is not None]
    if itl_ratios:
        print(f"p99 ITL ratio: {min(itl_ratios):.2f}-{max(itl_ratios):.2f} (target <= {ITL_TARGET_RATIO})")
    knee, target = result["knee"], f"{result['attainment']:.0%}"
    if knee is None:
        print(f"aggregated keeps >= {target} SLO attainment at every rate: no knee in this sweep (raise --rates)")
    else:
        print(f"aggregated first falls below {target} attainment at {knee['rate']:g} req/s: goodput ratio "
              f"{_fmt(knee['goodput_ratio'])} (target >= {GOODPUT_TARGET_RATIO})")
    print(f"highest rate meeting {target} attainment: {result['max_rate_meeting_attainment']}")


def plot(layouts: dict[str, dict], out: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    panels = {"compare_itl.png": [("p99 ITL (ms)", lambda r: r["itl_ms"]["p99"]),
                                  ("p99 TTFT (ms)", lambda r: r["ttft_ms"]["p99"])],
              "compare_goodput.png": [("goodput (req/s)", lambda r: r["goodput"]),
                                      ("SLO attainment", lambda r: r["slo_attainment"])]}
    paths = []
    for name, series in panels.items():
        fig, axes = plt.subplots(1, len(series), figsize=(10, 4))
        for ax, (label, value) in zip(axes, series):
            for layout, data in layouts.items():
                runs = data["runs"]
                ax.plot([r["rate"] for r in runs], [value(r) for r in runs], "o-", label=f"{layout} ({data['shape']})")
            ax.set(xlabel="arrival rate (req/s)", ylabel=label, title=f"{label} vs rate")
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths


# ---- runs ---------------------------------------------------------------------------------------
def _rates(value: str) -> list[float]:
    rates = [float(x) for x in value.split(",") if x.strip()]
    if not rates or any(r <= 0 or math.isinf(r) for r in rates):
        raise argparse.ArgumentTypeError("rates must be positive and finite, e.g. 0.5,1,2")
    return sorted(rates)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="baton bench compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cores", type=int, default=2, help="worker cores N, one worker per core (default: %(default)s)")
    p.add_argument("--prefill", type=int, default=1, help="disaggregated: P prefill workers, N - P decode")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--preset", choices=("tiny", "small"), default="tiny", help="`baton model` preset to serve")
    model.add_argument("--model", type=Path, default=None, help="a Hugging Face checkpoint folder instead")
    p.add_argument("--workload", choices=serve.WORKLOADS, default="long-prompt")
    p.add_argument("--long-tokens", type=int, default=1536, help="long-prompt: length of the long prompts")
    p.add_argument("--long-fraction", type=float, default=0.1, help="long-prompt: share of long prompts")
    p.add_argument("--rates", type=_rates, default=[0.5, 1.0, 2.0], help="arrivals per second, e.g. 0.5,1,2")
    p.add_argument("--duration-s", type=float, default=30.0, help="requests per rate = rate x this")
    p.add_argument("--num-requests", type=int, default=None, help="a fixed number of requests per rate instead")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--attainment", type=float, default=0.9, help="SLO attainment that defines the knee")
    p.add_argument("--slo-grid-ttft-ms", type=_rates, default=None,
                   help="also judge the runs by these TTFT SLOs (x the TPOT ones), e.g. 1000,3000,5000")
    p.add_argument("--slo-grid-tpot-ms", type=_rates, default=None, help="... and these TPOT SLOs, e.g. 100,200")
    p.add_argument("--max-prompt-len", type=int, default=None)
    p.add_argument("--max-output-len", type=int, default=None)
    p.add_argument("--protocol", choices=PROTOCOLS, default="grpc")
    p.add_argument("--policy", default=None, help="router --policy (default: the router's)")
    p.add_argument("--disagg-threshold-tokens", type=int, default=None, help="router flag (default: the router's)")
    p.add_argument("--router-args", type=shlex.split, default=[],
                   help="more router flags for both layouts, one string, e.g. '--itl-target-ms 200'")
    p.add_argument("--only", choices=("aggregated", "disaggregated"), default=None,
                   help="run one layout alone (to study it; no comparison is made)")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per worker")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="worker token budget per step")
    p.add_argument("--router-core", type=int, default=None, help="core of router + redis (default: see above)")
    p.add_argument("--warmup", type=int, default=2, help="uncounted requests before each run")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--out", type=Path, default=Path("bench/results/compare"))
    args = p.parse_args(argv)
    if not 1 <= args.prefill < args.cores:
        p.error("--prefill must be at least 1 and leave at least one decode core (--cores > --prefill)")
    if args.burstiness <= 0 or (args.num_requests is not None and args.num_requests < 1):
        p.error("--burstiness and --num-requests must be positive")
    return args


def layouts(args: argparse.Namespace) -> list[Layout]:
    return [Layout(name="aggregated", prefill=0, decode=args.cores),
            Layout(name="disaggregated", prefill=args.prefill, decode=args.cores - args.prefill)]


def _flags(pairs: dict[str, object]) -> list[str]:
    return [x for flag, value in pairs.items() if value is not None for x in (flag, str(value))]


def run_layout(args: argparse.Namespace, plan: CorePlan, model_dir: Path) -> dict:
    """Start ``plan``'s platform, run every rate against it, stop it; the layout's record."""
    layout = plan.layout
    print(f"\n>>> starting {plan.describe()}", flush=True)
    start_s = time.perf_counter()
    worker_args = _flags({"--num-blocks": args.num_blocks, "--block-size": args.block_size,
                          "--max-num-batched-tokens": args.max_num_batched_tokens})
    router_args = _flags({"--policy": args.policy, "--disagg-threshold-tokens": args.disagg_threshold_tokens,
                          "--ttft-target-ms": args.slo_ttft_ms, "--itl-target-ms": args.slo_tpot_ms})
    router_args += args.router_args
    with Platform.start(plan, model_dir, args.out / "logs" / layout.name, worker_args=worker_args,
                        router_args=router_args) as platform:
        print(f">>> {layout.name} ready in {time.perf_counter() - start_s:.1f} s", flush=True)
        info = asyncio.run(model_info(platform.grpc_address))
        address = platform.grpc_address if args.protocol == "grpc" else platform.http_address
        runs = [_run_rate(args, layout.name, address, info, i, rate) for i, rate in enumerate(args.rates)]
    print(f">>> {layout.name} stopped ({time.perf_counter() - start_s:.1f} s in all)", flush=True)
    return {"prefill": layout.prefill, "decode": layout.decode, "shape": f"{layout.prefill}P+{layout.decode}D",
            "cores": plan.describe(), "runs": runs}


def _run_rate(args: argparse.Namespace, name: str, address: str, info, index: int, rate: float) -> dict:
    seed = args.seed + index  # the same requests for both layouts; fresh prefixes at each rate
    planned = plan_requests(args, rate, seed, info.vocab_size, info.max_model_len)
    offsets = serve.arrival_offsets(len(planned), rate, args.burstiness, seed)
    results, duration_s = asyncio.run(run_once(address, planned, offsets, f"{name} {rate:g} req/s",
                                               args.timeout_s, args.warmup, args.protocol))
    summary = serve.summarize(results, duration_s, args.slo_ttft_ms, args.slo_tpot_ms)
    print(f"    {name} {rate:g} req/s: {summary['completed']}/{summary['num_requests']} done, "
          f"p99 ITL {summary['itl_ms']['p99']:.1f} ms, p99 TTFT {summary['ttft_ms']['p99']:.1f} ms, "
          f"goodput {summary['goodput']:.2f} req/s, SLO attainment {summary['slo_attainment']:.0%}, "
          f"prefill {summary['route_kinds'] or 'n/a'}", flush=True)
    return {"rate": rate, **summary, "requests": [_record(r) for r in results]}


def _record(result: Result) -> dict:
    return {k: v for k, v in asdict(result).items() if k != "itl_s"}


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return args.model
    from engine.tiny import ensure_model

    print(f"model: the {args.preset} preset (built on first use)", flush=True)
    return ensure_model(args.preset)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    available = sorted(os.sched_getaffinity(0))
    plans = [core_plan(layout, available, args.router_core) for layout in layouts(args)
             if args.only in (None, layout.name)]
    model_dir = _model_dir(args)
    load_before = os.getloadavg()
    records = {plan.layout.name: run_layout(args, plan, model_dir) for plan in plans}
    result = {}
    if args.only is None:
        agg, disagg = records["aggregated"]["runs"], records["disaggregated"]["runs"]
        result = compare(agg, disagg, args.attainment)
        print_table(result)
        if args.slo_grid_ttft_ms or args.slo_grid_tpot_ms:
            result["slo_grid"] = slo_grid(agg, disagg, args.slo_grid_ttft_ms or [args.slo_ttft_ms],
                                          args.slo_grid_tpot_ms or [args.slo_tpot_ms], args.attainment)
            print_slo_grid(result["slo_grid"])
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    machine = {"cores": available, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
               "router_and_redis": "share one core; see each layout's 'cores'", "client": "not pinned"}
    report = {"config": config, "model": str(model_dir), "machine": machine, "layouts": records, **result}
    (args.out / "compare.json").write_text(json.dumps(report, indent=2))
    paths = plot(records, args.out)
    print(f"wrote {', '.join(str(p) for p in [args.out / 'compare.json', *paths])}")
    failed = sum(run["failed"] for record in records.values() for run in record["runs"])
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
