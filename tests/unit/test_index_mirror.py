"""The in-memory KV index mirror against a real ``redis-server``: after any mix of publishes, removals and
workers going away, its lookups equal ``KVIndex.lookup``'s script; it catches up from the events stream,
and resyncs when the stream was trimmed past it or recreated."""

from __future__ import annotations

import asyncio
import random

import pytest

from kv_transfer.redis_index import IndexEvent, KVIndex
from kv_transfer.registry import Registry, connect
from kv_transfer.workers import WorkerInfo
from router.routing.directory import WorkerDirectory
from router.routing.index_mirror import IndexMirror, MirrorSync
from tests.redis_server import RedisServer, require_redis_server

CHAIN = [bytes([0xC0 + i]) * 16 for i in range(10)]


def info(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="decode", grpc_address="127.0.0.1:1", kv_uri="tcp://127.0.0.1:2",
                      model_fingerprint="ab" * 16, layout_json='{"block_size": 16}', total_blocks=100)


@pytest.fixture(scope="module")
def server():
    require_redis_server()
    with RedisServer.start() as srv:
        yield srv


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_lookup_walks_leading_blocks_like_the_script():
    mirror = IndexMirror()
    mirror.store("a", CHAIN[:5])
    mirror.store("b", CHAIN[:2] + CHAIN[3:6])  # a hole at block 2
    mirror.store("c", CHAIN[1:4])  # no block 0: no prefix at all
    assert mirror.lookup(CHAIN) == {"a": 5, "b": 2}
    mirror.apply(IndexEvent("1-0", "removed", "a", hashes=(CHAIN[3],)))
    assert mirror.lookup(CHAIN) == {"a": 3, "b": 2}
    mirror.apply(IndexEvent("2-0", "worker-down", "a"))
    assert mirror.lookup(CHAIN) == {"b": 2} and mirror.lookup([]) == {} and mirror.lookup(CHAIN[6:]) == {}
    mirror.drop_worker("b")
    mirror.drop_worker("c")
    assert len(mirror) == 0


def test_mirror_equals_the_index_under_random_churn(server: RedisServer):
    async def scenario() -> None:
        redis = connect(server.url)
        registry = Registry(redis, "churn")
        index = registry.index
        workers = [f"w{i}" for i in range(4)]
        for w in workers:
            await registry.register(info(w))
        rng = random.Random(3)
        # Events before the mirror starts (the snapshot path) and after it (the tail path).
        for _ in range(40):
            w = rng.choice(workers)
            await index.publish(w, rng.sample(CHAIN, rng.randint(0, 6)), rng.sample(CHAIN, rng.randint(0, 3)))
        sync = MirrorSync(index, redis, batch=7)  # small batches: several reads per catch-up
        await sync.sync()
        for step in range(120):
            w = rng.choice(workers)
            roll = rng.random()
            if roll < 0.05:
                await registry.deregister(w)  # worker-down: every entry of it goes
                await registry.register(info(w))
            elif roll < 0.1:
                await index.remove_worker(w)
            else:
                await index.publish(w, rng.sample(CHAIN, rng.randint(0, 6)), rng.sample(CHAIN, rng.randint(0, 3)))
            if step % 10 == 0:
                while await sync.catch_up():
                    pass
                for start in range(3):
                    assert sync.mirror.lookup(CHAIN[start:]) == await index.lookup(CHAIN[start:])
        while await sync.catch_up():
            pass
        for start in range(len(CHAIN)):
            assert sync.mirror.lookup(CHAIN[start:]) == await index.lookup(CHAIN[start:])
        assert sync.resyncs == 1  # never fell behind the stream's cap
        await redis.aclose()

    run(scenario())


def test_a_trimmed_or_recreated_stream_forces_a_resync(server: RedisServer):
    async def scenario() -> None:
        redis = connect(server.url)
        registry = Registry(redis, "trim", events_maxlen=10)
        index = registry.index
        await registry.register(info("w0"))
        sync = MirrorSync(index, redis, batch=5)
        await sync.sync()
        for i in range(60):  # far past MAXLEN ~10 while the mirror is not reading
            await index.publish("w0", [CHAIN[i % 10]], [CHAIN[(i + 5) % 10]])
        await redis.xtrim(index.keys.events, maxlen=10, approximate=False)
        while await sync.catch_up():
            pass
        assert sync.resyncs == 2 and sync.mirror.lookup(CHAIN) == await index.lookup(CHAIN)
        # Redis lost everything (a restart without persistence): the stream's ids start over.
        await redis.flushdb()
        await registry.register(info("w1"))
        await index.publish("w1", CHAIN[:3], [])
        while await sync.catch_up():
            pass
        assert sync.resyncs == 3 and sync.mirror.lookup(CHAIN) == {"w1": 3}
        await redis.aclose()

    run(scenario())


def test_the_directory_answers_from_the_running_mirror_without_redis(server: RedisServer):
    async def scenario() -> None:
        redis = connect(server.url)
        registry = Registry(redis, "dir")
        await registry.register(info("w0"))
        await registry.index.publish("w0", CHAIN[:4], [])
        sync = MirrorSync(registry.index, redis, block_ms=50)
        directory = WorkerDirectory(registry, mirror=sync)
        assert await directory.lookup(CHAIN) == {"w0": 4}  # not in sync yet: asked Redis
        sync.start()
        for _ in range(100):
            if sync.ready:
                break
            await asyncio.sleep(0.02)
        await registry.index.publish("w0", CHAIN[4:6], [])
        for _ in range(100):  # the tail applies the new event within a few block_ms
            if sync.mirror.lookup(CHAIN) == {"w0": 6}:
                break
            await asyncio.sleep(0.02)
        sent = []
        original = redis.execute_command

        async def counting(*args, **kwargs):
            sent.append(args[0])
            return await original(*args, **kwargs)

        redis.execute_command = counting
        assert await directory.lookup(CHAIN) == {"w0": 6}
        assert not [c for c in sent if str(c).upper() in ("EVALSHA", "EVAL")]  # no index script was run
        assert await registry.index.lookup(CHAIN) == {"w0": 6} and "EVALSHA" in map(str.upper, map(str, sent))
        redis.execute_command = original
        await sync.stop()
        assert not sync.ready and await directory.lookup(CHAIN) == {"w0": 6}  # back to Redis
        await directory.close()
        await redis.aclose()

    run(scenario())
