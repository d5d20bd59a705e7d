"""The in-memory KV index mirror against a real ``redis-server``: after any history of publishes in both worker
tiers and the store, removals, workers leaving and coming back, its lookups equal ``KVIndex.lookup_tiers``'s
script; it follows each holder's stream, resyncs one holder when that holder's sequence numbers jump, and
everything when the control stream was trimmed past it or recreated."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_transfer.index_schema import IndexEvent, TieredLookup
from kv_transfer.registry import Registry, connect
from kv_transfer.workers import WorkerInfo
from router.routing.directory import WorkerDirectory
from router.routing.index_mirror import IndexMirror
from router.routing.mirror_sync import MirrorSync
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


async def drain(sync: MirrorSync) -> None:
    """Catch up until a read finds nothing new (a read that only resynced applies nothing either)."""
    idle = 0
    while idle < 2:
        idle = 0 if await sync.catch_up() else idle + 1


async def assert_agrees(sync: MirrorSync, starts: range = range(len(CHAIN))) -> None:
    for start in starts:
        assert sync.mirror.lookup_tiers(CHAIN[start:]) == await sync.index.lookup_tiers(CHAIN[start:]), start


def test_lookup_walks_leading_blocks_per_tier_like_the_script():
    mirror = IndexMirror()
    mirror.store("a", CHAIN[:5])
    mirror.store("b", CHAIN[:2] + CHAIN[3:6])  # a hole at block 2
    mirror.store("c", CHAIN[1:4])  # no block 0: no prefix at all
    assert mirror.lookup(CHAIN) == {"a": 5, "b": 2}
    mirror.apply(IndexEvent("1-0", "stored", "a", tier="cpu", hashes=(CHAIN[1],), seq=1))  # a's block 1 fell to cpu
    assert mirror.lookup_tiers(CHAIN) == TieredLookup(gpu={"a": 1, "b": 2}, gpu_or_cpu={"a": 5, "b": 2})
    mirror.store("store", CHAIN[:7], "store")
    assert mirror.lookup_tiers(CHAIN).store == 7  # the store outlives every worker's prefix: the walk goes on
    mirror.apply(IndexEvent("2-0", "removed", "a", hashes=(CHAIN[3],), seq=2))
    assert mirror.lookup_tiers(CHAIN) == TieredLookup(gpu={"a": 1, "b": 2}, gpu_or_cpu={"a": 3, "b": 2}, store=7)
    mirror.apply(IndexEvent("3-0", "cleared", "a", seq=3))
    assert mirror.lookup(CHAIN) == {"b": 2} and mirror.lookup([]) == {} and mirror.lookup(CHAIN[7:]) == {}
    mirror.replace("b", {CHAIN[0]: "cpu"})
    assert mirror.lookup_tiers(CHAIN) == TieredLookup(gpu={}, gpu_or_cpu={"b": 1}, store=7)
    for holder in ("b", "c", "store"):
        mirror.drop(holder)
    assert len(mirror) == 0 and mirror.holders() == []


def test_store_run_counts_blocks_the_holder_or_the_store_holds():
    """A hot first block stays in every pool and never reaches the store: the store's own prefix is 0, yet it
    holds the rest of the chain, which is what the worker holding block 0 would fetch."""
    mirror = IndexMirror()
    assert mirror.store_run(CHAIN, "a") == 0  # no store at all
    mirror.store("a", CHAIN[:2])
    mirror.store("b", CHAIN[:1])
    mirror.store("store", CHAIN[2:6], "store")
    assert mirror.lookup_tiers(CHAIN).store == 0
    assert mirror.store_run(CHAIN, "a") == 6  # a's 0-1, the store's 2-5
    assert mirror.store_run(CHAIN, "b") == 1  # b lacks block 1, the store too: the run breaks
    assert mirror.store_run(CHAIN, "nobody") == 0
    mirror.apply(IndexEvent("1-0", "stored", "a", tier="cpu", hashes=(CHAIN[6],), seq=1))  # any tier counts
    assert mirror.store_run(CHAIN, "a") == 7


async def random_step(registry: Registry, rng: random.Random, workers: list[str]) -> None:
    """One move of a random history: tiers per worker, the store, workers leaving and coming back."""
    index, w, roll = registry.index, rng.choice(workers), rng.random()
    if roll < 0.05:
        await registry.deregister(w)  # worker-down: every entry of it goes, its stream too
        await registry.register(info(w))
    elif roll < 0.1:
        await index.remove_worker(w)  # 'cleared'
    elif roll < 0.2:
        await index.publish_store(rng.sample(CHAIN, rng.randint(0, 5)), rng.sample(CHAIN, rng.randint(0, 2)))
    else:
        stored = {tier: rng.sample(CHAIN, rng.randint(0, 4)) for tier in ("gpu", "cpu")}
        stored["cpu"] = [h for h in stored["cpu"] if h not in stored["gpu"]]
        await index.publish_tiers(w, stored, rng.sample(CHAIN, rng.randint(0, 3)))


def test_mirror_equals_the_index_under_random_churn(server: RedisServer):
    async def scenario() -> None:
        redis = connect(server.url)
        registry = Registry(redis, "churn")
        workers = [f"w{i}" for i in range(4)]
        for w in workers:
            await registry.register(info(w))
        rng = random.Random(3)
        for _ in range(40):  # before the mirror starts (the snapshot path) ...
            await random_step(registry, rng, workers)
        sync = MirrorSync(registry.index, batch=7)  # small batches: several reads per catch-up
        await sync.sync()
        assert sync.followed == sorted(workers + ["store"])
        for step in range(150):  # ... and after it (the tail path)
            await random_step(registry, rng, workers)
            if step % 10 == 0:
                await drain(sync)
                await assert_agrees(sync, range(3))
        await drain(sync)
        await assert_agrees(sync)
        assert sync.resyncs == 1  # never fell behind a stream's cap
        assert sum(sync.holder_resyncs.values()) >= 1  # each re-registration (worker-up) re-read that worker
        for holder in sync.followed:
            assert sync.mirror.held(holder) == (await registry.index.holder_state(holder)).holdings
        await redis.aclose()

    run(scenario())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), before=st.integers(0, 30), after=st.integers(1, 40),
       batch=st.integers(1, 9), trim=st.sampled_from([0.0, 0.2]))
def test_property_mirror_lookups_equal_the_script_on_random_histories(server: RedisServer, seed, before, after,
                                                                      batch, trim):
    """Random histories (in half of them streams are trimmed to their newest 0-2 entries behind the mirror's
    back, as MAXLEN does to a reader that fell behind, and worse, so it loses entries and must resync a holder
    or everything): after each catch-up, every suffix of the chain gets the script's answer."""

    async def scenario() -> None:
        redis = connect(server.url)
        await redis.flushdb()
        registry = Registry(redis, "prop")
        workers = ["a", "b", "c"]
        for w in workers:
            await registry.register(info(w))
        rng = random.Random(seed)
        for _ in range(before):
            await random_step(registry, rng, workers)
        sync = MirrorSync(registry.index, batch=batch)
        await sync.sync()
        for _ in range(after):
            await random_step(registry, rng, workers)
            if rng.random() < trim:
                keys = registry.keys
                key = rng.choice([keys.worker_events] + [keys.events(h) for h in workers + ["store"]])
                await redis.xtrim(key, maxlen=rng.randint(0, 2), approximate=False)
            if rng.random() < 0.3:
                await drain(sync)
                await assert_agrees(sync)
        await drain(sync)
        await assert_agrees(sync)
        await redis.aclose()

    run(scenario())


def test_a_sequence_gap_resyncs_that_worker_alone(server: RedisServer):
    async def scenario() -> None:
        redis = connect(server.url)
        registry = Registry(redis, "gap", events_maxlen=10)
        index = registry.index
        for w in ("w0", "w1"):
            await registry.register(info(w))
        sync = MirrorSync(index, batch=5)
        await sync.sync()
        for i in range(60):  # far past w0's MAXLEN ~10 while the mirror is not reading
            await index.publish("w0", [CHAIN[i % 10]], [CHAIN[(i + 5) % 10]])
        await redis.xtrim(index.keys.events("w0"), maxlen=10, approximate=False)
        await index.publish_tiers("w1", {"gpu": CHAIN[:2], "cpu": CHAIN[2:4]}, [])
        await drain(sync)
        assert sync.holder_resyncs == {"w0": 1}  # w0 alone was re-read; w1's entries were applied in order
        assert sync.resyncs == 1
        await assert_agrees(sync)
        assert sync.mirror.lookup_tiers(CHAIN[:4]).gpu_or_cpu["w1"] == 4
        await redis.aclose()

    run(scenario())


def test_workers_joining_and_leaving_are_followed_without_a_full_resync(server: RedisServer):
    async def scenario() -> None:
        redis = connect(server.url)
        registry = Registry(redis, "join")
        await registry.register(info("w0"))
        sync = MirrorSync(registry.index)
        await sync.sync()
        await registry.register(info("late"))  # its worker-up tells the mirror to follow its stream
        await drain(sync)
        await registry.index.publish("late", CHAIN[:3], [])
        await drain(sync)
        assert "late" in sync.followed and sync.mirror.lookup(CHAIN) == {"late": 3}
        # A restart of it read in one batch: down, up (one re-read) and its new stream's first entry, which that
        # re-read already reflects (not a sequence jump to resync again).
        await registry.deregister("late")
        await registry.register(info("late"))
        await registry.index.publish("late", CHAIN[:1], [])
        await drain(sync)
        assert sync.mirror.lookup(CHAIN) == {"late": 1} and sync.holder_resyncs == {"late": 2}
        await registry.deregister("late")  # worker-down: dropped, no longer followed
        await drain(sync)
        assert "late" not in sync.followed and sync.mirror.lookup(CHAIN) == {}
        assert sync.resyncs == 1 and sync.holder_resyncs == {"late": 2}
        await redis.aclose()

    run(scenario())


def test_a_trimmed_or_recreated_control_stream_forces_a_full_resync(server: RedisServer):
    async def scenario() -> None:
        redis = connect(server.url)
        registry = Registry(redis, "trim", events_maxlen=10)
        index = registry.index
        await registry.register(info("w0"))
        sync = MirrorSync(index, batch=5)
        await sync.sync()
        for i in range(30):  # worker-ups and -downs past the control stream's MAXLEN ~10
            await registry.register(info(f"x{i}"))
            await registry.deregister(f"x{i}")
        await redis.xtrim(index.keys.worker_events, maxlen=10, approximate=False)
        await index.publish("w0", CHAIN[:2], [])
        await drain(sync)
        assert sync.resyncs == 2 and sync.mirror.lookup(CHAIN) == await index.lookup(CHAIN) == {"w0": 2}
        # Redis lost everything (a restart without persistence): the streams start over.
        await redis.flushdb()
        await registry.register(info("w1"))
        await index.publish("w1", CHAIN[:3], [])
        await drain(sync)
        assert sync.resyncs == 3 and sync.mirror.lookup(CHAIN) == {"w1": 3}
        assert sync.followed == ["store", "w1"]
        await redis.aclose()

    run(scenario())


def test_the_directory_answers_from_the_running_mirror_without_redis(server: RedisServer):
    async def scenario() -> None:
        redis = connect(server.url)
        registry = Registry(redis, "dir")
        await registry.register(info("w0"))
        await registry.index.publish("w0", CHAIN[:4], [])
        sync = MirrorSync(registry.index, block_ms=50)
        directory = WorkerDirectory(registry, mirror=sync)
        assert await directory.lookup(CHAIN) == {"w0": 4}  # not in sync yet: asked Redis
        sync.start()
        for _ in range(100):
            if sync.ready:
                break
            await asyncio.sleep(0.02)
        await registry.index.publish_tiers("w0", {"gpu": CHAIN[4:6], "cpu": CHAIN[6:7]}, [])
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
        assert await directory.lookup(CHAIN) == {"w0": 6}  # the KV pool's count, as routing reads it
        assert (await directory.lookup_tiers(CHAIN)).gpu_or_cpu == {"w0": 7}
        assert not [c for c in sent if str(c).upper() in ("EVALSHA", "EVAL")]  # no index script was run
        assert await registry.index.lookup(CHAIN) == {"w0": 6} and "EVALSHA" in map(str.upper, map(str, sent))
        redis.execute_command = original
        await sync.stop()
        assert not sync.ready and await directory.lookup(CHAIN) == {"w0": 6}  # back to Redis
        await directory.close()
        await redis.aclose()

    run(scenario())


def test_a_running_mirror_resyncs_after_redis_restarts_empty():
    """The tail loses its connection, falls back (not ready), and once the worker has registered and
    republished on the restarted Redis, answers from memory again with the new state."""
    require_redis_server()
    with RedisServer.start() as server:
        run(_restart_scenario(server))


async def _restart_scenario(server: RedisServer) -> None:
    redis = connect(server.url)
    registry = Registry(redis, "restart")
    await registry.register(info("w0"))
    await registry.index.publish("w0", CHAIN[:4], [])
    sync = MirrorSync(registry.index, block_ms=50, retry_s=0.05)
    sync.start()
    await _until(lambda: sync.lookup(CHAIN) == {"w0": 4})
    server.stop(remove_folder=False)
    await _until(lambda: not sync.ready)
    server.restart()  # same port, no data
    await _until(lambda: sync.ready, timeout_s=10.0)
    await registry.register(info("w0"))  # what the worker's heartbeat does, then it republishes
    await registry.index.publish("w0", CHAIN[:2], [])
    await _until(lambda: sync.lookup(CHAIN) == {"w0": 2})
    assert sync.resyncs >= 2
    await sync.stop()
    await redis.aclose()


def test_a_mirror_cut_off_from_a_frozen_redis_stops_answering_then_resumes(server: RedisServer):
    """Redis frozen (SIGSTOP: the socket stays open, nothing answers, as behind a partition) and a client that
    would wait a minute for it: within ``stale_after_s`` the mirror answers nothing (the directory asks Redis, which
    gives up after ``redis_wait_s``: a lookup without holders, said as unanswered), and answers again once Redis
    does."""
    async def scenario() -> None:
        redis = connect(server.url, timeout_s=60.0)
        registry = Registry(redis, "frozen")
        await registry.register(info("w0"))
        await registry.index.publish("w0", CHAIN[:4], [])
        sync = MirrorSync(registry.index, block_ms=50, stale_after_s=0.5)
        directory = WorkerDirectory(registry, mirror=sync, redis_wait_s=0.2)
        sync.start()
        await _until(lambda: sync.lookup(CHAIN) == {"w0": 4})
        assert (await directory.match(CHAIN)).answered
        os.kill(server.pid, signal.SIGSTOP)
        try:
            await _until(lambda: sync.lookup(CHAIN) is None)  # without the staleness bound: {"w0": 4} for 60 s
            match = await directory.match(CHAIN)
            assert not match.answered and match.depths("w0") == (0, 0)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        await _until(lambda: sync.lookup(CHAIN) == {"w0": 4})
        await sync.stop()
        await directory.close()
        await redis.aclose()

    run(scenario())


async def _until(done, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
