"""Optional per-block checksums of pulled KV (``TransportConfig.checksum``).

A block's checksum is xxh3-64 over its bytes in wire order (layer 0's segment, then layer 1's, ...), so
both sides compute it from their own buffer whatever the block's id there. The serving side sends one
``uint64`` per block with the data; the pulling side recomputes over the blocks that landed and raises
``ChecksumMismatch`` naming the destination blocks that differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from kv_transfer.errors import ChecksumMismatch
from kv_transfer.layout import KVBuffer
from kv_transfer.tensor_buffer import AnyKVBuffer, TensorKVBuffer

DTYPE = np.dtype("<u8")


def block_checksums(buffer: AnyKVBuffer, block_ids: Sequence[int]) -> np.ndarray:
    """``uint64[len(block_ids)]``: xxh3-64 of each block's bytes in wire order (a tensor's blocks: of a host
    copy of them)."""
    if isinstance(buffer, TensorKVBuffer):
        return block_checksums(buffer.host_blocks(block_ids), range(len(block_ids)))
    buffer.check_block_ids(block_ids)
    out = np.empty(len(block_ids), DTYPE)
    for i, block_id in enumerate(block_ids):
        h = xxhash.xxh3_64()
        for layer in range(buffer.layout.num_layers):
            h.update(buffer.array[layer, int(block_id)])  # a contiguous uint8 row: hashed without a copy
        out[i] = h.intdigest()
    return out


def verify(buffer: AnyKVBuffer, block_ids: Sequence[int], expected: np.ndarray | bytes) -> None:
    """Raise ``ChecksumMismatch`` unless the blocks of ``buffer`` hash to ``expected`` (array or wire bytes)."""
    want = np.frombuffer(expected, DTYPE) if isinstance(expected, (bytes, bytearray, memoryview)) else expected
    if len(want) != len(block_ids):
        raise ChecksumMismatch(f"got {len(want)} checksums for {len(block_ids)} blocks")
    bad = tuple(int(b) for b, ok in zip(block_ids, block_checksums(buffer, block_ids) == want) if not ok)
    if bad:
        raise ChecksumMismatch(f"{len(bad)} of {len(block_ids)} pulled blocks fail their checksum: {list(bad[:8])}", bad)
