"""Per-request results and a run's summary: hit rate, TTFT, throughput (pure)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from workload.stats import percentile

_STORE_REASON = re.compile(r"fetched (\d+) prefix tokens from the store")


@dataclass(slots=True, kw_only=True)
class Outcome:
    index: int
    ok: bool
    prompt_tokens: int
    cached_tokens: int = 0  # as the worker that computed the prompt reported it
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_ms: float = 0.0  # the request's mean inter-token latency (aiperf's; 0: not measured)
    error: str = ""
    route_kind: str = ""
    prefill_worker: str = ""
    decode_worker: str = ""
    store_tokens: int = 0  # fetched from the store, when the route reason says so (D's local admissions)
    queue_ms: float = 0.0  # the router's timings: the engine queue before the prompt's first step
    prefill_ms: float = 0.0  # the prefilling worker's queue + compute (P's includes its store fetch, D's does not)
    transfer_ms: float = 0.0  # D's pull of the prompt's KV from P (remote prefills)


def summarize(outcomes: list[Outcome], duration_s: float, reusable: set[int] | None = None) -> dict:
    """Hit rate over the requests that completed (cached / prompt tokens, as the workers reported them), TTFT
    p50/p90 and throughput over the run (first send to last finish). ``reusable``: the indices of the requests
    the trace lets a cache serve more than their first block (the same requests in every configuration); their
    TTFT is reported apart, since the median request of a conversation trace reuses nothing past it."""
    done = [o for o in outcomes if o.ok]
    some = [o.ttft_s * 1e3 for o in done if reusable is not None and o.index in reusable]
    prompt = sum(o.prompt_tokens for o in done)
    cached = sum(o.cached_tokens for o in done)
    ttfts = [o.ttft_s * 1e3 for o in done]
    out_tokens = sum(o.output_tokens for o in done)
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            errors[o.error] = errors.get(o.error, 0) + 1
    return {
        "requests": len(outcomes), "completed": len(done), "errors": errors,
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else math.nan,
        "ttft_ms": {"p50": percentile(ttfts, 50), "p90": percentile(ttfts, 90), "mean": sum(ttfts) / len(ttfts)
                    if ttfts else math.nan},
        "ttft_reusable_ms": {"p50": percentile(some, 50), "p90": percentile(some, 90), "requests": len(some)},
        "duration_s": duration_s,
        "requests_per_s": len(done) / duration_s if duration_s > 0 else math.nan,
        "output_tokens_per_s": out_tokens / duration_s if duration_s > 0 else math.nan,
        "prompt_tokens_per_s": prompt / duration_s if duration_s > 0 else math.nan,
        "routes": _count(o.route_kind for o in done if o.route_kind),
    }


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def store_tokens_of(reason: str) -> int:
    match = _STORE_REASON.search(reason)
    return int(match.group(1)) if match else 0
