"""The attention backend interface and the per-step batch the model's layers see."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
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


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One step of B sequences and T new tokens as the attention backends see it: tensors on the device for
    the kernels, and the same facts as host arrays for planning, so building a step's plan never reads the
    device (no host sync). ``engine.step_inputs.StepInputs`` fills it from persistent buffers each step."""

    positions: torch.Tensor  # [T] int64: each new token's position in its sequence
    slots: torch.Tensor  # [T] int64: where each new token's KV goes, block * block_size + offset
    block_table: torch.Tensor  # [B, W] int64: each sequence's blocks (W covers the longest context; the rest unread)
    context_lens: torch.Tensor  # [B] int64: each sequence's tokens in the cache after this step's write
    starts: np.ndarray  # [B] int64, host: tokens cached before this step
    counts: np.ndarray  # [B] int64, host: new tokens this step
    block_table_host: np.ndarray  # [B, W] int64, host: ``block_table``'s values
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.counts)

    @property
    def context_lens_host(self) -> np.ndarray:  # [B]
        return self.starts + self.counts

    @property
    def is_decode_only(self) -> bool:
        """Every sequence has one new token (decode steps: what CUDA graphs capture)."""
        return bool((self.counts == 1).all())

    @staticmethod
    def from_slices(slices: Sequence[SeqSlice], block_size: int, device: torch.device) -> StepBatch:
        """A batch built from plain lists (scoring, calibration, tests); steps use ``StepInputs``."""
        starts = np.array([s.start for s in slices], np.int64)  # [B]
        counts = np.array([s.num_new_tokens for s in slices], np.int64)  # [B]
        width = max(-(-s.context_len // block_size) for s in slices)
        table = np.zeros((len(slices), width), np.int64)  # [B, W]
        for i, s in enumerate(slices):
            assert len(s.block_ids) * block_size >= s.context_len, "block table shorter than context"
            num_blocks = min(len(s.block_ids), width)
            table[i, :num_blocks] = list(s.block_ids)[:num_blocks]
        positions = np.concatenate([np.arange(s.start, s.context_len) for s in slices])  # [T]
        seq_of_token = np.repeat(np.arange(len(slices)), counts)  # [T]
        slots = table[seq_of_token, positions // block_size] * block_size + positions % block_size  # [T]
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        return StepBatch(to(positions), to(slots), to(table), to(starts + counts), starts, counts, table, block_size)


class AttentionBackend(Protocol):
    name: str

    def build_metadata(self, batch: StepBatch) -> Any:
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


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on ``device`` without a host sync: on CUDA through pinned memory (torch's caching
    host allocator keeps it until the copy is done) and an asynchronous copy; on CPU the array itself."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)  # never run here (no GPU)


@dataclass(slots=True)
class ForwardBatch:
    """What one forward pass needs beyond token ids: positions, the cache and the attention plan."""

    positions: torch.Tensor  # [T] int64
    kv_caches: Sequence[torch.Tensor]  # per layer: [num_blocks, 2, block_size, num_kv_heads, head_dim]
    backend: AttentionBackend
    metadata: Any
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin at ``positions``: the model looks them up once

    def attention(self, layer_idx: int, q, k, v, window: int | None, scale: float) -> torch.Tensor:
        return self.backend.forward(q, k, v, self.kv_caches[layer_idx], self.metadata, window, scale)
