"""Routing policies on a shared-prefix workload: the cost model vs the baselines, same arrivals, cold caches.

    python -m bench.routing [--policies cost,round_robin,random,prefix_overlap,least_loaded]
                            [--conversations 24] [--turns 3] [--rate 4] [--max-tokens 16]
                            [--model tiny|small|PATH]

Starts a private redis-server; for each policy a fresh namespace with 2 prefill + 2 decode workers (the
tiny model by default; ``--model small`` is ~30x costlier per token, where prefix reuse moves TTFT;
1 torch thread, block size 16) and a router started with ``--policy``, so every policy
starts with empty prefix caches. Workload (token ids, greedy): a few long system prompts, several users
each, multi-turn conversations (each turn's prompt = system prompt + history + new user text), sent
open-loop at Poisson arrivals (seeded, identical for every policy). Reports per policy: prefix cache hit
rate (sum of ``usage.cached_prompt_tokens`` / sum of prompt tokens) against the oracle (each request's
longest block-aligned prefix seen in any earlier request), TTFT p50/p90, ITL p50/p99 (per-token arrival
times of the streams) and output tokens/s. Writes bench/results/routing.json and routing.png (``--out``).

``--repeats N`` runs N workloads (seeds ``--seed`` .. ``--seed + N - 1``; each policy on the same arrivals
within a repeat, the policies' order rotated from one repeat to the next), pools every request of a policy
for its figures, and compares the first policy with each other one on every figure with a paired two-level
bootstrap (repeats with replacement, then requests within each; the same picks for both policies): the 95%
interval of the difference is the noise, run to run and request to request, that a comparison has to beat.
"Worse by more than noise" = the whole interval on the worse side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.client import greedy_request, stream_generate
from workload.plots import pyplot
from deploy.up import Child, spawn, start_redis, stop_all
from kv_transfer.ports import free_port
from proto import baton_pb2_grpc as pb_grpc
from router.routing.policy import POLICIES

RESULTS = Path(__file__).parent / "results"
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Planned:
    arrival_s: float
    conversation: int
    turn: int
    prompt: list[int]


@dataclass(slots=True)
class Outcome:
    ttft_s: float
    itl_s: list[float]
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    finished_s: float
    route_kind: str
    decode_worker: str
    prefill_worker: str = ""
    queue_ms: float = 0.0  # the computing worker's engine queue
    prefill_ms: float = 0.0  # the computing worker's queue + compute
    predicted_ttft_ms: float = 0.0
    route_reason: str = ""
    conversation: int = 0
    turn: int = 0


# ---- workload (pure) ----------------------------------------------------------------------------
def build_workload(args: argparse.Namespace) -> list[Planned]:
    """Conversations over ``args.systems`` system prompts; turn k of a conversation arrives after turn k-1."""
    rng = random.Random(args.seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(4, 4096) for _ in range(n)]

    systems = [text(args.system_tokens) for _ in range(args.systems)]
    prompts: dict[tuple[int, int], list[int]] = {}
    for c in range(args.conversations):
        history = list(systems[c % args.systems])
        for turn in range(args.turns):
            history += text(rng.randint(24, 48))  # the user's new message
            prompts[c, turn] = list(history)
            history += text(args.max_tokens)  # the assistant's reply (fixed, so prompts match across policies)
    order = [c for c in range(args.conversations) for _ in range(args.turns)]
    rng.shuffle(order)
    t, seen, planned = 0.0, {c: 0 for c in range(args.conversations)}, []
    for c in order:
        t += rng.expovariate(args.rate)
        planned.append(Planned(t, c, seen[c], prompts[c, seen[c]]))
        seen[c] += 1
    return planned


def oracle_cached_tokens(planned: list[Planned]) -> list[int]:
    """Per request, the longest block-aligned prefix some earlier request had (at most prompt - 1 tokens)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for req in planned:
        blocks = (len(req.prompt) - 1) // BLOCK_SIZE
        prefixes = [tuple(req.prompt[: (i + 1) * BLOCK_SIZE]) for i in range(len(req.prompt) // BLOCK_SIZE)]
        hit = next((i for i in range(blocks) if prefixes[i] not in seen), blocks)
        out.append(hit * BLOCK_SIZE)
        seen.update(prefixes)
    return out


# ---- platform -----------------------------------------------------------------------------------
def start_platform(redis_url: str, model: str, policy: str, log_dir: Path, children: list[Child],
                   num_blocks: int = 2048, tag: str | None = None) -> str:
    """2 prefill + 2 decode workers and a router in namespace ``bench-{tag}`` (default: the policy's name);
    the router's address."""
    tag = tag or policy
    common = ["--redis-url", redis_url, "--model", model, "--namespace", f"bench-{tag}"]
    for role in ("prefill", "decode"):
        for i in range(2):
            worker_id = f"{tag}-{role[0]}{i}"
            spawn(worker_id, [role, *common, "--port", str(free_port()), "--worker-id", worker_id,
                              "--num-threads", "1", "--block-size", str(BLOCK_SIZE), "--num-blocks", str(num_blocks)],
                  log_dir, children)
    port = free_port()
    spawn(f"router-{tag}", ["router", *common, "--port", str(port), "--policy", policy,
                                     "--http-port", "0", "--metrics-port", "0"], log_dir, children)
    return f"127.0.0.1:{port}"


async def wait_for_workers(redis_url: str, ns: str, count: int, children: list[Child], timeout_s: float = 120) -> None:
    from kv_transfer.registry import Registry, connect

    redis = connect(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while len(await Registry(redis, ns).list_workers()) < count:
            dead = [c.name for c in children if c.popen.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"platform did not come up (exited: {dead}); see the logs")
            await asyncio.sleep(0.3)
    finally:
        await redis.aclose()


# ---- client -------------------------------------------------------------------------------------
async def _send(stub, req: Planned, max_tokens: int, start_s: float) -> Outcome:
    await asyncio.sleep(max(0.0, start_s + req.arrival_s - time.perf_counter()))
    stream = await stream_generate(stub, greedy_request(req.prompt, max_tokens))
    sent, times, last = stream.sent_s, stream.token_times_s, stream.last
    itl = [b - a for a, b in zip(times, times[1:])]
    return Outcome(ttft_s=times[0] - sent, itl_s=itl, prompt_tokens=len(req.prompt),
                   cached_tokens=last.usage.cached_prompt_tokens, output_tokens=len(times),
                   finished_s=times[-1] - start_s, route_kind=last.timings.route_kind,
                   decode_worker=last.timings.decode_worker, prefill_worker=last.timings.prefill_worker,
                   queue_ms=last.timings.queue_ms, prefill_ms=last.timings.prefill_ms,
                   predicted_ttft_ms=last.timings.predicted_ttft_ms, route_reason=last.timings.route_reason,
                   conversation=req.conversation, turn=req.turn)


async def run_policy(router: str, planned: list[Planned], max_tokens: int) -> list[Outcome]:
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pb_grpc.GenerationStub(channel)
        warm = random.Random(99)
        for i in range(4):  # warm up the path with prompts that share nothing with the workload
            async for _ in stub.Generate(greedy_request([warm.randrange(4, 4096) for _ in range(40)], 4)):
                pass
        start_s = time.perf_counter()
        return await asyncio.gather(*(_send(stub, req, max_tokens, start_s) for req in planned))


# ---- report -------------------------------------------------------------------------------------
def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def figures(outcomes: list[Outcome]) -> dict[str, float]:
    """The compared figures of a set of requests (also of a bootstrap resample)."""
    ttft = [o.ttft_s for o in outcomes]
    itl = [x for o in outcomes for x in o.itl_s]
    return {
        "hit_rate": sum(o.cached_tokens for o in outcomes) / sum(o.prompt_tokens for o in outcomes),
        "ttft_p50_ms": _pct(ttft, 0.5) * 1e3, "ttft_p90_ms": _pct(ttft, 0.9) * 1e3,
        "itl_p50_ms": _pct(itl, 0.5) * 1e3, "itl_p99_ms": _pct(itl, 0.99) * 1e3,
    }


HIGHER_IS_BETTER = {"hit_rate"}


def summarize(outcomes: list[Outcome], runs: list[list[Outcome]] | None = None) -> dict:
    """``outcomes``: every request of a policy; ``runs``: the same split per repeat (throughput is per run)."""
    runs = runs or [outcomes]
    kinds = {k: sum(o.route_kind == k for o in outcomes) for k in ("remote", "local")}
    decodes = sorted({o.decode_worker for o in outcomes})
    tokens_per_s = [sum(o.output_tokens for o in run) / max(o.finished_s for o in run) for run in runs]
    return {
        "requests": len(outcomes), **figures(outcomes),
        "output_tokens_per_s": sum(tokens_per_s) / len(tokens_per_s),
        "routes": kinds, "per_decode": {d: sum(o.decode_worker == d for o in outcomes) for d in decodes},
    }


def paired_bootstrap(a_runs: list[list[Outcome]], b_runs: list[list[Outcome]], *, samples: int = 1000,
                     seed: int = 0) -> dict[str, dict[str, float]]:
    """Per figure: ``a - b`` on every request pooled, and its 95% interval over ``samples`` two-level
    resamples: repeats with replacement (run-to-run noise: the machine, the order), then requests within
    each (the same picks for both policies, which saw the same arrivals in a repeat)."""
    rng = random.Random(seed)
    point_a = figures([o for run in a_runs for o in run])
    point_b = figures([o for run in b_runs for o in run])
    diffs: dict[str, list[float]] = {k: [] for k in point_a}
    for _ in range(samples):
        repeats = [rng.randrange(len(a_runs)) for _ in a_runs]
        picks = [(r, [rng.randrange(len(a_runs[r])) for _ in a_runs[r]]) for r in repeats]
        fa = figures([a_runs[r][i] for r, idx in picks for i in idx])
        fb = figures([b_runs[r][i] for r, idx in picks for i in idx])
        for k in diffs:
            diffs[k].append(fa[k] - fb[k])
    out = {}
    for k, values in diffs.items():
        low, high = _pct(values, 0.025), _pct(values, 0.975)
        worse = low > 0 if k not in HIGHER_IS_BETTER else high < 0
        better = high < 0 if k not in HIGHER_IS_BETTER else low > 0
        out[k] = {"a": point_a[k], "b": point_b[k], "diff": point_a[k] - point_b[k], "ci95": [low, high],
                  "ratio": point_a[k] / point_b[k] if point_b[k] else float("nan"),
                  "verdict": "worse" if worse else "better" if better else "within noise"}
    return out


def per_request(outcome: Outcome, oracle_cached: int) -> dict:
    """One request's record for the JSON (its ITL gaps summarized)."""
    record = {k: getattr(outcome, k) for k in Outcome.__slots__ if k != "itl_s"}
    record.update(ttft_ms=round(outcome.ttft_s * 1e3, 1), oracle_cached_tokens=oracle_cached,
                  itl_max_ms=round(max(outcome.itl_s, default=0.0) * 1e3, 1),
                  itl_ms=[round(x * 1e3, 2) for x in outcome.itl_s])
    del record["ttft_s"]
    return record


def print_table(report: dict) -> None:
    print(f"\noracle hit rate {report['oracle_hit_rate']:.3f} ({report['requests']} requests, "
          f"{report['arrival_rate_per_s']} req/s, {report.get('repeats', 1)} repeat(s) pooled)")
    head = f"{'policy':<16}{'hit':>7}{'/oracle':>9}{'ttft p50':>10}{'p90':>8}{'itl p50':>9}{'p99':>8}{'tok/s':>8}"
    print(head + "   (ms)")
    oracle = report["oracle_hit_rate"] or float("nan")  # no prefix repeats in the workload: no ratio
    for name, s in report["policies"].items():
        print(f"{name:<16}{s['hit_rate']:>7.3f}{s['hit_rate'] / oracle:>9.2f}"
              f"{s['ttft_p50_ms']:>10.1f}{s['ttft_p90_ms']:>8.1f}{s['itl_p50_ms']:>9.1f}{s['itl_p99_ms']:>8.1f}"
              f"{s['output_tokens_per_s']:>8.1f}")


def oracle_ttft_floor(runs: dict[str, list[list[Outcome]]], oracles: list[list[int]],
                      neighbours: int = 15) -> dict[str, float] | None:
    """What a router that hits every prefix the oracle does could reach on TTFT p50 on this machine, from
    the run's own measurements: each request's TTFT is estimated as the median measured TTFT of the
    ``neighbours`` requests (any policy, any repeat) that computed the nearest number of prompt tokens to
    what the oracle leaves it to compute. A TTFT ratio below ``floor p50 / baseline p50`` is out of any
    router's reach here (the compute of the new tokens, on cores the workers share, is the floor)."""
    measured = sorted((o.prompt_tokens - o.cached_tokens, o.ttft_s * 1e3)
                      for rs in runs.values() for run in rs for o in run)
    if len(measured) < neighbours:
        return None
    some_policy = next(iter(runs.values()))
    estimates = []
    for run, oracle in zip(some_policy, oracles):
        for o, cached in zip(run, oracle):
            uncached = o.prompt_tokens - cached
            nearest = sorted(measured, key=lambda m: abs(m[0] - uncached))[:neighbours]
            estimates.append(_pct([t for _, t in nearest], 0.5))
    return {"ttft_p50_ms": _pct(estimates, 0.5), "neighbours": neighbours, "measured_requests": len(measured)}


def print_comparisons(report: dict) -> None:
    if floor := report.get("oracle_ttft_floor"):
        line = (f"\noracle-cache TTFT p50 estimate {floor['ttft_p50_ms']:.0f} ms (each request: the median TTFT of the "
                f"{floor['neighbours']} measured requests that computed the nearest number of tokens)")
        for name, s in report["policies"].items():
            line += f"; / {name} {floor['ttft_p50_ms'] / s['ttft_p50_ms']:.2f}"
        print(line)
    for pair, figs in report.get("comparisons", {}).items():
        print(f"\n{pair}: difference on the pooled requests [95% paired-bootstrap interval]")
        for k, c in figs.items():
            print(f"  {k:<12} {c['a']:>9.3f} vs {c['b']:>9.3f}  ratio {c['ratio']:.2f}  "
                  f"diff {c['diff']:+.3f} [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]  {c['verdict']}")


def plot(ttfts: dict[str, list[float]], path: Path, model: str = "tiny") -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in ttfts.items():
        xs = sorted(v * 1e3 for v in values)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title=f"TTFT CDF per routing policy (2P+2D, {model})")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


# ---- main ---------------------------------------------------------------------------------------
def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="cost,round_robin,random,prefix_overlap,least_loaded")
    p.add_argument("--systems", type=int, default=4, help="distinct system prompts")
    p.add_argument("--system-tokens", type=int, default=400)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="workloads (seeds --seed, --seed + 1, ...) per policy, pooled; with several, the first policy "
                   "is compared with each other one by a paired bootstrap")
    p.add_argument("--num-blocks", type=int, default=2048,
                   help="KV blocks of 16 tokens per worker; fewer than the workload's prefixes make caches evict")
    p.add_argument("--model", default="tiny", help="tiny | small (built offline on first use) | a checkpoint folder")
    p.add_argument("--out", default="routing", help="results file name: bench/results/OUT.json and OUT.png")
    args = p.parse_args(argv)
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}; choose from {POLICIES}")
    return args


def rotated(policies: list[str], repeat: int) -> list[str]:
    """Repeat r runs the policies starting at the r-th: no policy always runs first (or last) on the machine."""
    k = repeat % len(policies)
    return policies[k:] + policies[:k]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    report, outcomes, model = run(args)
    print_table(report)
    print_comparisons(report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path, png_path = RESULTS / f"{args.out}.json", RESULTS / f"{args.out}.png"
    json_path.write_text(json.dumps(report, indent=2))
    ttfts = {name: [o.ttft_s for o in out] for name, out in outcomes.items()}
    if plot(ttfts, png_path, Path(model).name):
        print(f"wrote {json_path} and {png_path}")
    return 0


def run(args: argparse.Namespace) -> tuple[dict, dict[str, list[Outcome]], str]:
    """Every policy on every repeat's workload: (the report, each policy's pooled outcomes, the model path)."""
    from engine.tiny import ensure_model

    model = str(ensure_model(args.model)) if args.model in ("tiny", "small") else args.model
    policies = args.policies.split(",")
    workloads = [build_workload(argparse.Namespace(**{**vars(args), "seed": args.seed + r}))
                 for r in range(args.repeats)]
    oracles = [oracle_cached_tokens(planned) for planned in workloads]
    oracle = sum(map(sum, oracles)) / sum(len(r.prompt) for planned in workloads for r in planned)
    log_dir = Path(tempfile.mkdtemp(prefix="baton-bench-routing-"))
    print(f"{args.repeats} x {len(workloads[0])} requests over ~{workloads[0][-1].arrival_s:.1f} s each; oracle hit "
          f"rate {oracle:.3f}; {args.num_blocks} KV blocks per worker; logs in {log_dir}", flush=True)
    redis_children: list[Child] = []
    runs: dict[str, list[list[Outcome]]] = {name: [] for name in policies}
    try:
        redis_url = start_redis(log_dir, redis_children)
        for r, planned in enumerate(workloads):
            for policy in rotated(policies, r):
                if args.repeats > 1:
                    print(f"[repeat {r + 1}/{args.repeats}, seed {args.seed + r}]", flush=True)
                runs[policy].append(_run_one(redis_url, model, policy, planned, args.max_tokens, log_dir,
                                             args.num_blocks, tag=f"{policy}-{r}"))
    finally:
        stop_all(redis_children)
    outcomes = {name: [o for run in rs for o in run] for name, rs in runs.items()}
    report = {"requests": sum(map(len, workloads)), "repeats": args.repeats, "arrival_rate_per_s": args.rate,
              "oracle_hit_rate": oracle,
              "workload": {k: v for k, v in vars(args).items() if k not in ("policies", "out")},
              "policies": {name: summarize(outcomes[name], runs[name]) for name in policies},
              "per_repeat": [{name: summarize(runs[name][r]) for name in policies} for r in range(args.repeats)],
              # every request of every policy, in arrival order per repeat: where it went and why, what it cost
              "per_request": {name: [{**per_request(o, cached), "repeat": r}
                                     for r, (run, oracle_r) in enumerate(zip(runs[name], oracles))
                                     for o, cached in zip(run, oracle_r)] for name in policies}}
    report["oracle_ttft_floor"] = oracle_ttft_floor(runs, oracles)
    if len(policies) > 1:
        first = policies[0]
        report["comparisons"] = {f"{first} vs {other}": paired_bootstrap(runs[first], runs[other])
                                 for other in policies[1:]}
    return report, outcomes, model


def _run_one(redis_url: str, model: str, policy: str, planned: list[Planned], max_tokens: int,
             log_dir: Path, num_blocks: int = 2048, tag: str | None = None) -> list[Outcome]:
    """A fresh platform for ``policy`` (cold caches, namespace ``bench-{tag}``), the workload, then the
    platform stopped."""
    children: list[Child] = []
    tag = tag or policy
    try:
        started = time.monotonic()
        router = start_platform(redis_url, model, policy, log_dir, children, num_blocks, tag=tag)
        asyncio.run(wait_for_workers(redis_url, f"bench-{tag}", 4, children))
        print(f"[{policy}] platform up in {time.monotonic() - started:.1f} s; sending ...", flush=True)
        grpc.channel_ready_future(grpc.insecure_channel(router)).result(timeout=60)
        outcomes = asyncio.run(run_policy(router, planned, max_tokens))
        s = summarize(outcomes)
        print(f"[{policy}] hit {s['hit_rate']:.3f}, ttft p50 {s['ttft_p50_ms']:.1f} ms, routes {s['routes']}, "
              f"decode {s['per_decode']}", flush=True)
        return outcomes
    finally:
        stop_all(children)


if __name__ == "__main__":
    raise SystemExit(main())
