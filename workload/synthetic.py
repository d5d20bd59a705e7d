"""Synthetic ShareGPT-like workloads: log-normal prompt and output lengths, seeded."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SyntheticRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def sharegpt_like(
    num_requests: int,
    *,
    vocab_size: int,
    seed: int = 0,
    prompt_median: int = 128,
    prompt_range: tuple[int, int] = (16, 1024),
    output_median: int = 64,
    output_range: tuple[int, int] = (16, 256),
    sigma: float = 0.8,
    first_token_id: int = 4,  # keep clear of the special tokens
) -> list[SyntheticRequest]:
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = _lognormal(rng, prompt_median, sigma, *prompt_range)
        output_len = _lognormal(rng, output_median, sigma, *output_range)
        prompt = [rng.randrange(first_token_id, vocab_size) for _ in range(prompt_len)]
        requests.append(SyntheticRequest(prompt, output_len))
    return requests
