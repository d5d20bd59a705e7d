"""Serving benchmark: replay a workload against a running router, open-loop, and report vLLM-style metrics.

    python -m bench serve --router HOST:PORT [--protocol grpc|http]
                          [--workload sharegpt|shared-prefix|long-prompt | --trace F.jsonl]
                          [--num-requests 200] [--rate 4 | --rate-sweep 1,2,4] [--burstiness 1.0] [--seed 0]
                          [--slo-ttft-ms 500] [--slo-tpot-ms 100] [--out DIR]

Requests are greedy streaming calls with token ids (``ignore_eos``, so each yields ``max_tokens``): gRPC
``Generate`` (``--router`` is the router's gRPC address), or with ``--protocol http`` the OpenAI front's
``/v1/completions`` with ``stream: true`` (``--router`` is the HTTP front's address; token ids are drawn below
``--vocab-size``, which the model card does not state; see bench/client.py for how SSE chunks are timed). They
are sent at seeded Poisson arrivals (``--burstiness`` < 1 makes them gamma-bursty, > 1 smoother) whatever the
earlier ones are doing. Workloads: ``sharegpt`` (log-normal prompt and output lengths), ``shared-prefix``
(multi-turn conversations over a few long system prompts), ``long-prompt`` (short chats with a few very long
prompts mixed in: the interference case), or ``--trace``: JSONL, one object per line with ``prompt_token_ids``
or ``prompt``, ``max_tokens`` and optionally ``arrival_s`` (used when ``--rate`` is not given). Reports request
and token throughput, TTFT / TPOT / ITL / E2E (mean, p50, p90, p99) and goodput: requests per second that met
both SLOs. ``--out`` writes serve.json, serve_cdf.png and, for a sweep, serve_sweep.png (goodput and p99 ITL
against the rate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from bench.client import PROTOCOLS, Planned, Result, http_model_card, model_info, run_once
from workload.plots import pyplot
from workload.synthetic import sharegpt_like
from proto import baton_pb2 as pb
from proto import tls
from workload.stats import percentile  # noqa: F401 - part of this module's interface (tests, bench.compare)

WORKLOADS = ("sharegpt", "shared-prefix", "long-prompt")
PERCENTILES = (50, 90, 99)


# ---- statistics (pure) --------------------------------------------------------------------------
def tpot_s(result: Result) -> float | None:
    """Time per output token after the first; None for a request with fewer than two tokens."""
    if result.output_tokens < 2:
        return None
    return (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)


def meets_slo(result: Result, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    tpot = tpot_s(result)
    return result.ok and result.ttft_s * 1e3 <= slo_ttft_ms and (tpot is None or tpot * 1e3 <= slo_tpot_ms)


def goodput(results: list[Result], duration_s: float, slo_ttft_ms: float, slo_tpot_ms: float) -> float:
    """Requests per second that completed within both the TTFT and the TPOT SLO."""
    return sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results) / duration_s if duration_s > 0 else 0.0


def distribution_ms(values_s: list[float]) -> dict[str, float]:
    out = {"mean": sum(values_s) / len(values_s) * 1e3 if values_s else math.nan}
    out.update({f"p{q}": percentile(values_s, q) * 1e3 for q in PERCENTILES})
    return out


def summarize(results: list[Result], duration_s: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    done = [r for r in results if r.ok]
    return {
        "num_requests": len(results), "completed": len(done), "failed": len(results) - len(done),
        "duration_s": duration_s,
        "input_tokens": sum(r.prompt_tokens for r in done), "output_tokens": sum(r.output_tokens for r in done),
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": sum(r.output_tokens for r in done) / duration_s if duration_s > 0 else 0.0,
        "goodput": goodput(results, duration_s, slo_ttft_ms, slo_tpot_ms),
        "slo_attainment": sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results) / max(1, len(results)),
        "ttft_ms": distribution_ms([r.ttft_s for r in done]),
        "tpot_ms": distribution_ms([t for r in done if (t := tpot_s(r)) is not None]),
        "itl_ms": distribution_ms([x for r in done for x in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in done]),
        "route_kinds": dict(Counter(r.route_kind for r in done if r.route_kind)),  # gRPC only
    }


# ---- workloads (pure) ---------------------------------------------------------------------------
def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Cumulative gamma inter-arrival gaps with mean 1/rate (shape ``burstiness``; 1 = Poisson)."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(4, vocab_size) for _ in range(n)]  # ids 0-3 are special tokens


def shared_prefix(n: int, vocab_size: int, seed: int, system_tokens: int = 256, systems: int = 4,
                  turns: int = 3) -> list[Planned]:
    """Conversations over a few system prompts; turn k's prompt = system + earlier turns + new user text."""
    rng = random.Random(seed)
    heads = [_tokens(rng, system_tokens, vocab_size) for _ in range(systems)]
    out: list[Planned] = []
    for c in range(math.ceil(n / turns)):
        history = list(heads[c % systems])
        for _ in range(turns):
            history += _tokens(rng, rng.randint(16, 64), vocab_size)
            max_tokens = rng.randint(16, 64)
            out.append(Planned(None, list(history), max_tokens))
            history += _tokens(rng, max_tokens, vocab_size)  # the assistant's reply
    order = sorted(range(len(out)), key=lambda i: (i % turns, rng.random()))  # turn 0s, then 1s, ...
    return [out[i] for i in order][:n]


def long_prompt(n: int, vocab_size: int, seed: int, long_tokens: int = 1536,
                long_fraction: float = 0.1) -> list[Planned]:
    """Short chats (ShareGPT-like, short) with exactly ``round(n * long_fraction)`` very long prompts mixed in
    at seeded positions: every run (and every rate of a sweep) carries the same share of interference,
    where drawing each request's kind made runs of 30-75 requests range from 0% to 22% long."""
    rng = random.Random(seed)
    chats = sharegpt_like(n, vocab_size=vocab_size, seed=seed, prompt_median=64, prompt_range=(8, 256))
    longs = set(rng.sample(range(n), round(n * long_fraction)))
    return [Planned(None, _tokens(rng, long_tokens, vocab_size), 16) if i in longs
            else Planned(None, c.prompt_token_ids, c.max_tokens) for i, c in enumerate(chats)]


def load_trace(path: Path, limit: int | None) -> list[Planned]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            obj = json.loads(line)
            prompt = obj["prompt_token_ids"] if "prompt_token_ids" in obj else obj["prompt"]
            out.append(Planned(obj.get("arrival_s"), prompt, int(obj["max_tokens"])))
    return out[:limit] if limit else out


def fit(planned: list[Planned], max_model_len: int, max_prompt: int | None, max_output: int | None) -> list[Planned]:
    """Cap output lengths, then prompt lengths so prompt + output fits the model's context."""
    out = []
    for p in planned:
        max_tokens = min(p.max_tokens, max_output or p.max_tokens)
        room = min(max_model_len - max_tokens, max_prompt or max_model_len)
        prompt = p.prompt if isinstance(p.prompt, str) else p.prompt[:room]
        out.append(Planned(p.arrival_s, prompt, max_tokens))
    return out


def default_rate(planned: list[Planned], rate: float | None) -> float | None:
    """The rate to draw arrivals at: ``rate`` if given, else None (a trace's own times) or 1 req/s."""
    if rate is None and not all(p.arrival_s is not None for p in planned):
        return 1.0
    return rate


def schedule(planned: list[Planned], rate: float | None, burstiness: float, seed: int) -> list[float]:
    """Arrival offsets: the trace's own when ``rate`` is None, else drawn at ``rate``."""
    if rate is None:
        return [p.arrival_s for p in planned]
    return arrival_offsets(len(planned), rate, burstiness, seed)


# ---- report -------------------------------------------------------------------------------------
def print_run(label: str, s: dict) -> None:
    print(f"\n============ Serving Benchmark Result ({label}) ============")
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", s["duration_s"]), ("Total input tokens", s["input_tokens"]),
            ("Total generated tokens", s["output_tokens"]), ("Request throughput (req/s)", s["request_throughput"]),
            ("Output token throughput (tok/s)", s["output_throughput"]), ("Request goodput (req/s)", s["goodput"]),
            ("SLO attainment", s["slo_attainment"])]
    for name, value in rows:
        print(f"{name:<40}{value:>12.2f}" if isinstance(value, float) else f"{name:<40}{value:>12}")
    print(f"{'(ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[key]
        print(f"{key[:-3].upper():<16}" + "".join(f"{d[k]:>10.2f}" for k in ("mean", "p50", "p90", "p99")))


def print_sweep(runs: list[dict]) -> None:
    print(f"\n{'rate':>8}{'done':>6}{'fail':>6}{'req/s':>8}{'tok/s':>9}{'goodput':>9}"
          f"{'ttft p99':>10}{'tpot p99':>10}{'itl p99':>9}   (ms)")
    for r in runs:
        print(f"{r['rate']:>8.2f}{r['completed']:>6}{r['failed']:>6}{r['request_throughput']:>8.2f}"
              f"{r['output_throughput']:>9.1f}{r['goodput']:>9.2f}{r['ttft_ms']['p99']:>10.1f}"
              f"{r['tpot_ms']['p99']:>10.1f}{r['itl_ms']['p99']:>9.1f}")


def plot(runs: list[dict], results: list[list[Result]], out: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    series = {"TTFT": lambda rs: [r.ttft_s for r in rs],
              "TPOT": lambda rs: [t for r in rs if (t := tpot_s(r)) is not None],
              "ITL": lambda rs: [x for r in rs for x in r.itl_s], "E2E": lambda rs: [r.e2e_s for r in rs]}
    for ax, (name, values) in zip(axes, series.items()):
        for run, rs in zip(runs, results):
            xs = sorted(v * 1e3 for v in values([r for r in rs if r.ok]))
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{run['rate']:g} req/s")
        ax.set(xlabel=f"{name} (ms)", ylabel="fraction", title=f"{name} CDF")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    paths = [out / "serve_cdf.png"]
    fig.savefig(paths[0], dpi=110)
    if len(runs) > 1:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        rates = [r["rate"] for r in runs]
        a.plot(rates, [r["goodput"] for r in runs], "o-")
        a.set(xlabel="arrival rate (req/s)", ylabel="goodput (req/s)", title="goodput vs rate")
        b.plot(rates, [r["itl_ms"]["p99"] for r in runs], "o-")
        b.set(xlabel="arrival rate (req/s)", ylabel="p99 ITL (ms)", title="p99 ITL vs rate")
        for ax in (a, b):
            ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out / "serve_sweep.png")
        fig.savefig(paths[1], dpi=110)
    return paths


# ---- main ---------------------------------------------------------------------------------------
def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="baton bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router", required=True, help="HOST:PORT of the router's gRPC endpoint (http: its OpenAI front)")
    p.add_argument("--protocol", choices=PROTOCOLS, default="grpc", help="gRPC Generate or OpenAI /v1/completions SSE")
    p.add_argument("--vocab-size", type=int, default=4096, help="http only: draw token ids below this")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--workload", choices=WORKLOADS, default="sharegpt")
    source.add_argument("--trace", type=Path, help="JSONL: prompt_token_ids|prompt, max_tokens[, arrival_s]")
    p.add_argument("--num-requests", type=int, default=None, help="default 200 (a trace: all its lines)")
    rates = p.add_mutually_exclusive_group()
    rates.add_argument("--rate", type=float, default=None, help="arrivals per second (inf = all at once)")
    rates.add_argument("--rate-sweep", type=lambda v: [float(x) for x in v.split(",")], help="e.g. 1,2,4")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--max-prompt-len", type=int, default=None, help="truncate prompts to this many tokens")
    p.add_argument("--max-output-len", type=int, default=None, help="cap max_tokens")
    p.add_argument("--warmup", type=int, default=2, help="uncounted requests before each run")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    p.add_argument("--out", type=Path, default=None, help="write serve.json and PNG plots here")
    tls.add_arguments(p)
    args = p.parse_args(argv)
    if args.burstiness <= 0 or (args.rate is not None and args.rate <= 0):
        p.error("--rate and --burstiness must be positive")
    try:
        tls.from_args(args)
    except tls.TlsConfigError as exc:
        p.error(str(exc))
    return args


def build(args: argparse.Namespace, info: pb.ModelInfoResponse) -> list[Planned]:
    n, vocab = args.num_requests or 200, info.vocab_size
    if args.trace:
        planned = load_trace(args.trace, args.num_requests)
    elif args.workload == "sharegpt":
        planned = [Planned(None, r.prompt_token_ids, r.max_tokens)
                   for r in sharegpt_like(n, vocab_size=vocab, seed=args.seed)]
    elif args.workload == "shared-prefix":
        planned = shared_prefix(n, vocab, args.seed)
    else:
        planned = long_prompt(n, vocab, args.seed)
    return fit(planned, info.max_model_len, args.max_prompt_len, args.max_output_len)


def fetch_model_info(router: str, protocol: str, vocab_size: int,
                     tls_config: tls.TlsConfig | None = None) -> pb.ModelInfoResponse:
    """gRPC ``ModelInfo``; over HTTP the model card (name, context) plus the given vocabulary size."""
    if protocol == "grpc":
        return asyncio.run(model_info(router, tls_config))
    card = asyncio.run(http_model_card(router))
    return pb.ModelInfoResponse(model=card["id"], max_model_len=card["max_model_len"], vocab_size=vocab_size)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    tls_config = tls.from_args(args)
    info = fetch_model_info(args.router, args.protocol, args.vocab_size, tls_config)
    planned = build(args, info)
    if not planned:
        raise SystemExit("no requests to send")
    name = f"trace {args.trace.name}" if args.trace else args.workload
    print(f"{len(planned)} requests ({name}) against {args.router} over {args.protocol} ({info.model})", flush=True)
    runs, results = [], []
    for rate in args.rate_sweep or [default_rate(planned, args.rate)]:
        offsets = schedule(planned, rate, args.burstiness, args.seed)
        label = f"{rate:g} req/s" if rate is not None else "trace times"
        out, duration_s = asyncio.run(run_once(args.router, planned, offsets, label, args.timeout_s, args.warmup,
                                               args.protocol, tls_config))
        summary = summarize(out, duration_s, args.slo_ttft_ms, args.slo_tpot_ms)
        runs.append({"rate": rate if rate is not None else len(planned) / max(max(offsets), 1e-9), **summary})
        results.append(out)
        print_run(label, summary)
    if len(runs) > 1:
        print_sweep(runs)
    if args.out:
        _write(args, name, runs, results)
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def _write(args: argparse.Namespace, name: str, runs: list[dict], results: list[list[Result]]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    for run, out in zip(runs, results):
        run["requests"] = [{k: v for k, v in asdict(r).items() if k != "itl_s"} for r in out]
    report = {"workload": name, "config": config, "runs": runs}
    (args.out / "serve.json").write_text(json.dumps(report, indent=2))
    paths = plot(runs, results, args.out)
    print(f"wrote {', '.join(str(p) for p in [args.out / 'serve.json', *paths])}")


if __name__ == "__main__":
    raise SystemExit(main())
