"""The store tier's host slots and their copies to and from the KV cache (runtime; the books are
``engine.core.store_writes.StoreWrites``; the store I/O is the worker shell's, ``worker/store_tier.py``).

One host buffer (pinned on CUDA), registered once with the store client: ``raw`` is ``[num_write + num_read,
stride]`` bytes; slot i's first ``block_bytes`` are one block, block-major (``[num_layers, 2, block_size,
num_kv_heads, head_dim]``: layer 0's K and V, then layer 1's, ...: a block's bytes in the data plane's wire
order), followed by its 8-byte checksum (written by the store client). The first ``num_write`` slots are the
engine's: blocks are copied into them (``spill``) before the blocks are reused; the others are the shell's: the
store reads into them and ``fill`` copies them into reserved pool blocks.
"""

from __future__ import annotations

import torch

from engine.core.block_pool import TIER_POOL
from engine.core.store_writes import StoreCopy
from engine.host_cache import HostCache

CHECKSUM_BYTES = 8  # kv_transfer.kv_store.CHECKSUM_BYTES (the engine does not import the store client)
_ALIGN = 64


class StoreBuffer:
    def __init__(self, kv_cache: torch.Tensor, host: HostCache | None, num_write: int, num_read: int) -> None:
        # kv_cache: [num_layers, pool blocks, 2, block_size, num_kv_heads, head_dim]
        self.kv_cache, self.host = kv_cache, host
        self.on_gpu = kv_cache.device.type == "cuda"
        self.num_write, self.num_read = num_write, num_read
        block_shape = (kv_cache.shape[0], *kv_cache.shape[2:])  # [L, 2, bs, kvh, d]
        self.block_bytes = kv_cache[:, 0].numel() * kv_cache.element_size()
        stride = -(-(self.block_bytes + CHECKSUM_BYTES) // _ALIGN) * _ALIGN
        self.raw = torch.zeros((num_write + num_read, stride), dtype=torch.uint8, pin_memory=self.on_gpu)
        # [slots, L, 2, bs, kvh, d]: each slot's block bytes as the cache's dtype
        self.blocks = self.raw[:, : self.block_bytes].view(kv_cache.dtype).view(num_write + num_read, *block_shape)

    @property
    def read_slots(self) -> range:
        return range(self.num_write, self.num_write + self.num_read)

    def spill(self, copies: tuple[StoreCopy, ...]) -> None:
        """Copy each block into its write slot (pool blocks: gathered across the cache's layers)."""
        pool = [c for c in copies if c.tier == TIER_POOL]
        host = [c for c in copies if c.tier != TIER_POOL]
        if pool:
            ids = torch.tensor([c.block_id for c in pool], device=self.kv_cache.device)
            src = self.kv_cache.index_select(1, ids).transpose(0, 1)
            self._put([c.slot for c in pool], src)  # src: [n, L, 2, bs, kvh, d]
        if host:
            host_ids = torch.tensor([c.block_id for c in host])
            self._put([c.slot for c in host], self.host.blocks.index_select(0, host_ids))  # [n, L, 2, bs, kvh, d]

    def fill(self, slots: list[int], block_ids: list[int]) -> None:
        """Copy read slots into pool blocks (reserved for a request, so nothing else writes them meanwhile)."""
        if not slots:
            return
        src = self.blocks.index_select(0, torch.tensor(slots))  # [n, L, 2, bs, kvh, d], on the host
        dst = torch.tensor(block_ids, device=self.kv_cache.device)
        self.kv_cache.index_copy_(1, dst, src.to(self.kv_cache.device, non_blocking=True).transpose(0, 1))
        self.sync()  # the slots go back to the shell after this

    def sync(self) -> None:
        if self.on_gpu:  # never run here (no GPU)
            torch.cuda.current_stream(self.kv_cache.device).synchronize()

    def _put(self, slots: list[int], src: torch.Tensor) -> None:
        if self.on_gpu:  # never run here (no GPU): device -> pinned slot, in stream order before the forward
            for slot, block in zip(slots, src):
                self.blocks[slot].copy_(block.contiguous(), non_blocking=True)
            return
        self.blocks.index_copy_(0, torch.tensor(slots), src)
