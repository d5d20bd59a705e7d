"""``baton simulate check``: the simulator calibrated on this machine, then checked against real runs of the same
workload, per routing policy (issue 23, item 2).

    baton simulate check [--trace tests/data/conversation_trace_head300.jsonl] [--limit 150] [--time-scale 0.5]
                         [--prefill 2] [--decode 2] [--policies cost,least_loaded,round_robin] [--num-blocks 1024]
                         [--reuse OUT.json] [--out bench/results/sim_check]

1. Calibration (``sim/calibration.py`` says each term and what it is fitted from): a ``baton up`` of the same
   layout, idle; ``baton admin profile -o FILE`` measures its workers' curves; a few probe requests through the
   router, one at a time, time the router's own share and the KV pull; a training replay of the trace's next
   ``--limit`` requests (none of those compared) times how the router's share grows with requests in flight.
   The platform is stopped.
2. Real: per policy a fresh ``baton up`` (``--policy``, the tiny model, 1 torch thread per worker, cold caches), the
   trace slice replayed open-loop at its scaled arrival times by ``bench trace``'s client (exact token ids), the
   platform stopped; the machine's load average before and after.
3. Simulated: the same requests (the replay's own token ids, hashed as the router hashes them), the same layout
   and policy, on the calibrated model.
Prints, per policy, TTFT p50 / p90 and hit rate real vs simulated with the error (sim / real - 1), whether the
policies rank the same, and the same table for the simulator with the calibrated terms taken away one at a time
(what each one is worth). Writes OUT/sim_check.json. ``--reuse`` takes the calibration and the real runs of an
earlier JSON and simulates again (no processes started). This lives in ``sim/`` because the simulator sits above
the benches: bench never imports sim, so ``python -m bench`` cannot name it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from workload.trace import Scale, block_token_ids, load_trace
from bench.trace_replay.grpc_client import WARMUP_HASH_BASE, probe, replay_grpc
from bench.trace_replay.outcomes import summarize as summarize_replay
from bench.trace_replay.report import loadavg
from bench.trace_replay.slice import ReplayRequest, scaled_requests
from bench.trace_replay.up import ROOT, Up
from kv_transfer.hashing import hash_blocks, root_hash
from router.routing.cost_model import CostConfig
from router.routing.policy import POLICIES, PolicyConfig
from sim.calibration import (CPU, Calibration, Probe, Served, calibrate, compare, figures_of_real, figures_of_sim,
                             in_flight_at_send)
from bench.sim_check_report import ablations, print_check
from sim.cluster import ClusterConfig
from sim.cpu_load import RunnableSampler
from sim.hardware import MODELS, WorkerShape
from sim.metrics import Slo
from sim.simulation import simulate
from sim.workload import SimRequest

MODEL = MODELS["tiny"]
BLOCK_SIZE = 16
PROBE_LENS = (32, 32, 128, 512, 1024, 1900)  # 32 stays under the disaggregation threshold: local prefills


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="baton simulate check", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=ROOT / "tests" / "data" / "conversation_trace_head300.jsonl")
    p.add_argument("--limit", type=int, default=150, help="the trace's first N requests")
    p.add_argument("--length-scale", type=int, default=32, help="divide lengths (32: a trace block = a KV block)")
    p.add_argument("--time-scale", type=float, default=0.5, help="multiply arrival times")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--policies", default="cost,least_loaded,round_robin")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks of 16 tokens per worker")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="also the cost policy's TTFT target")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="also the cost policy's ITL target")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="cores the workers share")
    p.add_argument("--passes", type=int, default=1, help="real runs per policy (every other pass in reverse order); "
                   "each policy is compared on its run with the least load from other programs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse", type=Path, default=None, help="calibration and real runs from an earlier JSON")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sim_check")
    args = p.parse_args(argv)
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    return args


# ---- the workload, as the replay sends it and as the simulator takes it -----------------------------------------
def replay_slice(args: argparse.Namespace, start: int = 0) -> list[ReplayRequest]:
    trace = load_trace(args.trace, limit=start + args.limit)[start:]
    scale = Scale(length_scale=args.length_scale, time_scale=args.time_scale)
    return scaled_requests(trace, scale, vocab_size=MODEL.vocab_size, max_model_len=MODEL.max_model_len)


def sim_requests(replay: list[ReplayRequest]) -> list[SimRequest]:
    """The replay's requests with their own token ids' block hashes (prompts cut to the context stay cut)."""
    root = root_hash(MODEL.fingerprint, BLOCK_SIZE)
    return [SimRequest(f"r{r.index}", r.arrival_s, len(r.prompt), r.max_tokens,
                       tuple(hash_blocks(r.prompt, BLOCK_SIZE, root))) for r in replay]


# ---- real: calibration platform, then one platform per policy ----------------------------------------------------
def _flags(args: argparse.Namespace, policy: str) -> list[str]:
    return ["--policy", policy, "--num-threads", "1", "--num-blocks", str(args.num_blocks), "--block-size",
            str(BLOCK_SIZE), "--ttft-target-ms", str(args.slo_ttft_ms), "--itl-target-ms", str(args.slo_tpot_ms)]


def _up(args: argparse.Namespace, policy: str, tag: str) -> Up:
    log_dir = Path(tempfile.mkdtemp(prefix=f"sim-check-{tag}-"))
    print(f"[{tag}] baton up --prefill {args.prefill} --decode {args.decode} {' '.join(_flags(args, policy))} "
          f"(logs: {log_dir})", file=sys.stderr, flush=True)
    return Up.start("tiny", _flags(args, policy), log_dir, prefill=args.prefill, decode=args.decode)


def measure_calibration(args: argparse.Namespace) -> dict[str, Any]:
    """Profile the idle workers (``baton admin profile``) and probe the router, on a platform of the run's layout."""
    args.out.mkdir(parents=True, exist_ok=True)
    profile_file = args.out / "profile.json"
    up = _up(args, "round_robin", "calibration")  # every probe above the threshold goes remote: pulls to time
    try:
        load_before = loadavg()
        cmd = [sys.executable, "-m", "deploy.cli", "admin", "--router", up.grpc_address, "--timeout", "120",
               "profile", "-o", str(profile_file), "--no-store", "--prompt-lens", "16,32,64,128,256,512,1024,2000",
               "--batch-sizes", "1,2,4,8,16", "--contexts", "64,256,512,1024", "--repeats", "5"]
        subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        probes = _probes(up.grpc_address)
        training = replay_slice(args, start=args.limit)  # the next requests: none of them is compared
        outcomes, _ = asyncio.run(replay_grpc(up.grpc_address, training, vocab_size=MODEL.vocab_size,
                                              request_timeout_s=120.0, max_run_s=180.0, label="training"))
        return {"profile": json.loads(profile_file.read_text()), "probes": [dataclasses.asdict(p) for p in probes],
                "training": training_samples(training, outcomes),
                "served": [dataclasses.asdict(s) for s in served_of(outcomes)], "loadavg_before": load_before,
                "loadavg_after": loadavg()}
    finally:
        up.stop()


def _probes(address: str, repeats: int = 3) -> list[Probe]:
    """PROBE_LENS ``repeats + 1`` times, each prompt fresh (no cache holds it); the first round warms the path."""
    lens = PROBE_LENS * (repeats + 1)
    prompts = [block_token_ids(WARMUP_HASH_BASE + 10_000 + i, n, MODEL.vocab_size).tolist()
               for i, n in enumerate(lens)]
    return [Probe(**p) for p in asyncio.run(probe(address, prompts))[len(PROBE_LENS):]]


def training_samples(replay: list[ReplayRequest], outcomes) -> list[tuple[int, float]]:
    """(requests in flight at its send, client TTFT - the worker's prefill_ms in s) of each request that finished."""
    done = [(r, o) for r, o in zip(replay, outcomes) if o.ok]
    flights = in_flight_at_send([(r.arrival_s, r.arrival_s + o.e2e_s) for r, o in done])
    return [(n, o.ttft_s - o.prefill_ms * 1e-3) for n, (_, o) in zip(flights, done)]


def served_of(outcomes) -> list[Served]:
    """The training replay's finished requests as the loaded hops' fit takes them."""
    return [Served(route_kind=o.route_kind, prompt_tokens=o.prompt_tokens, cached_tokens=o.cached_tokens,
                   ttft_s=o.ttft_s, prefill_ms=o.prefill_ms) for o in outcomes if o.ok and o.prefill_ms > 0]


def run_real(args: argparse.Namespace, policy: str, replay: list[ReplayRequest]) -> dict[str, Any]:
    load_before = loadavg()
    up = _up(args, policy, policy)
    try:
        with RunnableSampler({up.popen.pid}) as sampler:
            outcomes, duration_s = asyncio.run(replay_grpc(up.grpc_address, replay, vocab_size=MODEL.vocab_size,
                                                           request_timeout_s=120.0, max_run_s=180.0, label=policy))
    finally:
        up.stop()
    summary = summarize_replay(outcomes, duration_s)
    summary.update(loadavg_before=load_before, loadavg_after=loadavg(), runnable=sampler.means(),
                   outcomes=[dataclasses.asdict(o) for o in outcomes])
    print(f"[{policy}] real: TTFT p50 {summary['ttft_ms']['p50']:.1f} ms, p90 {summary['ttft_ms']['p90']:.1f} ms, "
          f"hit rate {summary['hit_rate']:.3f}, {summary['completed']}/{summary['requests']} done, load "
          f"{load_before} -> {summary['loadavg_after']}, runnable {summary['runnable']}", file=sys.stderr, flush=True)
    return summary


# ---- simulated -------------------------------------------------------------------------------------------------
def cluster_config(args: argparse.Namespace, calibration: Calibration, policy: str) -> ClusterConfig:
    shape = WorkerShape(gpu=CPU, model=MODEL, tp=1, block_size=BLOCK_SIZE, kv_blocks=args.num_blocks)
    cost = CostConfig(ttft_target_s=args.slo_ttft_ms * 1e-3, itl_target_s=args.slo_tpot_ms * 1e-3)
    workers = args.prefill + args.decode
    router_host = _router_host(calibration)
    return ClusterConfig(shape=shape, num_prefill=args.prefill, num_decode=args.decode,
                         policy=PolicyConfig(policy=policy, cost=cost), time_model=calibration.time_model(),
                         intra_link=calibration.link, inter_link=calibration.link, gpus_per_host=workers,
                         placement="mixed", rpc_s=calibration.rpc_s, router_host=router_host,
                         router_s=calibration.router_s if router_host is not None else calibration.loaded_router_s(),
                         router_per_stream_s=calibration.router_per_stream_s * calibration.sharing(),
                         local_return_s=calibration.local_return_s, remote_return_s=calibration.remote_return_s,
                         local_handoff_s=calibration.local_handoff_s,
                         cores_per_host=calibration.cores, background_load=calibration.background,
                         prefill_step_tokens=2048, decode_chunk_tokens=2048,
                         max_segment_steps=4, seed=args.seed)


def _router_host(calibration: Calibration) -> int | None:
    """The router and the client run on the workers' host (every worker is on host 0 here)."""
    return 0 if calibration.cores is not None and calibration.router_beside_workers else None


def background_of(real: dict[str, Any]) -> float:
    """The runnable tasks beside ours during the run (``sim/cpu_load.py``); a run recorded without them: the
    1-minute load average before its platform started (which may still hold our previous run)."""
    if "runnable" in real:
        return real["runnable"]["others"]
    return float(str(real["loadavg_before"]).split()[0])


def run_sim(args: argparse.Namespace, config: ClusterConfig, requests: list[SimRequest]) -> dict[str, Any]:
    slo = Slo(ttft_s=args.slo_ttft_ms * 1e-3, tpot_s=args.slo_tpot_ms * 1e-3)
    return simulate(config, requests, slo).summary


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    policies = args.policies.split(",")
    replay = replay_slice(args)
    requests = sim_requests(replay)
    context = sum(len(r.prompt) + r.max_tokens / 2 for r in replay) / len(replay)
    if args.reuse is not None:
        earlier = json.loads(args.reuse.read_text())
        measured, real = earlier["calibration"]["measured"], earlier["real"]
    else:
        measured = measure_calibration(args)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
        for k in range(args.passes):
            for name in policies if k % 2 == 0 else policies[::-1]:
                runs[name].append(run_real(args, name, replay))
        real = {name: min(rs, key=background_of) for name, rs in runs.items()}  # the quietest run of each
    fitted = calibrate(measured["profile"], [Probe(**p) for p in measured["probes"]], context_tokens=context,
                       cores=args.cores, training=[tuple(x) for x in measured.get("training", ())],
                       served=[Served(**x) for x in measured.get("served", ())])
    calibration = dataclasses.replace(fitted, router_per_stream_s=0.0)  # reported, not used: see the docs
    loaded = {n: dataclasses.replace(calibration, background=background_of(real[n])) for n in policies}
    sim = {n: run_sim(args, cluster_config(args, loaded[n], n), requests) for n in policies}
    comparison = compare({n: figures_of_real(real[n]) for n in policies}, {n: figures_of_sim(sim[n]) for n in policies})
    variants = {n: ablations(loaded[n], fitted.router_per_stream_s) for n in policies}
    ablated = {label: compare({n: figures_of_real(real[n]) for n in policies},
                              {n: figures_of_sim(run_sim(args, cluster_config(args, variants[n][label], n), requests))
                               for n in policies}) for label in variants[policies[0]]}
    doc = {"command": ["baton", "simulate", "check", *(sys.argv[1:] if argv is None else argv)],
           "workload": {"trace": str(args.trace), "limit": args.limit, "length_scale": args.length_scale,
                        "time_scale": args.time_scale, "requests": len(replay), "mean_context_tokens": context},
           "layout": {"prefill": args.prefill, "decode": args.decode, "num_blocks": args.num_blocks},
           "calibration": {"measured": measured, "terms": fitted.terms()},
           "real": real, "sim": sim, "comparison": comparison, "ablations": ablated,
           "real_passes": {n: [{k: v for k, v in r.items() if k != "outcomes"} for r in rs] for n, rs in runs.items()}
           if args.reuse is None else earlier.get("real_passes", {})}
    print_check(doc, sys.stdout)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_check.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"wrote {args.out / 'sim_check.json'}")
    return 0


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    sys.exit(code)
