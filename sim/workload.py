"""The requests a simulation replays: from a Mooncake-format trace (``workload/trace.py``) or from the synthetic
workloads the benchmarks generate (``workload/synthetic.py``), each with its prompt's block hashes computed by
Baton's own ``kv_transfer.hashing`` over the token ids the trace loader generates, so equal trace ids give equal
hashes exactly as the router would compute them for a replay of the same trace.

A trace's hash chains are memoized per (parent hash, trace block id): the conversation trace holds 12,031 requests
but only 182,790 distinct blocks, each hashed once. Pure.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from workload.trace import Scale, TraceRequest, block_spans, block_token_ids
from workload.synthetic import sharegpt_like
from kv_transfer.hashing import BlockHash, hash_blocks

SYNTHETIC = ("sharegpt", "shared-prefix")


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hashes: tuple[BlockHash, ...]  # the prompt's full blocks


class TraceHasher:
    """Block hashes of scaled trace prompts, each trace block's hashed once per parent."""

    def __init__(self, scale: Scale, *, block_size: int, root: BlockHash, vocab_size: int) -> None:
        if scale.block_tokens % block_size:
            raise ValueError(f"block size {block_size} must divide the scaled trace block ({scale.block_tokens} "
                             f"tokens): choose a --length-scale and --block-size that fit")
        self.scale, self.block_size, self.root, self.vocab_size = scale, block_size, root, vocab_size
        self._memo: dict[tuple[BlockHash, int], tuple[BlockHash, ...]] = {}

    def hashes(self, request: TraceRequest) -> tuple[BlockHash, ...]:
        out: list[BlockHash] = []
        parent = self.root
        for hash_id, num_tokens in block_spans(request, self.scale):
            if num_tokens < self.scale.block_tokens:  # the partial last block: its full sub-blocks only
                tokens = block_token_ids(hash_id, num_tokens, self.vocab_size).tolist()
                out += hash_blocks(tokens, self.block_size, parent)
                break
            key = (parent, hash_id)
            chain = self._memo.get(key)
            if chain is None:
                tokens = block_token_ids(hash_id, num_tokens, self.vocab_size).tolist()
                chain = self._memo[key] = tuple(hash_blocks(tokens, self.block_size, parent))
            out += chain
            parent = chain[-1]
        return tuple(out)


def from_trace(trace: Sequence[TraceRequest], scale: Scale, *, block_size: int, root: BlockHash,
               vocab_size: int) -> list[SimRequest]:
    hasher = TraceHasher(scale, block_size=block_size, root=root, vocab_size=vocab_size)
    return [SimRequest(f"r{i}", scale.arrival_s(r), scale.input_tokens(r), scale.output_tokens(r), hasher.hashes(r))
            for i, r in enumerate(trace)]


def synthetic(kind: str, num_requests: int, *, rate_per_s: float, seed: int, block_size: int, root: BlockHash,
              vocab_size: int, prompt_median: int = 1024, output_median: int = 128) -> list[SimRequest]:
    """``sharegpt``: ``workload.synthetic.sharegpt_like`` lengths (log-normal, no shared prefix); ``shared-prefix``:
    the same requests behind one of 8 long system prompts (``prompt_median`` tokens each). Poisson arrivals."""
    if kind not in SYNTHETIC:
        raise ValueError(f"workload must be one of {SYNTHETIC}, got {kind!r}")
    base = sharegpt_like(num_requests, vocab_size=vocab_size, seed=seed, prompt_median=prompt_median,
                         prompt_range=(16, 16 * prompt_median), output_median=output_median,
                         output_range=(1, 16 * output_median))
    rng = random.Random(seed + 1)
    systems = [[rng.randrange(4, vocab_size) for _ in range(prompt_median)] for _ in range(8)]
    out, t = [], 0.0
    for i, r in enumerate(base):
        t += rng.expovariate(rate_per_s) if math.isfinite(rate_per_s) else 0.0
        prompt = (systems[i % len(systems)] + r.prompt_token_ids) if kind == "shared-prefix" else r.prompt_token_ids
        out.append(SimRequest(f"r{i}", t, len(prompt), r.max_tokens, tuple(hash_blocks(prompt, block_size, root))))
    return out
