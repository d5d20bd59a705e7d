"""cma:// specifics (the conformance suite, tests/unit/test_kv_transport.py, covers the contract):
a server in another real process, servers that are not where they say, partial process_vm_readv reads."""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import errno
import multiprocessing
import os
import subprocess
import sys

import numpy as np
import pytest

from kv_transfer import cma, cma_memory, rows, wire
from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.transport import TransportConfig, kind_available, make_server, pull

pytestmark = pytest.mark.skipif(kind_available("cma") is not None, reason=kind_available("cma") or "")

LAYOUT = KVLayout(model_fingerprint=b"cma", dtype="float16", block_size=8, num_layers=4, num_kv_heads=2, head_dim=16)
NUM_BLOCKS = 64
CONFIG = TransportConfig(connect_timeout_s=2.0, io_timeout_s=2.0)
SENTINEL = 0xAB


def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def source_bytes(layout: KVLayout = LAYOUT, num_blocks: int = NUM_BLOCKS) -> np.ndarray:
    return np.random.default_rng(11).integers(0, 256, layout.bytes_per_block * num_blocks, dtype=np.uint8)


def destination(layout: KVLayout = LAYOUT, num_blocks: int = NUM_BLOCKS) -> KVBuffer:
    buffer = KVBuffer.allocate(layout, num_blocks)
    buffer.array[:] = SENTINEL
    return buffer


def serve_in_child(layout_json: str, num_blocks: int, conn, stop) -> None:
    """A cma:// server in a spawned process: seeded random blocks, any lease id reads every block."""

    async def main() -> None:
        layout = KVLayout.from_json(layout_json)
        buffer = KVBuffer(layout, source_bytes(layout, num_blocks))
        server = make_server("cma", buffer=buffer, resolve=lambda lease: range(num_blocks), config=CONFIG)
        conn.send((await server.start(), os.getpid()))
        while not stop.is_set():
            await asyncio.sleep(0.01)
        await server.stop()

    asyncio.run(main())


def test_a_server_in_another_process_gives_exact_bytes() -> None:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    stop = ctx.Event()
    proc = ctx.Process(target=serve_in_child, args=(LAYOUT.to_json(), NUM_BLOCKS, child, stop), daemon=True)
    proc.start()
    try:
        assert parent.poll(60.0), "the serving process did not start"
        uri, pid = parent.recv()
        assert uri.startswith("cma://") and pid != os.getpid()
        expected = KVBuffer(LAYOUT, source_bytes())
        rng = np.random.default_rng(3)

        async def scenario() -> None:
            for size in (1, 7, 30, NUM_BLOCKS):
                src_ids = [int(b) for b in rng.permutation(NUM_BLOCKS)[:size]]
                dst_ids = [int(b) for b in rng.permutation(NUM_BLOCKS)[:size]]
                dst = destination()
                stats = await pull(uri, LAYOUT, "any", src_ids, dst, dst_ids, config=CONFIG)
                assert stats.num_bytes == size * LAYOUT.bytes_per_block
                for s, d in zip(src_ids, dst_ids):
                    assert np.array_equal(dst.array[:, d], expected.array[:, s])
                untouched = sorted(set(range(NUM_BLOCKS)) - set(dst_ids))
                assert (dst.array[:, untouched] == SENTINEL).all()
            dst = destination()  # with checksums, across processes
            ids = list(range(NUM_BLOCKS))
            await pull(uri, LAYOUT, "any", ids, dst, ids[::-1], config=dataclasses.replace(CONFIG, checksum=True))
            assert np.array_equal(dst.array[:, ::-1], expected.array)

        run(scenario())
    finally:
        stop.set()
        proc.join(10.0)
        if proc.is_alive():
            os.kill(proc.pid, 9)
            proc.join()


class Served:
    """An in-process cma server over seeded blocks, one lease over all of them."""

    def __init__(self, config: TransportConfig = CONFIG) -> None:
        self.src = KVBuffer(LAYOUT, source_bytes())
        self.table = LeaseTable()
        self.server = make_server("cma", buffer=self.src, resolve=self.table.resolver(lambda: 0.0), config=config)
        self.uri = ""

    async def __aenter__(self) -> Served:
        self.uri = await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop()

    async def pull(self, src_ids, dst, dst_ids, config: TransportConfig = CONFIG):
        lease = self.table.create(range(NUM_BLOCKS), now=0.0).lease_id
        return await pull(self.uri, LAYOUT, lease, src_ids, dst, dst_ids, config=config)


@pytest.mark.parametrize("field, value, message", [
    ("boot_id", b"\x01" * 16, "runs on another host"),
    ("pid_namespace", 1, "another pid namespace"),
])
def test_a_server_on_another_host_or_namespace_is_refused_before_any_byte(field, value, message) -> None:
    async def scenario() -> None:
        async with Served() as s:
            setattr(s.server, field, value)
            dst = destination()
            with pytest.raises(KVTransferError, match=message):
                await s.pull([1, 2], dst, [1, 2])
            assert (dst.array == SENTINEL).all()

    run(scenario())


def test_a_bogus_pid_raises_a_clear_error() -> None:
    with open("/proc/sys/kernel/pid_max") as f:
        missing = int(f.read()) + 1  # no process can have it
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])

    async def scenario() -> None:
        async with Served() as s:
            s.server.pid = missing
            with pytest.raises(KVTransferError, match="ESRCH.*no such process here"):
                await s.pull([1], destination(), [1])
            s.server.pid = sleeper.pid  # a live process that is not the server: its probe does not read back
            dst = destination()
            with pytest.raises(KVTransferError, match="is not the server|no longer mapped"):
                await s.pull([1], dst, [1])
            assert (dst.array == SENTINEL).all()
            s.server.pid = os.getpid()  # the server still serves
            dst = destination()
            await s.pull([5, 6], dst, [0, 1])
            assert np.array_equal(dst.array[:, [0, 1]], s.src.array[:, [5, 6]])

    try:
        run(scenario())
    finally:
        sleeper.kill()
        sleeper.wait()


def test_permission_errors_name_ptrace_scope() -> None:
    message = str(cma_memory.explain(errno.EPERM, 1234, "cma://h:1"))
    assert "EPERM" in message and "/proc/sys/kernel/yama/ptrace_scope" in message


def test_tcp_and_cma_peers_refuse_each_other() -> None:
    async def scenario() -> None:
        async with Served() as s:
            lease = s.table.create([1], now=0.0).lease_id
            tcp_uri = s.uri.replace("cma://", "tcp://")
            with pytest.raises(KVTransferError, match="expected HELLO|cma:// KV server"):
                await pull(tcp_uri, LAYOUT, lease, [1], destination(), [1], config=CONFIG)
        server = make_server("tcp", buffer=KVBuffer(LAYOUT, source_bytes()), resolve=lambda lease: [1], config=CONFIG)
        uri = await server.start()
        try:
            dst = destination()
            with pytest.raises(KVTransferError, match="expected HELLO"):
                await pull(uri.replace("tcp://", "cma://"), LAYOUT, "lease", [1], dst, [1], config=CONFIG)
            assert (dst.array == SENTINEL).all()
        finally:
            await server.stop()

    run(scenario())


def test_partial_reads_are_resumed_and_large_reads_batched(monkeypatch) -> None:
    """A process_vm_readv that copies at most 1000 bytes a call (splitting iovecs), batches of 4 KiB in worker
    threads: every byte still lands where it belongs."""
    calls = []

    def short_readv(pid, local_ptr, liovcnt, remote_ptr, riovcnt, flags):
        local = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * liovcnt)).from_address(local_ptr)).reshape(-1, 2)
        remote = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * riovcnt)).from_address(remote_ptr)).reshape(-1, 2)
        assert liovcnt == riovcnt <= cma_memory.IOV_MAX and pid == os.getpid()
        budget, done = 1000, 0
        for (dst, n), (src, m) in zip(local, remote):
            assert n == m
            k = min(int(n), budget - done)
            ctypes.memmove(int(dst), int(src), k)
            done += k
            if done == budget:
                break
        calls.append(done)
        return done

    monkeypatch.setattr(cma_memory, "readv_fn", lambda: short_readv)
    monkeypatch.setattr(cma, "BATCH_BYTES", 4096)
    monkeypatch.setattr(cma, "INLINE_BYTES", 0)

    async def scenario() -> None:
        async with Served() as s:
            src_ids, dst_ids = list(range(10, 40)) + [3, 2, 1], list(range(0, 30)) + [50, 51, 60]
            dst = destination()
            await s.pull(src_ids, dst, dst_ids)
            assert np.array_equal(dst.array[:, dst_ids], s.src.array[:, src_ids])

    run(scenario())
    assert len(calls) > 30 and max(calls) == 1000


def test_split_cuts_long_rows() -> None:
    local = np.array([[1000, 10], [5000, 3]], np.uint64)
    remote = np.array([[9000, 10], [7000, 3]], np.uint64)
    new_local, new_remote = rows.split_rows(local, remote, 4)
    assert new_local.tolist() == [[1000, 4], [1004, 4], [1008, 2], [5000, 3]]
    assert new_remote.tolist() == [[9000, 4], [9004, 4], [9008, 2], [7000, 3]]


def test_cma_is_available_here_and_preferred_on_cpu() -> None:
    from kv_transfer.transport import AUTO_PREFERENCE, parse_kinds

    assert kind_available("cma") is None
    assert AUTO_PREFERENCE["cpu"][0] == "cma" and parse_kinds("auto")[0] == "cma"
    assert wire.HELLO not in (cma.C_HELLO, cma.C_READ) and wire.READ not in (cma.C_HELLO, cma.C_READ)
