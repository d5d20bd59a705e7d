"""``baton simulate``: replay a trace (or a synthetic workload) against modelled workers with Baton's real router.

    baton simulate --trace FILE --prefill-workers N --decode-workers M --policy NAME [--json OUT]
                   [--gpu H200] [--model llama-3-8b] [--tp auto] [--link rdma] [--time-scale 1[,0.5,...]]
                   [--length-scale 1] [--limit N] [--explain] [--plot OUT.png] [--profile CURVES.json]

``--policy`` takes one policy, a comma list or ``all`` (a per-policy comparison); ``--time-scale`` a comma
list sweeps the request rate, and with more than one the DistServe goodput (the highest rate served with
``--attainment`` of requests inside both SLOs) is reported per policy. Prints a table; ``--json`` writes
every figure with the configuration and the time model's terms. ``--profile`` prices steps from curves
``baton admin profile -o FILE`` measured instead of the roofline (a step's fixed cost fitted from them, paid once
per step). Subcommands: ``baton simulate check`` (the simulator calibrated here and checked against real runs,
``bench/sim_check.py``) and ``baton simulate pools`` (the planner judged at scale, ``sim/pools.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from workload.trace import Scale, load_trace
from kv_transfer.hashing import root_hash
from router.admin.queueing import dispatch_of
from router.routing.cost_model import CostConfig
from router.routing.policy import POLICIES, PolicyConfig
from sim.cluster import PLACEMENTS, ClusterConfig
from sim.hardware import GPUS, LINKS, MODELS, WorkerShape, default_tp
from sim.metrics import Slo, distserve_goodput
from sim.plan import curves_from_profile, plan_dict, plan_for
from sim.report import plot, print_report, write_json
from sim.simulation import simulate
from sim.timing import Chunk, CurveTimeModel, Efficiency, TimeModel, fit_step_overhead_s
from sim.workload import SYNTHETIC, SimRequest, from_trace, synthetic


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="baton simulate", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace")
    src.add_argument("--workload", choices=SYNTHETIC, help="a synthetic workload instead of a trace")
    p.add_argument("--limit", type=int, default=None, help="the trace's first N requests")
    p.add_argument("--num-requests", type=int, default=200, help="synthetic: how many")
    p.add_argument("--rate", type=float, default=4.0, help="synthetic: mean request rate (req/s, Poisson)")
    p.add_argument("--time-scale", default="1", help="multiply arrival times (comma list: a rate sweep)")
    p.add_argument("--length-scale", type=int, default=1, help="divide lengths (a trace block = 512/N tokens)")
    p.add_argument("--prefill-workers", type=int, required=True)
    p.add_argument("--decode-workers", type=int, required=True)
    p.add_argument("--policy", default="cost", help=f"one of {', '.join(POLICIES)}, a comma list, or all")
    p.add_argument("--gpu", choices=sorted(GPUS), default="H200")
    p.add_argument("--model", choices=sorted(MODELS), default="llama-3-8b")
    p.add_argument("--tp", default="auto", help="GPUs per worker (auto: fewest that hold the weights)")
    p.add_argument("--block-size", type=int, default=None, help="KV block tokens (default: one trace block)")
    p.add_argument("--link", choices=sorted(LINKS), default="rdma", help="between hosts (NVLink within one)")
    p.add_argument("--gpus-per-host", type=int, default=8)
    p.add_argument("--placement", choices=PLACEMENTS, default="split")
    p.add_argument("--mfu", type=float, default=Efficiency().compute, help="achieved / peak FLOP/s")
    p.add_argument("--bandwidth-efficiency", type=float, default=Efficiency().memory)
    p.add_argument("--step-overhead-ms", type=float, default=Efficiency().step_overhead_s * 1e3)
    p.add_argument("--profile", type=Path, default=None, help="price steps from measured curves (admin profile -o)")
    p.add_argument("--cores-per-host", type=int, default=None, help="workers of a host share this many compute units "
                   "(CPU cores: this machine's workers; default: a device each)")
    p.add_argument("--router-ms", type=float, default=0.0, help="the router's own time per request (default: 0)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-events", type=int, default=None, help="bound of the run (default: scales with requests)")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--plot", type=Path, default=None, help="TTFT CDFs and SLO attainment vs rate (PNG)")
    p.add_argument("--explain", action="store_true", help="print the time model's terms and the planner's plan")
    return p.parse_args(argv)


def policies_of(text: str) -> list[str]:
    names = list(POLICIES) if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise ValueError(f"unknown policy {unknown}: choose from {', '.join(POLICIES)} or all")
    return names


def time_scales_of(text: str) -> list[float]:
    scales = [float(x) for x in text.split(",") if x.strip()]
    if not scales or any(not (x > 0 and x != float("inf")) for x in scales):
        raise ValueError(f"--time-scale needs positive numbers, got {text!r}")
    return scales


def shape_of(args: argparse.Namespace) -> WorkerShape:
    gpu, model = GPUS[args.gpu], MODELS[args.model]
    tp = default_tp(gpu, model) if args.tp == "auto" else int(args.tp)
    block_size = args.block_size or (Scale(length_scale=args.length_scale).block_tokens if args.trace else 16)
    return WorkerShape(gpu=gpu, model=model, tp=tp, block_size=block_size)


def requests_of(args: argparse.Namespace, shape: WorkerShape) -> list[SimRequest]:
    root = root_hash(shape.model.fingerprint, shape.block_size)
    vocab = shape.model.vocab_size
    if args.trace is not None:
        trace = load_trace(args.trace, limit=args.limit)
        return from_trace(trace, Scale(length_scale=args.length_scale), block_size=shape.block_size, root=root,
                          vocab_size=vocab)
    return synthetic(args.workload, args.num_requests, rate_per_s=args.rate, seed=args.seed,
                     block_size=shape.block_size, root=root, vocab_size=vocab)


def time_model_of(args: argparse.Namespace, base: ClusterConfig) -> TimeModel:
    if args.profile is None:
        return base.build_time_model()
    prefill, decode = curves_from_profile(json.loads(args.profile.read_text(encoding="utf-8")))
    return CurveTimeModel(prefill, decode, overhead_s=fit_step_overhead_s(prefill))


def explain_of(model: TimeModel, shape: WorkerShape, requests: list[SimRequest]) -> dict:
    isl = round(sum(r.prompt_tokens for r in requests) / len(requests))
    out: dict = {"model_params": float(shape.model.num_params), "weight_bytes": float(shape.model.weight_bytes),
                 "kv_bytes_per_token": shape.layout.bytes_per_block / shape.block_size,
                 f"prefill of the mean prompt ({isl} tokens)": model.explain(0, 0, [Chunk(isl, 0)])}
    for batch in (1, 16, 64):
        out[f"decode step, batch {batch} x {isl} tokens"] = model.explain(batch, batch * isl)
    return out


def run_all(args: argparse.Namespace, base: ClusterConfig, requests: list[SimRequest], slo: Slo,
            out=sys.stderr) -> list[tuple[dict, list]]:
    runs = []
    for time_scale in time_scales_of(args.time_scale):
        scaled = [dataclasses.replace(r, arrival_s=r.arrival_s * time_scale) for r in requests]
        for name in policies_of(args.policy):
            policy = PolicyConfig(policy=name, cost=CostConfig(ttft_target_s=slo.ttft_s, itl_target_s=slo.tpot_s))
            result = simulate(dataclasses.replace(base, policy=policy), scaled, slo, max_events=args.max_events)
            runs.append(({"policy": name, "time_scale": time_scale, "summary": result.summary,
                          "decision_ms": result.decision_ms, "policy_ms": result.policy_ms, "events": result.events,
                          "wall_s": result.wall_s, "learned": result.learned}, result.records))
            out.write(f"simulated {name} at time scale {time_scale:g}: {len(scaled)} requests, {result.events:,} "
                      f"events in {result.wall_s:.1f} s\n")
    return runs


def config_dict(args: argparse.Namespace, base: ClusterConfig, slo: Slo) -> dict:
    shape = base.shape
    workload = str(args.trace) if args.trace else f"{args.workload} x {args.num_requests} at {args.rate} req/s"
    return {"gpu": shape.gpu.name, "model": shape.model.name, "tp": shape.tp, "block_size": shape.block_size,
            "num_blocks": shape.num_blocks, "kv_bytes_per_block": shape.layout.bytes_per_block,
            "prefill_workers": base.num_prefill, "decode_workers": base.num_decode, "gpus": base.num_gpus,
            "intra_link": dataclasses.asdict(base.intra_link), "inter_link": dataclasses.asdict(base.inter_link),
            "placement": base.placement, "efficiency": dataclasses.asdict(base.efficiency),
            "time_model": f"curves from {args.profile}" if args.profile else "roofline", "workload": workload,
            "length_scale": args.length_scale, "time_scales": args.time_scale, "seed": args.seed,
            "slo": {"ttft_ms": slo.ttft_s * 1e3, "tpot_ms": slo.tpot_s * 1e3, "attainment": slo.attainment},
            "gpu_spec": dataclasses.asdict(shape.gpu), "model_spec": dataclasses.asdict(shape.model)}


def setup(args: argparse.Namespace) -> tuple[ClusterConfig, list[SimRequest], Slo]:
    """The run's cluster, requests and SLOs from the flags; ValueError / OSError on bad input."""
    shape = shape_of(args)
    policies_of(args.policy)
    time_scales_of(args.time_scale)
    requests = requests_of(args, shape)
    if not requests:
        raise ValueError("no requests to simulate")
    slo = Slo(ttft_s=args.slo_ttft_ms * 1e-3, tpot_s=args.slo_tpot_ms * 1e-3, attainment=args.attainment)
    base = ClusterConfig(shape=shape, num_prefill=args.prefill_workers, num_decode=args.decode_workers,
                         efficiency=Efficiency(compute=args.mfu, memory=args.bandwidth_efficiency,
                                               step_overhead_s=args.step_overhead_ms * 1e-3),
                         inter_link=LINKS[args.link], gpus_per_host=args.gpus_per_host, placement=args.placement,
                         cores_per_host=args.cores_per_host, router_s=args.router_ms * 1e-3, seed=args.seed)
    return dataclasses.replace(base, time_model=time_model_of(args, base)), requests, slo


SUBCOMMANDS = {"pools": "sim.pools"}  # `baton simulate check` runs real processes too: bench.sim_check (deploy.cli)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        return int(importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:]) or 0)
    args = parse(argv)
    try:
        base, requests, slo = setup(args)
        plan, traffic = plan_for(requests, base.time_model, slo,  # the first policy's queue (the terms name it)
                                 kv_tokens=base.shape.num_blocks * base.shape.block_size,
                                 dispatch=dispatch_of(policies_of(args.policy)[0]))
    except (ValueError, OSError) as exc:  # InvalidRequest (a planner input) is a ValueError too
        print(f"baton simulate: {exc}", file=sys.stderr)
        return 2
    runs = run_all(args, base, requests, slo)
    doc = {"command": ["baton", "simulate", *argv],
           "config": config_dict(args, base, slo), "explain": explain_of(base.time_model, base.shape, requests),
           "planner": plan_dict(plan, traffic), "runs": [run for run, _ in runs]}
    if len({run["time_scale"] for run, _ in runs}) > 1:
        doc["distserve_goodput"] = {p: distserve_goodput([(r["summary"]["request_rate"], r["summary"]) for r, _ in runs
                                                          if r["policy"] == p], slo.attainment)
                                    for p in policies_of(args.policy)}
    print_report(doc, sys.stdout, explain=args.explain)
    if args.json is not None:
        write_json(args.json, doc)
    if args.plot is not None:
        plot(runs, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
