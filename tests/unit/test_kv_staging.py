"""Host staging (``--kv-staging always`` on CPU runs every line but the CUDA stream calls): a region's byte
ranges, the staging pool's copies, leases served from staging over every streaming transport (also layer by
layer while the prompt computes), pulls landing through staging, and staging blocks back in the pool however a
lease or a pull ends."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from kv_transfer.errors import KVTransferError, LeaseNotFound
from kv_transfer.layout import KVLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.progress import LayerProgress
from kv_transfer.staging import KVRegion, StagedLeases, StagingFull, StagingPool, pull_staged, staged_kinds
from kv_transfer.transport import STREAMING_KINDS, TransportConfig, connect, kind_available, make_server
from worker.leases import WorkerLeases

LAYOUT = KVLayout(model_fingerprint=b"staging", dtype="float32", block_size=4, num_layers=3, num_kv_heads=2,
                  head_dim=8)
CONFIG = TransportConfig(connect_timeout_s=2.0, io_timeout_s=3.0)
def _runnable(kinds):
    return [pytest.param(k, marks=pytest.mark.skipif(kind_available(k) is not None, reason=kind_available(k) or ""))
            for k in sorted(kinds)]


def _nixl_kind():
    from tests.unit.test_kv_nixl import nixl_skip_reason  # in a process of its own: see test_kv_nixl.py

    why = nixl_skip_reason()
    return pytest.param("nixl", marks=pytest.mark.skipif(why is not None, reason=why or ""))


KINDS = _runnable(STREAMING_KINDS)  # the transports that stream a lease's layers
ALL_KINDS = [*_runnable(STREAMING_KINDS | {"ucx"}), _nixl_kind()]


def run(coro, timeout_s: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def engine_cache(num_blocks: int = 16, seed: int = 0) -> torch.Tensor:
    """A cache tensor shaped as the engine's: [layers, blocks, 2, block_size, kv_heads, head_dim]."""
    shape = (LAYOUT.num_layers, num_blocks, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def test_a_region_knows_each_blocks_bytes_and_serves_a_host_cache_in_place():
    cache = engine_cache()
    region = KVRegion(LAYOUT, cache)
    assert (region.is_host, region.num_blocks, region.nbytes) == (True, 16, cache.numel() * 4)
    raw = cache.numpy().reshape(-1).view(np.uint8)
    for offset, nbytes in region.block_ranges(5):  # layer l of block 5, by offset from the base pointer
        layer = offset // (16 * region.segment_bytes)
        assert bytes(raw[offset : offset + nbytes]) == cache[layer, 5].numpy().tobytes()
    buffer = region.host_buffer()
    cache[2, 7] = 42.0  # the same memory: no copy
    assert buffer.gather([7])[-region.segment_bytes :] == cache[2, 7].numpy().tobytes()
    with pytest.raises(KVTransferError):
        region.block_ranges(16)
    assert staged_kinds(("tcp", "nixl"), region, "auto") == set()  # a host cache: every kind in place
    assert staged_kinds(("tcp", "nixl"), region, "always") == {"tcp", "nixl"}
    with pytest.raises(ValueError):
        staged_kinds(("tcp",), region, "sometimes")


def test_the_pool_copies_exactly_the_blocks_asked_for_and_runs_out_cleanly():
    region = KVRegion(LAYOUT, engine_cache())
    pool = StagingPool(region, 6)
    staged = pool.allocate(4)
    pool.copy_out([9, 3, 4, 12], staged)
    assert pool.buffer.gather(staged) == region.host_buffer().gather([9, 3, 4, 12])
    with pytest.raises(StagingFull):
        pool.allocate(3)
    assert pool.num_free == 2
    before = region.kv.clone()
    pool.copy_in(staged[:2], [0, 15])  # staging -> the region's blocks 0 and 15
    assert torch.equal(region.kv[:, [0, 15]], before[:, [9, 3]])
    assert torch.equal(region.kv[:, 1:15], before[:, 1:15])  # nothing else touched
    pool.free(staged)
    assert pool.num_free == 6


class Holder:
    """A holder of leases served from staging: a region, its staging pool, a lease table, a server of ``kind``."""

    def __init__(self, kind: str, staging_blocks: int = 8) -> None:
        self.region = KVRegion(LAYOUT, engine_cache(seed=1))
        self.pool = StagingPool(self.region, staging_blocks)
        self.table = LeaseTable()
        self.staged = StagedLeases(self.pool, self.table.resolver(time.monotonic))
        self.progress: dict[str, LayerProgress] = {}
        self.server = make_server(kind, buffer=self.pool.buffer, resolve=self.staged.resolve, config=CONFIG,
                                  progress=self.staged.progress, locate=self.staged.locate)
        self.uri = ""

    async def __aenter__(self) -> Holder:
        self.uri = await self.server.start("127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop()

    def lease(self, block_ids: list[int], computing: LayerProgress | None = None) -> tuple[str, list[int]]:
        """(lease id, the ids a reader asks for: the cache blocks, which the server translates)."""
        lease_id = self.table.create(block_ids, now=time.monotonic()).lease_id
        self.staged.stage(lease_id, block_ids, computing)
        return lease_id, block_ids

    def release(self, lease_id: str) -> None:
        self.table.release(lease_id)
        self.staged.end(lease_id)


class Reader:
    """The pulling side: its own region and staging pool."""

    def __init__(self, kind: str) -> None:
        self.region = KVRegion(LAYOUT, torch.zeros_like(engine_cache()))
        self.pool = StagingPool(self.region, 8)
        self.client = connect(f"{kind}://", CONFIG)

    async def pull(self, holder: Holder, lease_id: str, staged: list[int], dst: list[int]):
        return await pull_staged(self.client, self.pool, holder.uri, LAYOUT, lease_id, staged, dst)

    def close(self) -> None:
        if callable(close := getattr(self.client, "close", None)):
            close()


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_a_lease_is_served_from_staging_and_lands_in_the_readers_blocks(kind: str):
    async def scenario() -> None:
        reader = Reader(kind)
        try:
            async with Holder(kind) as holder:
                lease_id, staged = holder.lease([11, 2, 3, 7])
                assert holder.pool.num_free == 4
                stats = await reader.pull(holder, lease_id, staged, [5, 6, 0, 9])
                assert stats.num_blocks == 4
                assert torch.equal(reader.region.kv[:, [5, 6, 0, 9]], holder.region.kv[:, [11, 2, 3, 7]])
                assert reader.pool.num_free == reader.pool.num_blocks  # the reader's staging is back
                holder.release(lease_id)
                assert holder.pool.num_free == holder.pool.num_blocks and len(holder.staged) == 0
                with pytest.raises(LeaseNotFound):  # an ended lease is refused, nothing lands
                    await reader.pull(holder, lease_id, staged, [1, 2, 3, 4])
                assert not reader.region.kv[:, [1, 2, 3, 4]].any()
                assert reader.pool.num_free == reader.pool.num_blocks
        finally:
            reader.close()

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_a_layer_wise_lease_is_staged_and_streamed_layer_by_layer(kind: str):
    """The staged copy follows the prompt's layers: a read of a lease still computing gets each layer once it
    is computed and copied, and the pull is exact."""

    async def scenario() -> None:
        reader = Reader(kind)
        try:
            async with Holder(kind) as holder:
                computing = LayerProgress(LAYOUT.num_layers)
                lease_id, staged = holder.lease([4, 5, 6], computing)
                copies = holder.staged.progress(lease_id)
                assert copies.num_complete == 0
                pulling = asyncio.create_task(reader.pull(holder, lease_id, staged, [0, 1, 2]))
                for layer in range(LAYOUT.num_layers):
                    await asyncio.sleep(0.05)
                    assert not pulling.done() and copies.num_complete == layer
                    computing.complete(layer)
                    await copies.wait(layer + 1, timeout_s=5.0)  # copied once computed
                await pulling
                assert torch.equal(reader.region.kv[:, [0, 1, 2]], holder.region.kv[:, [4, 5, 6]])
                holder.release(lease_id)
                assert holder.pool.num_free == holder.pool.num_blocks
        finally:
            reader.close()

    run(scenario())


def test_a_lease_that_ends_while_its_layers_compute_stops_its_copy_and_frees_its_staging():
    async def scenario() -> None:
        async with Holder("tcp") as holder:
            computing = LayerProgress(LAYOUT.num_layers)
            lease_id, _ = holder.lease([1, 2], computing)
            computing.complete(0)
            await holder.staged.progress(lease_id).wait(1, timeout_s=5.0)
            copies = holder.staged.progress(lease_id)
            holder.release(lease_id)
            assert holder.pool.num_free == holder.pool.num_blocks
            with pytest.raises(KVTransferError):  # a read still waiting on it ends at once
                await copies.wait(LAYOUT.num_layers, timeout_s=1.0)
            computing.complete(1)  # the engine goes on: nothing is copied into the freed blocks
            await asyncio.sleep(0.05)
            assert copies.num_complete == 1

    run(scenario())


def test_a_lease_the_staging_pool_cannot_hold_is_refused_and_the_reader_is_untouched():
    async def scenario() -> None:
        reader = Reader("tcp")
        try:
            async with Holder("tcp", staging_blocks=2) as holder:
                with pytest.raises(StagingFull):
                    holder.lease([1, 2, 3])
                lease_id = next(iter(holder.table._leases))  # the lease exists; it was not staged
                with pytest.raises(KVTransferError, match="not in host staging"):
                    await reader.pull(holder, lease_id, [0, 1, 2], [4, 5, 6])
                assert not reader.region.kv.any() and reader.pool.num_free == reader.pool.num_blocks
                assert holder.pool.num_free == 2
        finally:
            reader.close()

    run(scenario())


def test_worker_leases_stage_every_lease_and_free_its_staging_however_it_ends():
    async def scenario() -> None:
        freed: list[int] = []
        clock = [0.0]
        leases = WorkerLeases(ttl_s=5.0, free=freed.extend, clock=lambda: clock[0])
        pool = StagingPool(KVRegion(LAYOUT, engine_cache()), 8)
        leases.stage_through(pool)
        pinned = leases.pin([3, 4])  # LeasePrefix
        assert leases.read_ids(pinned) == list(leases.resolver()(pinned.lease_id)) and pool.num_free == 6
        leases.hand_over("r1", [7, 8, 9])  # a finished prefill
        handed = leases.take("r1")
        assert len(leases.read_ids(handed)) == 3 and pool.num_free == 3
        progress = LayerProgress(LAYOUT.num_layers)
        admitted = leases.pin_admitted("r2", [10], progress)  # layer-wise
        assert leases.progress(admitted.lease_id).num_complete == 0 and pool.num_free == 2
        assert leases.release(pinned.lease_id) and pool.num_free == 4
        assert leases.release_request("r2") and pool.num_free == 5
        clock[0] = 10.0
        assert [lease.lease_id for lease in leases.expire()] == [handed.lease_id]
        assert pool.num_free == 8 and sorted(freed) == [3, 4, 7, 8, 9, 10]
        with pytest.raises(LeaseNotFound):
            leases.resolver()(handed.lease_id)

    run(scenario())
