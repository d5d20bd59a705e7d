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
        """One row per request: its next output token."""
        return self.build_rows([(r, 0) for r in requests])

    def build_rows(self, rows: Sequence[tuple[Request, int]]) -> SamplingBatch:
        """One row per (request, offset): its output token at ``num_output_tokens + offset`` (offsets past 0 are
        speculative drafts' rows; requests with penalties never draft, so their rows are at offset 0)."""
        params = [r.sampling_params for r, _ in rows]
        seen = None
        if any(p.needs_penalties for p in params):
            seen = self.penalties.seen_tokens([r if p.needs_penalties else None for (r, _), p in zip(rows, params)])
        return SamplingBatch.build(
            params, seeds=[r.seed for r, _ in rows], positions=[r.num_output_tokens + k for r, k in rows],
            banned=[banned_tokens(r, k) for r, k in rows], seen_tokens=seen, vocab_size=self.vocab_size,
            device=self.device,
        )

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drops the state of requests that finished, were aborted or preempted (safe for unknown ids)."""
        self.penalties.forget(request_ids)


def banned_tokens(request: Request, offset: int = 0) -> list[int]:
    """Stop tokens may not be sampled before ``min_tokens`` outputs exist (``offset``: a draft row's)."""
    params = request.sampling_params
    if request.num_output_tokens + offset >= params.min_tokens:
        return []
    eos = () if params.ignore_eos else request.eos_token_ids
    return sorted(set(params.stop_token_ids) | set(eos))
