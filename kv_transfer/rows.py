"""Rows of ``(address, length)`` over KV blocks, the shape one-sided transports hand out and read by:
``cma://`` (process_vm_readv iovecs) and ``nixl://`` (NIXL transfer descriptors). The serving side lists its
blocks' rows (``buffer_iovecs``), the pulling side pairs them with its destination blocks (``pair_rows``) and
may cut them to a batch size (``split_rows``).
"""

from __future__ import annotations

import numpy as np

from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVBuffer, block_runs, paired_runs

def buffer_iovecs(buffer: KVBuffer, block_ids: Sequence[int]) -> np.ndarray:
    """uint64 [layers x runs, 2]: (address, length) of ``block_ids`` in ``buffer``, per layer per run of
    consecutive ids, in wire order (what a server hands out)."""
    seg, num_blocks = buffer.segment_bytes, buffer.num_blocks
    runs = np.array(block_runs(block_ids), np.uint64).reshape(-1, 2)
    base = buffer.array.ctypes.data
    layers = np.arange(buffer.layout.num_layers, dtype=np.uint64)[:, None]
    out = np.empty((len(layers), len(runs), 2), np.uint64)
    out[:, :, 0] = np.uint64(base) + (layers * np.uint64(num_blocks) + runs[None, :, 0]) * np.uint64(seg)
    out[:, :, 1] = runs[None, :, 1] * np.uint64(seg)
    return out.reshape(-1, 2)


def pair_rows(dst: KVBuffer, src_ids: list[int], dst_ids: list[int], remote: np.ndarray,
              uri: str) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) uint64 [n, 2] rows of equal lengths: one per layer per paired run of ``src_ids`` ->
    ``dst_ids``; remote addresses come from the server's iovecs (one per layer per run of ``src_ids``)."""
    seg, layers = dst.segment_bytes, dst.layout.num_layers
    runs = block_runs(src_ids)
    if remote.shape != (layers * len(runs), 2):
        raise KVTransferError(f"KV server {uri} sent {len(remote)} iovecs, expected {layers * len(runs)}")
    if not np.array_equal(remote[:, 1].reshape(layers, -1),
                          np.tile(np.array([c * seg for _, c in runs], np.uint64), (layers, 1))):
        raise KVTransferError(f"KV server {uri} sent iovecs of the wrong lengths")
    # source block -> (index of its run, offset in the run)
    where = {}
    for r, (first, count) in enumerate(runs):
        for k in range(count):
            where[first + k] = (r, k * seg)
    pairs = paired_runs(src_ids, dst_ids)
    remote_rows = remote.reshape(layers, len(runs), 2)
    local = np.empty((layers, len(pairs), 2), np.uint64)
    out_remote = np.empty((layers, len(pairs), 2), np.uint64)
    base, num_blocks = dst.array.ctypes.data, dst.num_blocks
    lyr = np.arange(layers, dtype=np.uint64)
    for p, (s, d, count) in enumerate(pairs):
        r, offset = where[s]
        out_remote[:, p, 0] = remote_rows[:, r, 0] + np.uint64(offset)
        local[:, p, 0] = np.uint64(base) + (lyr * np.uint64(num_blocks) + np.uint64(d)) * np.uint64(seg)
        local[:, p, 1] = out_remote[:, p, 1] = np.uint64(count * seg)
    return local.reshape(-1, 2), out_remote.reshape(-1, 2)


def split_rows(local: np.ndarray, remote: np.ndarray, max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The same rows, those longer than ``max_bytes`` cut into pieces of at most ``max_bytes``."""
    lengths = local[:, 1].astype(np.int64)
    if (lengths <= max_bytes).all():
        return local.copy(), remote.copy()
    pieces = np.maximum(1, -(-lengths // max_bytes))
    row = np.repeat(np.arange(len(local)), pieces)
    k = np.arange(len(row)) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # piece index within its row
    offset = (k * max_bytes).astype(np.uint64)
    length = np.minimum(lengths[row] - k * max_bytes, max_bytes).astype(np.uint64)
    new_local = np.stack([local[row, 0] + offset, length], axis=1)
    new_remote = np.stack([remote[row, 0] + offset, length], axis=1)
    return new_local, new_remote
