"""Transport conformance: every KV data-plane transport passes these (parametrized by kind).

Each scenario runs in its own event loop, bounded by ``asyncio.wait_for``, so a hang fails fast.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import struct
import time
from collections.abc import Sequence

import numpy as np
import pytest

from kv_transfer import tcp
from kv_transfer.errors import KVTransferError, LayoutMismatch, LeaseNotFound
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.transport import TransportConfig, connect, make_server, pull

LAYOUT = KVLayout(
    model_fingerprint=b"conformance", dtype="float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8
)
CONFIG = TransportConfig(connect_timeout_s=2.0, io_timeout_s=2.0)
SENTINEL = 0xAB
KINDS = ("tcp", "local")


def run(coro, timeout_s: float = 15.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def source(num_blocks: int = 40) -> KVBuffer:
    buffer = KVBuffer.allocate(LAYOUT, num_blocks)
    buffer.array[:] = np.random.default_rng(7).integers(0, 256, buffer.array.shape, dtype=np.uint8)
    return buffer


def destination(layout: KVLayout = LAYOUT, num_blocks: int = 40) -> KVBuffer:
    buffer = KVBuffer.allocate(layout, num_blocks)
    buffer.array[:] = SENTINEL
    return buffer


class Prefill:
    """A serving side: a source buffer, a lease table on a fake clock, and a started server."""

    def __init__(self, kind: str, src: KVBuffer | None = None) -> None:
        self.kind, self.src, self.now, self.table = kind, src or source(), [0.0], LeaseTable()
        resolve = self.table.resolver(lambda: self.now[0])
        self.server = make_server(kind, buffer=self.src, resolve=resolve, config=CONFIG)
        self.uri = ""

    async def __aenter__(self) -> Prefill:
        self.uri = await self.server.start("127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop()

    def lease(self, block_ids: Sequence[int], ttl_s: float = 30.0) -> str:
        return self.table.create(block_ids, ttl_s, now=self.now[0]).lease_id

    async def pull(self, lease_id: str, src_ids: Sequence[int], dst: KVBuffer, dst_ids: Sequence[int]):
        return await pull(self.uri, dst.layout, lease_id, src_ids, dst, dst_ids, config=CONFIG)


def assert_copied(p: Prefill, src_ids: Sequence[int], dst: KVBuffer, dst_ids: Sequence[int]) -> None:
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert np.array_equal(dst.array[:, d], p.src.array[:, s]), f"src block {s} -> dst block {d}"
    untouched = sorted(set(range(dst.num_blocks)) - set(dst_ids))
    assert (dst.array[:, untouched] == SENTINEL).all(), "blocks outside the pull were written"


def assert_untouched(dst: KVBuffer) -> None:
    assert (dst.array == SENTINEL).all(), "a refused pull wrote into the destination"


@pytest.mark.parametrize("kind", KINDS)
def test_exact_bytes_for_random_block_sets(kind: str) -> None:
    rng = np.random.default_rng(0)

    async def scenario() -> None:
        async with Prefill(kind) as p:
            for size in (1, 5, 17, 40):
                src_ids = [int(b) for b in rng.permutation(40)[:size]]
                dst_ids = [int(b) for b in rng.permutation(40)[:size]]
                dst = destination()
                stats = await p.pull(p.lease(src_ids), src_ids, dst, dst_ids)
                assert_copied(p, src_ids, dst, dst_ids)
                assert (stats.num_blocks, stats.num_bytes) == (size, size * LAYOUT.bytes_per_block)
                assert stats.seconds > 0 and stats.gbps > 0

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_partial_and_out_of_order_block_lists(kind: str) -> None:
    async def scenario() -> None:
        async with Prefill(kind) as p:
            lease_id = p.lease(range(10, 20))
            dst = destination()
            await p.pull(lease_id, [17, 16, 11], dst, [3, 2, 30])  # a subset, reversed runs
            assert_copied(p, [17, 16, 11], dst, [3, 2, 30])
            await p.pull(lease_id, [12, 13, 14], dst, [5, 6, 7])  # the same lease, read again
            assert_copied(p, [17, 16, 11, 12, 13, 14], dst, [3, 2, 30, 5, 6, 7])

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_eight_concurrent_pulls(kind: str) -> None:
    async def scenario() -> None:
        async with Prefill(kind) as p:
            dst = destination(num_blocks=40)
            jobs = [([(5 * i + j) % 40 for j in range(5)], list(range(5 * i, 5 * i + 5))[::-1]) for i in range(8)]
            leases = [p.lease(src_ids) for src_ids, _ in jobs]
            await asyncio.gather(*(p.pull(lease, s, dst, d) for lease, (s, d) in zip(leases, jobs)))
            assert_copied(p, [b for s, _ in jobs for b in s], dst, [b for _, d in jobs for b in d])

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_unknown_or_expired_lease_is_refused_and_nothing_is_written(kind: str) -> None:
    async def scenario() -> None:
        async with Prefill(kind) as p:
            dst = destination()
            with pytest.raises(LeaseNotFound, match="unknown"):
                await p.pull("0" * 32, [1], dst, [1])
            lease_id = p.lease([1, 2], ttl_s=5.0)
            p.now[0] = 5.0
            with pytest.raises(KVTransferError, match="expired"):
                await p.pull(lease_id, [1, 2], dst, [1, 2])
            assert_untouched(dst)

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_outside_the_lease_or_range_are_refused(kind: str) -> None:
    async def scenario() -> None:
        async with Prefill(kind) as p:
            dst = destination()
            with pytest.raises(KVTransferError, match="not in the lease"):
                await p.pull(p.lease([1, 2]), [1, 3], dst, [1, 3])
            with pytest.raises(KVTransferError, match="out of range"):  # a lease naming a block the server lacks
                await p.pull(p.lease([1, 99]), [99], dst, [0])
            with pytest.raises(KVTransferError, match="out of range"):  # refused before connecting
                await p.pull(p.lease([1]), [1], dst, [40])
            with pytest.raises(KVTransferError, match="repeat"):
                await p.pull(p.lease([1, 2]), [1, 2], dst, [4, 4])
            with pytest.raises(KVTransferError, match="destination blocks"):
                await p.pull(p.lease([1, 2]), [1, 2], dst, [4])
            assert_untouched(dst)

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("field, value", [("model_fingerprint", b"another model"), ("num_kv_heads", 4)])
def test_layout_mismatch_is_refused_before_any_byte_is_written(kind: str, field: str, value) -> None:
    async def scenario() -> None:
        async with Prefill(kind) as p:
            dst = destination(dataclasses.replace(LAYOUT, **{field: value}), num_blocks=10)
            with pytest.raises(LayoutMismatch, match=field) as info:
                await p.pull(p.lease([1, 2]), [1, 2], dst, [1, 2])
            assert field in info.value.fields
            assert_untouched(dst)

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_pull_fails_when_the_lease_ends_during_the_read(kind: str) -> None:
    calls = []

    def resolve_once(lease_id: str):  # live for the check before the read, gone for the one after
        calls.append(lease_id)
        if len(calls) > 1:
            raise LeaseNotFound("transfer lease released")
        return [1, 2]

    async def scenario() -> None:
        src = source()
        server = make_server(kind, buffer=src, resolve=resolve_once, config=CONFIG)
        uri = await server.start()
        try:
            with pytest.raises(LeaseNotFound, match="released"):
                await pull(uri, LAYOUT, "lease", [1, 2], destination(), [1, 2], config=CONFIG)
        finally:
            await server.stop()

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_stopped_server_and_bad_uris_raise(kind: str) -> None:
    async def scenario() -> None:
        async with Prefill(kind) as p:
            lease_id, uri = p.lease([1]), p.uri
        with pytest.raises(KVTransferError):
            await pull(uri, LAYOUT, lease_id, [1], destination(), [1], config=CONFIG)
        for bad in ("udp://127.0.0.1:1", "tcp://127.0.0.1", "tcp://:80", "local://nobody-serves-this"):
            with pytest.raises(KVTransferError):
                await connect(bad, CONFIG).pull(bad, LAYOUT, lease_id, [1], destination(), [1])

    run(scenario())


# --- tcp only: misbehaving peers ------------------------------------------------------------------


async def fake_server(behaviour: str) -> tuple[asyncio.AbstractServer, str, list[asyncio.StreamWriter]]:
    """Answers the handshake correctly, announces the data, sends half of it, then closes or stalls."""
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        for _ in range(2):  # HELLO, READ
            header = await reader.readexactly(tcp.HEADER.size)
            payload = await reader.readexactly(tcp.HEADER.unpack(header)[4])
        _, block_ids = tcp.decode_read(payload)
        num_bytes = len(block_ids) * LAYOUT.bytes_per_block
        writer.write(tcp.encode_frame(tcp.HELLO_OK, LAYOUT.to_json().encode()))
        writer.write(tcp.encode_frame(tcp.DATA, struct.pack("<Q", num_bytes)) + b"\x01" * (num_bytes // 2))
        await writer.drain()
        if behaviour == "close":
            writer.close()
        else:
            await asyncio.sleep(30)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}", writers


@pytest.mark.parametrize("behaviour", ["close", "stall"])
def test_tcp_peer_that_vanishes_mid_transfer_raises_within_the_timeout(behaviour: str) -> None:
    config = TransportConfig(connect_timeout_s=1.0, io_timeout_s=0.3)

    async def scenario() -> None:
        server, uri, writers = await fake_server(behaviour)
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="closed the connection" if behaviour == "close" else "silent"):
            await pull(uri, LAYOUT, "lease", list(range(8)), destination(), list(range(8)), config=config)
        assert time.monotonic() - start < 2.0
        server.close()
        for writer in writers:
            writer.close()
        await asyncio.sleep(0.01)

    run(scenario())


def raw_exchange(uri: str, data: bytes) -> bytes:
    """Send ``data`` from a plain blocking socket; return what the server answers before closing."""
    host, port = uri.removeprefix("tcp://").split(":")
    with socket.create_connection((host, int(port)), timeout=5.0) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_tcp_server_keeps_serving_after_bad_clients() -> None:
    huge = struct.pack("<4sBBHI", b"BTKV", 1, tcp.HELLO, 0, 1 << 31)
    bad_read = tcp.encode_frame(tcp.HELLO, LAYOUT.to_json().encode()) + tcp.encode_frame(tcp.READ, b"\x05\x00ab")

    async def scenario() -> None:
        async with Prefill("tcp") as p:
            idle = socket.create_connection(("127.0.0.1", int(p.uri.rsplit(":", 1)[1])))  # says nothing
            for garbage in (b"GET / HTTP/1.1\r\n\r\n", huge, tcp.encode_frame(tcp.READ, b""), bad_read):
                reply = await asyncio.to_thread(raw_exchange, p.uri, garbage)
                assert tcp.encode_frame(tcp.ERROR)[:6] in reply  # an ERROR frame, then a clean close
            dst = destination()
            await p.pull(p.lease([4, 5]), [4, 5], dst, [0, 1])
            assert_copied(p, [4, 5], dst, [0, 1])
            idle.close()

    run(scenario())
