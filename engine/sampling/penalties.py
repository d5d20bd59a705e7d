"""Repetition, presence and frequency penalties (vLLM v1's semantics), applied where they act: on each
row's distinct prompt and output tokens, a few hundred entries, not its whole vocabulary.

Repetition counts prompt and output tokens; presence and frequency only output tokens. Each penalised
logit goes through the same float ops as the dense formulas below, so the result is bit for bit theirs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SeenTokens:
    """Each row's distinct prompt and output tokens, padded to a common width W.

    A row's padding repeats its first entry (so a scatter writes the same value twice); a row with no
    token holds token 0 with count 0, and ``nonempty`` False keeps the repetition penalty off it.
    """

    token_ids: torch.Tensor  # [B, W] int64
    output_counts: torch.Tensor  # [B, W] int32: occurrences of the token in the row's output
    nonempty: torch.Tensor  # [B] bool

    @classmethod
    def from_lists(cls, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                   device: torch.device | str) -> SeenTokens:
        """From plain Python, counted from scratch (tests and tools; the runner keeps ``PenaltyState``)."""
        rows = [distinct_counts(prompt, output) for prompt, output in zip(prompts, outputs)]
        width = max((len(ids) for ids, _ in rows), default=0) or 1
        ids = [_pad(row_ids, width) for row_ids, _ in rows]
        counts = [_pad(row_counts, width) for _, row_counts in rows]
        return cls(
            token_ids=torch.tensor(ids, dtype=torch.int64, device=device).view(len(rows), width),  # [B, W]
            output_counts=torch.tensor(counts, dtype=torch.int32, device=device).view(len(rows), width),
            nonempty=torch.tensor([bool(row_ids) for row_ids, _ in rows], dtype=torch.bool, device=device),
        )


def distinct_counts(prompt: Sequence[int], output: Sequence[int]) -> tuple[list[int], list[int]]:
    """A row's distinct tokens (prompt's first, in first-seen order) and each one's count in ``output``."""
    counts = Counter(output)
    ids = list(dict.fromkeys([*prompt, *output]))
    return ids, [counts.get(token, 0) for token in ids]


def _pad(row: list[int], width: int) -> list[int]:
    return [*row, *([row[0] if row else 0] * (width - len(row)))]


def penalise_seen(logits: torch.Tensor, seen: SeenTokens, repetition: torch.Tensor, frequency: torch.Tensor,
                  presence: torch.Tensor) -> torch.Tensor:
    """The penalised logits [B, W] of each row's seen tokens (penalties [B] each), to scatter back."""
    values = logits.gather(-1, seen.token_ids)  # [B, W]
    seen_mask = seen.nonempty[:, None].expand_as(values)  # [B, W]
    values = apply_repetition_penalty(values, seen_mask, repetition)  # [B, W]
    return apply_frequency_presence_penalties(values, seen.output_counts, frequency, presence)  # [B, W]


def token_bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each vocab id occurs in each row of ``token_ids`` [B, L] (padded with vocab_size)."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))  # [B, V + 1]; column V counts padding
    return counts[:, :vocab_size]  # [B, V]


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """For tokens ``seen`` [B, N] in prompt or output: positive logits / penalty, others * penalty."""
    row_penalty = torch.where(seen, penalty[:, None], 1.0)  # [B, N]
    return torch.where(logits > 0, logits / row_penalty, logits * row_penalty)  # [B, N]


def apply_frequency_presence_penalties(
    logits: torch.Tensor, output_counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor
) -> torch.Tensor:
    """logit -= frequency * count_in_output + presence * (count_in_output > 0). [B, N] each."""
    logits = logits - frequency[:, None] * output_counts  # [B, N]
    return logits - presence[:, None] * (output_counts > 0)  # [B, N]
