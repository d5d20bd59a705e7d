"""The attention backend interface and the per-step batch the model's layers see."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True, slots=True)
class SeqSlice:
    """One sequence in a step: tokens [start, start + num_new_tokens) are computed; their KV goes
    into ``block_ids`` (the sequence's whole block table)."""

    start: int
    num_new_tokens: int
    block_ids: Sequence[int]

    @property
    def context_len(self) -> int:
        return self.start + self.num_new_tokens


class AttentionBackend(Protocol):
    name: str

    def build_metadata(self, slices: Sequence[SeqSlice], block_size: int, device: torch.device) -> Any:
        """Everything the layers need for this step (computed once, shared by all layers)."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim] (one layer)
        metadata: Any,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k and v into the cache at this step's slots, then attend."""
        ...


@dataclass(slots=True)
class ForwardBatch:
    """What one forward pass needs beyond token ids: positions, the cache and the attention plan."""

    positions: torch.Tensor  # [T] int64
    kv_caches: Sequence[torch.Tensor]  # per layer: [num_blocks, 2, block_size, num_kv_heads, head_dim]
    backend: AttentionBackend
    metadata: Any

    def attention(self, layer_idx: int, q, k, v, window: int | None, scale: float) -> torch.Tensor:
        return self.backend.forward(q, k, v, self.kv_caches[layer_idx], self.metadata, window, scale)
