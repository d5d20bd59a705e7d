"""WorkerDirectory against a real redis-server: listing cache, which workers route, Redis outages."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from engine.errors import BatonError
from kv_transfer.registry import Registry, connect
from kv_transfer.workers import WorkerInfo, WorkerLoad
from router.routing.directory import HashScheme, Snapshot, WorkerDirectory, build_candidates, served_scheme
from tests.redis_server import RedisServer, require_redis_server


def info(worker_id: str, role: str = "decode", fingerprint: str = "aa", block_size: int = 16) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, grpc_address=f"127.0.0.1:{hash(worker_id) % 1000 + 1}",
                      kv_uri="tcp://127.0.0.1:1", model_fingerprint=fingerprint,
                      layout_json=f'{{"block_size": {block_size}, "dtype": "float32"}}', total_blocks=100)


def test_served_scheme_is_what_most_decode_workers_share():
    workers = [(info("d0", fingerprint="aa"), None), (info("d1", fingerprint="bb"), None),
               (info("d2", fingerprint="bb"), None), (info("p0", "prefill", fingerprint="cc"), None),
               (info("p1", "prefill", fingerprint="cc"), None), (info("p2", "prefill", fingerprint="cc"), None)]
    assert served_scheme(workers) == HashScheme(bytes.fromhex("bb"), 16)
    assert served_scheme(workers[3:]) == HashScheme(bytes.fromhex("cc"), 16)  # no decode worker: all of them
    assert served_scheme([]) is None
    assert served_scheme([(info("d0", fingerprint="not-hex"), None)]) is None


def test_candidates_leave_out_other_models_and_mark_draining():
    snapshot = Snapshot(
        workers=((info("d0"), None), (info("d1", block_size=8), None), (info("p0", "prefill"), None)),
        draining=frozenset({"p0"}), taken_at_s=0.0,
    )
    candidates = build_candidates(snapshot, HashScheme(bytes.fromhex("aa"), 16), {"d0": 3, "d1": 9})
    assert [(c.worker_id, c.cached_blocks, c.draining) for c in candidates] == [("d0", 3, False), ("p0", 0, True)]


@pytest.fixture
def redis_server():
    require_redis_server()
    with RedisServer.start() as server:
        yield server


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_listing_is_cached_for_ttl_and_survives_a_redis_outage(redis_server):
    async def scenario() -> None:
        redis = connect(redis_server.url, timeout_s=0.5)
        registry, clock = Registry(redis, "dir", ttl_s=60), Clock()
        directory = WorkerDirectory(registry, ttl_s=0.5, redis_retry_s=1.0, clock=clock)
        await registry.register(info("d0"))
        await registry.heartbeat(info("d0"), WorkerLoad(running=1, waiting=2, free_blocks=50, queued_prefill_tokens=0))
        first = await directory.snapshot()
        assert [(i.worker_id, load.running if load else None) for i, load in first.workers] == [("d0", 1)]

        await registry.register(info("d1"))
        assert await directory.snapshot() is first  # within the TTL: no Redis round trip
        clock.now_s += 0.5
        assert [i.worker_id for i, _ in (await directory.snapshot()).workers] == ["d0", "d1"]

        redis_server.stop(remove_folder=False)
        clock.now_s += 0.5
        stale = await directory.snapshot()  # Redis down: the last listing keeps serving
        assert [i.worker_id for i, _ in stale.workers] == ["d0", "d1"]
        assert await directory.lookup([b"x" * 16]) == {}  # and routing goes by load only
        redis_server.restart()  # empty: no persistence; workers re-register with their next heartbeat
        assert [i.worker_id for i, _ in (await directory.snapshot()).workers] == ["d0", "d1"]  # backing off
        clock.now_s += 1.0
        empty = await directory.snapshot()  # an empty registry right after a full one: the last listing
        assert [i.worker_id for i, _ in empty.workers] == ["d0", "d1"]
        clock.now_s += 60.0  # longer than a heartbeat TTL: the registry is believed
        assert (await directory.snapshot()).workers == ()
        await registry.register(info("d2"))
        clock.now_s += 1.0
        assert [i.worker_id for i, _ in (await directory.snapshot()).workers] == ["d2"]
        await registry.deregister("d2")  # every worker left (Redis kept its data): believed at once
        clock.now_s += 1.0
        assert (await directory.snapshot()).workers == ()
        await directory.close()
        await redis.aclose()

    asyncio.run(scenario())


def test_no_listing_and_no_redis_is_unavailable(redis_server):
    async def scenario() -> None:
        redis = connect(redis_server.url, timeout_s=0.5)
        directory = WorkerDirectory(Registry(redis, "dir"))
        redis_server.stop(remove_folder=False)
        with pytest.raises(BatonError, match="cannot list workers: Redis is unreachable"):
            await directory.snapshot()
        await redis.aclose()

    asyncio.run(scenario())


def test_a_silent_redis_costs_a_request_at_most_redis_wait_s(redis_server):
    """Redis frozen (SIGSTOP: connections open, nothing answers, as behind a partition): with a client that would
    wait 60 s, the listing and the lookup give up after redis_wait_s and routing goes on with the last listing."""
    async def scenario() -> None:
        redis = connect(redis_server.url, timeout_s=60.0)
        registry, clock = Registry(redis, "dir", ttl_s=60), Clock()
        directory = WorkerDirectory(registry, ttl_s=0.5, redis_retry_s=1.0, redis_wait_s=0.2, clock=clock)
        await registry.register(info("d0"))
        first = await directory.snapshot()
        assert (await directory.match([b"x" * 16])).answered
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            clock.now_s += 1.0
            assert await directory.snapshot() is first  # the refresh goes on in the background
            assert await directory.lookup([b"x" * 16]) == {}  # load only
            assert not (await directory.match([b"x" * 16])).answered  # and the route's reason will say so
            assert await directory.snapshot() is first  # the same refresh: past its first redis_wait_s, no wait
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        await directory.close()
        await redis.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 20.0))  # without the bound: a 60 s wait, then this fails
