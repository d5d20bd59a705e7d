"""The host tier's memory and its copies to and from the KV cache (runtime; the books are
``engine.core.host_tier.HostTier``).

Host blocks are block-major, ``[num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, so each
is one contiguous piece of (pinned, on CUDA) memory, while a pool block's bytes lie across the cache's layers.
On CPU a batch of saves is one gather and one indexed copy, likewise loads. On CUDA each block is gathered on
the device and copied to or from its pinned host block asynchronously, in stream order with the forward pass
that follows, so a save reads a reused block before the step overwrites it and a load lands before the step
reads it (``sync`` waits for them where something outside the stream writes next: a KV pull).
"""

from __future__ import annotations

import torch

from engine.core.host_tier import HostCopies


class HostCache:
    def __init__(self, kv_cache: torch.Tensor, num_blocks: int) -> None:
        # kv_cache: [num_layers, pool blocks, 2, block_size, num_kv_heads, head_dim]
        self.kv_cache = kv_cache
        self.on_gpu = kv_cache.device.type == "cuda"
        shape = (num_blocks, kv_cache.shape[0], *kv_cache.shape[2:])
        self.blocks = torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=self.on_gpu)  # [H, L, 2, bs, kvh, d]

    @property
    def bytes_per_block(self) -> int:
        return self.blocks[0].numel() * self.blocks.element_size()

    def copy(self, copies: HostCopies) -> None:
        """Saves (pool -> host), then loads (host -> pool)."""
        if copies.saves:
            self._save([b for b, _ in copies.saves], [h for _, h in copies.saves])
        if copies.loads:
            self._load([h for h, _ in copies.loads], [b for _, b in copies.loads])

    def sync(self) -> None:
        if self.on_gpu:  # never run here (no GPU)
            torch.cuda.current_stream(self.kv_cache.device).synchronize()

    def _save(self, block_ids: list[int], host_ids: list[int]) -> None:
        if self.on_gpu:  # never run here (no GPU)
            for block_id, host_id in zip(block_ids, host_ids):
                self.blocks[host_id].copy_(self.kv_cache[:, block_id].contiguous(), non_blocking=True)
            return
        src = torch.tensor(block_ids)
        self.blocks.index_copy_(0, torch.tensor(host_ids), self.kv_cache.index_select(1, src).transpose(0, 1))

    def _load(self, host_ids: list[int], block_ids: list[int]) -> None:
        if self.on_gpu:  # never run here (no GPU)
            for host_id, block_id in zip(host_ids, block_ids):
                self.kv_cache[:, block_id].copy_(self.blocks[host_id], non_blocking=True)
            return
        dst = torch.tensor(block_ids)
        self.kv_cache.index_copy_(1, dst, self.blocks.index_select(0, torch.tensor(host_ids)).transpose(0, 1))
