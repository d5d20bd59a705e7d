"""``python -m bench trace``: the command line, and one run of every configuration (the package's docstring says
what it does)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from workload.trace import Scale, load_trace
from bench.trace_replay.aiperf_client import aiperf_binary, replay_aiperf
from bench.trace_replay.counters import scrape
from bench.trace_replay.grpc_client import replay_grpc
from bench.trace_replay.outcomes import Outcome, summarize
from bench.trace_replay.report import line_of, loadavg, plot, table
from bench.trace_replay.slice import (ReplayRequest, oracle_pool_blocks, reusable_blocks, scaled_requests,
                                      working_set_blocks)
from bench.trace_replay.up import CONFIGS, ROOT, Up, config_flags

CLIENTS = ("grpc", "aiperf")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    import bench.trace_replay as package  # its docstring is the command's description

    p = argparse.ArgumentParser(prog="baton bench trace", description=package.__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    p.add_argument("--start", type=int, default=0, help="skip the trace's first N requests")
    p.add_argument("--limit", type=int, default=300, help="replay N requests (default: %(default)s)")
    p.add_argument("--length-scale", type=int, default=32, help="divide lengths (default: %(default)s: a trace "
                   "block is one 16-token KV block)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (< 1: faster)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV pool blocks per worker (not the oracle's)")
    p.add_argument("--host-blocks", type=int, default=4096, help="host-tier blocks per worker")
    p.add_argument("--store-memory", default="1 GB", help="the store's memory (Mooncake's spelling)")
    p.add_argument("--store-buffer-blocks", type=int, default=256, help="--kv-store-buffer-blocks per worker")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS))
    p.add_argument("--passes", type=int, default=1, help="run the configurations this many times, every other pass "
                   "in reverse order (ABBA: a machine whose load drifts favours no configuration)")
    p.add_argument("--client", choices=CLIENTS, default="grpc")
    p.add_argument("--aiperf", default=None, help="the aiperf binary (default: .venv-aiperf/bin/aiperf, PATH)")
    p.add_argument("--router", default=None, help="replay once against this running router's gRPC address "
                   "(with --client aiperf: its OpenAI HTTP port's address) instead of starting platforms")
    p.add_argument("--extra", default="", help="more `baton up` flags for every configuration (one string)")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--max-run-s", type=float, default=900.0, help="bound on one configuration's replay")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "trace")
    return p.parse_args(argv)


def _model(model: str) -> tuple[Path, str]:
    from engine.model_source import resolve_model

    source = resolve_model(model)
    return Path(source.path), source.name


def _model_info(model_dir: Path, extra: list[str]) -> tuple[int, int, int]:
    """(vocab size, context, KV block size) as the platform will serve them: the checkpoint's (a folder's
    config.json or a GGUF file's metadata; no torch), ``--max-model-len`` and ``--block-size`` when ``--extra``
    sets them."""
    from router.config import ModelCard

    card = ModelCard.from_path(model_dir)

    def flag(name: str, default: int) -> int:
        return int(extra[extra.index(name) + 1]) if name in extra[:-1] else default

    context = min(card.max_position_embeddings, flag("--max-model-len", card.max_position_embeddings))
    return card.vocab_size, context, flag("--block-size", 16)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Plan:
    """What every configuration replays, found once: the model as the platform serves it and the scaled slice."""

    model_dir: Path
    model_name: str
    vocab_size: int
    block_size: int
    scale: Scale
    requests: list[ReplayRequest]
    reusable: set[int]  # the requests the trace lets a cache serve more than their first block
    oracle_blocks: int


def run(args: argparse.Namespace) -> dict:
    configs = _configs(args.configs)
    plan, slice_info = _plan(args)
    print(f"slice: {len(plan.requests)} requests over {slice_info['span_s']:.0f} s, {slice_info['prompt_tokens']} "
          f"prompt tokens, working set {slice_info['working_set_blocks']} blocks, ceiling hit rate "
          f"{slice_info['ceiling_hit_rate']}, {slice_info['cut']} prompts cut to the context", flush=True)
    report = {"command": "python -m bench trace " + " ".join(sys.argv[1:] if args._argv is None else args._argv),
              "model": plan.model_name, "client": args.client, "slice": slice_info,
              "oracle_blocks": plan.oracle_blocks, "num_blocks": args.num_blocks, "host_blocks": args.host_blocks,
              "store_memory": args.store_memory, "layout": {"prefill": args.prefill, "decode": args.decode},
              "runs": []}
    args.out.mkdir(parents=True, exist_ok=True)
    order = [(k, c) for k in range(args.passes) for c in (configs if k % 2 == 0 else configs[::-1])]
    for pass_, config in order if args.router is None else [(0, "running")]:
        summary, outcomes = _run_config(args, plan, config, pass_)
        report["runs"].append(summary)
        suffix = f"-{pass_ + 1}" if args.passes > 1 else ""
        (args.out / f"outcomes-{args.client}-{config.replace('+', '-')}{suffix}.jsonl").write_text(
            "\n".join(json.dumps(asdict(o)) for o in outcomes) + "\n")
        print(line_of(summary, plan.block_size), flush=True)
    return report


def _configs(text: str) -> list[str]:
    configs = [c for c in text.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"unknown configuration {c!r}; choose from {', '.join(CONFIGS)}")
    return configs


def _plan(args: argparse.Namespace) -> tuple[_Plan, dict]:
    """The slice, scaled for the model as served, and what the report says of it."""
    trace = load_trace(args.trace, limit=args.start + args.limit)[args.start:]
    scale = Scale(length_scale=args.length_scale, time_scale=args.time_scale)
    model_dir, model_name = _model(args.model)
    vocab_size, max_model_len, block_size = _model_info(model_dir, args.extra.split())
    requests = scaled_requests(trace, scale, vocab_size=vocab_size, max_model_len=max_model_len)
    ceiling = reusable_blocks(requests, block_size) if scale.block_tokens == block_size else []
    slice_info = _slice_info(args, requests, ceiling, block_size)
    reusable = {r.index for r, hit in zip(requests, ceiling) if hit > 1}
    slice_info["reusable_requests"] = len(reusable)
    plan = _Plan(model_dir=model_dir, model_name=model_name, vocab_size=vocab_size, block_size=block_size,
                 scale=scale, requests=requests, reusable=reusable,
                 oracle_blocks=oracle_pool_blocks(requests, block_size))
    return plan, slice_info


def _slice_info(args: argparse.Namespace, requests: list[ReplayRequest], ceiling: list[int],
                block_size: int) -> dict:
    prompt_tokens = sum(len(r.prompt) for r in requests)
    return {
        "trace": str(args.trace), "start": args.start, "requests": len(requests),
        "length_scale": args.length_scale, "time_scale": args.time_scale,
        "span_s": requests[-1].arrival_s if requests else 0.0, "prompt_tokens": prompt_tokens,
        "output_tokens": sum(r.max_tokens for r in requests), "cut": sum(r.cut for r in requests),
        "working_set_blocks": working_set_blocks(requests, block_size),
        "ceiling_hit_rate": sum(ceiling) * block_size / prompt_tokens if ceiling else None,
        "lru_hit_rate_at_pool": (sum(reusable_blocks(requests, block_size, args.num_blocks)) * block_size
                                 / prompt_tokens) if ceiling else None,
    }


def _run_config(args: argparse.Namespace, plan: _Plan, config: str, pass_: int) -> tuple[dict, list[Outcome]]:
    """One configuration on a platform of its own (or, with ``--router``, the running one), stopped after: its
    summary (with the workers' tier counters and the machine's load) and its outcomes."""
    load_before = loadavg()
    up = None
    try:
        if args.router is None:
            up = _start(args, plan, config)
            address, http_port = up.grpc_address, up.http_port
        else:
            address, http_port = args.router, int(args.router.rsplit(":", 1)[1])
        outcomes, duration = _replay(args, plan, config, address, http_port)
        if up is not None:
            time.sleep(1.0)  # the workers refresh their counters every 0.25 s; writes still queued land
        counters = {wid: scrape(port) for wid, port in up.worker_metrics_ports().items()} if up else {}
    finally:
        if up is not None:
            up.stop()
    summary = summarize(outcomes, duration, plan.reusable)
    summary.update(config=config, passes=args.passes, pass_=pass_ + 1, counters=counters,
                   loadavg_before=load_before, loadavg_after=loadavg(),
                   store_tokens_local=sum(o.store_tokens for o in outcomes))
    return summary, outcomes


def _start(args: argparse.Namespace, plan: _Plan, config: str) -> Up:
    flags = config_flags(config, num_blocks=args.num_blocks, host_blocks=args.host_blocks,
                         store_memory=args.store_memory, oracle_blocks=plan.oracle_blocks,
                         store_buffer_blocks=args.store_buffer_blocks) + args.extra.split()
    log_dir = Path(tempfile.mkdtemp(prefix=f"bench-trace-{config.replace('+', '-')}-"))
    print(f"[{config}] baton up {' '.join(flags)} (logs: {log_dir})", flush=True)
    return Up.start(args.model, flags, log_dir, prefill=args.prefill, decode=args.decode)


def _replay(args: argparse.Namespace, plan: _Plan, config: str, address: str,
            http_port: int) -> tuple[list[Outcome], float]:
    if args.client == "grpc":
        return asyncio.run(replay_grpc(
            address, plan.requests, vocab_size=plan.vocab_size, request_timeout_s=args.request_timeout_s,
            max_run_s=args.max_run_s, label=config))
    return replay_aiperf(
        aiperf_binary(args.aiperf), http_port, plan.model_name, plan.model_dir, plan.requests, plan.scale,
        args.out / f"aiperf-{config.replace('+', '-')}", request_timeout_s=args.request_timeout_s,
        max_run_s=args.max_run_s)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    args._argv = argv
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"trace-{args.client}.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    png = plot(report, args.out / f"trace-{args.client}.png")
    print(f"wrote {args.out / f'trace-{args.client}.json'}" + (f" and {png}" if png else ""))
    return 0
