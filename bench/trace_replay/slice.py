"""The trace's slice as this machine replays it, and what a prefix cache could reuse of it (pure)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from workload.trace import Scale, TraceRequest, prompt_token_ids


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayRequest:
    index: int  # position in the trace file's slice
    arrival_s: float  # scaled offset from the first request's arrival
    prompt: list[int]
    max_tokens: int
    hash_ids: tuple[int, ...]
    cut: bool = False  # the scaled prompt was longer than the context allows and was cut at its end


def scaled_requests(trace: list[TraceRequest], scale: Scale, *, vocab_size: int,
                    max_model_len: int) -> list[ReplayRequest]:
    """The slice as this machine replays it: lengths divided, arrivals multiplied and made relative to the first
    request, token ids from the hash ids. A prompt that leaves no room for its output is cut at its end (to
    ``max_model_len - max_tokens`` tokens; the output too when it alone overflows): its leading blocks stay."""
    if not trace:
        return []
    t0 = scale.arrival_s(trace[0])
    out = []
    for i, request in enumerate(trace):
        max_tokens = min(scale.output_tokens(request), max_model_len // 2)
        prompt = prompt_token_ids(request, scale, vocab_size)
        room = max_model_len - max_tokens
        cut = len(prompt) > room
        out.append(ReplayRequest(index=i, arrival_s=scale.arrival_s(request) - t0, prompt=prompt[:room],
                                 max_tokens=max_tokens, hash_ids=request.hash_ids, cut=cut))
    return out


def reusable_blocks(requests: list[ReplayRequest], block_size: int, capacity: int | None = None) -> list[int]:
    """Per request, the leading full blocks a prefix cache over every earlier request can serve: unbounded
    (``capacity`` None: the ceiling) or an LRU of ``capacity`` blocks shared by all (one pool for everything).
    Requests are taken in arrival order, each cached entirely before the next arrives (no concurrency); a hit is
    capped at ``(prompt - 1) // block_size`` blocks, as the engine caps one. Needs one trace block per KV block."""
    seen: OrderedDict[tuple[int, ...], None] = OrderedDict()
    hits = []
    for r in requests:
        full = min(len(r.prompt) // block_size, len(r.hash_ids))
        chain = [r.hash_ids[:i + 1] for i in range(full)]
        limit = min(full, (len(r.prompt) - 1) // block_size)
        hit = next((i for i, key in enumerate(chain[:limit]) if key not in seen), limit)
        hits.append(hit)
        for key in chain:
            seen[key] = None
            seen.move_to_end(key)
        while capacity is not None and len(seen) > capacity:
            seen.popitem(last=False)
    return hits


def working_set_blocks(requests: list[ReplayRequest], block_size: int) -> int:
    """Distinct full blocks in the slice: the KV pool an unbounded cache needs (besides requests in flight)."""
    return len({r.hash_ids[:i + 1] for r in requests for i in range(min(len(r.prompt) // block_size,
                                                                       len(r.hash_ids)))})


def oracle_pool_blocks(requests: list[ReplayRequest], block_size: int, in_flight: int = 32) -> int:
    """A KV pool that never evicts on this slice: its working set plus ``in_flight`` of its longest requests."""
    longest = sorted((-(-(len(r.prompt) + r.max_tokens) // block_size) for r in requests), reverse=True)
    return working_set_blocks(requests, block_size) + sum(longest[:in_flight]) + 64
