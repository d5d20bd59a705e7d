"""The ``ucx://`` transport's pure parts (``kv_transfer/ucx.py``): its request and its message plan. No ucxx,
no I/O: it tests on any machine.

The request inlines what tcp's HELLO carries, ahead of the shared READ (``wire.encode_read``, with the runs)::

    u8 flags (READ_CHECKSUM, READ_AUTH) | u16 len | client KVLayout JSON | READ [| HMAC trailer over it all]

The plan: how many blocks each KV message carries, in request order (``plan_pull``). A message is one
contiguous piece of memory on each side and costs far more than copying it, so runs consecutive on both
sides go straight between the blocks when they are large enough; otherwise the fragmented side copies once
(the server gathers, the client stages and scatters) and the pull stays a few large messages.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVLayout, block_runs, paired_runs
from kv_transfer.wire import ReadRequest, decode_read

MAX_MESSAGE_BYTES = 4 << 20  # longer runs are split, so progress (and the io timeout) has a fine grain
DIRECT_MIN_MESSAGE_BYTES = 256 << 10  # below this average, stage scattered pulls (see the docstring)
HELLO_HEAD = struct.Struct("<BH")  # flags, layout JSON length


# --- the request ----------------------------------------------------------------------------------


def encode_request(layout: KVLayout, read: bytes, flags: int = 0) -> bytes:
    """The request's body: flags and the client's layout, then ``read`` (``wire.encode_read``)."""
    layout_json = layout.to_json().encode()
    return HELLO_HEAD.pack(flags, len(layout_json)) + layout_json + read


def decode_request(body: bytes) -> tuple[int, bytes, ReadRequest]:
    """-> (flags, client layout JSON, the READ)."""
    try:
        flags, layout_len = HELLO_HEAD.unpack_from(body)
        (layout_json,) = struct.unpack_from(f"<{layout_len}s", body, HELLO_HEAD.size)
    except struct.error as exc:
        raise KVTransferError(f"malformed READ: {exc}") from exc
    return flags, layout_json, decode_read(body[HELLO_HEAD.size + layout_len :])


def check_runs(block_ids: Sequence[int], runs: Sequence[int]) -> None:
    """The runs (blocks per message, in request order) must partition the request."""
    if any(r < 1 for r in runs) or sum(runs) != len(block_ids):
        raise KVTransferError("malformed READ: the runs do not partition the block ids")


# --- the plan -------------------------------------------------------------------------------------


def runs_consecutive(block_ids: Sequence[int], runs: Sequence[int]) -> bool:
    """Whether every run is consecutive in ``block_ids`` (so each message is one contiguous view)."""
    pos = 0
    for count in runs:
        first = block_ids[pos]
        if any(block_ids[pos + k] != first + k for k in range(1, count)):
            return False
        pos += count
    return True


def split_runs(counts: Sequence[int], max_blocks: int) -> list[int]:
    return [min(max_blocks, count - i) for count in counts for i in range(0, count, max_blocks)]


def plan_pull(
    layout: KVLayout, src_ids: Sequence[int], dst_ids: Sequence[int], *, staging: bool | None = None
) -> tuple[list[int], bool]:
    """(blocks per message, does the client stage?). A side whose blocks within each run are not consecutive
    stages (the server gathers, the client scatters: one copy each); each message costs more than a copy
    below ``DIRECT_MIN_MESSAGE_BYTES``. In order of preference: runs consecutive on both sides (no copy);
    runs of the destination (the server gathers); runs of the source, or else one run (the client stages)."""
    n, seg = len(src_ids), layout.bytes_per_block_per_layer
    max_blocks = max(1, MAX_MESSAGE_BYTES // seg)

    def large(counts: list[int]) -> bool:
        return n * seg / max(1, len(counts)) >= DIRECT_MIN_MESSAGE_BYTES

    paired = [c for _, _, c in paired_runs(src_ids, dst_ids)]
    if staging is False:
        return split_runs(paired, max_blocks), False
    if staging is None:
        if large(paired):
            return split_runs(paired, max_blocks), False
        by_dst = [c for _, c in block_runs(dst_ids)]
        if large(by_dst):
            return split_runs(by_dst, max_blocks), False
    by_src = [c for _, c in block_runs(src_ids)]
    return split_runs(by_src if large(by_src) else [n], max_blocks), True


def run_starts(runs: Sequence[int]) -> list[int]:
    """Where each run starts in the request (its first block's index)."""
    return list(itertools.accumulate(runs, initial=0))[:-1]


def run_views(array: Any, first_blocks: Sequence[int], runs: Sequence[int]) -> list[Any]:
    """The KV messages in wire order: per layer, one contiguous view per run, run i being ``runs[i]`` blocks
    of ``array`` (``[num_layers, num_blocks, segment_bytes]``, contiguous: a numpy array, or a torch tensor of a
    ``TensorKVBuffer``) from block ``first_blocks[i]`` on; each as ucxx takes it (``message``)."""
    num_layers, seg = array.shape[0], array.shape[2]
    flat = array.reshape(num_layers, -1)  # [num_layers, num_blocks * seg]
    return [
        message(flat[layer, first * seg : (first + count) * seg])
        for layer in range(num_layers)
        for first, count in zip(first_blocks, runs)
    ]


def message(view: Any) -> Any:
    """What ucxx sends from or receives into: a host array's memoryview; a CUDA tensor itself (ucxx reads its
    ``__cuda_array_interface__``: UCX then moves device memory with cuda_copy / cuda_ipc / RDMA)."""
    if isinstance(view, np.ndarray):
        return memoryview(view)
    if view.is_cuda:  # pragma: no cover - never run here (no GPU)
        return view
    return memoryview(view.numpy())
