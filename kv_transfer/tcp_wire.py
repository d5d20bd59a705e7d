"""Socket plumbing of the socket-based transports (``tcp://``, ``cma://``, ``nccl://``'s control channel):
frames sent and received on non-blocking sockets driven by the event loop, every wait bounded by a timeout,
and the listening socket. The frames themselves are ``kv_transfer/wire.py``'s; tcp's protocol is described
in ``kv_transfer/tcp.py``."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import os
import socket
import time
from collections.abc import Sequence

from kv_transfer.errors import KVTransferError
from kv_transfer.transport import TransportConfig
from kv_transfer.wire import (  # noqa: F401 - re-exported for tests/integration/test_fuzz.py
    HEADER, HELLO, MAGIC, READ, VERSION, Frame, decode_header, encode_frame,
)

IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
CALL_BYTES = 2 << 20  # one sendmsg/recvmsg_into is handed the views covering this many bytes, not IOV_MAX of them:
# each view costs it ~0.1 us, taken or not (1,024 views of which a call takes 64: ~130 us a call against ~30)
YIELD_EVERY = 16  # successive non-blocking socket calls before yielding to other tasks
RCVLOWAT_BYTES = 1 << 20  # a reader of a longer stream is woken per this many bytes (SO_RCVLOWAT), not per segment
RCVLOWAT_FROM = 256 << 10  # ... when more than this is left to read (a frame's few bytes: no extra system calls)


# --- non-blocking socket I/O on the running event loop -------------------------------------------


def _wake(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


async def _wait_ready(sock: socket.socket, *, write: bool, timeout_s: float, what: str) -> None:
    """Wait until ``sock`` is readable (writable), at most ``timeout_s``."""
    loop = asyncio.get_running_loop()
    fut, fd = loop.create_future(), sock.fileno()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(fd, _wake, fut, None)
    timer = loop.call_later(timeout_s, _wake, fut, KVTransferError(f"{what}: peer silent for {timeout_s:g} s"))
    try:
        await fut
    finally:
        remove(fd)
        timer.cancel()


def advance(views: list[memoryview], i: int, num_bytes: int) -> int:
    """Consume ``num_bytes`` from ``views[i:]``; returns the index of the first view not yet full."""
    while num_bytes and num_bytes >= views[i].nbytes:
        num_bytes -= views[i].nbytes
        i += 1
    if num_bytes:
        views[i] = views[i][num_bytes:]
    return i


async def transfer(
    sock: socket.socket, views: Sequence[memoryview], *, write: bool, timeout_s: float, what: str
) -> None:
    """Send (``write``) or receive every byte of ``views`` in order, gather/scatter: a call is handed the views
    covering its next CALL_BYTES (IOV_MAX at most)."""
    pending = [v for v in views if v.nbytes]
    ends = list(itertools.accumulate(v.nbytes for v in pending))  # the stream offset where each view ends
    total, done, i, streak, lowat = ends[-1] if ends else 0, 0, 0, 0, 1
    try:
        while i < len(pending):
            batch = pending[i : min(bisect.bisect_left(ends, done + CALL_BYTES, i) + 1, i + IOV_MAX)]
            try:
                n = sock.sendmsg(batch) if write else sock.recvmsg_into(batch)[0]
            except (BlockingIOError, InterruptedError):
                if not write:  # never above what is left: the peer may send nothing more until we answer
                    want = min(total - done, RCVLOWAT_BYTES) if total - done > RCVLOWAT_FROM else 1
                    if want != lowat:
                        lowat = _set_rcvlowat(sock, want)
                await _wait_ready(sock, write=write, timeout_s=timeout_s, what=what)
                streak = 0
                continue
            if n == 0:
                raise KVTransferError(f"{what}: peer closed the connection after {done} of {total} bytes")
            done += n
            i = advance(pending, i, n)
            streak += 1
            if streak == YIELD_EVERY:  # a fast stream must not starve the loop's other tasks
                streak = 0
                await asyncio.sleep(0)
    finally:
        if lowat != 1:  # the next frame's header must wake its reader at its first byte
            _set_rcvlowat(sock, 1)


def _set_rcvlowat(sock: socket.socket, num_bytes: int) -> int:
    """A reader waiting for a long stream is woken once ``num_bytes`` are in (or at EOF), not per segment."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, num_bytes)
    return num_bytes


async def send_frame(sock: socket.socket, frame: bytes, timeout_s: float, what: str) -> None:
    await transfer(sock, [memoryview(frame)], write=True, timeout_s=timeout_s, what=what)


async def recv_frame(sock: socket.socket, timeout_s: float, what: str) -> Frame:
    header = bytearray(HEADER.size)
    await transfer(sock, [memoryview(header)], write=False, timeout_s=timeout_s, what=what)
    kind, code, length = decode_header(bytes(header), what)
    payload = bytearray(length)
    await transfer(sock, [memoryview(payload)], write=False, timeout_s=timeout_s, what=what)
    return Frame(kind, code, bytes(payload))


async def peek_byte(sock: socket.socket, timeout_s: float, what: str) -> bool:
    """Wait until ``sock`` has a byte to read (True, the byte stays unread) or its peer closed it (False);
    OSError on a reset, KVTransferError after ``timeout_s`` of silence."""
    while True:
        try:
            return bool(sock.recv(1, socket.MSG_PEEK))
        except (BlockingIOError, InterruptedError):
            await _wait_ready(sock, write=False, timeout_s=timeout_s, what=what)


def tune_socket(sock: socket.socket, config: TransportConfig) -> None:
    if config.socket_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, config.socket_buffer_bytes)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)


# --- listening and refusing -----------------------------------------------------------------------


def open_listener(host: str, port: int, config: TransportConfig | None = None) -> socket.socket:
    """A non-blocking listening socket on ``host:port`` (0: a free port); OSError if it cannot listen."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if config is not None:
            tune_socket(listener, config)
        listener.bind(addr)
        listener.listen(128)
        listener.setblocking(False)
    except OSError:
        listener.close()
        raise
    return listener


def server_uri(scheme: str, host: str, listener: socket.socket) -> str:
    """``scheme://host:port`` of a listener (an IPv6 host in brackets)."""
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{listener.getsockname()[1]}"


async def send_refusal(sock: socket.socket, frame: bytes, linger_s: float = 1.0) -> None:
    """Send an ERROR and close gracefully: drain what the client already sent (its pipelined READ)
    until it closes, so the close is a FIN after the ERROR rather than a reset that could destroy it."""
    scratch = memoryview(bytearray(1 << 16))
    with contextlib.suppress(KVTransferError, OSError):
        await send_frame(sock, frame, linger_s, "KV client")
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + linger_s
        while (left_s := deadline - time.monotonic()) > 0:
            try:
                if sock.recv_into(scratch) == 0:
                    return
            except (BlockingIOError, InterruptedError):
                await _wait_ready(sock, write=False, timeout_s=left_s, what="KV client")
