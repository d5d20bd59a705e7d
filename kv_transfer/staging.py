"""KV memory that knows where it lives, and host staging for caches a transport cannot read in place.

``KVRegion`` is the engine's cache seen as ``[num_layers, num_blocks, segment_bytes]`` uint8 on its device,
with its base pointer and each block's byte ranges (one per layer): what a transport that registers memory
needs. A host-resident region is served in place, as ``KVBuffer`` always did. A device-resident one (CUDA) is
served through a ``StagingPool``: blocks of pinned host memory, filled by copies of exactly the leased blocks
on a side stream (per layer, an event each), never a whole-cache copy. ``--kv-staging always`` puts a CPU cache
through the same path (plain copies; the probes are already true), so every line but the CUDA stream calls
runs in CI.

Serving (the prefill side, or any holder of a lease): ``StagedLeases`` stages each lease as it opens: staging
blocks are allocated and the lease's blocks copied there, each layer once it is computed for a layer-wise lease
(the staged progress completes a layer when its copy is done, so streamed reads follow the copies). The
lease's handle names the staging ids, the transport servers serve the pool's buffer, and the staging blocks
go back to the pool when the lease ends.

Pulling (the decode side): ``pull_staged`` pulls into staging blocks, copies them into the region's
destination blocks, and frees them, whatever happens.

Event-loop thread only, like the leases it wraps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import torch

from kv_transfer.errors import KVTransferError, LeaseNotFound
from kv_transfer.layout import KVBuffer, KVLayout, paired_runs
from kv_transfer.progress import LayerProgress, ProgressLookup, ReadyProbe
from kv_transfer.transport import KVClient, Resolver, TransferStats

logger = logging.getLogger(__name__)

STAGING_MODES = ("auto", "always")  # auto: only a device-resident cache is staged
FOLLOW_TIMEOUT_S = 3600.0  # a layer-wise copy waits this long for a layer at most (the lease's end stops it first)


class StagingFull(KVTransferError):
    """Not enough free staging blocks for a read (the reader recomputes, or retries after leases end)."""


class KVRegion:
    """A paged KV cache where it lives: ``kv`` is ``[num_layers, num_blocks, segment_bytes]`` uint8 over the
    engine's tensor (no copy), on ``device``."""

    def __init__(self, layout: KVLayout, cache: torch.Tensor) -> None:
        if not cache.is_contiguous():
            raise ValueError("KVRegion: the cache must be contiguous")
        flat = cache.reshape(-1).view(torch.uint8)
        seg = layout.bytes_per_block_per_layer
        num_blocks, rest = divmod(flat.numel(), layout.num_layers * seg)
        if rest or num_blocks < 1:
            raise ValueError(f"KVRegion: {flat.numel()} bytes is not a whole number of blocks of {layout}")
        self.layout, self.num_blocks, self.segment_bytes = layout, num_blocks, seg
        self.kv = flat.view(layout.num_layers, num_blocks, seg)

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def is_host(self) -> bool:
        return self.kv.device.type == "cpu"

    @property
    def base_ptr(self) -> int:
        return self.kv.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.kv.numel()

    def block_ranges(self, block_id: int) -> list[tuple[int, int]]:
        """``(offset from base_ptr, nbytes)`` of the block's bytes, one range per layer."""
        if not 0 <= block_id < self.num_blocks:
            raise KVTransferError(f"block id {block_id!r} out of range [0, {self.num_blocks})")
        seg, per_layer = self.segment_bytes, self.num_blocks * self.segment_bytes
        return [(layer * per_layer + block_id * seg, seg) for layer in range(self.layout.num_layers)]

    def host_buffer(self) -> KVBuffer:
        """The region's own bytes as a KVBuffer (served in place); host-resident regions only."""
        if not self.is_host:
            raise KVTransferError(f"the KV cache is on {self.device}: serve it through a StagingPool")
        return KVBuffer(self.layout, self.kv.numpy())


def needs_staging(region: KVRegion, mode: str) -> bool:
    if mode not in STAGING_MODES:
        raise ValueError(f"--kv-staging must be one of {STAGING_MODES}, got {mode!r}")
    return mode == "always" or not region.is_host


class StagingPool:
    """``num_blocks`` blocks of host memory (pinned when the region is on a GPU) and the copies between them
    and the region's blocks."""

    def __init__(self, region: KVRegion, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a staging pool needs at least one block, got {num_blocks}")
        self.region = region
        on_gpu = region.device.type == "cuda"
        shape = (region.layout.num_layers, num_blocks, region.segment_bytes)
        self.host = torch.zeros(shape, dtype=torch.uint8, pin_memory=on_gpu)
        self.buffer = KVBuffer(region.layout, self.host.numpy())
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: low ids first
        self._stream = torch.cuda.Stream(region.device) if on_gpu else None  # pragma: no cover - needs a GPU

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise StagingFull(f"{count} staging blocks wanted, {len(self._free)} of {self.num_blocks} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, block_ids: Sequence[int]) -> None:
        self._free.extend(reversed(block_ids))

    def copy_out(self, src_ids: Sequence[int], staged_ids: Sequence[int], layers: slice = slice(None)) -> ReadyProbe:
        """Copy ``layers`` of the region's blocks ``src_ids`` into staging blocks ``staged_ids`` (one copy per
        run consecutive on both sides); returns a probe that is true once the bytes are in host memory."""
        runs = paired_runs(list(src_ids), list(staged_ids))
        if self._stream is None:
            for s, d, count in runs:
                self.host[layers, d : d + count].copy_(self.region.kv[layers, s : s + count])
            return _always_ready
        return self._copy_on_stream(  # pragma: no cover - needs a GPU
            [(self.host[layers, d : d + c], self.region.kv[layers, s : s + c]) for s, d, c in runs])

    def copy_in(self, staged_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Copy staging blocks ``staged_ids`` into the region's blocks ``dst_ids``; returns once they landed."""
        runs = paired_runs(list(staged_ids), list(dst_ids))
        if self._stream is None:
            for s, d, count in runs:
                self.region.kv[:, d : d + count].copy_(self.host[:, s : s + count])
            return
        ready = self._copy_on_stream(  # pragma: no cover - needs a GPU
            [(self.region.kv[:, d : d + c], self.host[:, s : s + c]) for s, d, c in runs])
        while not ready():  # pragma: no cover - needs a GPU
            torch.cuda.current_stream(self.region.device).synchronize()

    def _copy_on_stream(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> ReadyProbe:  # pragma: no cover
        """The copies on the side stream, after the work already queued on the device (the layer's kernels)."""
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.region.device))
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event.query


def _always_ready() -> bool:
    return True


class _Staged:
    __slots__ = ("ids", "progress", "task")

    def __init__(self, ids: list[int], progress: LayerProgress) -> None:
        self.ids, self.progress, self.task = ids, progress, None


class StagedLeases:
    """Serve leases of ``pool.region`` from ``pool.buffer``: ``stage`` each lease as it opens (its handle then
    names the staging ids), give the transport servers ``resolve`` and ``progress`` instead of the worker's
    own, and ``end`` each lease as it ends."""

    def __init__(self, pool: StagingPool, resolve: Resolver) -> None:
        self.pool, self._resolve = pool, resolve
        self._staged: dict[str, _Staged] = {}

    def __len__(self) -> int:
        return len(self._staged)

    def stage(self, lease_id: str, block_ids: Sequence[int], computing: LayerProgress | None = None) -> list[int]:
        """Copy the lease's blocks into staging blocks: now, or each layer once ``computing`` has it (layer-wise);
        returns the staging ids a reader asks for. StagingFull: the lease stays unreadable (reads are refused,
        the reader recomputes)."""
        staged = _Staged(self.pool.allocate(len(block_ids)), LayerProgress(self.pool.region.layout.num_layers))
        self._staged[lease_id] = staged
        if computing is None or computing.is_ready:
            ready = self.pool.copy_out(block_ids, staged.ids)
            for layer in range(staged.progress.num_layers):
                staged.progress.complete(layer, ready)
        else:
            staged.task = asyncio.get_running_loop().create_task(self._follow(computing, list(block_ids), staged))
        return staged.ids

    def resolve(self, lease_id: str) -> list[int]:
        """The staging ids of a live lease (what the wrapped resolver raises for one that is not)."""
        try:
            self._resolve(lease_id)
        except LeaseNotFound:
            self.end(lease_id)
            raise
        staged = self._staged.get(lease_id)
        if staged is None:
            raise KVTransferError("the lease's blocks are not in host staging (the staging pool was full)")
        return staged.ids

    def ids_of(self, lease_id: str) -> list[int] | None:
        """The lease's staging ids (None: not staged)."""
        staged = self._staged.get(lease_id)
        return None if staged is None else staged.ids

    def progress(self, lease_id: str) -> LayerProgress | None:
        """The lease's staged layers: computed and copied to host memory."""
        staged = self._staged.get(lease_id)
        return None if staged is None else staged.progress

    def end(self, lease_id: str) -> None:
        """The lease ended: its staging blocks go back to the pool (a copy still following its layers stops)."""
        staged = self._staged.pop(lease_id, None)
        if staged is None:
            return
        if staged.task is not None and not staged.task.done():
            staged.task.cancel()
            staged.progress.fail("the lease ended")
        self.pool.free(staged.ids)

    async def _follow(self, computing: LayerProgress, block_ids: list[int], staged: _Staged) -> None:
        try:
            for layer in range(computing.num_layers):
                await computing.wait(layer + 1, timeout_s=FOLLOW_TIMEOUT_S)
                ready = self.pool.copy_out(block_ids, staged.ids, slice(layer, layer + 1))
                staged.progress.complete(layer, ready)
        except KVTransferError as exc:  # the computation failed: the staged reads fail with it
            staged.progress.fail(str(exc))


async def pull_staged(client: KVClient, pool: StagingPool, uri: str, layout: KVLayout, lease_id: str,
                      src_ids: Sequence[int], dst_ids: Sequence[int]) -> TransferStats:
    """``client.pull`` into staging blocks, then copied into the region's ``dst_ids``; the staging blocks are
    freed however the pull ends."""
    staged = pool.allocate(len(dst_ids))
    try:
        stats = await client.pull(uri, layout, lease_id, src_ids, pool.buffer, staged)
        pool.copy_in(staged, dst_ids)
        return stats
    finally:
        pool.free(staged)

