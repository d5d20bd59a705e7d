"""``kv_transfer/tcp_wire.py``'s reads of a long stream: woken per SO_RCVLOWAT bytes, never waiting for more than
is left to read, and the next frame read as soon as its first byte is in."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import numpy as np

from kv_transfer import tcp_wire
from kv_transfer.wire import encode_frame

CHUNK = 64 << 10


def connected_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        writer = socket.create_connection(listener.getsockname())
        reader, _ = listener.accept()
    reader.setblocking(False)
    return reader, writer


def with_sender(reader: socket.socket, writer: socket.socket, send, receive):
    """``receive()`` run on an event loop while ``send()`` runs on a thread; both sockets closed after."""
    sender = threading.Thread(target=send)
    sender.start()
    try:
        return asyncio.run(asyncio.wait_for(receive(), 10.0))
    finally:
        sender.join()
        reader.close()
        writer.close()


def test_a_long_read_wakes_per_low_water_mark_takes_its_short_tail_and_then_the_next_frame(monkeypatch) -> None:
    """4 MiB arrive in 64 KiB pieces a millisecond apart, then (after a pause) a 100 KiB tail, then (after another)
    a frame: the reader wakes a few times, not per piece; neither pause stalls it (the mark never exceeds what is
    left, and is back at one byte for the frame)."""
    body = np.random.default_rng(0).integers(0, 256, 4 * (1 << 20) + 100 * 1024, np.uint8).tobytes()
    frame = encode_frame(7, b"after the stream")
    reader, writer = connected_pair()
    waits = []
    real_wait = tcp_wire._wait_ready

    async def counted(*args, **kwargs):
        waits.append(time.monotonic())
        return await real_wait(*args, **kwargs)

    def send() -> None:
        head = len(body) - 100 * 1024
        for start in range(0, head, CHUNK):
            writer.sendall(body[start:start + CHUNK])
            time.sleep(0.001)
        time.sleep(0.2)  # a reader still waiting for a full mark would not see the tail
        writer.sendall(body[head:])
        time.sleep(0.2)
        writer.sendall(frame)

    async def receive() -> tuple[bytearray, tcp_wire.Frame]:
        got = bytearray(len(body))
        halves = [memoryview(got)[: len(got) // 2], memoryview(got)[len(got) // 2:]]
        await tcp_wire.transfer(reader, halves, write=False, timeout_s=5.0, what="test")
        num_waits = len(waits)
        answer = await tcp_wire.recv_frame(reader, 5.0, "test")
        assert len(waits) - num_waits <= 2  # the frame: one wake for its header (its payload came with it)
        return got, answer

    monkeypatch.setattr(tcp_wire, "_wait_ready", counted)
    got, answer = with_sender(reader, writer, send, receive)
    assert bytes(got) == body and answer.payload == b"after the stream"
    assert len(waits) <= 12, f"{len(waits)} wake-ups for 4 MiB"  # per piece, it was ~60


def test_a_read_that_ends_at_its_low_water_mark_leaves_none_for_the_next_frame() -> None:
    """600 KiB sent at once to a reader already waiting for them: its mark is all of them, so the read ends at
    the wake-up that brings them; the frame after it is still read at its first byte."""
    body = bytes(range(256)) * (600 * 4)
    reader, writer = connected_pair()

    def send() -> None:
        time.sleep(0.1)  # the reader waits first, its mark at the whole read
        writer.sendall(body)
        time.sleep(0.2)
        writer.sendall(encode_frame(7, b"next"))

    async def receive() -> tuple[bytearray, tcp_wire.Frame]:
        got = bytearray(len(body))
        await tcp_wire.transfer(reader, [memoryview(got)], write=False, timeout_s=5.0, what="test")
        return got, await tcp_wire.recv_frame(reader, 5.0, "test")

    got, answer = with_sender(reader, writer, send, receive)
    assert bytes(got) == body and answer.payload == b"next"


class CountingSocket(socket.socket):
    """A real socket that records how many views each gather/scatter call is handed."""

    handed: list[int]

    def sendmsg(self, buffers, *args):
        self.handed.append(len(buffers))
        return super().sendmsg(buffers, *args)

    def recvmsg_into(self, buffers, *args):
        self.handed.append(len(buffers))
        return super().recvmsg_into(buffers, *args)


def counting(sock: socket.socket) -> CountingSocket:
    out = CountingSocket(sock.family, sock.type, fileno=sock.detach())
    out.setblocking(False)
    out.handed = []
    return out


def test_gather_and_scatter_calls_are_handed_the_views_their_next_call_bytes_cover(monkeypatch) -> None:
    """6 MiB in 1,536 views of 4 KiB each way, with CALL_BYTES at 256 KiB: no call is handed more than the 65 views
    that cover its next 256 KiB (IOV_MAX of them cost each call ~0.1 us a view, taken or not), and every byte lands
    in its place."""
    monkeypatch.setattr(tcp_wire, "CALL_BYTES", 256 << 10)
    piece, count = 4096, 1536
    body = np.random.default_rng(1).integers(0, 256, piece * count, np.uint8)
    got = np.zeros_like(body)
    reader, writer = connected_pair()
    reader, sender = counting(reader), counting(writer)

    def send() -> None:
        views = [memoryview(body[i * piece:(i + 1) * piece]) for i in range(count)]
        asyncio.run(tcp_wire.transfer(sender, views, write=True, timeout_s=5.0, what="test"))

    async def receive() -> None:
        views = [memoryview(got[i * piece:(i + 1) * piece]) for i in range(count)]
        await tcp_wire.transfer(reader, views, write=False, timeout_s=5.0, what="test")

    with_sender(reader, sender, send, receive)
    assert np.array_equal(got, body)
    for handed in (sender.handed, reader.handed):
        assert handed and max(handed) <= (256 << 10) // piece + 1, handed
