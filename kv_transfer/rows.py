"""Rows of ``(address, length)`` over KV blocks, the shape one-sided transports hand out and read by:
``cma://`` (process_vm_readv iovecs) and ``nixl://`` (NIXL transfer descriptors). The serving side lists its
blocks' rows (``buffer_iovecs``), the pulling side pairs them with its destination blocks (``pair_rows``) and
may cut them to a batch size (``split_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kv_transfer.errors import KVTransferError
from kv_transfer.tensor_buffer import AnyKVBuffer


def buffer_iovecs(buffer: AnyKVBuffer, block_ids: Sequence[int]) -> np.ndarray:
    """uint64 [layers x runs, 2]: (address, length) of ``block_ids`` in ``buffer`` (host or device memory), per
    layer per run of consecutive ids, in wire order (what a server hands out; a puller's own rows too)."""
    seg, num_blocks = np.uint64(buffer.segment_bytes), np.uint64(buffer.num_blocks)
    runs = id_runs(block_ids).astype(np.uint64)
    layers = np.arange(buffer.layout.num_layers, dtype=np.uint64)[:, None]
    out = np.empty((len(layers), len(runs), 2), np.uint64)
    out[:, :, 0] = np.uint64(buffer.base_ptr) + (layers * num_blocks + runs[None, :, 0]) * seg
    out[:, :, 1] = runs[None, :, 1] * seg
    return out.reshape(-1, 2)


def id_runs(block_ids: Sequence[int]) -> np.ndarray:
    """int64 [runs, 2]: ``(first_id, count)`` of each run of consecutive ids, in order (``layout.block_runs``,
    vectorized)."""
    ids = np.asarray(block_ids, np.int64).reshape(-1)
    starts = np.flatnonzero(np.diff(ids, prepend=ids[:1] - 2) != 1)  # the first id always starts a run
    return np.stack([ids[starts], np.diff(np.append(starts, len(ids)))], axis=1)


def pair_rows(dst: AnyKVBuffer, dst_ids: list[int], remote: np.ndarray, uri: str) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) uint64 [n, 2] rows of equal lengths, in wire order: ``remote`` (the server's rows, any
    cut of the read's bytes in wire order: one per layer per run of the blocks in its own buffer) and this
    side's rows of ``dst_ids`` cut at each other's boundaries. Vectorized: no per-block Python work."""
    local = buffer_iovecs(dst, dst_ids)
    layer_bytes = len(dst_ids) * dst.segment_bytes
    total = dst.layout.num_layers * layer_bytes
    lengths = remote[:, 1].astype(np.int64) if remote.ndim == 2 and remote.shape[1] == 2 else None
    if lengths is None or (lengths <= 0).any() or int(lengths.sum()) != total:
        raise KVTransferError(f"KV server {uri} sent iovecs that do not cover the {total} bytes read")
    local_ends = np.cumsum(local[:, 1].astype(np.int64))  # every layer's end is one of these
    remote_ends = np.cumsum(lengths)
    ends = np.union1d(local_ends, remote_ends)
    starts = np.concatenate(([0], ends[:-1]))
    per_layer = np.diff(np.searchsorted(starts, np.arange(dst.layout.num_layers + 1) * layer_bytes))
    if (per_layer != per_layer[0]).any():  # a layer-wise read takes as many rows from each layer
        raise KVTransferError(f"KV server {uri} sent iovecs cut differently in each layer")
    return _cut(local, local_ends, starts), _cut(remote, remote_ends, starts)


def _cut(rows: np.ndarray, ends: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``rows`` (whose cumulative lengths are ``ends``) cut into pieces starting at byte offsets ``starts``."""
    which = np.searchsorted(ends, starts, side="right")  # the row each piece starts in
    offset = starts - (ends[which] - rows[which, 1].astype(np.int64))
    lengths = np.diff(np.concatenate((starts, ends[-1:])))
    return np.stack([rows[which, 0] + offset.astype(np.uint64), lengths.astype(np.uint64)], axis=1)


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
