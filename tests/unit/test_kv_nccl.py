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
from kv_transfer.tensor_buffer import TensorKVBuffer
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


def test_concurrent_pulls_of_one_client_take_turns_on_one_channel() -> None:
    """One communicator per P/D pair: built once, reused by every pull, concurrent ones included."""

    async def scenario() -> None:
        async with Prefill() as p:
            client, dst = nccl.NcclClient(CONFIG), KVBuffer.allocate(LAYOUT, 32)
            jobs = [([4 * i + j for j in range(4)], [31 - 4 * i - j for j in range(4)]) for i in range(6)]
            await asyncio.gather(*(p.pull(client, s, dst, d) for s, d in jobs))
            await asyncio.gather(*(p.pull(client, s, dst, d) for s, d in jobs[:3]))
            assert next(p.server._channel_ids) == 1  # one channel (one group) was ever built
            assert sum(len(c) for c in client._idle.values()) == 1 and p.channels() == 1
            client.close()
            await eventually(lambda: p.channels() == 0)

    run(scenario())


def test_a_lane_opens_another_channel_only_behind_streamed_pulls() -> None:
    """Queued behind a plain pull: wait for it. Behind streamed pulls only (waiting for P's layers): open one
    more, up to STREAMING_CHANNELS (the layer-wise integration test shows the streams then overlap)."""

    async def scenario() -> None:
        lane, channels = nccl._Lane(), [object() for _ in range(nccl_channel.STREAMING_CHANNELS)]
        assert lane.may_open()  # none busy: the first channel
        lane.busy.add(channels[0])
        assert not lane.may_open()  # a plain pull holds it: take turns
        await lane.streaming(channels[0])
        assert lane.may_open()
        for channel in channels[1:]:
            lane.busy.add(channel)
            await lane.streaming(channel)
        assert not lane.may_open()  # the cap

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
        src_gpu = TensorKVBuffer(LAYOUT, torch.from_numpy(src.array).to("cuda:0"))
        dst_gpu = TensorKVBuffer(LAYOUT, torch.zeros(src.array.shape, dtype=torch.uint8, device="cuda:1"))
        server = make_server("nccl", buffer=src_gpu, resolve=table.resolver(lambda: 0.0), config=CONFIG)
        uri = await server.start()
        try:
            assert server.backend == "nccl"
            client = nccl.NcclClient(CONFIG)
            lease = table.create([3, 4, 7], now=0.0).lease_id
            await client.pull(uri, LAYOUT, lease, [3, 4, 7], dst_gpu, [0, 1, 2])
            assert torch.equal(dst_gpu.tensor[:, [0, 1, 2]].cpu(), src_gpu.tensor[:, [3, 4, 7]].cpu())
            client.close()
        finally:
            await server.stop()

    run(scenario(), timeout_s=120.0)
