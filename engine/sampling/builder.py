"""SamplingBatchBuilder: what the model runner does each step to turn the requests it samples into a
SamplingBatch. It owns the per-request sampling state (``PenaltyState``), which ``forget`` releases."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from engine.core.request import Request
from engine.sampling.batch import SamplingBatch
from engine.sampling.penalty_state import PenaltyState


class SamplingBatchBuilder:
    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.penalties = PenaltyState(device)

    def build(self, requests: Sequence[Request]) -> SamplingBatch:
        params = [r.sampling_params for r in requests]
        seen = None
        if any(p.needs_penalties for p in params):
            seen = self.penalties.seen_tokens([r if p.needs_penalties else None for r, p in zip(requests, params)])
        return SamplingBatch.build(
            params, seeds=[r.seed for r in requests], positions=[r.num_output_tokens for r in requests],
            banned=[banned_tokens(r) for r in requests], seen_tokens=seen, vocab_size=self.vocab_size,
            device=self.device,
        )

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drops the state of requests that finished, were aborted or preempted (safe for unknown ids)."""
        self.penalties.forget(request_ids)


def banned_tokens(request: Request) -> list[int]:
    """Stop tokens may not be sampled before ``min_tokens`` outputs exist."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    eos = () if params.ignore_eos else request.eos_token_ids
    return sorted(set(params.stop_token_ids) | set(eos))
