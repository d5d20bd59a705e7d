"""Swap vs recompute preemption, same engine, same workload, one run.

    python -m bench.preemption [--model small] [--requests 16] [--prompt-tokens 384] [--output-tokens 128]
                               [--num-blocks 96] [--host-blocks 256] [--threads 2]

A KV pool too small for the batch forces preemptions. ``recompute`` frees a preempted request's blocks (its full
blocks stay cached: in the pool, or in the host tier once evicted) and recomputes what is gone; ``swap`` copies
all its blocks to the host tier and back. Both runs have the same host tier (``--host-blocks``), so recompute
also gets back whatever the pool and the host tier still cache; what swap adds is the partial last block and
everything the caches dropped. A request is preempted when it needs a new block, i.e. when all its blocks are
full: with its blocks still cached (pool or host tier), recompute redoes nothing. Reported per mode: wall seconds, output tokens/s, preemptions, and the prompt and
output tokens computed again (forward-pass tokens beyond one pass over each request); outputs must be equal.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "preemption.json"


def run(model: str, mode: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=model, num_blocks=args.num_blocks, kv_host_blocks=args.host_blocks,
                                 preemption_mode=mode, max_num_seqs=args.requests, num_threads=args.threads))
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs: dict[int, list[int]] = {}
    forward_tokens, schedule = [0], engine.scheduler.schedule

    def counted_schedule():  # every token a step computes, recomputed ones included
        output = schedule()
        forward_tokens[0] += output.num_batched_tokens
        return output

    engine.scheduler.schedule = counted_schedule
    started = time.perf_counter()
    while engine.has_unfinished():
        for delta in engine.step():
            outputs.setdefault(int(delta.request_id), []).extend(delta.new_token_ids)
    seconds = time.perf_counter() - started
    once = sum(len(p) + args.output_tokens - 1 for p in prompts)  # each token through the model once
    stats, host = engine.stats(), engine.kv_cache_manager.host
    return {"mode": mode, "seconds": seconds, "tokens_per_s": len(prompts) * args.output_tokens / seconds,
            "preemptions": stats.num_preemptions, "recomputed_tokens": forward_tokens[0] - once,
            "swapped_out": host.num_swapped_out if host is not None else 0, "outputs": [outputs[i] for i in range(len(prompts))]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.preemption", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=384)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--num-blocks", type=int, default=96)
    parser.add_argument("--host-blocks", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    from engine.model.loader import read_model_config
    from engine.model_source import resolve_model

    vocab = read_model_config(resolve_model(args.model)).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(4, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    rows = [run(args.model, mode, prompts, args) for mode in ("recompute", "swap")]
    if rows[0]["outputs"] != rows[1]["outputs"]:
        raise SystemExit("outputs differ between swap and recompute")
    print(f"{'mode':<10}{'seconds':>9}{'tok/s':>8}{'preempted':>11}{'recomputed':>12}{'swapped out':>13}")
    for r in rows:
        print(f"{r['mode']:<10}{r['seconds']:>9.1f}{r['tokens_per_s']:>8.1f}{r['preemptions']:>11}"
              f"{r['recomputed_tokens']:>12}{r['swapped_out']:>13}")
    print(f"swap / recompute throughput: {rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "runs": [{k: v for k, v in r.items() if k != "outputs"}
                                                                for r in rows]}, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
