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
    seg, num_layers = buffer.segment_bytes, buffer.layout.num_layers
    runs = id_runs(block_ids)
    out = np.empty((num_layers, len(runs), 2), np.int64)  # addresses fit: user space is below 2**63
    layer_base = np.arange(num_layers, dtype=np.int64) * (buffer.num_blocks * seg) + buffer.base_ptr
    np.add(layer_base[:, None], runs[:, 0] * seg, out=out[:, :, 0])
    out[:, :, 1] = runs[:, 1] * seg
    return out.reshape(-1, 2).view(np.uint64)


def id_runs(block_ids: Sequence[int]) -> np.ndarray:
    """int64 [runs, 2]: ``(first_id, count)`` of each run of consecutive ids, in order (``layout.block_runs``,
    vectorized)."""
    ids = np.asarray(block_ids, np.int64).reshape(-1)
    edge = np.ones(len(ids) + 1, bool)  # a run starts at 0, wherever an id is not its predecessor + 1, and ends
    np.not_equal(ids[1:] - ids[:-1], 1, out=edge[1:-1])
    bounds = np.flatnonzero(edge)
    runs = np.empty((len(bounds) - 1, 2), np.int64)  # filled, not np.stack'ed: every call here costs microseconds
    runs[:, 0] = ids[bounds[:-1]]
    runs[:, 1] = bounds[1:] - bounds[:-1]
    return runs


def pair_rows(dst: AnyKVBuffer, dst_ids: list[int], remote: np.ndarray, uri: str) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) uint64 [n, 2] rows of equal lengths, in wire order: ``remote`` (the server's rows, any
    cut of the read's bytes in wire order: one per layer per run of the blocks in its own buffer) and this
    side's rows of ``dst_ids`` cut at each other's boundaries. Vectorized: no per-block Python work."""
    layer_bytes = len(dst_ids) * dst.segment_bytes
    total = dst.layout.num_layers * layer_bytes
    lengths = remote[:, 1].astype(np.int64) if remote.ndim == 2 and remote.shape[1] == 2 else None
    if total == 0 and lengths is not None and not len(lengths):  # a read of no blocks (a reader's release)
        return np.empty((0, 2), np.uint64), np.empty((0, 2), np.uint64)
    if lengths is None or (lengths <= 0).any() or int(lengths.sum()) != total:
        raise KVTransferError(f"KV server {uri} sent iovecs that do not cover the {total} bytes read")
    if total and not (lengths % dst.segment_bytes).any():  # whole blocks, as a server lists them
        return _pair_blocks(dst, dst_ids, remote, lengths // dst.segment_bytes, uri)
    return _pair_cuts(dst, dst_ids, remote, lengths, uri)


def paired_rows(dst: AnyKVBuffer, dst_ids: Sequence[int], src_base_ptr: int, src_num_blocks: int,
                src_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``pair_rows`` of a source buffer known by its geometry (``dst``'s layout, ``src_num_blocks`` blocks from
    ``src_base_ptr``): one row per layer per run of blocks consecutive on both sides, built at once."""
    seg, num_layers = dst.segment_bytes, dst.layout.num_layers
    src, near = np.asarray(src_ids, np.int64), np.asarray(dst_ids, np.int64)
    edge = np.ones(len(src) + 1, bool)  # a run starts at 0 and wherever either side's id is not its predecessor + 1
    np.logical_or(src[1:] - src[:-1] != 1, near[1:] - near[:-1] != 1, out=edge[1:-1])
    bounds = np.flatnonzero(edge)
    first = bounds[:-1]
    layers = np.arange(num_layers, dtype=np.int64)[:, None] * seg
    local, remote = np.empty((num_layers, len(first), 2), np.int64), np.empty((num_layers, len(first), 2), np.int64)
    np.add(layers * dst.num_blocks + dst.base_ptr, near[first] * seg, out=local[:, :, 0])
    np.add(layers * src_num_blocks + src_base_ptr, src[first] * seg, out=remote[:, :, 0])
    local[:, :, 1] = remote[:, :, 1] = (bounds[1:] - first) * seg
    return local.reshape(-1, 2).view(np.uint64), remote.reshape(-1, 2).view(np.uint64)


def _pair_cuts(dst: AnyKVBuffer, dst_ids: list[int], remote: np.ndarray, lengths: np.ndarray,
               uri: str) -> tuple[np.ndarray, np.ndarray]:
    """``pair_rows`` for any cut: both sides' rows cut at the union of their byte boundaries."""
    layer_bytes = len(dst_ids) * dst.segment_bytes
    local = buffer_iovecs(dst, dst_ids)
    local_ends = np.cumsum(local[:, 1].astype(np.int64))  # every layer's end is one of these
    remote_ends = np.cumsum(lengths)
    ends = np.union1d(local_ends, remote_ends)
    starts = np.concatenate(([0], ends[:-1]))
    per_layer = np.diff(np.searchsorted(starts, np.arange(dst.layout.num_layers + 1) * layer_bytes))
    if (per_layer != per_layer[0]).any():  # a layer-wise read takes as many rows from each layer
        raise KVTransferError(f"KV server {uri} sent iovecs cut differently in each layer")
    return _cut(local, local_ends, starts), _cut(remote, remote_ends, starts)


def _pair_blocks(dst: AnyKVBuffer, dst_ids: list[int], remote: np.ndarray, counts: np.ndarray,
                 uri: str) -> tuple[np.ndarray, np.ndarray]:
    """``pair_rows`` where every remote row is whole blocks (``counts`` of them): each block's address on both
    sides, in wire order, and a piece wherever either side jumps or a layer starts. A third of the general
    path's numpy calls (each costs microseconds: at 1k tokens the calls, not the bytes, are the time)."""
    seg, num_layers, n = dst.segment_bytes, dst.layout.num_layers, len(dst_ids)
    blocks = num_layers * n
    within = np.arange(blocks, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    far = np.repeat(remote[:, 0].astype(np.int64), counts) + within * seg
    layer_base = np.arange(num_layers, dtype=np.int64)[:, None] * (dst.num_blocks * seg) + dst.base_ptr
    near = (layer_base + np.asarray(dst_ids, np.int64)[None, :] * seg).reshape(-1)
    starts = np.ones(blocks, bool)
    np.logical_or(far[1:] - far[:-1] != seg, near[1:] - near[:-1] != seg, out=starts[1:])
    starts[::n] = True  # a piece never crosses a layer
    first = np.flatnonzero(starts)
    per_layer = len(first) // num_layers  # each layer's pieces start at its first block: as many in every layer
    if len(first) % num_layers or (first[::per_layer] != np.arange(0, blocks, n)).any():
        raise KVTransferError(f"KV server {uri} sent iovecs cut differently in each layer")
    local, remote = np.empty((len(first), 2), np.int64), np.empty((len(first), 2), np.int64)
    local[:, 0], remote[:, 0] = near[first], far[first]
    local[:-1, 1] = (first[1:] - first[:-1]) * seg
    local[-1, 1] = (blocks - first[-1]) * seg
    remote[:, 1] = local[:, 1]
    return local.view(np.uint64), remote.view(np.uint64)


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
