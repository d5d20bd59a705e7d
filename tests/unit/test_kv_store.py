"""The store tier's client (``kv_transfer.kv_store``): its URI, the bounded thread every call runs on (a stuck
call times out, refuses the next ones at once, releases what it used only once it has really ended), and values
against a real Mooncake Store on loopback (``deploy.kv_store.start_store``): a round trip, and every value that
must not be used: missing, another block's bytes, a short one."""

from __future__ import annotations

import asyncio
import subprocess
import threading

import numpy as np
import pytest

from deploy.kv_store import start_store, store_env
from kv_transfer.bounded_thread import BoundedThread, CallTimeout, ThreadStuck
from kv_transfer.kv_store import (
    CHECKSUM_BYTES, CORRUPT, FETCHED, MISSING, BlockStore, StoreError, parse_store_uri, seal,
)
from tests.required import import_or_skip

H = [bytes([i]) * 16 for i in range(8)]


# ---- the URI ---------------------------------------------------------------------------------
def test_the_uri_names_the_master_and_the_metadata_server():
    config = parse_store_uri("mooncake://127.0.0.1:7000?metadata=127.0.0.1:7001&timeout_s=2.5")
    assert (config.master_address, config.metadata_url, config.local_host, config.timeout_s) == (
        "127.0.0.1:7000", "http://127.0.0.1:7001/metadata", "127.0.0.1", 2.5)
    assert parse_store_uri(config.uri).metadata_url == config.metadata_url
    assert parse_store_uri("mooncake://h:1?metadata=http://m:2/meta&host=10.0.0.5").local_host == "10.0.0.5"


@pytest.mark.parametrize("uri, says", [
    ("redis://h:1?metadata=m:2", "mooncake://"), ("mooncake://h?metadata=m:2", "HOST:RPC_PORT"),
    ("mooncake://h:1", "metadata="), ("mooncake://h:1?metadata=m:2&ttl=3", "unknown field"),
    ("mooncake://h:1?metadata=m:2&timeout_s=0", "positive"),
])
def test_bad_uris_say_what_is_wrong(uri, says):
    with pytest.raises(ValueError, match=says):
        parse_store_uri(uri)


# ---- the bounded thread ------------------------------------------------------------------------
def test_a_stuck_call_times_out_refuses_the_next_and_ends_late():
    async def scenario() -> list[str]:
        thread, gate, seen = BoundedThread("test-store"), threading.Event(), []
        with pytest.raises(CallTimeout):
            await thread.call(lambda: gate.wait(30), 0.2, ended=lambda: seen.append("stuck call ended"))
        assert seen == []  # still running: what it uses stays reserved
        with pytest.raises(ThreadStuck):  # refused at once, not queued behind it
            await thread.call(lambda: seen.append("never runs"), 5.0, ended=lambda: seen.append("refused"))
        gate.set()
        while "stuck call ended" not in seen:
            await asyncio.sleep(0.01)
        assert await thread.call(lambda: "back", 5.0) == "back"  # the thread serves again
        thread.close()
        assert thread.join(5.0)
        return seen

    assert asyncio.run(scenario()) == ["refused", "stuck call ended"]


def test_a_call_whose_awaiter_gave_up_before_it_started_is_skipped():
    async def scenario() -> list[str]:
        thread, gate, ran = BoundedThread("test-store"), threading.Event(), []
        first = asyncio.ensure_future(thread.call(lambda: gate.wait(30), 30.0))
        await asyncio.sleep(0.05)  # the first call is running: the second queues behind it
        ended = asyncio.Event()
        with pytest.raises(CallTimeout):
            await thread.call(lambda: ran.append("late"), 0.1, ended=ended.set)
        gate.set()
        await first
        await asyncio.wait_for(ended.wait(), 5.0)  # ended (skipped), and what it would have used is free
        thread.close()
        return ran

    assert asyncio.run(scenario()) == []


# ---- values in a real store ----------------------------------------------------------------------
BLOCK_BYTES = 1024


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory):
    import_or_skip("mooncake", "mooncake", "the store tier needs mooncake-transfer-engine-non-cuda")
    procs: list[subprocess.Popen] = []

    def spawn(name, argv, log_path):
        with log_path.open("wb") as log:
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=store_env()))
        return procs[-1]

    try:
        yield start_store(tmp_path_factory.mktemp("store"), spawn, memory="32 MB") + "&timeout_s=3"
    finally:
        for popen in reversed(procs):
            popen.terminate()
            try:
                popen.wait(10)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(5)


def test_values_round_trip_and_every_bad_one_is_refused(store_uri):
    async def scenario():
        buffer = np.zeros((8, BLOCK_BYTES + 64), np.uint8)
        client = BlockStore(parse_store_uri(store_uri), buffer, BLOCK_BYTES)
        await client.start()
        try:
            buffer[0, :BLOCK_BYTES] = np.arange(BLOCK_BYTES) % 251
            buffer[1, :BLOCK_BYTES] = 7
            assert await client.put(H[:2], [0, 1]) == [True, True]
            assert await client.put(H[:1], [0]) == [True]  # there already: held, not an error
            assert await client.exists(H[:3]) == [True, True, False]
            assert await client.get(H[:3], [2, 3, 4]) == [FETCHED, FETCHED, MISSING]
            assert np.array_equal(buffer[2, :BLOCK_BYTES], buffer[0, :BLOCK_BYTES])
            # H[0]'s sealed value stored under H[2]: right length, right bytes for another block
            raw = client._native()  # noqa: SLF001 - plants bad values, as a broken writer would
            value = client.value_bytes
            assert raw.batch_put_from([H[2].hex()], [buffer[0].ctypes.data], [value]) == [0]
            seal(H[3], buffer[5], BLOCK_BYTES)
            assert raw.batch_put_from([H[3].hex()], [buffer[5].ctypes.data], [value - CHECKSUM_BYTES]) == [0]
            buffer[6, :] = 0
            assert await client.get([H[2], H[3]], [6, 7]) == [CORRUPT, CORRUPT]
            assert await client.remove([H[2], H[3]]) == 2
            assert await client.exists([H[2], H[3]]) == [False, False]
        finally:
            await client.close()

    asyncio.run(scenario())


def test_an_unreachable_store_is_refused_before_the_native_setup():
    """Mooncake's setup holds the GIL while it retries (90 s for an absent master): ``start`` checks first."""
    async def scenario():
        client = BlockStore(parse_store_uri("mooncake://127.0.0.1:9?metadata=127.0.0.1:9&timeout_s=1"),
                            np.zeros((1, 128), np.uint8), 64)
        try:
            with pytest.raises(StoreError, match="does not answer"):
                await client.start()
        finally:
            await client.close()

    asyncio.run(scenario())
