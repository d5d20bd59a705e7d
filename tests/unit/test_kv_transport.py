"""Transport conformance: every KV data-plane transport passes these (parametrized by kind).

Each scenario runs in its own event loop, bounded by ``asyncio.wait_for``, so a hang fails fast.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from kv_transfer import checksum, wire
from kv_transfer.errors import ChecksumMismatch, KVTransferError, LayoutMismatch, LeaseNotFound
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.transport import TransportConfig, check_read, connect, make_server, pull

LAYOUT = KVLayout(
    model_fingerprint=b"conformance", dtype="float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8
)
CONFIG = TransportConfig(connect_timeout_s=2.0, io_timeout_s=2.0)
SENTINEL = 0xAB
def _ucx_kind():
    from kv_transfer.ucx_endpoint import INSTALL_HINT, ucxx_available

    return pytest.param("ucx", marks=pytest.mark.skipif(not ucxx_available(), reason=INSTALL_HINT))


def _cma_kind():
    from kv_transfer.transport import kind_available

    why = kind_available("cma")
    return pytest.param("cma", marks=pytest.mark.skipif(why is not None, reason=why or ""))


def _nixl_kind():
    # NIXL's own UCX beside ucxx's, and NIXL agents left behind with dead peers, crash this process at random
    # later points: nixl's cases run in a process of their own (tests/unit/test_kv_nixl.py), with BATON_TEST_NIXL=1.
    from tests.unit.test_kv_nixl import nixl_skip_reason

    why = nixl_skip_reason()
    return pytest.param("nixl", marks=pytest.mark.skipif(why is not None, reason=why or ""))


KINDS = ("tcp", "local", "nccl", _ucx_kind(), _cma_kind(), _nixl_kind())


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

    def __init__(self, kind: str, src: KVBuffer | None = None, config: TransportConfig = CONFIG) -> None:
        self.kind, self.src, self.now, self.table = kind, src or source(), [0.0], LeaseTable()
        resolve = self.table.resolver(lambda: self.now[0])
        self.server = make_server(kind, buffer=self.src, resolve=resolve, config=config)
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


@pytest.mark.parametrize("kind", ["tcp", _cma_kind()])
def test_the_servers_on_read_hears_each_read_that_ended_in_done_and_no_other(kind: str) -> None:
    """``on_read`` (a holder that frees blocks once read: vLLM's Baton connector) hears a read that ended in DONE,
    with its lease and blocks, a read of no blocks too (how a reader that will not read says so); a refused read is
    not heard."""
    async def scenario() -> None:
        async with Prefill(kind) as p:
            heard: list[tuple[str, list[int]]] = []
            p.server.on_read = lambda lease_id, block_ids: heard.append((lease_id, block_ids))
            lease_id = p.lease([3, 4, 5])
            await p.pull(lease_id, [4, 5], destination(), [0, 1])
            with pytest.raises(KVTransferError):
                await p.pull(lease_id, [6], destination(), [0])
            released = p.lease([7])
            stats = await p.pull(released, [], destination(), [])  # a read of no blocks: a reader's release
            assert heard == [(lease_id, [4, 5]), (released, [])] and stats.num_bytes == 0

    run(scenario())


def test_a_read_may_take_any_of_its_leases_blocks_in_any_order_and_nothing_else() -> None:
    """The server's check: a slice of the lease in order (the whole lease; what a prefix hit leaves) is found
    by the fast path, any other subset by the set, in either case only blocks the lease and the buffer hold."""
    buffer, leased = KVBuffer.allocate(LAYOUT, 16), (5, 9, 2, 3, 12, 7)
    resolve = {"l": leased, "list": list(leased)}.get
    for ids in (leased, leased[3:], leased[1:4], (7, 5), (12,), [np.int64(2), 3], ()):
        check_read(buffer, resolve, "l", ids)
        check_read(buffer, resolve, "list", list(ids))
    for ids in ((5, 9, 4), (4,), (7, 5, 1), (3, 12, 7, 8)):
        with pytest.raises(KVTransferError, match="not in the lease"):
            check_read(buffer, resolve, "l", ids)
    with pytest.raises(KVTransferError, match="out of range"):
        check_read(buffer, {"l": (15, 16)}.get, "l", (15, 16))
    with pytest.raises(LeaseNotFound):
        check_read(buffer, resolve, "gone", (5,))


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
            header = await reader.readexactly(wire.HEADER.size)
            payload = await reader.readexactly(wire.HEADER.unpack(header)[4])
        block_ids = wire.decode_read(payload).block_ids
        num_bytes = len(block_ids) * LAYOUT.bytes_per_block
        writer.write(wire.encode_frame(wire.HELLO_OK, LAYOUT.to_json().encode()))
        writer.write(wire.encode_frame(wire.DATA, struct.pack("<Q", num_bytes)) + b"\x01" * (num_bytes // 2))
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
    huge = struct.pack("<4sBBHI", b"BTKV", 1, wire.HELLO, 0, 1 << 31)
    bad_read = wire.encode_frame(wire.HELLO, LAYOUT.to_json().encode()) + wire.encode_frame(wire.READ, b"\x05\x00ab")

    async def scenario() -> None:
        async with Prefill("tcp") as p:
            idle = socket.create_connection(("127.0.0.1", int(p.uri.rsplit(":", 1)[1])))  # says nothing
            for garbage in (b"GET / HTTP/1.1\r\n\r\n", huge, wire.encode_frame(wire.READ, b""), bad_read):
                reply = await asyncio.to_thread(raw_exchange, p.uri, garbage)
                assert wire.encode_frame(wire.ERROR)[:6] in reply  # an ERROR frame, then a clean close
            dst = destination()
            await p.pull(p.lease([4, 5]), [4, 5], dst, [0, 1])
            assert_copied(p, [4, 5], dst, [0, 1])
            idle.close()

    run(scenario())


# --- checksums (TransportConfig.checksum) ---------------------------------------------------------

CHECKSUM_CONFIG = dataclasses.replace(CONFIG, checksum=True)


@pytest.mark.parametrize("kind", KINDS)
def test_checksums_on_still_give_exact_bytes(kind: str) -> None:
    async def scenario() -> None:
        async with Prefill(kind) as p:
            src_ids, dst_ids = [3, 4, 5, 30, 12], [0, 1, 2, 39, 7]
            dst = destination()
            stats = await pull(p.uri, LAYOUT, p.lease(src_ids), src_ids, dst, dst_ids, config=CHECKSUM_CONFIG)
            assert_copied(p, src_ids, dst, dst_ids)
            assert stats.num_bytes == len(src_ids) * LAYOUT.bytes_per_block

    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_bytes_changed_after_checksumming_raise_checksum_mismatch(kind: str, monkeypatch) -> None:
    """A test-only hook on the serving side makes the bytes the server hashes differ from the bytes it
    sends: two source blocks are corrupted while they are hashed and restored at once, so whether a server
    hashes before or after sending, what lands differs from its checksums (and the source stays intact).
    Servers hash with ``checksum.block_checksums``; the patch reaches every module holding that function."""
    real_block_checksums = checksum.block_checksums
    corrupted_src = (12, 15)

    async def scenario() -> None:
        async with Prefill(kind) as p:

            def hash_corrupted(buffer: KVBuffer, block_ids: Sequence[int]) -> np.ndarray:
                if buffer is not p.src:
                    return real_block_checksums(buffer, block_ids)
                flip = (LAYOUT.num_layers - 1, list(corrupted_src), 5)  # [layer, blocks, byte]
                buffer.array[flip] ^= 0xFF
                try:
                    return real_block_checksums(buffer, block_ids)
                finally:
                    buffer.array[flip] ^= 0xFF

            for module in list(sys.modules.values()):  # every module that imported the function itself, too
                if module is checksum or getattr(module, "block_checksums", None) is real_block_checksums:
                    monkeypatch.setattr(module, "block_checksums", hash_corrupted)
            src_ids, dst_ids = list(range(10, 18)), list(range(20, 28))
            with pytest.raises(ChecksumMismatch) as info:
                await pull(p.uri, LAYOUT, p.lease(src_ids), src_ids, destination(), dst_ids, config=CHECKSUM_CONFIG)
            assert info.value.block_ids == (22, 25)  # the destination blocks the corrupted ones landed in
            dst = destination()  # checksums off: nothing is hashed, the (intact) bytes arrive
            await p.pull(p.lease(src_ids), src_ids, dst, dst_ids)
            assert_copied(p, src_ids, dst, dst_ids)

    run(scenario())


# --- peers that vanish mid-transfer: a real second process, killed by PID -------------------------

PROCESS_KINDS = tuple(k for k in KINDS if k != "local")  # local has no second process
ROOT = Path(__file__).resolve().parents[2]
BIG = KVLayout(model_fingerprint=b"big", dtype="float32", block_size=16, num_layers=8, num_kv_heads=2, head_dim=64)
BIG_BLOCKS = 2048  # 128 KiB a block: 256 MiB, long enough on loopback to be killed in the middle
PEER = """
import asyncio, sys
import numpy as np
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.transport import TransportConfig, make_server, pull

role, kind, layout, num_blocks = sys.argv[1], sys.argv[2], KVLayout.from_json(sys.argv[3]), int(sys.argv[4])
config = TransportConfig(connect_timeout_s=5.0, io_timeout_s=2.0)

def resolve(lease_id):
    print("reading", flush=True)
    return range(num_blocks)

async def main():
    if role == "serve":  # ones everywhere; serves any lease id
        buffer = KVBuffer(layout, np.ones(layout.bytes_per_block * num_blocks, np.uint8))
        server = make_server(kind, buffer=buffer, resolve=resolve, config=config)
        print(await server.start(), flush=True)
        await asyncio.sleep(120)
    else:
        ids = list(range(num_blocks))
        await pull(sys.argv[5], layout, sys.argv[6], ids, KVBuffer.allocate(layout, num_blocks), ids, config=config)
        print("pulled", flush=True)

asyncio.run(main())
"""


async def start_peer(role: str, kind: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", PEER, role, kind, BIG.to_json(), str(BIG_BLOCKS), *args,
        stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )


async def kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        os.kill(proc.pid, signal.SIGKILL)
    await proc.wait()


async def wait_until(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the transfer to start"
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("kind", PROCESS_KINDS)
def test_a_serving_process_killed_mid_pull_raises_within_the_timeout(kind: str) -> None:
    async def scenario() -> None:
        proc = await start_peer("serve", kind)
        try:
            uri = (await asyncio.wait_for(proc.stdout.readline(), 30.0)).decode().strip()
            dst, ids = KVBuffer.allocate(BIG, BIG_BLOCKS), list(range(BIG_BLOCKS))  # zeros; the source is ones
            pulling = asyncio.create_task(pull(uri, BIG, "lease", ids, dst, ids, config=CONFIG))
            await wait_until(lambda: dst.array[0, 0, 0] == 1 or pulling.done(), 30.0)  # the first bytes landed
            await kill(proc)
            killed_at = time.monotonic()
            with pytest.raises(KVTransferError):
                await pulling
            assert time.monotonic() - killed_at < CONFIG.io_timeout_s + 1.0
            # (cma reads in batches of cma.BATCH_BYTES, so the kill lands mid-read too: process_vm_readv ESRCH)
            assert not (dst.array[-1, -1] == 1).all(), "the pull had finished before the kill"
        finally:
            await kill(proc)

    run(scenario(), timeout_s=60.0)


# NIXL 1.5.1's bundled UCX crashes the *serving* process (SIGSEGV in uct_tcp_ep_pending_purge, from
# ucp_worker_discard_uct_ep while its worker progresses) when a reader over UCX's tcp lanes dies mid-read:
# about one run in three here. Upstream's bug, not worked around: skipped for nixl, with the reason.
NIXL_DEAD_READER = "NIXL 1.5.1's UCX segfaults the server when a tcp-connected reader dies mid-read (upstream bug)"
KILLED_PULLER_KINDS = tuple(
    pytest.param(*k.values, marks=pytest.mark.skip(reason=NIXL_DEAD_READER)) if getattr(k, "values", None) == ("nixl",)
    else k for k in PROCESS_KINDS)


@pytest.mark.parametrize("kind", KILLED_PULLER_KINDS)
def test_a_pulling_process_killed_mid_pull_leaves_the_server_serving(kind: str) -> None:
    async def scenario() -> None:
        num_bytes = BIG.bytes_per_block * BIG_BLOCKS
        src = KVBuffer(BIG, np.resize(np.arange(251, dtype=np.uint8), num_bytes))  # 251 is prime: blocks differ
        table, reads = LeaseTable(), asyncio.Event()

        def resolve(lease_id: str):
            reads.set()
            return table.get(lease_id, 0.0).block_ids

        server = make_server(kind, buffer=src, resolve=resolve, config=CONFIG)
        uri = await server.start()
        proc = await start_peer("pull", kind, uri, table.create(range(BIG_BLOCKS), now=0.0).lease_id)
        try:
            await asyncio.wait_for(reads.wait(), 30.0)
            await asyncio.sleep(0.02)  # the KV is flowing
            await kill(proc)
            dst, src_ids, dst_ids = KVBuffer.allocate(BIG, 8), [7, 8, 100, 2047], [0, 1, 2, 3]
            await pull(uri, BIG, table.create(src_ids, now=0.0).lease_id, src_ids, dst, dst_ids, config=CONFIG)
            assert np.array_equal(dst.array[:, dst_ids], src.array[:, src_ids])
        finally:
            await kill(proc)
            await server.stop()

    run(scenario(), timeout_s=60.0)


def test_tcp_checksums_asked_of_a_server_that_sends_none_raise() -> None:
    """A v1 server that predates READ_CHECKSUM ignores the flag and ends with an empty DONE."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):  # HELLO, READ
            header = await reader.readexactly(wire.HEADER.size)
            payload = await reader.readexactly(wire.HEADER.unpack(header)[4])
        num_bytes = len(wire.decode_read(payload).block_ids) * LAYOUT.bytes_per_block
        writer.write(wire.encode_frame(wire.HELLO_OK, LAYOUT.to_json().encode()))
        writer.write(wire.encode_frame(wire.DATA, struct.pack("<Q", num_bytes)) + b"\x01" * num_bytes)
        writer.write(wire.encode_frame(wire.DONE))
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        uri = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            with pytest.raises(KVTransferError, match="without checksum support"):
                await pull(uri, LAYOUT, "lease", [1, 2], destination(), [1, 2], config=CHECKSUM_CONFIG)
            await pull(uri, LAYOUT, "lease", [1, 2], destination(), [1, 2], config=CONFIG)  # not asked: fine
        finally:
            server.close()

    run(scenario())


# ---- choosing a transport per worker pair -------------------------------------------------------

def test_parse_kinds_and_auto_preference():
    from kv_transfer.transport import AUTO_PREFERENCE, kind_available, parse_kinds

    assert parse_kinds("tcp") == ("tcp",) and parse_kinds("nccl, tcp,nccl") == ("nccl", "tcp")
    auto = parse_kinds("auto")
    assert auto[0] == ("cma" if kind_available("cma") is None else "tcp") and set(auto) <= set(AUTO_PREFERENCE["cpu"])
    assert list(auto) == [k for k in AUTO_PREFERENCE["cpu"] if kind_available(k) is None]
    assert parse_kinds("auto", device="cuda:0")[-1] == "tcp"
    for bad, message in (("", "at least one"), ("local", "in-process only"), ("carrier-pigeon", "unknown")):
        with pytest.raises(ValueError, match=message):
            parse_kinds(bad)


def test_choose_uri_takes_the_pullers_first_kind_the_server_offers():
    from kv_transfer.transport import choose_uri

    offered = "tcp://10.0.0.1:7000 nccl://10.0.0.1:7001"
    assert choose_uri(offered, ("ucx", "nccl", "tcp")) == "nccl://10.0.0.1:7001"
    assert choose_uri(offered, ("tcp", "nccl")) == "tcp://10.0.0.1:7000"
    assert choose_uri("tcp://h:1", ("tcp",)) == "tcp://h:1"  # a single URI, as older workers register
    with pytest.raises(KVTransferError, match=r"peer serves \['nccl', 'tcp'\], this worker pulls with \['ucx'\]"):
        choose_uri(offered, ("ucx",))


# ---- authenticated reads (kv_transfer/auth.py) --------------------------------------------------

SECRET = b"0123456789abcdef-deployment-secret"
SERVED = [k for k in KINDS if k != "local"]  # local is in-process: no peer to authenticate


@pytest.mark.parametrize("kind", SERVED)
def test_a_peer_without_the_data_plane_secret_reads_nothing(kind: str) -> None:
    from kv_transfer.auth import Unauthenticated

    with_secret = dataclasses.replace(CONFIG, secret=SECRET)

    async def scenario() -> None:
        async with Prefill(kind, config=with_secret) as p:
            src_ids, dst_ids = [3, 4, 9], [0, 7, 8]
            lease = p.lease(src_ids)
            for client in (CONFIG, dataclasses.replace(CONFIG, secret=b"another-secret-of-enough-bytes")):
                dst = destination()
                with pytest.raises(Unauthenticated, match="unauthenticated"):
                    await pull(p.uri, LAYOUT, lease, src_ids, dst, dst_ids, config=client)
                assert_untouched(dst)
            dst = destination()  # the lease is intact: the right secret still reads it
            await pull(p.uri, LAYOUT, lease, src_ids, dst, dst_ids, config=with_secret)
            assert_copied(p, src_ids, dst, dst_ids)
            assert "secret" not in repr(with_secret)  # never printed with the config

    run(scenario())


def test_a_captured_authenticated_read_cannot_be_replayed() -> None:
    from kv_transfer.protocol import sign_read
    from kv_transfer.wire import DATA, ERR_AUTH, ERROR, HELLO, READ, ReadRequest, encode_frame, encode_read

    with_secret = dataclasses.replace(CONFIG, secret=SECRET)

    async def scenario() -> None:
        async with Prefill("tcp", config=with_secret) as p:
            lease = p.lease([1, 2])
            hello = LAYOUT.to_json().encode()
            read, flags = sign_read(with_secret, READ, hello, encode_read(ReadRequest(lease, [1, 2])))
            captured = encode_frame(HELLO, hello) + encode_frame(READ, read, flags)
            port = int(p.uri.rsplit(":", 1)[1])
            replies = []
            for _ in range(2):  # the genuine request, then the same bytes again
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(captured)
                await writer.drain()
                await reader.readexactly(wire.HEADER.size + len(hello))  # HELLO_OK
                replies.append(wire.HEADER.unpack(await reader.readexactly(wire.HEADER.size)))
                writer.close()
            assert replies[0][2] == DATA
            assert (replies[1][2], replies[1][3]) == (ERROR, ERR_AUTH)

    run(scenario())


def test_read_auth_rules() -> None:
    from kv_transfer.auth import ReadAuth, Unauthenticated, load_secret

    now = [1000.0]
    auth = ReadAuth(SECRET, window_s=30.0, clock=lambda: now[0])
    trailer = auth.sign(3, b"request")
    auth.verify(3, b"request", trailer)
    for kind, request, bad in ((3, b"request", trailer), (3, b"requesT", auth.sign(3, b"request")),
                               (4, b"request", auth.sign(3, b"request")), (3, b"request", b"short")):
        with pytest.raises(Unauthenticated):  # replay, altered request, other frame kind, garbage
            auth.verify(kind, request, bad)
    stale = auth.sign(3, b"request")
    now[0] += 31.0
    with pytest.raises(Unauthenticated):
        auth.verify(3, b"request", stale)
    assert load_secret(None, {}) is None
    assert load_secret(None, {"BATON_KV_SECRET": " " + SECRET.decode() + "\n"}) == SECRET
    with pytest.raises(ValueError, match="at least 16 bytes"):
        load_secret(None, {"BATON_KV_SECRET": "short"})


def test_choose_uri_skips_a_same_host_transport_of_another_host():
    from kv_transfer.cma_memory import boot_id
    from kv_transfer.transport import choose_uri

    here, elsewhere = boot_id().hex(), "0" * 32
    offered = f"cma://10.0.0.1:7002?boot={elsewhere} tcp://10.0.0.1:7000"
    assert choose_uri(offered, ("cma", "tcp")) == "tcp://10.0.0.1:7000"  # another host: cma is skipped
    local = f"cma://127.0.0.1:7002?boot={here} tcp://127.0.0.1:7000"
    assert choose_uri(local, ("cma", "tcp")) == f"cma://127.0.0.1:7002?boot={here}"


# ---- kept-alive connections (tcp, cma, nixl: kv_transfer/conn_pool.py) ---------------------------

POOLED_KINDS = ("tcp", _cma_kind(), _nixl_kind())
STREAMED_POOLED_KINDS = ("tcp", _cma_kind())  # nixl:// serves a lease only once every layer is written


def pooled_client(uri: str, config: TransportConfig = CONFIG, **pool_options):
    from kv_transfer.conn_pool import ConnectionPool

    return type(connect(uri, config))(config, pool=ConnectionPool(**pool_options))


@pytest.mark.parametrize("secret", [None, SECRET], ids=["open", "authenticated"])
@pytest.mark.parametrize("kind", POOLED_KINDS)
def test_sequential_pulls_reuse_one_connection(kind: str, secret: bytes | None) -> None:
    config = dataclasses.replace(CONFIG, secret=secret)

    async def scenario() -> None:
        async with Prefill(kind, config=config) as p:
            client = pooled_client(p.uri, config)
            for i in range(12):
                src_ids, dst_ids = [i, 39 - i, 20], [2 * i, 2 * i + 1, 35]
                dst = destination()
                await client.pull(p.uri, LAYOUT, p.lease(src_ids), src_ids, dst, dst_ids)
                assert_copied(p, src_ids, dst, dst_ids)
            with pytest.raises(LeaseNotFound):  # a refusal ends that connection ...
                await client.pull(p.uri, LAYOUT, "0" * 32, [1], destination(), [1])
            assert client.pool.num_idle() == 0
            dst = destination()  # ... and the next pull opens another
            await client.pull(p.uri, LAYOUT, p.lease([5]), [5], dst, [6])
            assert_copied(p, [5], dst, [6])
            assert p.server.num_accepted == 2 and client.pool.num_idle(p.uri) == 1
            client.close()
            assert client.pool.num_idle() == 0
            await wait_until(lambda: not p.server._connections, 2.0)  # the server saw it close

    run(scenario())


@pytest.mark.parametrize("kind", POOLED_KINDS)
def test_a_server_restarted_between_pulls_is_reconnected(kind: str) -> None:
    async def scenario() -> None:
        src, table = source(), LeaseTable()
        first = make_server(kind, buffer=src, resolve=table.resolver(lambda: 0.0), config=CONFIG)
        uri = await first.start()
        client = pooled_client(uri)
        dst = destination()
        await client.pull(uri, LAYOUT, table.create([1, 2], now=0.0).lease_id, [1, 2], dst, [1, 2])
        await first.stop()  # the client's pooled connection is now stale
        port = int(uri.split("?")[0].rsplit(":", 1)[1])
        second = make_server(kind, buffer=src, resolve=table.resolver(lambda: 0.0), config=CONFIG)
        assert await second.start("127.0.0.1", port) == uri
        try:
            dst = destination()
            await client.pull(uri, LAYOUT, table.create([3, 9], now=0.0).lease_id, [3, 9], dst, [0, 4])
            assert np.array_equal(dst.array[:, [0, 4]], src.array[:, [3, 9]])
            assert second.num_accepted == 1
        finally:
            client.close()
            await second.stop()

    run(scenario())


@pytest.mark.parametrize("kind", POOLED_KINDS)
def test_idle_connections_expire_on_both_sides(kind: str) -> None:
    now = [0.0]

    async def scenario() -> None:
        async with Prefill(kind) as p:
            client = pooled_client(p.uri, idle_timeout_s=30.0, clock=lambda: now[0])
            for step_s in (0.0, 31.0):  # the client drops a connection idle for longer than its timeout
                now[0] += step_s
                await client.pull(p.uri, LAYOUT, p.lease([1]), [1], destination(), [1])
            assert p.server.num_accepted == 2
            p.server.idle_timeout_s = 0.05  # the server closes one idle for longer than its own
            await client.pull(p.uri, LAYOUT, p.lease([1]), [1], destination(), [1])  # (still reuses the 2nd)
            await wait_until(lambda: not p.server._connections, 2.0)
            dst = destination()
            await client.pull(p.uri, LAYOUT, p.lease([7]), [7], dst, [7])
            assert_copied(p, [7], dst, [7])
            assert p.server.num_accepted == 3
            client.close()

    run(scenario())


@pytest.mark.parametrize("kind", POOLED_KINDS)
def test_concurrent_pulls_use_separate_connections_and_keep_a_bounded_few(kind: str) -> None:
    async def scenario() -> None:
        async with Prefill(kind) as p:
            client = pooled_client(p.uri, max_idle_per_peer=4)
            for rounds, accepted in ((1, 8), (2, 12)):  # then 4 idle ones are reused, 4 more opened
                dst = destination()
                jobs = [([(7 * i + j) % 40 for j in range(5)], list(range(5 * i, 5 * i + 5))[::-1]) for i in range(8)]
                await asyncio.gather(*(client.pull(p.uri, LAYOUT, p.lease(s), s, dst, d) for s, d in jobs))
                assert_copied(p, [b for s, _ in jobs for b in s], dst, [b for _, d in jobs for b in d])
                assert (p.server.num_accepted, client.pool.num_idle()) == (accepted, 4), rounds
            client.close()

    run(scenario())


@pytest.mark.parametrize("kind", POOLED_KINDS)
def test_a_pull_cancelled_while_awaiting_its_answer_closes_its_connection(kind: str) -> None:
    pulling: list[asyncio.Task] = []

    async def scenario() -> None:
        src, table = source(), LeaseTable()
        resolver = table.resolver(lambda: 0.0)

        def resolve(lease_id: str):
            if pulling and not pulling[0].done():
                pulling[0].cancel()  # the server is between the request and its answer
            return resolver(lease_id)

        server = make_server(kind, buffer=src, resolve=resolve, config=CONFIG)
        uri = await server.start()
        client = pooled_client(uri)
        try:
            ids = list(range(10))
            pulling.append(asyncio.create_task(
                client.pull(uri, LAYOUT, table.create(ids, now=0.0).lease_id, ids, destination(), ids)))
            with pytest.raises(asyncio.CancelledError):
                await pulling[0]
            assert client.pool.num_idle() == 0  # the answer is still on its way: never pooled
            dst = destination()
            await client.pull(uri, LAYOUT, table.create([4, 5], now=0.0).lease_id, [4, 5], dst, [0, 1])
            assert np.array_equal(dst.array[:, [0, 1]], src.array[:, [4, 5]])
            assert server.num_accepted == 2
        finally:
            client.close()
            await server.stop()

    run(scenario())


@pytest.mark.parametrize("kind", STREAMED_POOLED_KINDS)
@pytest.mark.parametrize("how", ["cancelled", "timed out"])
def test_a_streamed_pull_stopped_mid_read_closes_its_connection(kind: str, how: str) -> None:
    """A streamed read delivers layer 0 and stalls: the pull is cancelled (or times out) with part of its
    answer read; its connection must not be reused, or the next pull would read the rest of that answer."""
    from kv_transfer.progress import LayerProgress

    progress: dict[str, LayerProgress] = {}
    client_config = dataclasses.replace(CONFIG, io_timeout_s=0.3)

    async def scenario() -> None:
        src, table = source(), LeaseTable()
        server = make_server(kind, buffer=src, resolve=table.resolver(lambda: 0.0), config=CONFIG,
                             progress=progress.get)
        uri = await server.start()
        client = pooled_client(uri, client_config)
        try:
            stalled = table.create([1, 2], now=0.0).lease_id
            progress[stalled] = LayerProgress(LAYOUT.num_layers)
            progress[stalled].complete(0)
            dst = destination()
            task = asyncio.create_task(client.pull(uri, LAYOUT, stalled, [1, 2], dst, [1, 2]))
            await wait_until(lambda: np.array_equal(dst.array[0, [1, 2]], src.array[0, [1, 2]]), 5.0)
            if how == "cancelled":
                task.cancel()
            with pytest.raises(asyncio.CancelledError if how == "cancelled" else KVTransferError):
                await task
            assert client.pool.num_idle() == 0
            dst = destination()
            await client.pull(uri, LAYOUT, table.create([6, 7], now=0.0).lease_id, [6, 7], dst, [1, 2])
            assert np.array_equal(dst.array[:, [1, 2]], src.array[:, [6, 7]])
            assert server.num_accepted == 2
        finally:
            client.close()
            await server.stop()

    run(scenario())


async def keepalive_fake_server(second: str) -> tuple[asyncio.AbstractServer, str, list[int]]:
    """A tcp server that answers a connection's first exchange (ones as the KV bytes) and, on its second,
    reads the request and closes (``second="silent"``) or answers HELLO_OK and closes (``"partial"``)."""
    accepted = [0]

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, whole: bool) -> None:
        for _ in range(2):  # HELLO, READ
            header = await reader.readexactly(wire.HEADER.size)
            payload = await reader.readexactly(wire.HEADER.unpack(header)[4])
        if whole or second == "partial":
            writer.write(wire.encode_frame(wire.HELLO_OK, LAYOUT.to_json().encode()))
        if whole:
            num_bytes = len(wire.decode_read(payload).block_ids) * LAYOUT.bytes_per_block
            writer.write(wire.encode_frame(wire.DATA, struct.pack("<Q", num_bytes)) + b"\x01" * num_bytes)
            writer.write(wire.encode_frame(wire.DONE))
        await writer.drain()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        try:
            await answer(reader, writer, whole=True)
            await answer(reader, writer, whole=False)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}", accepted


@pytest.mark.parametrize("second", ["silent", "partial"])
def test_a_pooled_connection_is_retried_once_only_when_nothing_was_answered(second: str) -> None:
    async def scenario() -> None:
        server, uri, accepted = await keepalive_fake_server(second)
        client = pooled_client(uri)
        try:
            await client.pull(uri, LAYOUT, "lease", [1, 2], destination(), [1, 2])
            dst = destination()
            if second == "silent":  # closed before a byte of the answer: retried on a new connection
                await client.pull(uri, LAYOUT, "lease", [3], dst, [3])
                assert (dst.array[:, 3] == 1).all() and accepted[0] == 2
            else:  # part of an answer came: the pull fails, never read twice
                with pytest.raises(KVTransferError, match="closed the connection"):
                    await client.pull(uri, LAYOUT, "lease", [3], dst, [3])
                assert accepted[0] == 1
            assert client.pool.num_idle() == (1 if second == "silent" else 0)
        finally:
            client.close()
            server.close()

    run(scenario())


def test_each_read_on_a_kept_alive_connection_is_authenticated() -> None:
    """The same signed request twice on one connection: served, then refused as a replay (and closed)."""
    from kv_transfer.protocol import sign_read
    from kv_transfer.wire import (
        DATA, DONE, ERR_AUTH, ERROR, HELLO, HELLO_OK, READ, ReadRequest, encode_frame, encode_read,
    )

    with_secret = dataclasses.replace(CONFIG, secret=SECRET)

    async def frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
        _, _, kind, code, length = wire.HEADER.unpack(await reader.readexactly(wire.HEADER.size))
        return kind, code, await reader.readexactly(length)

    async def scenario() -> None:
        async with Prefill("tcp", config=with_secret) as p:
            hello = LAYOUT.to_json().encode()
            read, flags = sign_read(with_secret, READ, hello, encode_read(ReadRequest(p.lease([1, 2]), [1, 2])))
            reader, writer = await asyncio.open_connection("127.0.0.1", int(p.uri.rsplit(":", 1)[1]))
            writer.write(encode_frame(HELLO, hello) + encode_frame(READ, read, flags))
            assert (await frame(reader))[0] == HELLO_OK
            assert (await frame(reader))[0] == DATA
            await reader.readexactly(2 * LAYOUT.bytes_per_block)
            assert (await frame(reader))[0] == DONE
            writer.write(encode_frame(HELLO, hello) + encode_frame(READ, read, flags))  # the same bytes again
            assert (await frame(reader))[0] == HELLO_OK
            assert (await frame(reader))[:2] == (ERROR, ERR_AUTH)
            assert await reader.read() == b""  # closed after the ERROR
            writer.close()
            assert p.server.num_accepted == 1

    run(scenario())
