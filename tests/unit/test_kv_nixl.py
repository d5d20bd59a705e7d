"""nixl:// beyond the conformance suite (tests/unit/test_kv_transport.py runs it too): a server restarted on
the same address is a new incarnation whose agent replaces the old one's; the READ's notification is what
ends the server's part (none: the pull fails, within its bound); a client that gives up mid-wait frees the
server's waiter; a kept connection READs first and asks after (N_READ_POSTED: one round trip), answered only
while the lease is live, never by a staged or authenticated server; ``auto`` prefers nixl for a CUDA cache
only.

Every nixl case (these, nixl's in test_kv_transport.py, test_kv_staging.py and test_kv_in_place.py, and the
worker-level faults of tests/integration/test_nixl_faults.py) runs in a pytest process
of its own, started by ``test_the_nixl_cases_pass_in_a_process_of_their_own`` with ``BATON_TEST_NIXL=1``: in
the main test process NIXL's bundled UCX beside ucxx's, and NIXL agents whose peers were killed, crashed it at
random later points (a SIGSEGV in ucxx's progress, in protoc, ...), as two UCX copies in one worker could.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.transport import AUTO_PREFERENCE, TransportConfig, make_server, parse_kinds

ROOT = Path(__file__).resolve().parents[2]
OWN_PROCESS = "BATON_TEST_NIXL"
NIXL_FILES = ("tests/unit/test_kv_nixl.py", "tests/unit/test_kv_transport.py", "tests/unit/test_kv_staging.py",
              "tests/unit/test_kv_in_place.py", "tests/integration/test_nixl_faults.py")
MIN_NIXL_CASES = 30  # nixl's cases in NIXL_FILES, so a collection that silently drops them fails


def nixl_skip_reason() -> str | None:
    """None in the process of nixl's own (where NIXL must import), else why nixl's cases skip here."""
    if os.environ.get(OWN_PROCESS) != "1":
        return "nixl's cases run in a process of their own (test_kv_nixl.py::test_the_nixl_cases_pass_in_a_process_of_their_own)"
    from kv_transfer.nixl import unavailable_reason

    return unavailable_reason()


own_process = pytest.mark.skipif(nixl_skip_reason() is not None, reason=nixl_skip_reason() or "")
if nixl_skip_reason() is None:
    from kv_transfer import nixl  # only in nixl's own process


def _nixl_missing() -> str | None:
    from kv_transfer.nixl import INSTALL_HINT, installed  # installed() does not import NIXL

    if os.environ.get(OWN_PROCESS) == "1":
        return "this is nixl's own process"
    return None if installed() else INSTALL_HINT


@pytest.mark.skipif(_nixl_missing() is not None, reason=_nixl_missing() or "")
def test_the_nixl_cases_pass_in_a_process_of_their_own() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *NIXL_FILES, "-k", "nixl"],
                          cwd=ROOT, env={**os.environ, OWN_PROCESS: "1"}, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= MIN_NIXL_CASES and " failed" not in proc.stdout, tail

LAYOUT = KVLayout(model_fingerprint=b"nixl", dtype="float16", block_size=8, num_layers=4, num_kv_heads=2, head_dim=16)
NUM_BLOCKS = 32
CONFIG = TransportConfig(connect_timeout_s=2.0, io_timeout_s=1.0)


def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def filled(seed: int) -> KVBuffer:
    rng = np.random.default_rng(seed)
    return KVBuffer(LAYOUT, rng.integers(0, 256, LAYOUT.bytes_per_block * NUM_BLOCKS, dtype=np.uint8))


def lose_notifications(monkeypatch, server) -> None:
    """The server's agent still progresses (its polls of notifications drive it) but every notification is lost."""
    real = server.agent.nixl.get_new_notifs
    monkeypatch.setattr(server.agent.nixl, "get_new_notifs", lambda *a, **k: real(*a, **k) and {})


@own_process
def test_a_server_restarted_on_its_address_is_a_new_incarnation_whose_agent_replaces_the_old() -> None:
    async def scenario() -> None:
        table = LeaseTable()
        first = make_server("nixl", buffer=filled(1), resolve=table.resolver(lambda: 0.0), config=CONFIG)
        uri = await first.start()
        client = nixl.NixlClient(CONFIG)
        try:
            dst = KVBuffer.allocate(LAYOUT, NUM_BLOCKS)
            await client.pull(uri, LAYOUT, table.create([1, 2], now=0.0).lease_id, [1, 2], dst, [5, 6])
            assert np.array_equal(dst.array[:, [5, 6]], first.buffer.array[:, [1, 2]])
            await first.stop()  # its agent and registration are gone with it
            port = int(uri.rsplit(":", 1)[1])
            second = make_server("nixl", buffer=filled(2), resolve=table.resolver(lambda: 0.0), config=CONFIG)
            assert await second.start("127.0.0.1", port) == uri and second.incarnation != first.incarnation
            try:
                await client.pull(uri, LAYOUT, table.create([3, 9], now=0.0).lease_id, [3, 9], dst, [0, 4])
                # the bytes are the new server's (a READ through the old agent would fail or read freed memory)
                assert np.array_equal(dst.array[:, [0, 4]], second.buffer.array[:, [3, 9]])
                assert client.num_agents_loaded == 2
                assert client._remotes == {uri: (second.incarnation, second.agent.name)}  # the old one removed
            finally:
                await second.stop()
        finally:
            client.close()

    run(scenario())


@contextlib.asynccontextmanager
async def served(seed: int, config: TransportConfig = CONFIG, client_config: TransportConfig | None = None,
                 locate=None) -> AsyncIterator[tuple[LeaseTable, nixl.NixlServer, str, nixl.NixlClient]]:
    """A started nixl:// server over ``filled(seed)`` with its lease table, its URI and a client; both closed after."""
    table = LeaseTable()
    server = make_server("nixl", buffer=filled(seed), resolve=table.resolver(lambda: 0.0), config=config,
                         locate=locate)
    uri = await server.start()
    client = nixl.NixlClient(client_config or config)
    try:
        yield table, server, uri, client
    finally:
        client.close()
        await server.stop()


async def fails_within_bound(client, server, uri: str, lease: str, ids: list[int]) -> None:
    """The pull raises for want of a notification, within io_timeout_s (+2 s), and leaves nothing behind."""
    started = asyncio.get_running_loop().time()
    with pytest.raises(KVTransferError, match="notification|silent"):
        await client.pull(uri, LAYOUT, lease, ids, KVBuffer.allocate(LAYOUT, NUM_BLOCKS), ids)
    assert asyncio.get_running_loop().time() - started < CONFIG.io_timeout_s + 2.0
    for _ in range(400):  # the client may give up (its own bound) just before the server's ERROR: the server then
        if not server._waiting:  # frees its waiter once it sees the connection closed, on its next turn
            break
        await asyncio.sleep(0.005)
    assert client.pool.num_idle() == 0 and not server._waiting


@own_process
def test_without_the_reads_notification_the_pull_fails_within_its_bound(monkeypatch) -> None:
    async def scenario() -> None:
        async with served(3) as (table, server, uri, client):
            lease = table.create([1, 2, 3], now=0.0).lease_id
            lose_notifications(monkeypatch, server)
            await fails_within_bound(client, server, uri, lease, [1, 2, 3])
            monkeypatch.undo()  # notifications flow again: the same lease reads
            dst = KVBuffer.allocate(LAYOUT, NUM_BLOCKS)
            await client.pull(uri, LAYOUT, lease, [1, 2, 3], dst, [1, 2, 3])
            assert np.array_equal(dst.array[:, [1, 2, 3]], server.buffer.array[:, [1, 2, 3]])
            assert server.num_notifications >= 1
            lose_notifications(monkeypatch, server)  # a READ posted before asking: bounded just the same
            await fails_within_bound(client, server, uri, lease, [1, 2, 3])
            assert server.num_posted_reads == 0

    run(scenario())


@own_process
def test_a_client_that_gives_up_mid_wait_frees_the_servers_waiter(monkeypatch) -> None:
    async def scenario() -> None:
        patient = TransportConfig(connect_timeout_s=2.0, io_timeout_s=30.0)
        async with served(4, patient, CONFIG) as (table, server, uri, client):
            lose_notifications(monkeypatch, server)
            pulling = asyncio.create_task(client.pull(uri, LAYOUT, table.create([7], now=0.0).lease_id, [7],
                                                      KVBuffer.allocate(LAYOUT, NUM_BLOCKS), [0]))
            while not server._waiting:
                await asyncio.sleep(0.005)
            pulling.cancel()  # the client closes its connection; the server must not wait out its 30 s
            with pytest.raises(asyncio.CancelledError):
                await pulling
            for _ in range(400):
                if not server._waiting and not server._connections:
                    break
                await asyncio.sleep(0.005)
            assert not server._waiting and not server._connections

    run(scenario())


@own_process
def test_a_kept_connection_reads_first_and_asks_after_in_one_round_trip() -> None:
    """The first pull on a connection is the full exchange; every later one on it READs at once and sends
    N_READ_POSTED (the bytes are right, scattered or not); the connection stays the one connection. A client
    that asks for checksums always takes the full exchange (they are computed before the READ)."""
    async def scenario() -> None:
        async with served(5) as (table, server, uri, client):
            rng = np.random.default_rng(0)
            for i in range(6):
                src = rng.choice(NUM_BLOCKS, 1 + 3 * i, replace=False).tolist()
                dst_ids = rng.choice(NUM_BLOCKS, len(src), replace=False).tolist()
                dst = KVBuffer.allocate(LAYOUT, NUM_BLOCKS)
                await client.pull(uri, LAYOUT, table.create(src, now=0.0).lease_id, src, dst, dst_ids)
                assert np.array_equal(dst.array[:, dst_ids], server.buffer.array[:, src])
                assert client.num_posted_pulls == server.num_posted_reads == i  # all but the first
            assert server.num_accepted == 1 and client.pool.num_idle(uri) == 1 and not server._waiting
            checked = nixl.NixlClient(dataclasses.replace(CONFIG, checksum=True))  # DONE carries the checksums
            try:
                for i in range(3):
                    dst = KVBuffer.allocate(LAYOUT, NUM_BLOCKS)
                    await checked.pull(uri, LAYOUT, table.create([i, 9], now=0.0).lease_id, [i, 9], dst, [1, 2])
                    assert np.array_equal(dst.array[:, [1, 2]], server.buffer.array[:, [i, 9]])
                assert checked.num_posted_pulls == 0 and server.num_posted_reads == 5
            finally:
                checked.close()

    run(scenario())


@own_process
def test_a_posted_read_of_an_ended_lease_is_refused_and_the_next_pull_asks_first() -> None:
    """A READ posted before asking is only as good as the lease found live after it: an ended lease is refused
    (the connection closes), and the next pull runs the full exchange on a new connection."""
    from kv_transfer.errors import LeaseNotFound

    async def scenario() -> None:
        async with served(6) as (table, server, uri, client):
            dst = KVBuffer.allocate(LAYOUT, NUM_BLOCKS)
            await client.pull(uri, LAYOUT, table.create([1], now=0.0).lease_id, [1], dst, [1])
            with pytest.raises(KVTransferError, match="out of range"):  # beyond the server's blocks: no READ
                await client.pull(uri, LAYOUT, table.create([2], now=0.0).lease_id, [NUM_BLOCKS], dst, [2])
            await client.pull(uri, LAYOUT, table.create([3], now=0.0).lease_id, [3], dst, [3])
            ended = table.create([4, 5], now=0.0).lease_id
            table.release(ended)
            with pytest.raises(LeaseNotFound):
                await client.pull(uri, LAYOUT, ended, [4, 5], dst, [4, 5])
            assert client.pool.num_idle() == 0 and server.num_posted_reads == 0
            await client.pull(uri, LAYOUT, table.create([4, 5], now=0.0).lease_id, [4, 5], dst, [6, 7])
            assert np.array_equal(dst.array[:, [6, 7]], server.buffer.array[:, [4, 5]])
            assert server.num_accepted == 3 and client.num_posted_pulls == 0  # each new connection asked first

    run(scenario())


@own_process
def test_a_posted_reads_notification_taken_by_another_poll_still_ends_it(monkeypatch) -> None:
    """The notification of a posted READ may reach the server's agent, and be taken by a poll for other reads,
    before its N_READ_POSTED is read: the server keeps it, and the read still ends in DONE."""
    from kv_transfer import nixl_client

    async def scenario() -> None:
        async with served(7) as (table, server, uri, client):
            dst = KVBuffer.allocate(LAYOUT, NUM_BLOCKS)
            await client.pull(uri, LAYOUT, table.create([1], now=0.0).lease_id, [1], dst, [1])
            real_transfer = nixl_client.transfer

            async def other_reads_poll() -> None:  # progresses the server's agent, takes what notifications come
                while True:
                    server._poll_notifications()
                    await asyncio.sleep(0.001)

            async def notified_first(sock, views, **kwargs):  # the loop sends N_READ_POSTED once it is taken
                for _ in range(2000):  # 10 s at most: a busy machine is slow, not wrong
                    if server._early:
                        break
                    await asyncio.sleep(0.005)
                assert server._early, "the notification did not come first"
                return await real_transfer(sock, views, **kwargs)

            monkeypatch.setattr(client, "_send", lambda job, upto: None)  # nothing from the agent's thread
            monkeypatch.setattr(nixl_client, "transfer", notified_first)
            poller = asyncio.create_task(other_reads_poll())
            try:
                await client.pull(uri, LAYOUT, table.create([8, 9], now=0.0).lease_id, [8, 9], dst, [2, 3])
            finally:
                poller.cancel()
            assert np.array_equal(dst.array[:, [2, 3]], server.buffer.array[:, [8, 9]])
            assert server.num_posted_reads == 1 and not server._early

    run(scenario())


@own_process
def test_a_server_that_stages_or_authenticates_takes_no_posted_reads() -> None:
    """A staged server copies a lease's blocks in when asked, an authenticated one checks each request before
    any byte: neither may be read first. Their clients always ask first, and a posted read is refused."""
    from kv_transfer.nixl_wire import encode_posted
    from kv_transfer.wire import ERROR, HEADER, ReadRequest

    async def scenario() -> None:
        authenticated = dataclasses.replace(CONFIG, secret=b"s" * 32)
        for config, locate in ((authenticated, None), (CONFIG, lambda lease_id, ids: list(ids))):
            async with served(8, config, locate=locate) as (table, server, uri, client):
                dst = KVBuffer.allocate(LAYOUT, NUM_BLOCKS)
                for i in range(3):
                    await client.pull(uri, LAYOUT, table.create([i], now=0.0).lease_id, [i], dst, [i + 3])
                assert np.array_equal(dst.array[:, [3, 4, 5]], server.buffer.array[:, [0, 1, 2]])
                assert client.num_posted_pulls == 0 and server.num_accepted == 1
                host, port = uri.removeprefix("nixl://").rsplit(":", 1)
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(encode_posted(server.incarnation, b"t" * 16, ReadRequest("x", [1])))
                await writer.drain()
                _, _, kind, _, length = HEADER.unpack(await reader.readexactly(HEADER.size))
                assert kind == ERROR and b"takes no N_READ_POSTED" in await reader.readexactly(length)
                writer.close()

    run(scenario())


@own_process
def test_descriptors_name_the_servers_memory_and_refuse_malformed_frames() -> None:
    from kv_transfer.wire import Frame

    head = nixl.DESCS_HEAD.pack(b"i" * 8, 3, 1, b"t" * 16, 4, 2, 4096, 32, nixl.POSTED_READS)
    rows = np.array([[4096, 64], [8192, 64]], np.uint64).tobytes()
    descs = nixl.parse_descs("nixl://h:1", Frame(nixl.N_DESCS, 0, head + b"meta" + rows))
    assert (descs.incarnation, descs.device_id, nixl.MEM_KINDS[descs.memory_kind]) == (b"i" * 8, 3, "VRAM")
    assert descs.metadata == b"meta" and descs.rows.tolist() == [[4096, 64], [8192, 64]]
    for bad in (head + b"meta" + rows[:8], nixl.DESCS_HEAD.pack(b"i" * 8, 0, 7, b"t" * 16, 0, 0, 0, 0, 0), b"short"):
        with pytest.raises(KVTransferError, match="malformed N_DESCS"):
            nixl.parse_descs("nixl://h:1", Frame(nixl.N_DESCS, 0, bad))


@own_process
def test_auto_prefers_nixl_for_a_cuda_cache_only() -> None:
    assert parse_kinds("auto", device="cuda:0")[0] == "nixl" == AUTO_PREFERENCE["cuda"][0]
    assert "ucx" not in parse_kinds("auto", device="cuda:0")  # never two UCX libraries in one worker
    assert "nixl" not in parse_kinds("auto") and parse_kinds("nixl,tcp") == ("nixl", "tcp")
