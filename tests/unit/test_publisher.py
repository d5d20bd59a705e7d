"""The worker's index publisher: the engine's per-tier block events become each block's best tier in the index
(``TierBook``, pure), published to a real ``redis-server`` from a real ``BlockPool`` (the engine around it
is a stand-in: the pool's events plus host-tier events the test writes, as the host tier will emit them)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from engine.core.block_pool import BlockEvent, BlockEventKind, BlockPool
from kv_transfer.index_schema import TieredLookup
from kv_transfer.redis_index import NotRegistered
from kv_transfer.registry import Registry, connect
from kv_transfer.workers import WorkerInfo
from tests.redis_server import RedisServer, require_redis_server
from worker.engine_seam import BatonEngine
from worker.publisher import IndexPublisher, IndexUpdate, TierBook

H = [bytes([0x90 + i]) * 16 for i in range(6)]
STORED, REMOVED = BlockEventKind.STORED, BlockEventKind.REMOVED


def ev(kind: BlockEventKind, i: int, tier: str = "gpu") -> BlockEvent:
    return BlockEvent(kind, H[i], block_id=i, tier=tier)


def flush(book: TierBook) -> IndexUpdate:
    update = book.pending()
    book.mark_published(update)
    return update


def test_the_book_publishes_best_tiers_and_falls_back_to_the_host_tier():
    book = TierBook()
    for event in (ev(STORED, 0), ev(STORED, 1), ev(STORED, 2)):
        book.apply(event)
    assert sorted(flush(book).stored["gpu"]) == H[:3]
    # block 0 copied down to the host tier, then evicted from the pool: it is still held, in cpu
    for event in (ev(STORED, 0, "cpu"), ev(REMOVED, 0), ev(REMOVED, 1)):
        book.apply(event)
    assert flush(book) == IndexUpdate(stored={"cpu": [H[0]]}, removed=[H[1]])
    book.apply(ev(STORED, 0))  # copied back up; the host tier keeps its copy
    assert flush(book) == IndexUpdate(stored={"gpu": [H[0]]})
    book.apply(ev(REMOVED, 0, "cpu"))  # the host tier drops its copy: the best tier is still gpu
    assert not flush(book)
    book.apply(ev(REMOVED, 0))
    assert flush(book) == IndexUpdate(removed=[H[0]])
    for event in (ev(STORED, 3), ev(REMOVED, 3), ev(REMOVED, 5, "cpu")):  # came and went unpublished
        book.apply(event)
    assert not book.pending()
    with pytest.raises(ValueError, match="tier"):
        book.apply(BlockEvent(STORED, H[4], 4, tier="disk"))


def test_a_reset_book_publishes_the_engine_holdings_from_nothing():
    book = TierBook()
    book.apply(ev(STORED, 0))
    flush(book)
    book.reset({"gpu": [H[1], H[2]], "cpu": [H[2], H[3]]})  # the index lost everything of this worker
    update = book.pending()
    assert sorted(update.stored["gpu"]) == [H[1], H[2]] and update.stored["cpu"] == [H[3]] and not update.removed
    assert book.best(H[2]) == "gpu" and book.best(H[3]) == "cpu" and book.best(H[0]) is None


class StandInEngine:
    """What the publisher calls on an engine: a real pool's events, plus host-tier events the test adds."""

    def __init__(self, pool: BlockPool) -> None:
        self.kv_cache_manager = SimpleNamespace(pool=pool)
        self.host_events: list[BlockEvent] = []
        self.host_held: list[bytes] = []  # what the host tier holds (republish reads it)

    def host_tier_hashes(self) -> list[bytes]:
        return list(self.host_held)

    def take_block_events(self) -> list[BlockEvent]:
        events, self.host_events = self.kv_cache_manager.pool.take_events() + self.host_events, []
        return events


class EngineThread:
    def __init__(self, engine: StandInEngine) -> None:
        self.engine = engine

    async def call(self, fn: Any) -> Any:
        return fn(self.engine)


@pytest.fixture(scope="module")
def server():
    require_redis_server()
    with RedisServer.start() as srv:
        yield srv


def test_the_publisher_indexes_pool_and_host_moves_and_republishes(server: RedisServer):
    async def scenario() -> None:
        redis = connect(server.url)
        await redis.flushdb()
        registry = Registry(redis, "pub")
        info = WorkerInfo(worker_id="w", role="decode", grpc_address="127.0.0.1:1", kv_uri="tcp://127.0.0.1:2",
                          model_fingerprint="ab" * 16, layout_json='{"block_size": 16}', total_blocks=4)
        await registry.register(info)
        pool = BlockPool(4)
        engine = StandInEngine(pool)
        publisher = IndexPublisher(BatonEngine(EngineThread(engine), load_of=None), registry.index, lambda: "w")
        blocks = pool.allocate(2)
        for block_id, block_hash in zip(blocks, H[:2]):
            pool.commit(block_id, block_hash)
        await publisher.publish_pending()
        assert await registry.index.lookup_tiers(H) == TieredLookup(gpu={"w": 2}, gpu_or_cpu={"w": 2})

        pool.free(reversed(blocks))  # cached, evictable
        engine.host_events.append(BlockEvent(STORED, H[0], 0, tier="cpu"))  # the host tier took block 0
        pool.allocate(4)  # evicts both from the pool
        await publisher.publish_pending()
        assert await registry.index.lookup_tiers(H) == TieredLookup(gpu={}, gpu_or_cpu={"w": 1})
        entries = [f for _, f in await redis.xrange(registry.keys.events("w"))]
        assert [(e["seq"], e["type"], e.get("tier")) for e in entries] == [
            ("1", "stored", "gpu"), ("2", "stored", "cpu"), ("3", "removed", None)]

        await registry.deregister("w")  # pruned while events wait: kept until it is registered again
        pool.free(range(4))
        blocks = pool.allocate(1)
        pool.commit(blocks[0], H[4])
        with pytest.raises(NotRegistered):
            await publisher.publish_pending()
        await registry.register(info)
        engine.host_held = [H[0], H[4]]  # the host tier still holds block 0 (and a copy of block 4)
        await publisher.republish_all()  # what the heartbeat does after re-registering
        # the pool's cached hashes as gpu, the host tier's as cpu (gpu wins for a block in both)
        assert (await registry.index.holder_state("w")).holdings == {H[4]: "gpu", H[0]: "cpu"}
        await publisher.publish_pending()  # nothing left to say
        assert (await registry.index.holder_state("w")).seq == 2  # one entry per tier
        await redis.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 30))
