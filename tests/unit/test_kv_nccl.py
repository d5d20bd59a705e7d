"""nccl:// specifics (the conformance suite in test_kv_transport.py covers the contract): channels are reused
and torn down, refusals keep them, messages are coalesced, peers of the wrong kind or backend are refused,
a stalled sender is a timeout. On CPU the group is gloo; the GPU test needs two CUDA devices."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import numpy as np
import pytest
import torch

from kv_transfer import nccl, nccl_channel, tcp, wire
from kv_transfer.errors import KVTransferError, LeaseNotFound
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.leases import LeaseTable
from kv_transfer.transport import TransportConfig, make_server, parse_uri, pull

LAYOUT = KVLayout(model_fingerprint=b"nccl", dtype="float16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
CONFIG = TransportConfig(connect_timeout_s=5.0, io_timeout_s=2.0)


def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def source(num_blocks: int = 32) -> KVBuffer:
    buffer = KVBuffer.allocate(LAYOUT, num_blocks)
    buffer.array[:] = np.random.default_rng(3).integers(0, 256, buffer.array.shape, dtype=np.uint8)
    return buffer


class Prefill:
    def __init__(self, config: TransportConfig = CONFIG) -> None:
        self.src, self.table = source(), LeaseTable()
        self.server = nccl.NcclServer(buffer=self.src, resolve=self.table.resolver(lambda: 0.0), config=config)
        self.uri = ""

    async def __aenter__(self) -> Prefill:
        self.uri = await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop()

    def lease(self, block_ids) -> str:
        return self.table.create(block_ids, now=0.0).lease_id

    async def pull(self, client: nccl.NcclClient, src_ids, dst: KVBuffer, dst_ids):
        stats = await client.pull(self.uri, LAYOUT, self.lease(src_ids), src_ids, dst, dst_ids)
        assert np.array_equal(dst.array[:, dst_ids], self.src.array[:, src_ids])
        return stats

    def channels(self) -> int:
        return len(self.server._connections)


async def eventually(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def test_a_client_reuses_its_channel_and_close_tears_it_down() -> None:
    async def scenario() -> None:
        async with Prefill() as p:
            client, dst = nccl.NcclClient(CONFIG), KVBuffer.allocate(LAYOUT, 32)
            for i in range(3):
                await p.pull(client, [i, i + 10], dst, [5, 6])
            assert p.channels() == 1
            with pytest.raises(LeaseNotFound):  # a refusal moves nothing and keeps the channel
                await client.pull(p.uri, LAYOUT, "0" * 32, [1], dst, [1])
            await p.pull(client, [20], dst, [0])
            assert p.channels() == 1
            assert len(p.server._store.list_keys()) == 2  # the live channel's rendezvous keys, no more
            client.close()
            await eventually(lambda: p.channels() == 0)
            assert p.server._store.list_keys() == []

    run(scenario())


def test_concurrent_pulls_of_one_client_use_separate_channels() -> None:
    async def scenario() -> None:
        async with Prefill() as p:
            client, dst = nccl.NcclClient(CONFIG), KVBuffer.allocate(LAYOUT, 32)
            jobs = [([4 * i + j for j in range(4)], [31 - 4 * i - j for j in range(4)]) for i in range(6)]
            await asyncio.gather(*(p.pull(client, s, dst, d) for s, d in jobs))
            assert next(p.server._channel_ids) == 6  # six channels were opened
            assert sum(len(c) for c in client._idle.values()) == nccl_channel.MAX_IDLE_CHANNELS  # the rest closed
            await eventually(lambda: p.channels() == nccl_channel.MAX_IDLE_CHANNELS)
            client.close()
            await eventually(lambda: p.channels() == 0)

    run(scenario())


def test_a_channel_the_server_dropped_is_replaced(monkeypatch) -> None:
    monkeypatch.setattr(nccl, "IDLE_S", 0.2)

    async def scenario() -> None:
        async with Prefill() as p:
            client, dst = nccl.NcclClient(CONFIG), KVBuffer.allocate(LAYOUT, 32)
            await p.pull(client, [1, 2], dst, [1, 2])
            await eventually(lambda: p.channels() == 0)  # idle too long: the server closed it
            await p.pull(client, [3, 4], dst, [3, 4])  # the client notices and opens a new one
            assert p.channels() == 1
            client.close()

    run(scenario())


def test_runs_consecutive_on_both_sides_are_one_message_per_layer(monkeypatch) -> None:
    sizes: list[tuple[bool, list[int]]] = []
    real_exchange = nccl.exchange

    def recording(group, tensors, *, send, timeout_s):
        sizes.append((send, [t.numel() for t in tensors]))
        real_exchange(group, tensors, send=send, timeout_s=timeout_s)

    monkeypatch.setattr(nccl, "exchange", recording)

    async def scenario() -> None:
        async with Prefill() as p:
            client, dst = nccl.NcclClient(CONFIG), KVBuffer.allocate(LAYOUT, 32)
            await p.pull(client, [4, 5, 6, 9], dst, [0, 1, 2, 3])  # runs (4->0, 3 blocks) and (9->3, 1 block)
            client.close()

    run(scenario())
    seg = LAYOUT.bytes_per_block_per_layer
    expected = [3 * seg, seg] * LAYOUT.num_layers
    assert sorted(sizes) == [(False, expected), (True, expected)]


def test_a_sender_that_stalls_is_a_timeout_not_a_hang(monkeypatch) -> None:
    config = TransportConfig(connect_timeout_s=5.0, io_timeout_s=0.5)
    real_exchange = nccl.exchange

    def stalling(group, tensors, *, send, timeout_s):
        if send:
            time.sleep(1.0)  # the server's thread stalls (bounded, so the test leaves no thread behind)
        real_exchange(group, tensors, send=send, timeout_s=timeout_s)

    monkeypatch.setattr(nccl, "exchange", stalling)

    async def scenario() -> None:
        async with Prefill(config) as p:
            client = nccl.NcclClient(config)
            start = time.monotonic()
            with pytest.raises(KVTransferError, match="receiving KV"):
                await client.pull(p.uri, LAYOUT, p.lease([1]), [1], KVBuffer.allocate(LAYOUT, 4), [1])
            assert time.monotonic() - start < config.io_timeout_s + nccl_channel.GRACE_S + 1.0
            assert client._idle == {}  # the broken channel was not kept

    run(scenario())


def test_tcp_and_nccl_peers_refuse_each_other_and_keep_serving() -> None:
    async def scenario() -> None:
        async with Prefill() as p:
            tcp_server = make_server("tcp", buffer=p.src, resolve=p.table.resolver(lambda: 0.0), config=CONFIG)
            tcp_uri = await tcp_server.start()
            try:
                dst, lease = KVBuffer.allocate(LAYOUT, 32), p.lease([1])
                with pytest.raises(KVTransferError, match="HELLO"):
                    await tcp.TcpClient(CONFIG).pull(p.uri.replace("nccl", "tcp"), LAYOUT, lease, [1], dst, [1])
                with pytest.raises(KVTransferError, match="expected HELLO"):
                    await nccl.NcclClient(CONFIG).pull(tcp_uri.replace("tcp", "nccl"), LAYOUT, lease, [1], dst, [1])
                assert (dst.array == 0).all()
                await pull(p.uri, LAYOUT, lease, [1], dst, [1], config=CONFIG)
                assert np.array_equal(dst.array[:, 1], p.src.array[:, 1])
            finally:
                await tcp_server.stop()

    run(scenario())


def test_a_client_of_another_backend_is_refused_before_any_group_is_built() -> None:
    async def scenario() -> None:
        async with Prefill() as p:
            host, port = parse_uri(p.uri, "nccl")
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(wire.encode_frame(nccl.N_HELLO, LAYOUT.to_json().encode(), nccl.BACKENDS.index("nccl")))
            frame = wire.HEADER.unpack(await reader.readexactly(wire.HEADER.size))
            payload = await reader.readexactly(frame[4])
            assert (frame[2], frame[3]) == (wire.ERROR, wire.ERR_REFUSED) and b"gloo" in payload
            writer.close()

    run(scenario())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL refuses one GPU twice)")
def test_gpu_to_gpu_pull_over_nccl() -> None:  # pragma: no cover - needs GPUs
    async def scenario() -> None:
        src, table = source(), LeaseTable()
        src_gpu = torch.from_numpy(src.array).to("cuda:0")
        dst, dst_gpu = KVBuffer.allocate(LAYOUT, 32), torch.zeros(src.array.shape, dtype=torch.uint8, device="cuda:1")
        server = nccl.NcclServer(buffer=src, resolve=table.resolver(lambda: 0.0), config=CONFIG, device_cache=src_gpu)
        uri = await server.start()
        try:
            client = nccl.NcclClient(CONFIG, device_cache=dst_gpu)
            lease = table.create([3, 4, 7], now=0.0).lease_id
            await client.pull(uri, LAYOUT, lease, [3, 4, 7], dst, [0, 1, 2])
            assert torch.equal(dst_gpu[:, [0, 1, 2]].cpu(), src_gpu[:, [3, 4, 7]].cpu())
            client.close()
        finally:
            await server.stop()

    run(scenario(), timeout_s=120.0)


def test_long_runs_are_cut_into_bounded_messages(monkeypatch) -> None:
    seg = LAYOUT.bytes_per_block_per_layer
    monkeypatch.setattr(nccl_channel, "MAX_MESSAGE_BYTES", 2 * seg)
    kv = torch.arange(LAYOUT.num_layers * 32 * seg, dtype=torch.int64).to(torch.uint8).view(LAYOUT.num_layers, 32, seg)
    pieces = nccl_channel.messages(kv, [(10, 5), (3, 1)])
    assert [p.numel() // seg for p in pieces] == [2, 2, 1, 1] * LAYOUT.num_layers
    assert torch.equal(torch.cat(pieces[:4]), torch.cat([kv[0, 10:15].reshape(-1), kv[0, 3].reshape(-1)]))

    async def scenario() -> None:  # both ends cut the same way: the bytes still land in place
        async with Prefill() as p:
            client, dst = nccl.NcclClient(CONFIG), KVBuffer.allocate(LAYOUT, 32)
            await p.pull(client, [10, 11, 12, 13, 14, 3], dst, [0, 1, 2, 3, 4, 31])
            client.close()

    run(scenario())


def test_a_cancelled_pull_ends_only_once_no_more_bytes_can_land(monkeypatch) -> None:
    """A posted receive cannot be withdrawn, so cancelling a pull waits for it (bounded) to end."""
    real_exchange, sending = nccl.exchange, threading.Event()

    def slow_sender(group, tensors, *, send, timeout_s):
        if send:
            sending.set()
            time.sleep(0.6)  # the client's receives are posted and waiting meanwhile
        real_exchange(group, tensors, send=send, timeout_s=timeout_s)

    monkeypatch.setattr(nccl, "exchange", slow_sender)

    async def scenario() -> None:
        async with Prefill() as p:
            client, dst = nccl.NcclClient(CONFIG), KVBuffer.allocate(LAYOUT, 32)
            pulling = asyncio.create_task(client.pull(p.uri, LAYOUT, p.lease([1, 2]), [1, 2], dst, [1, 2]))
            await eventually(sending.is_set)
            pulling.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pulling
            landed = dst.array.copy()
            await asyncio.sleep(1.0)
            assert np.array_equal(dst.array, landed), "bytes landed after the cancelled pull was over"
            assert client._idle == {}

    run(scenario())


@pytest.mark.parametrize("how", ["lease released", "cancelled"])
def test_a_streamed_pull_that_fails_drops_its_channel_and_the_next_pull_is_exact(how: str) -> None:
    """A streamed read delivers layer 0, then its lease ends (the rest comes as zeros, then ERROR) or the pull
    is cancelled: the channel is not kept (its message order is spent), and the next pull is exact."""
    from kv_transfer.progress import LayerProgress

    async def scenario() -> None:
        src, table, progress = source(), LeaseTable(), {}
        server = make_server("nccl", buffer=src, resolve=table.resolver(lambda: 0.0), config=CONFIG,
                             progress=progress.get)
        uri = await server.start()
        client, dst = nccl.NcclClient(CONFIG), KVBuffer.allocate(LAYOUT, 32)
        dst.array[:] = 0xAB
        try:
            lease_id = table.create([1, 2], now=0.0).lease_id
            progress[lease_id] = LayerProgress(LAYOUT.num_layers)
            progress[lease_id].complete(0)
            task = asyncio.create_task(client.pull(uri, LAYOUT, lease_id, [1, 2], dst, [3, 4]))
            await eventually(lambda: np.array_equal(dst.array[0, [3, 4]], src.array[0, [1, 2]]))
            assert (dst.array[1:, [3, 4]] == 0xAB).all() and not task.done()  # layer 1 is not computed yet
            if how == "cancelled":
                task.cancel()
            else:
                table.release(lease_id)
                progress[lease_id].complete(1)
            with pytest.raises(asyncio.CancelledError if how == "cancelled" else LeaseNotFound):
                await task
            if how != "cancelled":
                assert (dst.array[1:, [3, 4]] == 0).all()  # zeros, never the released blocks' bytes
            assert not client._idle.get(uri)
            await client.pull(uri, LAYOUT, table.create([5, 6], now=0.0).lease_id, [5, 6], dst, [3, 4])
            assert np.array_equal(dst.array[:, [3, 4]], src.array[:, [5, 6]])
        finally:
            client.close()
            await server.stop()

    run(scenario())


@pytest.mark.parametrize("cancel_after", range(16))
def test_a_cancelled_receive_leaves_no_reader_on_its_socket(cancel_after: int) -> None:
    """However far a receive has got when its pull is cancelled, the control socket's reader is gone by the
    time the cancellation surfaces (the channel closes next): a reader left behind outlives the socket and
    breaks the next socket given the same fd (seen as ``Invalid file descriptor: -1`` on a fresh clone)."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        ours.setblocking(False)

        async def receive() -> None:
            for _ in range(3):
                await asyncio.sleep(0)

        async def pull() -> None:  # as NcclClient._pull: a failed receive closes its channel at once
            try:
                await nccl_channel.unless_closed(receive(), ours, "test")
            finally:
                ours.close()

        fd = ours.fileno()
        try:
            task = asyncio.create_task(pull())
            for _ in range(cancel_after):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for _ in range(3):  # any task left behind runs now
                await asyncio.sleep(0)
            assert not loop.remove_reader(fd), "a reader outlived the socket"
        finally:
            ours.close()
            theirs.close()

    run(scenario())
