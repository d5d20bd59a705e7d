"""KV index v2 against a real ``redis-server`` (docs/architecture.md "KV index v2"): a stream per holder with
sequence numbers, each block's best tier per worker, the store as a holder of its own, lookups per tier, and
no entries for workers that are not registered. The schema (key names and types) is checked in
test_redis_index.py; the mirror in test_index_mirror.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_transfer.index_schema import TieredLookup, walk_chain
from kv_transfer.redis_index import KVIndex, NotRegistered
from kv_transfer.registry import Registry, connect
from kv_transfer.workers import WorkerInfo
from tests.redis_server import RedisServer, require_redis_server

H = [bytes([0xB0 + i]) * 16 for i in range(8)]


def info(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="prefill", grpc_address="127.0.0.1:1", kv_uri="tcp://127.0.0.1:2",
                      model_fingerprint="ab" * 16, layout_json='{"block_size": 16}', total_blocks=100)


@pytest.fixture(scope="module")
def server():
    require_redis_server()
    with RedisServer.start() as srv:
        yield srv


def run(server: RedisServer, scenario: Callable[[Any, Any], Awaitable[None]]) -> None:
    async def main() -> None:
        client, raw = connect(server.url), connect(server.url)
        await raw.flushdb()
        try:
            await scenario(client, raw)
        finally:
            await client.aclose()
            await raw.aclose()

    asyncio.run(main())


async def stream(raw: Any, key: str) -> list[dict[str, str]]:
    return [fields for _, fields in await raw.xrange(key)]


def test_each_worker_streams_its_moves_with_its_own_sequence(server):
    async def scenario(client, raw):
        registry = Registry(client)
        for w in ("w0", "w1"):
            await registry.register(info(w))
        index = registry.index
        assert await index.publish_tiers("w0", {"gpu": H[:2], "cpu": H[2:3]}, [H[7]]) == 3
        assert await index.publish_tiers("w1", {"cpu": H[:1]}, []) == 1
        assert await index.publish_tiers("w0", {"cpu": H[:1]}, [H[1]]) == 5  # block 0 left the pool, 1 is gone
        assert await index.publish_tiers("w0", {}, []) is None  # nothing to say: nothing written
        assert await stream(raw, "baton:events:w0") == [
            {"seq": "1", "type": "stored", "tier": "gpu", "hashes": f"{H[0].hex()} {H[1].hex()}"},
            {"seq": "2", "type": "stored", "tier": "cpu", "hashes": H[2].hex()},
            {"seq": "3", "type": "removed", "hashes": H[7].hex()},
            {"seq": "4", "type": "stored", "tier": "cpu", "hashes": H[0].hex()},
            {"seq": "5", "type": "removed", "hashes": H[1].hex()},
        ]
        assert await stream(raw, "baton:events:w1") == [
            {"seq": "1", "type": "stored", "tier": "cpu", "hashes": H[0].hex()}]
        assert await raw.get("baton:events-seq:w0") == "5" and await raw.get("baton:events-seq:w1") == "1"
        assert await raw.hgetall(f"baton:kv:{H[0].hex()}") == {"w0": "cpu", "w1": "cpu"}  # the best tier, one field
        assert await raw.hgetall("baton:kv-of:w0") == {H[0].hex(): "cpu", H[2].hex(): "cpu"}
        assert [e["type"] for e in await stream(raw, "baton:worker-events")] == ["worker-up", "worker-up"]

        assert await index.remove_worker("w0") == 2  # one 'cleared' entry, however many blocks
        assert (await stream(raw, "baton:events:w0"))[-1] == {"seq": "6", "type": "cleared"}
        assert not await raw.exists("baton:kv-of:w0") and await raw.hgetall(f"baton:kv:{H[0].hex()}") == {"w1": "cpu"}
        await registry.deregister("w0")  # its stream and sequence go; the control stream says so
        assert not await raw.exists("baton:events:w0", "baton:events-seq:w0")
        assert (await stream(raw, "baton:worker-events"))[-1] == {"type": "worker-down", "worker": "w0",
                                                                 "reason": "deregister"}
        state = await index.holder_state("w1")
        assert state.holdings == {H[0]: "cpu"} and state.seq == 1 and state.stream_id != "0-0"

    run(server, scenario)


def test_workers_that_are_not_registered_are_not_indexed(server):
    async def scenario(client, raw):
        registry = Registry(client)
        with pytest.raises(NotRegistered, match="ghost"):
            await registry.index.publish("ghost", H[:2], [])
        assert await raw.keys("*") == []  # nothing written: no entry nobody would clean up
        await registry.register(info("w"))
        await registry.index.publish("w", H[:2], [])
        await raw.delete("baton:worker:w")  # its TTL ran out ...
        await registry.list_workers()  # ... and a router pruned it
        with pytest.raises(NotRegistered):  # a publish in flight lands after the prune
            await registry.index.publish("w", H[2:4], [])
        assert await raw.keys("baton:kv*") == [] and await raw.keys("baton:events*") == []
        with pytest.raises(ValueError, match="store"):
            await registry.index.publish("store", H[:1], [])

    run(server, scenario)


def test_lookup_per_tier_with_the_store_written_directly(server):
    async def scenario(client, raw):
        index = KVIndex(client)
        # a: gpu 0-1, cpu 2-3 | b: cpu 0, gpu 1-2 | c: gpu 1-5 (no block 0) | the store: 0-4
        tiers = {"a": "gg cc", "b": "cgg", "c": " ggggg"}
        for worker, row in tiers.items():
            for i, t in enumerate(row):
                if t != " ":
                    await raw.hset(f"baton:kv:{H[i].hex()}", worker, {"g": "gpu", "c": "cpu"}[t])
        for i in range(5):  # the store's entries, as the store slice will write them
            await raw.hset(f"baton:kv:{H[i].hex()}", "store", "store")
        # a holds block 2 in neither tier (a hole): both its counts stop at 2; b's pool prefix is 0 (block 0 in cpu)
        got = await index.lookup_tiers(H)
        assert got == TieredLookup(gpu={"a": 2}, gpu_or_cpu={"a": 2, "b": 3}, store=5)
        assert await index.lookup(H) == {"a": 2}  # the KV pool only: what routing reads today
        assert await index.lookup_tiers(H[1:]) == TieredLookup(gpu={"a": 1, "b": 2, "c": 5},
                                                               gpu_or_cpu={"a": 1, "b": 2, "c": 5}, store=4)
        await raw.hset(f"baton:kv:{H[2].hex()}", "a", "cpu")  # fill a's hole from its host tier
        assert (await index.lookup_tiers(H)).gpu_or_cpu == {"a": 5, "b": 3}
        await raw.hdel(f"baton:kv:{H[0].hex()}", "store")
        assert (await index.lookup_tiers(H)).store == 0  # the store's prefix starts at block 0 too
        assert await index.lookup_tiers([H[7], H[0]]) == TieredLookup()  # nobody holds the first block

    run(server, scenario)


def test_the_store_is_a_holder_with_its_own_stream(server):
    async def scenario(client, raw):
        index = KVIndex(client)
        assert await index.publish_store(H[:3], []) == 1  # needs no registration: not a worker
        assert await index.publish_store([], [H[2]]) == 2
        assert await raw.hgetall(f"baton:kv:{H[0].hex()}") == {"store": "store"}
        assert await raw.hgetall("baton:kv-of:store") == {H[0].hex(): "store", H[1].hex(): "store"}
        assert [e["seq"] for e in await stream(raw, "baton:events:store")] == ["1", "2"]
        assert await index.lookup_tiers(H) == TieredLookup(store=2)
        assert await index.list_holders() == ["store"]

    run(server, scenario)


FIELDS = st.dictionaries(st.sampled_from(["a", "b", "c", "d", "store"]), st.sampled_from(["gpu", "cpu"]),
                         max_size=5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chain=st.lists(FIELDS, min_size=1, max_size=8))
def test_property_the_script_walks_like_walk_chain(server, chain):
    """Any holdings (each block: holder -> tier, the store among them): the Lua walk and ``walk_chain``, which
    the mirror uses, give the same answer for every suffix of the chain."""

    async def scenario(client, raw):
        hashes = [bytes([0xE0 + i]) * 16 for i in range(len(chain))]
        rows = [{h: ("store" if h == "store" else t) for h, t in fields.items()} for fields in chain]
        for block_hash, row in zip(hashes, rows):
            if row:
                await raw.hset(f"baton:kv:{block_hash.hex()}", mapping=row)
        index = KVIndex(client)
        for start in range(len(hashes)):
            assert await index.lookup_tiers(hashes[start:]) == walk_chain(rows[start:]), start

    run(server, scenario)
