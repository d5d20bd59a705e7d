"""The ``tcp://`` transport's wire format and socket plumbing: frames, non-blocking socket waits bounded
by timeouts, and the listening side ``tcp://`` and ``cma://`` share. The protocol itself is described in
``kv_transfer/tcp.py``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import time
from collections.abc import Sequence
from typing import NamedTuple

from kv_transfer.errors import KVTransferError
from kv_transfer.transport import TransportConfig

logger = logging.getLogger("kv_transfer")

MAGIC, VERSION = b"BTKV", 1
HEADER = struct.Struct("<4sBBHI")
HELLO, HELLO_OK, READ, DATA, DONE, ERROR = 1, 2, 3, 4, 5, 6
ERR_PROTOCOL, ERR_LAYOUT, ERR_LEASE, ERR_REFUSED, ERR_INTERNAL, ERR_AUTH = 1, 2, 3, 4, 5, 6
# READ's code is a set of flags. A v1 server that predates one ignores it (and DONE's payload is then
# empty), so flags extend the protocol without a new VERSION: a client that asked and got nothing says so.
READ_CHECKSUM = 1  # DONE carries one xxh3-64 per block, in READ order (kv_transfer/checksum.py)
READ_AUTH = 2  # the READ payload ends with an HMAC trailer (kv_transfer/auth.py)
READ_STREAM = 4  # the client reads a lease still being computed layer by layer (cma://: kv_transfer/cma_stream.py)
MAX_PAYLOAD_BYTES = 8 << 20  # control frames only; KV bytes are not framed
MAX_LEASE_ID_BYTES = 1024
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
YIELD_EVERY = 16  # successive non-blocking socket calls before yielding to other tasks
SERVER_IDLE_S = 60.0  # a server closes a connection idle this long between requests (clients: conn_pool)


class Frame(NamedTuple):
    kind: int
    code: int
    payload: bytes


def encode_frame(kind: int, payload: bytes = b"", code: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, code, len(payload)) + payload


def encode_read(lease_id: str, block_ids: Sequence[int]) -> bytes:
    lease = lease_id.encode()
    if len(lease) > MAX_LEASE_ID_BYTES:
        raise KVTransferError(f"lease id longer than {MAX_LEASE_ID_BYTES} bytes")
    if any(not 0 <= b < 1 << 32 for b in block_ids):
        raise KVTransferError("source block ids must be in [0, 2**32)")
    return struct.pack(f"<H{len(lease)}sI{len(block_ids)}I", len(lease), lease, len(block_ids), *block_ids)


def decode_read(payload: bytes) -> tuple[str, list[int]]:
    try:
        (lease_len,) = struct.unpack_from("<H", payload)
        lease, count = struct.unpack_from(f"<{lease_len}sI", payload, 2)
        if len(payload) != 6 + lease_len + 4 * count:
            raise ValueError("READ length does not match its block count")
        return lease.decode(), list(struct.unpack_from(f"<{count}I", payload, 6 + lease_len))
    except (struct.error, ValueError) as exc:
        raise KVTransferError(f"malformed READ: {exc}") from exc


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


def _advance(views: list[memoryview], i: int, num_bytes: int) -> int:
    """Consume ``num_bytes`` from ``views[i:]``; returns the index of the first view not yet full."""
    while num_bytes and num_bytes >= views[i].nbytes:
        num_bytes -= views[i].nbytes
        i += 1
    if num_bytes:
        views[i] = views[i][num_bytes:]
    return i


async def _transfer(
    sock: socket.socket, views: Sequence[memoryview], *, write: bool, timeout_s: float, what: str
) -> None:
    """Send (``write``) or receive every byte of ``views`` in order, gather/scatter, IOV_MAX views a call."""
    pending = [v for v in views if v.nbytes]
    total, done, i, streak = sum(v.nbytes for v in pending), 0, 0, 0
    while i < len(pending):
        batch = pending[i : i + IOV_MAX]
        try:
            n = sock.sendmsg(batch) if write else sock.recvmsg_into(batch)[0]
        except (BlockingIOError, InterruptedError):
            await _wait_ready(sock, write=write, timeout_s=timeout_s, what=what)
            streak = 0
            continue
        if n == 0:
            raise KVTransferError(f"{what}: peer closed the connection after {done} of {total} bytes")
        done += n
        i = _advance(pending, i, n)
        streak += 1
        if streak == YIELD_EVERY:  # a fast stream must not starve the loop's other tasks
            streak = 0
            await asyncio.sleep(0)


async def send_frame(sock: socket.socket, frame: bytes, timeout_s: float, what: str) -> None:
    await _transfer(sock, [memoryview(frame)], write=True, timeout_s=timeout_s, what=what)


async def recv_frame(sock: socket.socket, timeout_s: float, what: str) -> Frame:
    header = bytearray(HEADER.size)
    await _transfer(sock, [memoryview(header)], write=False, timeout_s=timeout_s, what=what)
    magic, version, kind, code, length = HEADER.unpack(header)
    if magic != MAGIC or version != VERSION:
        raise KVTransferError(f"{what}: not a Baton KV peer (bad magic or version {version})")
    if length > MAX_PAYLOAD_BYTES:
        raise KVTransferError(f"{what}: control frame of {length} bytes exceeds {MAX_PAYLOAD_BYTES}")
    payload = bytearray(length)
    await _transfer(sock, [memoryview(payload)], write=False, timeout_s=timeout_s, what=what)
    return Frame(kind, code, bytes(payload))


async def peek_byte(sock: socket.socket, timeout_s: float, what: str) -> bool:
    """Wait until ``sock`` has a byte to read (True, the byte stays unread) or its peer closed it (False);
    OSError on a reset, KVTransferError after ``timeout_s`` of silence."""
    while True:
        try:
            return bool(sock.recv(1, socket.MSG_PEEK))
        except (BlockingIOError, InterruptedError):
            await _wait_ready(sock, write=False, timeout_s=timeout_s, what=what)


def _tune(sock: socket.socket, config: TransportConfig) -> None:
    if config.socket_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, config.socket_buffer_bytes)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)


# --- server ---------------------------------------------------------------------------------------


def open_listener(host: str, port: int, config: TransportConfig | None = None) -> socket.socket:
    """A non-blocking listening socket on ``host:port`` (0: a free port); OSError if it cannot listen."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if config is not None:
            _tune(listener, config)
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


class SocketServer:
    """The listening side every socket-based transport shares: listen, accept, one task per connection
    serving its requests one after another, stop. Subclasses set ``scheme``, implement ``_serve(sock)``
    (one request), and may add to the URI (``_uri_query``)."""

    scheme = ""

    def _init_listener(self, config: TransportConfig) -> None:
        self.config = config
        self.uri: str | None = None
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()
        self.num_accepted = 0  # connections accepted so far (pooled clients reuse theirs)
        self.idle_timeout_s = SERVER_IDLE_S

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, advertise_host: str | None = None) -> str:
        """Listen on ``host:port`` (0: a free port); the URI names ``advertise_host`` or else ``host``."""
        if self.uri is not None:
            return self.uri
        listener = open_listener(host, port, self.config)
        self._listener = listener
        self._accept_task = asyncio.create_task(self._accept_loop(listener))
        self.uri = server_uri(self.scheme, advertise_host or host, listener) + self._uri_query()
        logger.info("KV data plane serving %s", self.uri)
        return self.uri

    def _uri_query(self) -> str:
        return ""

    async def stop(self) -> None:
        tasks = [t for t in (self._accept_task, *self._connections) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        self._listener, self._accept_task, self.uri = None, None, None

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # e.g. out of file descriptors: back off instead of spinning
                logger.warning("KV data plane accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            self.num_accepted += 1
            task = asyncio.create_task(self._serve_connection(sock))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve_connection(self, sock: socket.socket) -> None:
        """Serve requests one after another until the client closes the connection, leaves it idle for
        ``idle_timeout_s`` (closed without a word: an ERROR could be taken for the answer to a later
        request) or a request ends in an ERROR (sent, then the connection closes)."""
        with sock:
            try:
                _tune(sock, self.config)
                refusal = await self._serve(sock)  # a new connection's request follows at once: io_timeout_s
                while refusal is None and await self._next_request(sock):
                    refusal = await self._serve(sock)
            except KVTransferError as exc:  # malformed, silent or vanished client
                logger.info("KV data plane (%s): dropped a client: %s", self.scheme, exc)
                refusal = encode_frame(ERROR, str(exc).encode(), ERR_PROTOCOL)
            except OSError as exc:
                logger.info("KV data plane (%s): dropped a client: %s", self.scheme, exc)
                return
            if refusal is not None:
                await _refuse(sock, refusal)

    async def _next_request(self, sock: socket.socket) -> bool:
        """True once the client starts its next request on this connection."""
        try:
            return await peek_byte(sock, self.idle_timeout_s, "idle KV client")
        except (KVTransferError, OSError):
            return False

    async def _serve(self, sock: socket.socket) -> bytes | None:
        """Serve one request; returns the ERROR frame to close with, None when the connection may go on."""
        raise NotImplementedError


async def _refuse(sock: socket.socket, frame: bytes, linger_s: float = 1.0) -> None:
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
