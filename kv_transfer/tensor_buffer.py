"""A paged KV cache's bytes as a torch tensor where they live: what the transports that move device memory
(``IN_PLACE_KINDS``: nixl, ucx, nccl) serve and pull into in place, without host staging.

``KVBuffer`` (``kv_transfer/layout.py``) is host memory seen through numpy: every transport reads it. A CUDA
cache has no numpy view, so a worker serving one hands those transports a ``TensorKVBuffer`` over the engine's
tensor instead (``[num_layers, num_blocks, segment_bytes]`` uint8 on its device, no copy) and the host-only
transports (tcp, cma) a staging buffer (``kv_transfer/staging.py``). It has ``KVBuffer``'s checks (layout,
block range, writable) but no host view. The same class over a CPU tensor runs every line of the device path
but the CUDA-only ones, so the tests exercise it here; those lines say "never run here (no GPU)".

No torch import at module level: it only holds the tensor (the module stays as light as ``layout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVBuffer, KVLayout, check_block_ids

# The transports that register or move device memory, so serve and pull a device-resident cache in place
# (GPU-direct); the others (tcp, cma: host sockets and process_vm_readv) need host memory, so a device cache
# reaches them through host staging. ``local`` copies with numpy: host only.
IN_PLACE_KINDS = frozenset({"nixl", "ucx", "nccl"})


class TensorKVBuffer:
    """``tensor`` (uint8 ``[num_layers, num_blocks, segment_bytes]``, contiguous, any device) as a KV buffer."""

    __slots__ = ("layout", "tensor", "num_blocks", "segment_bytes")
    writable = True

    def __init__(self, layout: KVLayout, tensor: Any) -> None:
        seg = layout.bytes_per_block_per_layer
        if str(tensor.dtype) != "torch.uint8" or tensor.dim() != 3 or not tensor.is_contiguous():
            raise ValueError(f"TensorKVBuffer: want a contiguous uint8 [layers, blocks, {seg}] tensor, got "
                             f"{tensor.dtype} {tuple(tensor.shape)}")
        if tensor.shape[0] != layout.num_layers or tensor.shape[2] != seg or tensor.shape[1] < 1:
            raise ValueError(f"TensorKVBuffer: shape {tuple(tensor.shape)} does not match {layout}")
        self.layout, self.tensor = layout, tensor
        self.num_blocks, self.segment_bytes = int(tensor.shape[1]), seg

    @property
    def is_host(self) -> bool:
        return self.tensor.device.type == "cpu"

    @property
    def is_cuda(self) -> bool:
        return self.tensor.device.type == "cuda"

    @property
    def device_id(self) -> int:
        """The CUDA device's index (0 on the host), as NIXL names memory."""
        return (self.tensor.device.index or 0) if self.is_cuda else 0

    @property
    def base_ptr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def check_block_ids(self, block_ids: Sequence[int]) -> None:
        """Raise KVTransferError unless every id is an int in ``[0, num_blocks)``."""
        check_block_ids(block_ids, self.num_blocks)

    def take(self, block_ids: Sequence[int]) -> Any:
        """A copy of the blocks, ``[num_layers, n, segment_bytes]`` on the buffer's device, ready to read."""
        self.check_block_ids(block_ids)
        blocks = self.tensor.index_select(1, self._index(block_ids))
        self.synchronize()
        return blocks

    def put(self, block_ids: Sequence[int], blocks: Any) -> None:
        """Write ``blocks`` (``[num_layers, n, segment_bytes]``, this device) into the blocks ``block_ids``."""
        self.check_block_ids(block_ids)
        self.tensor.index_copy_(1, self._index(block_ids), blocks)
        self.synchronize()

    def new_blocks(self, count: int) -> Any:
        """Uninitialised room for ``count`` blocks on the buffer's device (a receive's staging area)."""
        return self.tensor.new_empty((self.layout.num_layers, count, self.segment_bytes))

    def host_blocks(self, block_ids: Sequence[int]) -> KVBuffer:
        """A host copy of the blocks, as blocks 0..n-1 of a KVBuffer (checksums of device memory)."""
        return KVBuffer(self.layout, self.take(block_ids).cpu().numpy())  # [L, n, seg]

    def synchronize(self) -> None:
        """Wait for the device work queued on the current stream (a copy a transport reads next)."""
        if self.is_cuda:  # pragma: no cover - never run here (no GPU)
            import torch

            torch.cuda.current_stream(self.tensor.device).synchronize()

    def _index(self, block_ids: Sequence[int]) -> Any:
        import torch

        return torch.tensor([int(b) for b in block_ids], dtype=torch.int64, device=self.tensor.device)


AnyKVBuffer = KVBuffer | TensorKVBuffer
