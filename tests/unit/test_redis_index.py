"""Redis registry and KV index against a real ``redis-server`` (DESIGN.md "KV index and registry in Redis").

Key names and types are inspected with raw commands (TYPE, PTTL, HGETALL, SMEMBERS, XRANGE); lookups are
checked against hand-built holdings; round trips are counted at the connection's send. Skipped only when
no ``redis-server`` binary exists (see scripts/ensure-redis.sh).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection

from kv_transfer.redis_index import KVIndex, RedisKeys
from kv_transfer.registry import HeartbeatTask, Registry, connect
from kv_transfer.workers import WorkerInfo, WorkerLoad
from tests.redis_server import RedisServer, require_redis_server

H = [bytes([0xA0 + i]) * 16 for i in range(8)]  # a prompt's chain of block hashes, block 0 first
LOAD = WorkerLoad(running=2, waiting=1, free_blocks=90, queued_prefill_tokens=300)


def info(worker_id: str, role: str = "decode") -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id, role=role, grpc_address=f"127.0.0.1:{5000 + len(worker_id)}",  # type: ignore[arg-type]
        kv_uri="tcp://127.0.0.1:6000", model_fingerprint="ab" * 16, layout_json='{"block_size": 16}',
        total_blocks=100,
    )


@pytest.fixture(scope="module")
def server():
    require_redis_server()
    with RedisServer.start() as srv:
        yield srv


@pytest.fixture
def url(server) -> str:
    asyncio.run(_flush(server.url))
    return server.url


async def _flush(url: str) -> None:
    client = aioredis.from_url(url)
    await client.flushall()
    await client.aclose()


def run(url: str, scenario: Callable[[Any, Any], Awaitable[None]], *, decode: bool = True) -> None:
    """Run ``scenario(client, raw)``: ``client`` for the code under test, ``raw`` (str replies) to inspect."""

    async def main() -> None:
        client = connect(url) if decode else aioredis.from_url(url)
        raw = aioredis.from_url(url, decode_responses=True)
        try:
            await scenario(client, raw)
        finally:
            await client.aclose()
            await raw.aclose()

    asyncio.run(main())


async def events(raw: Any, holder: str | None = None, ns: str = "baton") -> list[dict[str, str]]:
    """The holder's stream of block moves, or (holder None) the control stream of worker-up / worker-down."""
    key = f"{ns}:worker-events" if holder is None else f"{ns}:events:{holder}"
    return [fields for _, fields in await raw.xrange(key)]


class RoundTrips:
    """Counts sends on every redis-py asyncio connection (a pipeline or a script call is one send)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = AbstractConnection.send_packed_command

        async def counted(conn, command, check_health=True):
            self.count += 1
            return await original(conn, command, check_health)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)


def test_keys_names_types_and_ttls_match_design(url):
    async def scenario(client, raw):
        registry = Registry(client, ttl_s=6.0)
        await registry.register(info("w1"))
        await registry.heartbeat(info("w1"), LOAD)
        await registry.index.publish("w1", [H[0], H[1]], [])
        await registry.set_desired_pool_size("prefill", 3)
        await registry.add_draining("w1")

        kv0, kv1 = f"baton:kv:{H[0].hex()}", f"baton:kv:{H[1].hex()}"
        assert set(await raw.keys("*")) == {
            "baton:worker:w1", "baton:workers", "baton:load:w1", kv0, kv1, "baton:kv-of:w1",
            "baton:pool:prefill:desired", "baton:draining", "baton:worker-events", "baton:events:w1",
            "baton:events-seq:w1",
        }
        types = {k: await raw.type(k) for k in await raw.keys("*")}
        assert types["baton:worker:w1"] == types["baton:load:w1"] == types[kv0] == types["baton:kv-of:w1"] == "hash"
        assert types["baton:workers"] == types["baton:draining"] == "set"
        assert types["baton:pool:prefill:desired"] == types["baton:events-seq:w1"] == "string"
        assert types["baton:worker-events"] == types["baton:events:w1"] == "stream"
        assert 5000 < await raw.pttl("baton:worker:w1") <= 6000
        assert 5000 < await raw.pttl("baton:load:w1") <= 6000
        for key in (kv0, "baton:workers", "baton:kv-of:w1", "baton:worker-events", "baton:events:w1",
                    "baton:events-seq:w1", "baton:pool:prefill:desired"):
            assert await raw.ttl(key) == -1, key  # no expiry: cleaned up explicitly
        assert await raw.hgetall("baton:worker:w1") == {
            "role": "decode", "grpc_address": "127.0.0.1:5002", "kv_uri": "tcp://127.0.0.1:6000",
            "model_fingerprint": "ab" * 16, "layout_json": '{"block_size": 16}', "total_blocks": "100",
        }
        load = await raw.hgetall("baton:load:w1")
        assert {k: load[k] for k in ("running", "waiting", "free_blocks", "queued_prefill_tokens")} == {
            "running": "2", "waiting": "1", "free_blocks": "90", "queued_prefill_tokens": "300"}
        assert abs(int(load["reported_unix_ms"]) - time.time() * 1000) < 5000
        assert await raw.smembers("baton:workers") == {"w1"}
        assert await raw.hgetall(kv0) == {"w1": "gpu"}
        assert await raw.hgetall("baton:kv-of:w1") == {H[0].hex(): "gpu", H[1].hex(): "gpu"}
        assert H[0].hex() == H[0].hex().lower() and "a0a0" in kv0
        assert await raw.get("baton:pool:prefill:desired") == "3"
        assert await raw.smembers("baton:draining") == {"w1"}
        [up] = await events(raw)
        assert up == {"type": "worker-up", "worker": "w1", "role": "decode", "grpc_address": "127.0.0.1:5002",
                      "reason": "register"}
        assert await events(raw, "w1") == [
            {"seq": "1", "type": "stored", "tier": "gpu", "hashes": f"{H[0].hex()} {H[1].hex()}"}]
        assert await raw.get("baton:events-seq:w1") == "1"

    run(url, scenario)


def test_namespace_prefixes_every_key(url):
    async def scenario(client, raw):
        registry = Registry(client, ns="tenant7")
        await registry.register(info("w1"))
        await registry.index.publish("w1", [H[0]], [])
        assert all(k.startswith("tenant7:") for k in await raw.keys("*"))
        assert RedisKeys("tenant7").kv(H[0]) in await raw.keys("*")

    run(url, scenario)


async def _hold(raw: Any, index: KVIndex, holdings: dict[str, list[int]]) -> None:
    """Register the workers (only registered workers are indexed), then publish their blocks in the KV pool."""
    await raw.sadd(index.keys.workers, *holdings)
    for worker_id, blocks in holdings.items():
        await index.publish(worker_id, [H[i] for i in blocks], [])


@pytest.mark.parametrize("decode", [True, False], ids=["str-replies", "bytes-replies"])
def test_lookup_counts_leading_blocks_per_worker(url, decode):
    async def scenario(client, raw):
        index = KVIndex(client)
        await _hold(raw, index, {"A": [0, 1, 2, 3], "B": [0, 1, 3], "C": [2]})
        assert await index.lookup(H[:4]) == {"A": 4, "B": 2}
        assert await index.lookup(H[:6]) == {"A": 4, "B": 2}  # blocks nobody holds end the walk
        assert await index.lookup(H[1:4]) == {"A": 3, "B": 1}  # the walk follows the order it is given
        assert await index.lookup([H[5], H[0], H[1]]) == {}  # nobody holds block 0
        assert await index.lookup([H[2], H[3]]) == {"A": 2, "C": 1}
        assert await index.lookup([]) == {}
        await index.publish("A", [], [H[1]])  # eviction breaks A's prefix at block 1
        assert await index.lookup(H[:4]) == {"A": 1, "B": 2}

    run(url, scenario, decode=decode)


def test_lookup_is_one_round_trip(url, monkeypatch):
    async def scenario(client, raw):
        index = KVIndex(client)
        await _hold(raw, index, {"A": list(range(8)), "B": [0, 1, 2]})
        long_chain = H + [bytes([i]) * 16 for i in range(200)]
        await index.lookup(H[:1])  # connection handshake and script load happen here, not below
        await raw.config_resetstat()
        trips = RoundTrips(monkeypatch)
        assert await index.lookup(long_chain) == {"A": 8, "B": 3}
        assert trips.count == 1
        stats = await raw.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] == 1
        assert "cmdstat_eval" not in stats and "cmdstat_script|load" not in stats

    run(url, scenario)


def test_publish_is_one_round_trip_and_removals_apply_last(url, monkeypatch):
    async def scenario(client, raw):
        index = KVIndex(client)
        await raw.sadd("baton:workers", "w")
        await index.publish("w", [H[7]], [])  # warm the connection
        stored = [bytes([i]) * 16 for i in range(64)]
        trips = RoundTrips(monkeypatch)
        await index.publish("w", stored, [H[7], stored[0]], tier="cpu")
        assert trips.count == 1
        assert await raw.hlen("baton:kv-of:w") == 63
        assert await raw.hgetall(f"baton:kv:{stored[1].hex()}") == {"w": "cpu"}
        assert not await raw.exists(f"baton:kv:{stored[0].hex()}", f"baton:kv:{H[7].hex()}")
        assert [(e["seq"], e["type"]) for e in await events(raw, "w")] == [("1", "stored"), ("2", "stored"),
                                                                          ("3", "removed")]
        parsed = (await index.read_events("0-0", {"w": "0-0"})).holders["w"]
        assert parsed[-1].hashes == (H[7], stored[0]) and parsed[1].tier == "cpu" and parsed[1].worker_id == "w"
        assert [e.seq for e in parsed] == [1, 2, 3]
        with pytest.raises(ValueError, match="tier"):
            await index.publish("w", [H[0]], [], tier="disk")

    run(url, scenario)


def test_expired_worker_is_pruned_with_its_index_entries(url):
    async def scenario(client, raw):
        registry = Registry(client, ttl_s=1.0)
        await registry.register(info("dead"))
        await registry.index.publish("dead", H[:3], [])
        beating = HeartbeatTask(registry, info("live"), lambda: LOAD, interval_s=0.2)
        beating.start()
        await _wait_for(registry.list_workers, lambda ws: [w.worker_id for w, _ in ws] == ["dead", "live"])
        await registry.index.publish("live", H[:2], [])
        await _wait_for(lambda: raw.exists("baton:worker:dead"), lambda n: n == 0, timeout_s=3.0)

        listed = await registry.list_workers()
        assert [w.worker_id for w, _ in listed] == ["live"]
        assert dataclasses.replace(listed[0][1], reported_unix_ms=None) == LOAD
        assert await raw.smembers("baton:workers") == {"live"}
        assert not await raw.exists("baton:kv-of:dead", "baton:load:dead", f"baton:kv:{H[2].hex()}",
                                    "baton:events:dead", "baton:events-seq:dead")
        assert await raw.hgetall(f"baton:kv:{H[0].hex()}") == {"live": "gpu"}
        assert await registry.index.lookup(H[:3]) == {"live": 2}
        await registry.list_workers()  # pruning happens once
        downs = [e for e in await events(raw) if e["type"] == "worker-down"]
        assert downs == [{"type": "worker-down", "worker": "dead", "reason": "expired"}]
        await beating.stop()

    run(url, scenario)


async def _wait_for(
    probe: Callable[[], Awaitable[Any]], done: Callable[[Any], bool], timeout_s: float = 5.0
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = await probe()
            if done(value):
                return value
        except Exception:  # noqa: BLE001 - Redis may be restarting
            value = None
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s (last value {value!r})")
        await asyncio.sleep(0.05)


def test_deregister_removes_everything_and_register_forgets_stale_entries(url):
    async def scenario(client, raw):
        registry = Registry(client)
        await registry.register(info("w"))
        await registry.heartbeat(info("w"), LOAD)
        await registry.index.publish("w", H[:2], [])
        await registry.add_draining("w")
        await registry.deregister("w")
        assert await raw.keys("*") == ["baton:worker-events"]  # its stream and sequence went with it
        assert [e["type"] for e in await events(raw)][-1] == "worker-down"
        assert await registry.list_workers() == [] and await registry.list_draining() == set()

        await registry.register(info("w"))  # an earlier process with this id left entries behind
        await registry.index.publish("w", H[:2], [])
        await registry.register(info("w"))  # the restarted process holds nothing yet
        assert await registry.index.lookup(H[:2]) == {}
        listed = await registry.list_workers()
        assert [(w, load) for w, load in listed] == [(info("w"), None)]  # no heartbeat yet: no load

    run(url, scenario)


def test_heartbeat_recreates_a_pruned_worker_and_asks_for_republish(url):
    async def scenario(client, raw):
        registry = Registry(client)
        await registry.register(info("w"))
        assert await registry.heartbeat(info("w"), LOAD) is False
        await registry.index.publish("w", H[:2], [])
        await raw.delete("baton:worker:w")  # as if its TTL ran out
        await registry.list_workers()
        assert await registry.index.lookup(H[:2]) == {}
        assert await registry.heartbeat(info("w"), LOAD) is True
        assert [w.worker_id for w, _ in await registry.list_workers()] == ["w"]
        last = (await events(raw))[-1]
        assert (last["type"], last["reason"]) == ("worker-up", "reregister")

    run(url, scenario)


def test_pool_and_draining_helpers(url):
    async def scenario(client, raw):
        registry = Registry(client)
        assert await registry.get_desired_pool_size("decode") is None
        await registry.set_desired_pool_size("decode", 4)
        assert await registry.get_desired_pool_size("decode") == 4
        with pytest.raises(ValueError):
            await registry.set_desired_pool_size("router", 1)  # type: ignore[arg-type]
        await registry.add_draining("a")
        await registry.add_draining("b")
        await registry.remove_draining("a")
        assert await registry.list_draining() == {"b"}

    run(url, scenario)


def test_worker_info_rejects_bad_role_and_id():
    with pytest.raises(ValueError, match="role"):
        WorkerInfo(worker_id="w", role="router", grpc_address="x", kv_uri="y",  # type: ignore[arg-type]
                   model_fingerprint="00", layout_json="{}", total_blocks=1)
    with pytest.raises(ValueError, match="worker_id"):
        WorkerInfo(worker_id="a b", role="decode", grpc_address="x", kv_uri="y", model_fingerprint="00",
                   layout_json="{}", total_blocks=1)
    with pytest.raises(ValueError, match="reserved"):  # the store's holder id in the KV index
        WorkerInfo(worker_id="store", role="decode", grpc_address="x", kv_uri="y", model_fingerprint="00",
                   layout_json="{}", total_blocks=1)


def test_heartbeat_task_survives_a_redis_restart():
    require_redis_server()
    with RedisServer.start() as server:
        asyncio.run(_restart_scenario(server))


async def _restart_scenario(server: RedisServer) -> None:
    client, raw = connect(server.url), connect(server.url)
    registry = Registry(client, ttl_s=1.0)
    republished: list[int] = []

    async def republish() -> None:  # what a worker does: publish every block its cache holds
        await registry.index.publish("w", H[:3], [])
        republished.append(1)

    task = HeartbeatTask(registry, info("w"), lambda: LOAD, interval_s=0.1, on_reregistered=republish)
    task.start()
    await _wait_for(registry.list_workers, lambda ws: [w.worker_id for w, _ in ws] == ["w"])
    await registry.index.publish("w", H[:3], [])
    server.stop(remove_folder=False)
    await _wait_for(lambda: asyncio.sleep(0, task.failures), lambda n: n >= 3)  # beats fail; the task lives on
    assert task._task is not None and not task._task.done()
    server.restart()  # same port, empty data
    await _wait_for(registry.list_workers, lambda ws: [w.worker_id for w, _ in ws] == ["w"])
    await _wait_for(lambda: registry.index.lookup(H[:3]), lambda got: got == {"w": 3})
    assert republished == [1] and task.failures == 0
    assert 0 < await raw.pttl("baton:worker:w") <= 1000
    await task.stop()
    assert await raw.exists("baton:worker:w") == 0 and await raw.smembers("baton:workers") == set()
    await client.aclose()
    await raw.aclose()
