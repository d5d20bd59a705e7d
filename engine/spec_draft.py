"""Draft-model speculative decoding (``--speculative-config '{"model": PATH, "num_speculative_tokens": k}'``):
a smaller checkpoint with the target's vocabulary proposes the drafts the scheduler reserved slots for.

The draft keeps its own paged KV cache with the target's block ids (same block size, one cache block per
target block; its own shape), so it needs no allocator of its own: a request's blocks are where the draft
writes too. Each step, before the target's forward pass:

1. catch up: for every sequence that may draft, the draft computes the tokens the target knows that it has
   not (``_computed`` per request: a prompt on its first step, one or two tokens after that), in one batched
   forward, always including the last known token, whose logits give the first draft;
2. k - 1 decode steps of the draft over the sequences that draft, each feeding the draft it just chose
   (greedy), so drafts 1..k-1 have their KV written and draft k is chosen.

The target then verifies the drafts (``engine.core.speculation.accepted``). Rejected drafts need no rollback
here: the next catch-up starts at the request's last known token at the latest, overwriting any position
past it, and the draft never reads a position it has not written in this or an earlier step. A preempted or
finished request is forgotten (its blocks are gone; it catches up from scratch if it comes back). Prefix-cache
hits are recomputed by the draft (its KV of a shared block may have come from a pull, which moves only the
target's KV). Never runs in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from engine.attention.base import ForwardBatch, SeqSlice, StepBatch
from engine.attention.torch_backend import TorchAttentionBackend
from engine.core.outputs import ScheduledSeq
from engine.errors import InvalidRequest
from engine.model.config import ModelConfig
from engine.model.loader import load_model, open_gguf, read_model_config
from engine.model_source import resolve_model

logger = logging.getLogger(__name__)


def load_draft(model: str, target: ModelConfig, device: torch.device, *, num_blocks: int,
               block_size: int) -> DraftProposer:
    """The draft model on the target's device and dtype, with a cache over the same block ids."""
    source = resolve_model(model)
    gguf = open_gguf(source) if source.is_gguf else None
    config = read_model_config(source, target.dtype, gguf)
    if config.vocab_size != target.vocab_size:
        raise InvalidRequest(f"the draft model's vocabulary ({config.vocab_size}) is not the target's "
                             f"({target.vocab_size}): its tokens would mean other things")
    draft, _ = load_model(source, config, device, gguf)
    logger.info("draft model %s: %d layers, hidden %d", source.path, config.num_layers, config.hidden_size)
    return DraftProposer(draft, config, num_blocks=num_blocks, block_size=block_size, device=device)


class DraftProposer:
    def __init__(self, model: nn.Module, config: ModelConfig, *, num_blocks: int, block_size: int,
                 device: torch.device) -> None:
        self.model, self.block_size, self.device = model, block_size, device
        shape = (config.num_layers, num_blocks, 2, block_size, config.num_kv_heads, config.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=getattr(torch, config.dtype), device=device)
        self.kv_layers = list(self.kv_cache.unbind(0))  # per layer: [num_blocks, 2, bs, kvh, d]
        self.backend = TorchAttentionBackend()
        self._computed: dict[str, int] = {}  # request id -> positions whose draft KV is valid
        self.num_forwards = 0  # draft forward passes (tests, logs)

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._computed.pop(request_id, None)

    @torch.inference_mode()
    def fill(self, seqs: Sequence[ScheduledSeq]) -> tuple[ScheduledSeq, ...]:
        """``seqs`` with every reserved draft slot (``draft_token_ids`` of placeholders) filled by the draft."""
        drafting = [s for s in seqs if s.draft_token_ids]
        if not drafting:
            return tuple(seqs)
        known_end = {s.request.request_id: s.end - len(s.draft_token_ids) for s in drafting}
        drafts = {rid: [token] for rid, token in zip(known_end, self._catch_up(drafting, known_end))}
        for step in range(1, max(len(s.draft_token_ids) for s in drafting)):
            growing = [s for s in drafting if len(s.draft_token_ids) > step]
            tokens = [drafts[s.request.request_id][-1] for s in growing]
            positions = [known_end[s.request.request_id] + step - 1 for s in growing]
            for s, token in zip(growing, self._decode(growing, tokens, positions)):
                drafts[s.request.request_id].append(token)
        for s in drafting:
            rid = s.request.request_id
            self._computed[rid] = known_end[rid] + len(s.draft_token_ids) - 1
        return tuple(dataclasses.replace(s, draft_token_ids=tuple(drafts[s.request.request_id]))
                     if s.draft_token_ids else s for s in seqs)

    def _catch_up(self, seqs: Sequence[ScheduledSeq], known_end: dict[str, int]) -> list[int]:
        """Compute each sequence's known tokens the draft lacks; the greedy draft after its last one."""
        slices, token_ids = [], []
        for s in seqs:
            rid = s.request.request_id
            start = min(self._computed.get(rid, 0), known_end[rid] - 1)
            slices.append(SeqSlice(start, known_end[rid] - start, s.block_ids))
            token_ids.extend(s.request.all_token_ids[start : known_end[rid]])
        hidden = self._forward(slices, token_ids)  # [T, hidden]
        last_rows = torch.tensor([0, *(sl.num_new_tokens for sl in slices)]).cumsum(0)[1:] - 1  # [B]
        return self.model.compute_logits(hidden[last_rows.to(self.device)]).argmax(-1).tolist()

    def _decode(self, seqs: Sequence[ScheduledSeq], tokens: list[int], positions: list[int]) -> list[int]:
        slices = [SeqSlice(p, 1, s.block_ids) for s, p in zip(seqs, positions)]
        return self.model.compute_logits(self._forward(slices, tokens)).argmax(-1).tolist()

    def _forward(self, slices: list[SeqSlice], token_ids: list[int]) -> torch.Tensor:
        batch = StepBatch.from_slices(slices, self.block_size, self.device)
        metadata = self.backend.build_metadata(batch)
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        self.num_forwards += 1
        return self.model(input_ids, ForwardBatch(batch.positions, self.kv_layers, self.backend, metadata))
