"""KV memory that knows where it lives, and host staging for the transports that cannot read it in place.

``KVRegion`` is the engine's cache seen as ``[num_layers, num_blocks, segment_bytes]`` uint8 on its device,
with its base pointer and each block's byte ranges (one per layer): what a transport that registers memory
needs. Where each transport serves it is decided per kind (``staged_kinds``): a host-resident region is served
in place by every kind, as ``KVBuffer`` always was; a device-resident one (CUDA) is served in place
(GPU-direct, a ``TensorKVBuffer``) by the kinds that register or move device memory (``IN_PLACE_KINDS``: nixl,
ucx, nccl) and through a ``StagingPool`` by the others (tcp, cma): blocks of pinned host memory, filled by
copies of exactly the leased blocks on a side stream (per layer, an event each), never a whole-cache copy.
``--kv-staging always`` puts every kind of any cache through staging (plain copies on a CPU cache; the probes
are already true), so every line but the CUDA stream calls runs in CI.

Serving (the prefill side, or any holder of a lease): ``StagedLeases`` stages each lease as it opens: staging
blocks are allocated and the lease's blocks copied there, each layer once it is computed for a layer-wise lease
(the staged progress completes a layer when its copy is done, so streamed reads follow the copies). The
lease's handle names its cache blocks whatever the reader's transport; a staged server translates a read's ids
through the lease's staging map (``locate``) and serves the pool's buffer; the staging blocks go back to the
pool when the lease ends.

Pulling (the decode side): ``pull_staged`` pulls into staging blocks, copies them into the region's
destination blocks, and frees them, whatever happens; a kind served in place pulls straight into the cache.

Event-loop thread only, like the leases it wraps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import torch

from kv_transfer.errors import KVTransferError, LeaseNotFound
from kv_transfer.layout import KVBuffer, KVLayout, paired_runs
from kv_transfer.progress import LayerProgress, ReadyProbe
from kv_transfer.tensor_buffer import IN_PLACE_KINDS, TensorKVBuffer
from kv_transfer.transport import KVClient, Resolver, TransferStats

logger = logging.getLogger(__name__)

STAGING_MODES = ("auto", "always")  # auto: a device-resident cache, for the kinds that cannot read it in place
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

    def tensor_buffer(self) -> TensorKVBuffer:
        """The region's own bytes as a TensorKVBuffer on its device (served in place by ``IN_PLACE_KINDS``)."""
        return TensorKVBuffer(self.layout, self.kv)

    def in_place_buffer(self) -> KVBuffer | TensorKVBuffer:
        """What a kind serving this region in place serves: the host bytes, or the device tensor."""
        return self.host_buffer() if self.is_host else self.tensor_buffer()


def staged_kinds(kinds: Sequence[str], region: KVRegion, mode: str) -> frozenset[str]:
    """The transport kinds of ``kinds`` that serve and pull ``region`` through host staging: every one with
    ``--kv-staging always``; else none for a host cache, and for a device cache those that cannot move device
    memory (not in ``IN_PLACE_KINDS``: tcp, cma)."""
    if mode not in STAGING_MODES:
        raise ValueError(f"--kv-staging must be one of {STAGING_MODES}, got {mode!r}")
    if mode == "always":
        return frozenset(kinds)
    return frozenset() if region.is_host else frozenset(kinds) - IN_PLACE_KINDS


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
    __slots__ = ("ids", "of", "progress", "task")

    def __init__(self, block_ids: Sequence[int], ids: list[int], progress: LayerProgress) -> None:
        self.ids, self.progress, self.task = ids, progress, None
        self.of = dict(zip((int(b) for b in block_ids), ids, strict=True))  # cache block id -> its staging id


class StagedLeases:
    """Serve leases of ``pool.region`` from ``pool.buffer``: ``stage`` each lease as it opens, give the staged
    transport servers ``locate`` (a read's cache block ids -> their staging ids), ``resolve`` and ``progress``
    instead of the worker's own, and ``end`` each lease as it ends."""

    def __init__(self, pool: StagingPool, resolve: Resolver) -> None:
        self.pool, self._resolve = pool, resolve
        self._staged: dict[str, _Staged] = {}

    def __len__(self) -> int:
        return len(self._staged)

    def stage(self, lease_id: str, block_ids: Sequence[int], computing: LayerProgress | None = None) -> list[int]:
        """Copy the lease's blocks into staging blocks: now, or each layer once ``computing`` has it (layer-wise);
        returns its staging ids. StagingFull: the lease stays unreadable by staged kinds (their reads are
        refused, the reader recomputes)."""
        num_layers = self.pool.region.layout.num_layers
        staged = _Staged(block_ids, self.pool.allocate(len(block_ids)), LayerProgress(num_layers))
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

    def locate(self, lease_id: str, block_ids: Sequence[int]) -> list[int]:
        """Where the lease's blocks ``block_ids`` (cache ids, as its handle names them) are in staging (a
        ``transport.Locator``): LeaseNotFound for a lease that ended, KVTransferError for a block not in it."""
        self.resolve(lease_id)  # live and staged, or raises
        of = self._staged[lease_id].of
        outside = [b for b in block_ids if b not in of]
        if outside:
            raise KVTransferError(f"blocks {outside[:8]} are not in the lease ({len(outside)} in all)")
        return [of[b] for b in block_ids]

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

