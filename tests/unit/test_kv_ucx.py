"""The ``ucx://`` transport beyond the conformance suite (tests/unit/test_kv_transport.py runs that):
a server process that dies or stalls mid-pull, listener port reuse, checksums, staged vs direct landing.

A vanished peer is a real second process (multiprocessing, spawn) killed or stopped by PID.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import socket
import sys
import time

import numpy as np
import pytest

from kv_transfer import ucx, ucx_endpoint, ucx_plan, wire
from kv_transfer.errors import ChecksumMismatch, KVTransferError, LeaseNotFound
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.transport import TransportConfig, make_server, parse_uri, pull

pytestmark = pytest.mark.skipif(not ucx_endpoint.ucxx_available(), reason=ucx_endpoint.INSTALL_HINT)

LAYOUT = KVLayout(model_fingerprint=b"ucx", dtype="float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
# The "small" preset: 128 KiB per block; 2048 blocks = 256 MiB, long enough to stop a pull midway.
BIG = KVLayout(model_fingerprint=b"ucx-big", dtype="float32", block_size=16, num_layers=8, num_kv_heads=2, head_dim=64)
BIG_BLOCKS = 2048
CONFIG = TransportConfig(connect_timeout_s=2.0, io_timeout_s=2.0)
SENTINEL = 0xAB


def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def source(layout: KVLayout = LAYOUT, num_blocks: int = 40) -> KVBuffer:
    buffer = KVBuffer.allocate(layout, num_blocks)
    buffer.array[:] = np.random.default_rng(7).integers(0, 256, buffer.array.shape, dtype=np.uint8)
    return buffer


def destination(layout: KVLayout = LAYOUT, num_blocks: int = 40) -> KVBuffer:
    buffer = KVBuffer.allocate(layout, num_blocks)
    buffer.array[:] = SENTINEL
    return buffer


def assert_copied(src: KVBuffer, src_ids, dst: KVBuffer, dst_ids) -> None:
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert np.array_equal(dst.array[:, d], src.array[:, s]), f"src block {s} -> dst block {d}"
    untouched = sorted(set(range(dst.num_blocks)) - set(dst_ids))
    assert (dst.array[:, untouched] == SENTINEL).all(), "blocks outside the pull were written"


# --- a server in another process ------------------------------------------------------------------


def serve_big(conn, reading) -> None:
    """Child process: serve one lease over every block of a BIG buffer; set ``reading`` when a pull has
    passed its lease check (its KV bytes are about to flow), then serve until killed."""
    buffer = KVBuffer.allocate(BIG, BIG_BLOCKS)
    buffer.array[:] = 1
    table = LeaseTable(default_ttl_s=3600.0)
    lease = table.create(range(BIG_BLOCKS), now=time.monotonic())
    resolve = table.resolver(time.monotonic)

    def resolve_and_tell(lease_id: str):
        blocks = resolve(lease_id)
        reading.set()
        return blocks

    async def main() -> None:
        server = make_server("ucx", buffer=buffer, resolve=resolve_and_tell, config=TransportConfig())
        conn.send((await server.start("127.0.0.1", 0), lease.lease_id, os.getpid()))
        await asyncio.sleep(3600)

    asyncio.run(main())


@pytest.fixture
def server_process():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    reading = ctx.Event()
    proc = ctx.Process(target=serve_big, args=(child, reading), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "the server process did not start"
        uri, lease_id, pid = parent.recv()
        yield uri, lease_id, pid, reading
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.join(10)


@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_server_process_that_vanishes_mid_pull_raises_within_the_timeout(server_process, how: str) -> None:
    uri, lease_id, pid, reading = server_process
    config = TransportConfig(connect_timeout_s=2.0, io_timeout_s=1.0)
    dst = KVBuffer.allocate(BIG, BIG_BLOCKS)
    ids = list(range(BIG_BLOCKS))

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        pulling = asyncio.ensure_future(pull(uri, BIG, lease_id, ids, dst, ids, config=config))
        assert await loop.run_in_executor(None, reading.wait, 20.0), "the pull never reached the server"
        os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(KVTransferError):
            await pulling
        elapsed = time.monotonic() - start
        assert elapsed < config.io_timeout_s + 1.5, f"took {elapsed:.2f} s to notice"
        assert not (dst.array == 1).all(), "the pull completed before the server was stopped"
        if how == "stalled":  # the server wakes up: nothing may land in the destination after the error
            snapshot = dst.array.copy()
            os.kill(pid, signal.SIGCONT)
            await asyncio.sleep(1.0)
            assert np.array_equal(dst.array, snapshot), "bytes landed after the pull had failed"

    run(scenario())

    async def still_works() -> None:  # this process's UCX worker is unharmed
        src = source()
        table = LeaseTable()
        server = make_server("ucx", buffer=src, resolve=table.resolver(lambda: 0.0), config=CONFIG)
        uri2 = await server.start()
        try:
            dst2 = destination()
            await pull(uri2, LAYOUT, table.create([3, 4], 30.0, now=0.0).lease_id, [3, 4], dst2, [7, 9], config=CONFIG)
            assert_copied(src, [3, 4], dst2, [7, 9])
        finally:
            await server.stop()

    run(still_works())


def test_stalled_server_before_the_reply_times_out(server_process) -> None:
    uri, lease_id, pid, _ = server_process
    os.kill(pid, signal.SIGSTOP)
    config = TransportConfig(connect_timeout_s=1.0, io_timeout_s=1.0)
    dst = destination(BIG, 4)
    start = time.monotonic()
    with pytest.raises(KVTransferError):
        run(pull(uri, BIG, lease_id, [0, 1], dst, [0, 1], config=config))
    assert time.monotonic() - start < 3.5
    assert (dst.array == SENTINEL).all()


# --- in-process -----------------------------------------------------------------------------------


def test_listener_port_can_be_reused_right_after_stop() -> None:
    src = source()
    table = LeaseTable()
    resolve = table.resolver(lambda: 0.0)

    async def scenario() -> None:
        server = make_server("ucx", buffer=src, resolve=resolve, config=CONFIG)
        uri = await server.start("127.0.0.1", 0)
        port = int(uri.rsplit(":", 1)[1])
        for _ in range(3):
            dst = destination()
            await pull(uri, LAYOUT, table.create([1, 2], 30.0, now=0.0).lease_id, [1, 2], dst, [5, 6], config=CONFIG)
            assert_copied(src, [1, 2], dst, [5, 6])
            await server.stop()
            start = time.monotonic()
            assert await server.start("127.0.0.1", port) == uri
            assert time.monotonic() - start < CONFIG.connect_timeout_s + 0.5
        await server.stop()

    run(scenario())


def test_a_stopped_server_stops_listening_and_later_pulls_fail_cleanly() -> None:
    """ucxx keeps a listener listening while an endpoint it accepted lives, and a connection to such a
    listener after its Python side is gone crashed the process: stop() must leave nothing listening."""
    src = source()
    table = LeaseTable()

    async def scenario() -> None:
        server = make_server("ucx", buffer=src, resolve=table.resolver(lambda: 0.0), config=CONFIG)
        uri = await server.start()
        for _ in range(3):
            await pull(uri, LAYOUT, table.create([1], 30.0, now=0.0).lease_id, [1], destination(), [1], config=CONFIG)
        await server.stop()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(parse_uri(uri, "ucx"), timeout=1.0).close()
        for _ in range(3):
            with pytest.raises(KVTransferError):
                await pull(uri, LAYOUT, "lease", [1], destination(), [1], config=CONFIG)

    run(scenario())


def test_a_port_in_use_is_a_transport_error() -> None:
    async def scenario() -> None:
        config = TransportConfig(connect_timeout_s=0.3)
        first = make_server("ucx", buffer=source(), resolve=lambda _: [], config=config)
        uri = await first.start()
        try:
            second = make_server("ucx", buffer=source(), resolve=lambda _: [], config=config)
            with pytest.raises(KVTransferError, match="cannot listen"):
                await second.start("127.0.0.1", int(uri.rsplit(":", 1)[1]))
        finally:
            await first.stop()

    run(scenario())


@pytest.mark.parametrize("staging", [False, True, None])
def test_direct_and_staged_landing_copy_exact_bytes(staging) -> None:
    rng = np.random.default_rng(1)
    src = source()
    table = LeaseTable()

    async def scenario() -> None:
        server = make_server("ucx", buffer=src, resolve=table.resolver(lambda: 0.0), config=CONFIG)
        uri = await server.start()
        try:
            client = ucx.UcxClient(CONFIG, staging=staging)
            for src_ids, dst_ids in [
                (list(range(10, 30)), list(range(0, 20))),  # contiguous on both sides
                ([int(b) for b in rng.permutation(40)[:25]], [int(b) for b in rng.permutation(40)[:25]]),
                (list(range(0, 40)), [int(b) for b in rng.permutation(40)]),  # contiguous source, scattered dst
                ([0, 2, 4, 6, 8, 10, 13, 17], list(range(30, 38))),  # fragmented source, contiguous destination
            ]:
                dst = destination()
                lease = table.create(src_ids, 30.0, now=0.0).lease_id
                stats = await client.pull(uri, LAYOUT, lease, src_ids, dst, dst_ids)
                assert stats.num_bytes == len(src_ids) * LAYOUT.bytes_per_block
                assert_copied(src, src_ids, dst, dst_ids)
        finally:
            await server.stop()

    run(scenario())


def test_every_plan_lands_exact_bytes_at_full_block_size() -> None:
    """With 16 KiB per block per layer the planner takes every path: zero copy, server gathers, client
    stages, both copy (the conformance suite's tiny blocks always take the last)."""
    src = source(BIG, 96)
    table = LeaseTable()
    rng = np.random.default_rng(3)
    fragmented = sorted(int(b) for b in rng.permutation(96)[:48])
    scattered = [int(b) for b in rng.permutation(64)[:48]]
    cases = [  # (source ids, destination ids, plan)
        (list(range(10, 58)), list(range(0, 48)), ([48], False)),
        (fragmented, list(range(8, 56)), ([48], False)),
        (list(range(40, 88)), scattered, ([48], True)),
        (fragmented, scattered, ([48], True)),
    ]

    async def scenario() -> None:
        server = make_server("ucx", buffer=src, resolve=table.resolver(lambda: 0.0), config=CONFIG)
        uri = await server.start()
        try:
            for src_ids, dst_ids, plan in cases:
                assert ucx_plan.plan_pull(BIG, src_ids, dst_ids) == plan
                dst = destination(BIG, 64)
                lease = table.create(src_ids, 30.0, now=0.0).lease_id
                await pull(uri, BIG, lease, src_ids, dst, dst_ids, config=CONFIG)
                assert_copied(src, src_ids, dst, dst_ids)
        finally:
            await server.stop()

    run(scenario())


def test_plan_pull_prefers_few_large_messages() -> None:
    layout = BIG  # 16 KiB per block per layer
    rng = np.random.default_rng(0)
    scattered = [int(b) for b in rng.permutation(1024)[:256]]
    fragmented = sorted(scattered)
    assert ucx_plan.plan_pull(layout, list(range(256)), list(range(256))) == ([256], False)  # zero copies
    assert ucx_plan.plan_pull(layout, list(range(256)), scattered) == ([256], True)  # the client stages
    assert ucx_plan.plan_pull(layout, fragmented, list(range(256))) == ([256], False)  # the server gathers
    assert ucx_plan.plan_pull(layout, fragmented, scattered) == ([256], True)  # both copy once
    runs, staged = ucx_plan.plan_pull(layout, list(range(256)), scattered, staging=False)
    assert not staged and sum(runs) == 256 and len(runs) > 200  # forced: one message per block per layer
    runs, _ = ucx_plan.plan_pull(layout, list(range(2048)), list(range(2048)))  # long runs are split
    assert max(runs) * layout.bytes_per_block_per_layer <= ucx_plan.MAX_MESSAGE_BYTES and sum(runs) == 2048


def test_request_round_trips_and_runs_must_partition_it() -> None:
    with pytest.raises(KVTransferError, match="partition"):
        ucx_plan.check_runs([4, 5, 6], [2])
    ucx_plan.check_runs([4, 5, 9], [2, 1])
    assert ucx_plan.runs_consecutive([4, 5, 9], [2, 1]) and not ucx_plan.runs_consecutive([4, 5, 9], [1, 2])
    read = wire.ReadRequest("lease", (4, 5, 9), runs=(2, 1))
    payload = ucx_plan.encode_request(LAYOUT, wire.encode_read(read), wire.READ_CHECKSUM)
    assert ucx_plan.decode_request(payload) == (wire.READ_CHECKSUM, LAYOUT.to_json().encode(), read)
    with pytest.raises(KVTransferError, match="malformed"):
        ucx_plan.decode_request(payload[:-1])


@pytest.mark.parametrize("staging", [False, True])
def test_checksums_pass_and_catch_corruption(staging: bool) -> None:
    src = source()
    config = TransportConfig(connect_timeout_s=2.0, io_timeout_s=2.0, checksum=True)
    calls = []

    def corrupt_after_the_read(lease_id: str):
        calls.append(lease_id)
        if lease_id == "corrupt" and len(calls) % 2 == 0:  # the check after the last byte: the block changed
            src.array[1, 12, 5] ^= 0xFF
        return range(40)

    async def scenario() -> None:
        server = make_server("ucx", buffer=src, resolve=corrupt_after_the_read, config=config)
        uri = await server.start()
        try:
            client = ucx.UcxClient(config, staging=staging)
            dst = destination()
            await client.pull(uri, LAYOUT, "fine", [10, 11, 12, 13], dst, [3, 1, 30, 31])
            assert_copied(src, [10, 11, 12, 13], dst, [3, 1, 30, 31])
            with pytest.raises(ChecksumMismatch) as info:
                await client.pull(uri, LAYOUT, "corrupt", [10, 11, 12, 13], destination(), [3, 1, 30, 31])
            assert info.value.block_ids == (30,)  # the destination block the changed source block landed in
        finally:
            await server.stop()

    run(scenario())


def test_server_keeps_serving_after_silent_and_garbage_clients() -> None:
    src = source()
    table = LeaseTable()
    config = TransportConfig(connect_timeout_s=1.0, io_timeout_s=0.5)

    async def scenario() -> None:
        ucxx = ucx_endpoint.import_ucxx()
        server = make_server("ucx", buffer=src, resolve=table.resolver(lambda: 0.0), config=config)
        uri = await server.start()
        host, port = parse_uri(uri, "ucx")
        error_handling = ucx_endpoint.ENDPOINT_ERROR_HANDLING
        try:
            silent = await ucxx.create_endpoint(host, port, endpoint_error_handling=error_handling)
            garbage = []
            for message in (b"GET / HTTP/1.1\r\n", b"GET / HTTP/1"):  # too long for a header; bad magic
                ep = await ucxx.create_endpoint(host, port, endpoint_error_handling=error_handling)
                await ep.send(message, tag=ucx_endpoint.TAG_REQUEST)
                reply = bytearray(12)
                await asyncio.wait_for(ep.recv(reply, tag=ucx_endpoint.TAG_REPLY), 2.0)
                assert reply[:6] == wire.encode_frame(wire.ERROR)[:6]  # an ERROR frame
                garbage.append(ep)
            dst = destination()
            await pull(uri, LAYOUT, table.create([4, 5], 30.0, now=0.0).lease_id, [4, 5], dst, [0, 1], config=config)
            assert_copied(src, [4, 5], dst, [0, 1])
            ucx_endpoint.close_idle_endpoints()  # in case clients keep endpoints (ucx.REUSE_ENDPOINTS)
            await asyncio.sleep(2 * config.io_timeout_s + 0.5)  # the silent client: timed out, told, lingered, dropped
            assert len(server._connections) == 0
            for ep in (silent, *garbage):
                ep.abort()
            with pytest.raises(LeaseNotFound):
                await pull(uri, LAYOUT, "nope", [4], destination(), [0], config=config)
        finally:
            await server.stop()

    run(scenario())


def test_reused_endpoints_serve_many_pulls_and_survive_refusals_and_restarts() -> None:
    src = source()
    table = LeaseTable()
    resolve = table.resolver(lambda: 0.0)

    async def scenario() -> None:
        server = make_server("ucx", buffer=src, resolve=resolve, config=CONFIG)
        uri = await server.start()
        port = int(uri.rsplit(":", 1)[1])
        client = ucx.UcxClient(CONFIG, reuse_endpoints=True)

        async def one(src_ids, dst_ids) -> None:
            dst = destination()
            await client.pull(uri, LAYOUT, table.create(src_ids, 30.0, now=0.0).lease_id, src_ids, dst, dst_ids)
            assert_copied(src, src_ids, dst, dst_ids)

        try:
            for i in range(5):  # one after another: one connection
                await one([i, i + 1], [9, 3])
            assert len(server._connections) == 1
            await asyncio.gather(*(one([i], [i + 5]) for i in range(4)))  # concurrent: one endpoint each
            assert 1 < len(server._connections) <= 4
            with pytest.raises(LeaseNotFound):  # a refused pull drops its endpoint...
                await client.pull(uri, LAYOUT, "nope", [1], destination(), [1])
            await one([7, 8], [1, 2])  # ...and the next one works
            await server.stop()  # the server goes away under the pooled endpoints and comes back
            assert await server.start("127.0.0.1", port) == uri
            await one([10, 11, 12], [0, 2, 4])
            await server.stop()
            with pytest.raises(KVTransferError):
                await one([1], [1])
        finally:
            ucx_endpoint.close_idle_endpoints()
            await server.stop()

    run(scenario())


def test_a_client_reuses_its_endpoint_by_default() -> None:
    src, table = source(), LeaseTable()

    async def scenario() -> None:
        server = make_server("ucx", buffer=src, resolve=table.resolver(lambda: 0.0), config=CONFIG)
        uri = await server.start()
        client = ucx.UcxClient(CONFIG)
        try:
            for i in range(3):
                dst = destination()
                await client.pull(uri, LAYOUT, table.create([i, 9], 30.0, now=0.0).lease_id, [i, 9], dst, [4, 2])
                assert_copied(src, [i, 9], dst, [4, 2])
            assert server.num_accepted == 1  # one endpoint, kept and reused
        finally:
            ucx_endpoint.close_idle_endpoints()
            await server.stop()

    run(scenario())


def test_without_ucxx_the_transport_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ucxx", None)  # "import ucxx" raises ImportError
    assert not ucx_endpoint.ucxx_available()
    server = make_server("ucx", buffer=source(), resolve=lambda _: [])
    with pytest.raises(KVTransferError, match="pip install ucxx-cu12==0.52.0"):
        run(server.start())
    with pytest.raises(KVTransferError, match="pip install ucxx-cu12==0.52.0"):
        run(pull("ucx://127.0.0.1:1", LAYOUT, "x", [1], destination(), [1]))
