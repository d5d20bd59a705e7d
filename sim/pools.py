"""``baton simulate pools``: Baton's planner judged at scale, in the simulator (issue 23, item 3).

    baton simulate pools --trace ../shared/traces/conversation_trace.jsonl [--gpu H200] [--model llama-3-8b]
                         [--policy cost] [--prefill 1-6] [--decode 1-4] [--slo-ttft-ms 2000] [--slo-tpot-ms 100]
                         [--attainment 0.9] [--interval-s 60] [--window-s 300] [--startup-s 60]
                         [--json OUT.json] [--plot OUT.png]

On the whole trace, four answers to "how many prefill and decode workers", each simulated with the real router:
- **sweep**: fixed pools, for each decode size the prefill sizes from the smallest up to the first that meets the
  SLOs (``--attainment`` of requests within TTFT and TPOT); the cheapest pools that meet them (fewest GPUs);
- **plan (mean)**: ``baton admin plan`` (the real ``plan_pools``, ``sim/plan.py``) sized from the trace's mean
  traffic, as an operator would size fixed pools from it (every prompt on a prefill worker, uncached);
- **plan (peak)**: fixed pools the size of the planner's largest plan over the run's windows (each interval, the
  arrivals of the last ``--window-s``): fixed pools sized for the peak;
- **planner**: pools the planner resizes every ``--interval-s`` from the traffic that finished in the last
  ``--window-s``, with its measured corrections, hysteresis and cool-downs (``sim/elastic.py``), starting from the
  mean plan; a new worker costs ``--startup-s`` before it serves; it reads the prefill pool's own traffic (the
  requests routed to a prefill worker, their cached tokens) as the router's window does.
Every plan takes the queue model of ``--policy`` (``router.admin.queueing.dispatch_of``: M/G/n pooled for cost,
least_loaded and prefix_overlap, n x M/G/1 split for round_robin and random).
For each: SLO attainment, provisioned GPU-seconds, TTFT / TPOT p90, hit rate. Prints a table, writes every figure
and the planner's every plan as JSON, and plots GPU-seconds against attainment (fixed pools, the plans and the
planner marked).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from router.admin.planner import (PlannerConfig, PrefillProfile, Traffic, plan_pools, prefill_ttft_p90_s,
                                  service_mix)
from router.admin.planner import Slo as PlannerSlo
from router.admin.queueing import Dispatch, dispatch_of
from router.routing.cost_model import CostConfig
from router.routing.policy import POLICIES, PolicyConfig
from sim.cli import requests_of, shape_of
from sim.cluster import ClusterConfig
from sim.elastic import ElasticConfig, ElasticSimulation
from sim.hardware import GPUS, MODELS
from sim.metrics import Slo
from sim.plan import profiles_for, traffic_of
from sim.pools_report import plot, print_pools, row_of
from sim.report import write_json
from sim.simulation import simulate
from sim.workload import SimRequest


def _range(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    values = list(range(int(lo), int(hi or lo) + 1))
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"need N or N-M with 1 <= N <= M, got {text!r}")
    return values


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="baton simulate pools", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times")
    p.add_argument("--length-scale", type=int, default=1)
    p.add_argument("--gpu", choices=sorted(GPUS), default="H200")
    p.add_argument("--model", choices=sorted(MODELS), default="llama-3-8b")
    p.add_argument("--tp", default="auto")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--policy", choices=POLICIES, default="cost")
    p.add_argument("--prefill", type=_range, default=_range("1-6"), help="prefill sizes to sweep (N-M)")
    p.add_argument("--decode", type=_range, default=_range("1-4"), help="decode sizes to sweep (N-M)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--interval-s", type=float, default=60.0)
    p.add_argument("--window-s", type=float, default=300.0)
    p.add_argument("--startup-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    return p.parse_args(argv)


def window_plans(requests: list[SimRequest], profiles, slo: PlannerSlo, config: PlannerConfig, *, interval_s: float,
                 window_s: float, dispatch: Dispatch) -> list[dict]:
    """The planner's raw sizes at every interval, from the arrivals of the last ``window_s`` (no state: the size
    each window's traffic needs)."""
    out, end = [], max(r.arrival_s for r in requests)
    t = interval_s
    while t <= end + interval_s:
        seen = [r for r in requests if t - window_s <= r.arrival_s < t]
        if seen:
            traffic = traffic_of(seen, span_s=min(window_s, t))
            plan = plan_pools(slo, traffic, *profiles, config=config, dispatch=dispatch)
            out.append({"t_s": t, "rate_per_s": traffic.rate_per_s, "prefill": plan.prefill, "decode": plan.decode})
        t += interval_s
    return out


def md1_split_p90_s(rate_per_s: float, service_s: float, workers: int) -> float:
    """The planner's prefill model before issue 23: ``workers`` separate M/D/1 queues at the mean prompt's time."""
    rho = rate_per_s * service_s / workers
    if rho >= 1:
        return math.inf
    return service_s + (service_s * math.log(10 * rho) / (2 * (1 - rho)) if rho > 0.1 else 0.0)


def predicted(traffic: Traffic, prefill: PrefillProfile, workers: int) -> dict[str, float]:
    """TTFT p90 the planner predicts for ``workers`` prefill workers (every prompt remote, uncached): M/G/n over the
    prompt mix (pooled dispatch), n x M/G/1 (split), and the M/D/1s it used before (the judge is the simulated TTFT
    p90 beside them)."""
    services = service_mix(prefill, traffic.mean_isl, traffic.isl_mix)
    mean_prompt_s = prefill.service_time_s(traffic.mean_isl)
    return {"mgn_ms": prefill_ttft_p90_s(traffic.rate_per_s, services, workers, "pooled")[1] * 1e3,
            "split_ms": prefill_ttft_p90_s(traffic.rate_per_s, services, workers, "split")[1] * 1e3,
            "md1_split_ms": md1_split_p90_s(traffic.rate_per_s, mean_prompt_s, workers) * 1e3}


def sweep(base: ClusterConfig, requests: list[SimRequest], slo: Slo, prefill: list[int], decode: list[int],
          profile: PrefillProfile, out=sys.stderr) -> list[dict]:
    """For each decode size, prefill sizes upward until the SLOs are met."""
    rows, traffic = [], traffic_of(requests)
    for d in decode:
        for p in prefill:
            result = simulate(dataclasses.replace(base, num_prefill=p, num_decode=d), requests, slo)
            rows.append({**row_of(f"fixed {p}P+{d}D", p, d, result.summary),
                         "planner_ttft_p90_ms": predicted(traffic, profile, p)})
            out.write(f"fixed {p}P+{d}D: attainment {result.summary['slo_attainment']:.1%} "
                      f"({result.wall_s:.0f} s)\n")
            if result.summary["slo_attainment"] >= slo.attainment:
                break
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    shape = shape_of(args)
    requests = [dataclasses.replace(r, arrival_s=r.arrival_s * args.time_scale) for r in requests_of(args, shape)]
    slo = Slo(ttft_s=args.slo_ttft_ms * 1e-3, tpot_s=args.slo_tpot_ms * 1e-3, attainment=args.attainment)
    policy = PolicyConfig(policy=args.policy, cost=CostConfig(ttft_target_s=slo.ttft_s, itl_target_s=slo.tpot_s))
    base = ClusterConfig(shape=shape, num_prefill=1, num_decode=1, policy=policy, seed=args.seed)
    model = base.build_time_model()
    kv_tokens = shape.num_blocks * shape.block_size
    profiles = profiles_for(requests, model, kv_tokens=kv_tokens)
    planner_slo = PlannerSlo(ttft_p90_s=slo.ttft_s, itl_p90_s=slo.tpot_s)
    planner_config = PlannerConfig(max_workers=512)
    dispatch = dispatch_of(args.policy)
    mean_plan = plan_pools(planner_slo, traffic_of(requests), *profiles, config=planner_config, dispatch=dispatch)
    windows = window_plans(requests, profiles, planner_slo, planner_config, interval_s=args.interval_s,
                           window_s=args.window_s, dispatch=dispatch)
    peak = (max(w["prefill"] for w in windows), max(w["decode"] for w in windows))
    rows = sweep(base, requests, slo, args.prefill, args.decode, profiles[0])
    for label, (p, d) in (("plan (mean)", (mean_plan.prefill, mean_plan.decode)), ("plan (peak)", peak)):
        result = simulate(dataclasses.replace(base, num_prefill=p, num_decode=d), requests, slo)
        rows.append(row_of(label, p, d, result.summary))
    elastic = ElasticConfig(interval_s=args.interval_s, window_s=args.window_s, startup_s=args.startup_s,
                            planner=planner_config)
    start = dataclasses.replace(base, num_prefill=mean_plan.prefill, num_decode=mean_plan.decode)
    driven = ElasticSimulation(start, requests, slo, elastic, profiles=profiles).run()
    sizes = [(h["live"]["prefill"], h["live"]["decode"]) for h in driven.plan_history]
    rows.append(row_of("planner", sizes, None, driven.summary))
    doc = {"command": ["baton", "simulate", "pools", *(sys.argv[1:] if argv is None else argv)],
           "config": {"gpu": shape.gpu.name, "model": shape.model.name, "tp": shape.tp, "block_size": shape.block_size,
                      "trace": str(args.trace), "requests": len(requests), "policy": args.policy,
                      "dispatch": dispatch,
                      "slo": dataclasses.asdict(slo), "elastic": {"interval_s": args.interval_s,
                                                                  "window_s": args.window_s,
                                                                  "startup_s": args.startup_s}},
           "traffic": dataclasses.asdict(traffic_of(requests)), "mean_plan_explain": mean_plan.explain(),
           "window_plans": windows, "rows": rows, "planner_history": driven.plan_history}
    print_pools(doc, sys.stdout)
    if args.json is not None:
        write_json(args.json, doc)
    if args.plot is not None:
        plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
