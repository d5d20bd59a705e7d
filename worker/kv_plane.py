"""Where a worker's KV data plane reads and writes its cache, per transport kind (``kv_transfer/staging.py``).

A worker serves every kind of ``--kv-transport`` at once, and each kind sees the cache in its own way:
- **in place**: a host cache for every kind (``KVBuffer``), a device cache for the kinds that register or move
  device memory (nixl, ucx, nccl: a ``TensorKVBuffer``, GPU-direct);
- **through host staging**: a device cache for tcp and cma, and any cache for every kind with
  ``--kv-staging always`` (how CI covers staging). Every lease is copied into the ``StagingPool`` as it opens
  (the reader's choice of kind is not known then), and the staged servers translate a read's block ids.

Handles always name cache blocks, so one handle serves both at once: a ``nixl,tcp`` worker on a GPU serves a
nixl reader GPU-direct and a tcp reader from pinned host memory. Pulling likewise: a kind served in place
pulls straight into the cache, a staged one into staging blocks that are then copied into the cache.

Tensor parallelism (``kv_transfer/tp_plane.py``): a worker of N ranks has one region per rank (each rank's cache,
seen here through shared memory) and serves each on its own URI per kind; it pulls from every rank of the peer,
re-cutting the heads when the two degrees differ. Host staging is not combined with it (the ranks' caches are
host memory: nothing to stage).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kv_transfer.layout import KVLayout
from kv_transfer.staging import KVRegion, StagingPool, pull_staged, staged_kinds
from kv_transfer.tensor_buffer import AnyKVBuffer
from kv_transfer.tp_plane import pull_ranks
from kv_transfer.transport import KVClient, KVServer, TransferStats, TransportConfig, make_server
from worker.leases import WorkerLeases

logger = logging.getLogger(__name__)


class KVPlane:
    """The region, the kinds served through staging (``staged``) and the pool they share (None: no kind is)."""

    def __init__(self, region: KVRegion, kinds: Sequence[str], mode: str, leases: WorkerLeases,
                 staging_blocks: int, *, rank_regions: Sequence[KVRegion] = ()) -> None:
        """``region``: the cache (rank 0's under tensor parallelism); ``rank_regions``: ranks 1..N-1's."""
        regions = [region, *rank_regions]
        self.region, self.regions, self.leases = region, regions, leases
        self.staged = staged_kinds(kinds, region, mode)
        if len(regions) > 1 and self.staged:
            raise ValueError(f"tensor parallelism serves each rank's cache in place; it is not combined with host "
                             f"staging ({','.join(sorted(self.staged))} would stage a {region.device} cache)")
        self.in_place = region.in_place_buffer()  # no copy: a view of the engine's tensor
        self.rank_buffers = [self.in_place, *(r.in_place_buffer() for r in regions[1:])]
        self.pool: StagingPool | None = None
        if self.staged:
            self.pool = StagingPool(region, staging_blocks)
            leases.stage_through(self.pool)
            logger.info("KV data plane: %s through host staging (%d blocks, %.1f MiB), %s in place on %s",
                        ",".join(sorted(self.staged)), self.pool.num_blocks, self.pool.host.numel() / 2**20,
                        ",".join(k for k in kinds if k not in self.staged) or "nothing", region.device)

    def buffer(self, kind: str) -> AnyKVBuffer:
        """What ``kind`` serves and pulls into: the staging pool's buffer, or the cache itself."""
        return self.pool.buffer if kind in self.staged else self.in_place

    @property
    def tp_size(self) -> int:
        return len(self.regions)

    def server(self, kind: str, config: TransportConfig, rank: int = 0) -> KVServer:
        """A server of ``kind`` (over tensor-parallel rank ``rank``'s cache) over this worker's leases: in place,
        or from staging (ids translated)."""
        if rank:
            return make_server(kind, buffer=self.rank_buffers[rank], resolve=self.leases.resolver(), config=config,
                               progress=self.leases.progress)
        if kind in self.staged:
            staged = self.leases.staged
            return make_server(kind, buffer=self.pool.buffer, resolve=staged.resolve, config=config,
                               progress=staged.progress, locate=staged.locate)
        return make_server(kind, buffer=self.buffer(kind), resolve=self.leases.resolver(), config=config,
                           progress=self.leases.progress)

    async def pull_ranks(self, client: KVClient, uris: Sequence[str], layout: KVLayout, lease_id: str,
                         src: Sequence[int], dst: Sequence[int]) -> TransferStats:
        """``pull`` from every rank of a tensor-parallel peer (``uris``: one per rank, ``layout``: rank 0's), or
        into the ranks of this worker (``kv_transfer/tp_plane.py``)."""
        async def pull_rank(uri, rank_layout, buffer, ids):
            return await client.pull(uri, rank_layout, lease_id, src, buffer, ids)

        return await pull_ranks(pull_rank, uris, layout, self.regions, self.rank_buffers, src, dst)

    async def pull(self, client: KVClient, kind: str, uri: str, layout: KVLayout, lease_id: str,
                   src: Sequence[int], dst: Sequence[int]) -> TransferStats:
        """Pull a peer's leased blocks ``src`` into this worker's cache blocks ``dst`` over ``client`` (of
        ``kind``): straight into the cache, or through staging blocks."""
        if kind in self.staged:
            return await pull_staged(client, self.pool, uri, layout, lease_id, src, dst)
        return await client.pull(uri, layout, lease_id, src, self.buffer(kind), dst)
