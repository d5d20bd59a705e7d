"""A quantized KV cache (``--kv-cache-dtype int8|fp8``) against the model's own dtype, on the real model.

    python -m bench.kv_quant [--model smollm2] [--prompts 8] [--tokens 64] [--transfer-tokens 2048] [--runs 5]

Per KV dtype (the model's, int8, fp8), side by side in one run:
- **size**: bytes per block, and the blocks and 1k-token sequences that fit in 1 GiB (the decode batch gained);
- **transfer**: a prompt's KV (``--transfer-tokens``) pulled over tcp from a server process, median seconds
  and bytes (the layout's arithmetic: fewer bytes, same wire);
- **quality**: teacher-forced decode over each prompt's full-precision greedy continuation (each step reads its
  whole context from the cache, as decoding does): mean and max absolute logit error, KL divergence and next-
  token agreement against the model's dtype; and free greedy generation: tokens equal before the first
  difference, and whole continuations equal.
Writes ``bench/results/kv_quant.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "kv_quant.json"
DTYPES = ("auto", "int8", "fp8")
PROMPTS = [
    "What is the capital of France, and what is it known for?",
    "Explain in two sentences how a refrigerator keeps food cold.",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Give me a tip for learning a new language.",
    "What does a compiler do?",
]


def _serve(layout_json: str, num_blocks: int, conn, stop) -> None:
    """A tcp KV server holding ``num_blocks`` blocks of ``layout_json`` under one lease."""
    from kv_transfer.layout import KVBuffer, KVLayout
    from kv_transfer.leases import LeaseTable
    from kv_transfer.transport import make_server

    async def main() -> None:
        buffer, table = KVBuffer.allocate(KVLayout.from_json(layout_json), num_blocks), LeaseTable(default_ttl_s=3600)
        lease = table.create(range(num_blocks), now=time.monotonic())
        server = make_server("tcp", buffer=buffer, resolve=table.resolver(time.monotonic))
        conn.send({"uri": await server.start("127.0.0.1", 0), "lease_id": lease.lease_id})
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop()

    asyncio.run(main())


def transfer(layout, num_tokens: int, runs: int) -> dict:
    """Median seconds to pull a ``num_tokens`` prompt's blocks of ``layout`` from a server process."""
    from kv_transfer.layout import KVBuffer
    from kv_transfer.transport import connect

    blocks = -(-num_tokens // layout.block_size)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    stop = ctx.Event()
    server = ctx.Process(target=_serve, args=(layout.to_json(), blocks, child, stop), daemon=True)
    server.start()
    endpoint, loop = parent.recv(), asyncio.new_event_loop()
    client, dst = connect(endpoint["uri"]), KVBuffer.allocate(layout, blocks)
    seconds = []
    try:
        for _ in range(runs + 1):  # the first warms the connection up
            started = time.perf_counter()
            loop.run_until_complete(client.pull(endpoint["uri"], layout, endpoint["lease_id"], list(range(blocks)),
                                                dst, list(range(blocks))))
            seconds.append(time.perf_counter() - started)
    finally:
        client.close()
        loop.close()
        stop.set()
        server.join(10)
    return {"bytes": blocks * layout.bytes_per_block, "seconds": statistics.median(seconds[1:])}


def teacher_forced(llm, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """[T, vocab] log-probs of each continuation token's successor, one decode step at a time over the cache."""
    engine, tokens = llm.engine, prompt + continuation
    manager = engine.kv_cache_manager
    block_ids = manager.allocate_scratch(manager.blocks_needed(len(tokens)))
    try:
        engine.runner.prompt_logits(prompt, block_ids)
        rows = [engine.runner.prompt_logits([token], block_ids, start=len(prompt) + i, last_only=True)
                for i, token in enumerate(continuation)]
    finally:
        manager.pool.free(block_ids)
    return torch.cat(rows).float().log_softmax(-1)  # [T, vocab]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_quant", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--transfer-tokens", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    from engine import LLM, SamplingParams
    from worker.node import _layout

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    rows, reference, ref_logprobs = [], None, None
    for dtype in DTYPES:
        llm = LLM(args.model, num_threads=args.threads, kv_cache_dtype=dtype, max_num_seqs=8, num_blocks=1024)
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]]
        greedy = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        reference = reference or greedy
        logprobs = [teacher_forced(llm, p, c) for p, c in zip(prompts, reference)]
        ref_logprobs = ref_logprobs or logprobs
        layout = _layout(llm.engine)
        row = {"kv_cache_dtype": dtype, "layout_dtype": layout.dtype, "bytes_per_block": layout.bytes_per_block,
               "blocks_per_gib": (1 << 30) // layout.bytes_per_block,
               "seqs_of_1k_tokens_per_gib": (1 << 30) // layout.bytes_per_block // (1024 // layout.block_size),
               **_quality(logprobs, ref_logprobs, greedy, reference),
               "transfer": transfer(layout, args.transfer_tokens, args.runs)}
        rows.append(row)
        print(_line(row, rows[0]), flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


def _quality(logprobs, ref_logprobs, greedy, reference) -> dict:
    diff = torch.cat([(a - b).abs() for a, b in zip(logprobs, ref_logprobs)])  # [T, vocab]
    kl = torch.cat([(r.exp() * (r - a)).sum(-1) for a, r in zip(logprobs, ref_logprobs)])  # [T]
    agree = torch.cat([a.argmax(-1) == r.argmax(-1) for a, r in zip(logprobs, ref_logprobs)]).float()
    prefix = [next((i for i, (x, y) in enumerate(zip(g, r)) if x != y), len(r)) for g, r in zip(greedy, reference)]
    return {"mean_abs_logprob_error": diff.mean().item(), "max_abs_logprob_error": diff.max().item(),
            "mean_kl": kl.mean().item(), "next_token_agreement": agree.mean().item(),
            "greedy_equal_prefix_tokens": statistics.mean(prefix),
            "greedy_identical": sum(g == r for g, r in zip(greedy, reference)) / len(reference)}


def _line(row: dict, base: dict) -> str:
    t, b = row["transfer"], base["transfer"]
    return (f"{row['kv_cache_dtype']:>5} ({row['layout_dtype']}): {row['bytes_per_block'] / 1024:.0f} KiB/block "
            f"({base['bytes_per_block'] / row['bytes_per_block']:.2f}x fewer), {row['seqs_of_1k_tokens_per_gib']} "
            f"1k-token seqs/GiB; pull {t['bytes'] / 2**20:.1f} MiB in {t['seconds'] * 1e3:.1f} ms "
            f"({b['seconds'] / t['seconds']:.2f}x faster); |dlogp| mean {row['mean_abs_logprob_error']:.4f} max "
            f"{row['max_abs_logprob_error']:.3f}, KL {row['mean_kl']:.5f}, next-token agreement "
            f"{row['next_token_agreement']:.1%}, greedy identical {row['greedy_identical']:.0%} (equal prefix "
            f"{row['greedy_equal_prefix_tokens']:.1f} tokens)")


if __name__ == "__main__":
    raise SystemExit(main())
