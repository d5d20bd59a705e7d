"""``tcp://host:port``: the KV data plane over TCP, zero-copy on both ends.

Wire protocol (little-endian; no pickle, no object deserialization). Every control message is a frame,
a 12-byte header ``magic b"BTKV" | version u8 | kind u8 | code u16 | payload_len u32`` and a payload.
One pull is one connection and one round trip:

    client -> HELLO     the client's KVLayout JSON
              READ      u16 len | lease id | u32 count | count x u32 source block ids   (pipelined)
    server -> ERROR     layout mismatch: refused before any KV byte moves (the READ is drained unread)
           or HELLO_OK  the server's KVLayout JSON (the client checks it too), then
              ERROR     unknown/expired lease, block not in the lease, out of range: nothing moves
           or DATA      u64 num_bytes, then num_bytes raw KV bytes in wire order (layout.py), then
              DONE      the lease was still live after the last byte (else ERROR: it ended mid-read)

ERROR carries a code (``ERR_*``) and a UTF-8 message; the client raises LayoutMismatch, LeaseNotFound or
KVTransferError from it. HELLO_OK goes out with DATA in one write, once the READ is checked.

Zero copy: the server hands the leased blocks' memoryviews (one per layer per run of consecutive
block ids) to ``sendmsg`` (gather), and the client ``recvmsg_into``s the stream straight into the
destination blocks' memoryviews (scatter), up to IOV_MAX views per system call, on non-blocking
sockets driven by the event loop. Every wait on the peer is bounded by ``TransportConfig`` timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
import time
from collections.abc import Sequence
from typing import NamedTuple
from urllib.parse import urlsplit

from kv_transfer.errors import KVTransferError, LayoutMismatch, LeaseNotFound
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.transport import Resolver, TransferStats, TransportConfig, check_pull_args, check_read

logger = logging.getLogger(__name__)

MAGIC, VERSION = b"BTKV", 1
HEADER = struct.Struct("<4sBBHI")
HELLO, HELLO_OK, READ, DATA, DONE, ERROR = 1, 2, 3, 4, 5, 6
ERR_PROTOCOL, ERR_LAYOUT, ERR_LEASE, ERR_REFUSED, ERR_INTERNAL = 1, 2, 3, 4, 5
MAX_PAYLOAD_BYTES = 8 << 20  # control frames only; KV bytes are not framed
MAX_LEASE_ID_BYTES = 1024
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
YIELD_EVERY = 16  # successive non-blocking socket calls before yielding to other tasks


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


def _tune(sock: socket.socket, config: TransportConfig) -> None:
    if config.socket_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, config.socket_buffer_bytes)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)


# --- server ---------------------------------------------------------------------------------------


class TcpServer:
    """Serves reads of leased blocks of ``buffer``; ``resolve`` maps a lease id to its block ids."""

    def __init__(self, *, buffer: KVBuffer, resolve: Resolver, config: TransportConfig | None = None) -> None:
        self.buffer = buffer
        self.resolve = resolve
        self.config = config or TransportConfig()
        self.uri: str | None = None
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, advertise_host: str | None = None) -> str:
        """Listen on ``host:port`` (0: a free port); the URI names ``advertise_host`` or else ``host``."""
        if self.uri is not None:
            return self.uri
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            _tune(listener, self.config)
            listener.bind(addr)
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._accept_task = asyncio.create_task(self._accept_loop(listener))
        shown = advertise_host or host
        self.uri = f"tcp://{f'[{shown}]' if ':' in shown else shown}:{listener.getsockname()[1]}"
        logger.info("KV data plane serving %s", self.uri)
        return self.uri

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
            task = asyncio.create_task(self._serve_connection(sock))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve_connection(self, sock: socket.socket) -> None:
        with sock:
            try:
                _tune(sock, self.config)
                refusal = await self._serve(sock)
            except KVTransferError as exc:  # malformed, silent or vanished client
                logger.info("KV data plane: dropped a client: %s", exc)
                refusal = encode_frame(ERROR, str(exc).encode(), ERR_PROTOCOL)
            except OSError as exc:
                logger.info("KV data plane: dropped a client: %s", exc)
                return
            if refusal is not None:
                await _refuse(sock, refusal)

    async def _serve(self, sock: socket.socket) -> bytes | None:
        """Serve one HELLO + READ; returns the ERROR frame to close with, None when all went well."""
        io_s, what = self.config.io_timeout_s, "KV client"
        hello = await recv_frame(sock, io_s, what)
        refusal = self._check_hello(hello)
        if refusal is not None:
            return refusal
        hello_ok = encode_frame(HELLO_OK, self.buffer.layout.to_json().encode())
        read = await recv_frame(sock, io_s, what)  # pipelined by the client right behind its HELLO
        if read.kind != READ:
            return hello_ok + encode_frame(ERROR, b"expected READ", ERR_PROTOCOL)
        lease_id, block_ids = decode_read(read.payload)
        refusal = self._check_read(lease_id, block_ids)
        if refusal is not None:
            return hello_ok + refusal
        num_bytes = len(block_ids) * self.buffer.layout.bytes_per_block
        header = memoryview(hello_ok + encode_frame(DATA, struct.pack("<Q", num_bytes)))
        await _transfer(sock, [header, *self.buffer.segments(block_ids)], write=True, timeout_s=io_s, what=what)
        # DONE only if the lease held for the whole read: its blocks cannot have been freed and reused.
        await send_frame(sock, self._check_read(lease_id, block_ids) or encode_frame(DONE), io_s, what)
        return None

    def _check_hello(self, frame: Frame) -> bytes | None:
        """None if the client may go on, else the ERROR frame to send."""
        if frame.kind != HELLO:
            return encode_frame(ERROR, b"expected HELLO", ERR_PROTOCOL)
        try:
            self.buffer.layout.check_compatible(KVLayout.from_json(frame.payload))
        except LayoutMismatch as exc:
            logger.warning("KV data plane: refused a client: %s", exc)
            return encode_frame(ERROR, self.buffer.layout.to_json().encode(), ERR_LAYOUT)
        except KVTransferError as exc:
            return encode_frame(ERROR, str(exc).encode(), ERR_PROTOCOL)
        return None

    def _check_read(self, lease_id: str, block_ids: list[int]) -> bytes | None:
        try:
            if len(block_ids) > self.config.max_blocks_per_read:
                raise KVTransferError(f"{len(block_ids)} blocks exceed max_blocks_per_read")
            check_read(self.buffer, self.resolve, lease_id, block_ids)
        except LeaseNotFound as exc:
            return encode_frame(ERROR, str(exc).encode(), ERR_LEASE)
        except KVTransferError as exc:
            return encode_frame(ERROR, str(exc).encode(), ERR_REFUSED)
        except Exception:
            logger.exception("KV data plane: lease resolver failed")
            return encode_frame(ERROR, b"internal error resolving the lease", ERR_INTERNAL)
        return None


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


# --- client ---------------------------------------------------------------------------------------


class TcpClient:
    """Pulls leased blocks from ``tcp://`` servers; one connection per pull, HELLO and READ pipelined."""

    def __init__(self, config: TransportConfig | None = None) -> None:
        self.config = config or TransportConfig()

    async def pull(
        self,
        uri: str,
        layout: KVLayout,
        lease_id: str,
        src_block_ids: Sequence[int],
        dst_buffer: KVBuffer,
        dst_block_ids: Sequence[int],
    ) -> TransferStats:
        start = time.perf_counter()
        check_pull_args(layout, src_block_ids, dst_buffer, dst_block_ids)
        request = [
            memoryview(encode_frame(HELLO, layout.to_json().encode())),
            memoryview(encode_frame(READ, encode_read(lease_id, [int(b) for b in src_block_ids]))),
        ]
        views = dst_buffer.segments(dst_block_ids)  # [num_layers x runs of dst ids], views into dst
        num_bytes = len(src_block_ids) * layout.bytes_per_block
        io_s, what = self.config.io_timeout_s, f"KV server {uri}"
        with await self._connect(uri) as sock:
            try:  # the first write also waits for the connection to complete
                await _transfer(sock, request, write=True, timeout_s=self.config.connect_timeout_s, what=what)
                _check_hello_ok(uri, layout, await recv_frame(sock, io_s, what))
                _check_data(uri, num_bytes, await recv_frame(sock, io_s, what))
                await _transfer(sock, views, write=False, timeout_s=io_s, what=what)
                done = await recv_frame(sock, io_s, what)
            except OSError as exc:
                raise KVTransferError(f"KV pull from {uri} failed: {exc!r}") from exc
        if done.kind != DONE:
            raise _remote_error(uri, done)
        seconds = time.perf_counter() - start
        return TransferStats(num_blocks=len(src_block_ids), num_bytes=num_bytes, seconds=seconds)

    async def _connect(self, uri: str) -> socket.socket:
        family, addr = await _resolve(uri, self.config.connect_timeout_s)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            _tune(sock, self.config)
            err = sock.connect_ex(addr)  # completes (or fails) while the request is written
            if err not in (0, errno.EINPROGRESS):
                raise KVTransferError(f"cannot connect to KV server {uri}: {os.strerror(err)}")
        except BaseException:
            sock.close()
            raise
        return sock


async def _resolve(uri: str, timeout_s: float) -> tuple[int, tuple]:
    """``tcp://host:port`` -> (address family, socket address); numeric hosts skip the resolver thread."""
    parts = urlsplit(uri)
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise KVTransferError(f"bad KV data-plane URI {uri!r}: {exc}") from exc
    if parts.scheme != "tcp" or not host or port is None:
        raise KVTransferError(f"bad KV data-plane URI {uri!r} (want tcp://host:port)")
    for family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            socket.inet_pton(family, host)
            return family, (host, port)
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout_s)
    except OSError as exc:
        raise KVTransferError(f"cannot resolve KV server {uri}: {exc!r}") from exc
    return infos[0][0], infos[0][4]


def _check_hello_ok(uri: str, layout: KVLayout, frame: Frame) -> None:
    if frame.kind not in (HELLO_OK, ERROR) or (frame.kind == ERROR and frame.code != ERR_LAYOUT):
        raise _remote_error(uri, frame)
    layout.check_compatible(KVLayout.from_json(frame.payload))  # both carry the server's layout
    if frame.kind == ERROR:
        raise LayoutMismatch(f"KV server {uri} refused the layout")


def _check_data(uri: str, expected: int, frame: Frame) -> None:
    if frame.kind != DATA:
        raise _remote_error(uri, frame)
    (num_bytes,) = struct.unpack("<Q", frame.payload)
    if num_bytes != expected:
        raise KVTransferError(f"KV server {uri} announced {num_bytes} bytes, expected {expected}")


def _remote_error(uri: str, frame: Frame) -> KVTransferError:
    if frame.kind != ERROR:
        return KVTransferError(f"KV server {uri}: unexpected frame kind {frame.kind}")
    message = f"KV server {uri} refused: {frame.payload.decode(errors='replace')}"
    return LeaseNotFound(message) if frame.code == ERR_LEASE else KVTransferError(message)
