"""Client connections to the socket transports' KV servers (``tcp://``, ``cma://``): open, keep, reuse.

Opening a connection per pull costs a TCP handshake and socket setup (~7 ms a pull on a loaded host), most
of a 1k-token pull. So a client keeps a few idle connections per server in a ``ConnectionPool`` and runs
each pull as one exchange (the transport's frames, unchanged) on one of them:

- a pull takes the most recently used idle connection to its server (keyed by the server's URI), or opens one;
- the connection goes back to the pool only when the exchange completed cleanly (the server's DONE); after
  any error, refusal, timeout, cancellation or partial read it is closed, so no later pull can ever read
  the rest of an old answer;
- at most ``max_idle_per_peer`` idle connections per server, each kept at most ``idle_timeout_s`` (shorter
  than the servers' ``socket_server.SERVER_IDLE_S``, so a client seldom reuses one its server is closing);
  ``close()`` closes them all (so does garbage collection of the pool);
- an idle connection the server closed meanwhile (restart, idle timeout) is noticed when taken (EOF or a
  reset waiting on it), or else by ``send_request``: the server closes it before the first byte of its
  answer, the exchange raises ``NotAnswered`` and runs once more on a new connection. Only then: no byte
  was answered, so replies cannot mix; the request is rebuilt (a fresh HMAC nonce), and reading a lease
  twice is harmless (reads do not consume it; the ack does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from kv_transfer.errors import KVTransferError, PeerUnreachable
from kv_transfer.protocol import check_hello_ok, remote_error, sign_read, verify_done
from kv_transfer.socket_server import ReadKinds
from kv_transfer.tcp_wire import peek_byte, recv_frame, send_frame, transfer, tune_socket
from kv_transfer.transport import KVClient, Pull, TransportConfig, parse_uri
from kv_transfer.wire import DONE, READ_CHECKSUM, Frame, ReadRequest, encode_frame, encode_read

logger = logging.getLogger(__name__)

MAX_IDLE_PER_PEER = 4
CLIENT_IDLE_S = 30.0  # below socket_server.SERVER_IDLE_S: the client drops an idle connection first
T = TypeVar("T")


UNREACHABLE_HINT = ("is the address the serving worker registered one this host can reach? check its --host, "
                    "--kv-advertise-uri and the network between them")


class NotAnswered(KVTransferError):
    """The connection failed, or the server closed it, before the first byte of its answer."""


class ConnectionPool:
    """Idle client connections per server URI; ``run`` performs one exchange on one of them."""

    def __init__(self, *, max_idle_per_peer: int = MAX_IDLE_PER_PEER, idle_timeout_s: float = CLIENT_IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_idle_per_peer, self.idle_timeout_s, self._clock = max_idle_per_peer, idle_timeout_s, clock
        self._idle: dict[str, list[tuple[socket.socket, float]]] = {}  # uri -> (socket, idle since), oldest first
        self._finalizer = weakref.finalize(self, _close_all, self._idle)

    def num_idle(self, peer: str | None = None) -> int:
        return sum(len(v) for k, v in self._idle.items() if peer is None or k == peer)

    async def run(self, peer: str, connect: Callable[[], Awaitable[socket.socket]],
                  exchange: Callable[[socket.socket], Awaitable[T]]) -> T:
        """``exchange(sock)`` on an idle connection to ``peer``, else on a new one from ``connect``; retried once
        on a new connection when a pooled one raises ``NotAnswered``."""
        sock = self._take(peer)
        if sock is not None:
            try:
                return await self._exchange(peer, sock, exchange)
            except NotAnswered as exc:
                logger.debug("KV data plane: pooled connection to %s was closed (%s); retrying on a new one", peer, exc)
        return await self._exchange(peer, await connect(), exchange)

    def close(self) -> None:
        """Close every idle connection; connections of pulls still running close when they end."""
        self._finalizer()

    async def _exchange(self, peer: str, sock: socket.socket, exchange: Callable[[socket.socket], Awaitable[T]]) -> T:
        try:
            result = await exchange(sock)
        except BaseException:  # an error, a timeout, a cancellation: the stream's position is unknown
            sock.close()
            raise
        self._give(peer, sock)
        return result

    def _take(self, peer: str) -> socket.socket | None:
        self._expire()
        idle = self._idle.get(peer, [])
        while idle:
            sock, _ = idle.pop()
            if _reusable(sock):
                return sock
            sock.close()
        return None

    def _give(self, peer: str, sock: socket.socket) -> None:
        if not self._finalizer.alive:  # the pool was closed during the exchange
            sock.close()
            return
        idle = self._idle.setdefault(peer, [])
        idle.append((sock, self._clock()))
        while len(idle) > self.max_idle_per_peer:
            idle.pop(0)[0].close()

    def _expire(self) -> None:
        """Close connections idle for longer than ``idle_timeout_s``, to every peer."""
        cutoff = self._clock() - self.idle_timeout_s
        for peer, idle in list(self._idle.items()):
            for sock, since in idle:
                if since < cutoff:
                    sock.close()
            idle[:] = [(sock, since) for sock, since in idle if since >= cutoff]
            if not idle:
                del self._idle[peer]


class PooledClient(KVClient):
    """A client whose pulls run on the connections of its ``ConnectionPool`` (tcp, cma)."""

    def __init__(self, config: TransportConfig | None = None, *, pool: ConnectionPool | None = None) -> None:
        super().__init__(config)
        self.pool = pool or ConnectionPool()

    def close(self) -> None:
        """Close the idle connections (those of pulls still running close when they end)."""
        self.pool.close()

    async def one_sided_read(self, request: Pull, scheme: str, kinds: ReadKinds, read_done: int, flags: int,
                             read: Callable[[socket.socket], Awaitable[bool | None]],
                             shortcut: Callable[[socket.socket], Awaitable[Frame | None]] | None = None) -> None:
        """A pull whose bytes the client reads itself (cma, nixl), as one exchange on a pooled connection:
        HELLO + READ (signed per attempt: a retry carries a fresh nonce; ``flags`` and READ_CHECKSUM as
        configured) -> HELLO_OK checked -> ``read(sock)`` (the transport's answer frame and its reading of
        the bytes; True if it sent ``read_done`` itself) -> ``read_done`` -> DONE, whose checksums are verified
        when asked. ``shortcut(sock)``, tried first on each connection: the DONE frame of an exchange of the
        transport's own, or None (nothing sent) for the one above."""
        uri, layout = request.uri, request.layout
        io_s, what = self.config.io_timeout_s, f"KV server {uri}"

        async def exchange(sock: socket.socket) -> Frame:
            if shortcut is not None and (done := await shortcut(sock)) is not None:
                return done
            hello = layout.to_json().encode()
            payload, signed = sign_read(self.config, kinds.read, hello,
                                        encode_read(ReadRequest(request.lease_id, request.src_ids)))
            code = signed | flags | (READ_CHECKSUM if self.config.checksum else 0)
            await send_request(sock, [encode_frame(kinds.hello, hello), encode_frame(kinds.read, payload, code)],
                               self.config, what)
            check_hello_ok(uri, layout, await recv_frame(sock, io_s, what), kinds.hello_ok)
            if not await read(sock):  # the transport may have sent ``read_done`` itself
                await send_frame(sock, encode_frame(read_done), io_s, what)
            done = await recv_frame(sock, io_s, what)
            if done.kind != DONE:
                raise remote_error(uri, done)
            return done

        try:
            done = await self.pool.run(uri, lambda: connect_socket(uri, self.config, scheme), exchange)
        except OSError as exc:
            raise KVTransferError(f"KV pull from {uri} failed: {exc!r}") from exc
        if self.config.checksum:
            verify_done(uri, request.dst_buffer, request.dst_ids, done.payload)


def _close_all(idle: dict[str, list[tuple[socket.socket, float]]]) -> None:
    for conns in idle.values():
        for sock, _ in conns:
            sock.close()
    idle.clear()


def _reusable(sock: socket.socket) -> bool:
    """True when an idle connection is still open and has nothing to read (no EOF, reset or stray bytes)."""
    try:
        sock.recv(1, socket.MSG_PEEK)  # b"": the server closed it; a byte: stray data; either way not reusable
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    return False


async def send_request(sock: socket.socket, frames: Sequence[bytes], config: TransportConfig, what: str) -> None:
    """Write a request's frames (the first write on a new connection also waits for it to complete), then
    wait for the first byte of the answer; ``NotAnswered`` when the connection fails or is closed before it."""
    try:
        await transfer(sock, [memoryview(f) for f in frames], write=True, timeout_s=config.connect_timeout_s,
                        what=what)
        answered = await peek_byte(sock, config.io_timeout_s, what)
    except OSError as exc:
        raise NotAnswered(f"{what}: connection failed before an answer: {exc!r}") from exc
    if not answered:
        raise NotAnswered(f"{what} closed the connection before answering")


async def connect_socket(uri: str, config: TransportConfig, scheme: str = "tcp") -> socket.socket:
    """A non-blocking socket connected to ``scheme://host:port``; ``PeerUnreachable`` when the connection is
    refused, has no route, or is not accepted within ``connect_timeout_s`` (an address this host cannot reach)."""
    family, addr = await _resolve(uri, config.connect_timeout_s, scheme)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        tune_socket(sock, config)
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, addr), config.connect_timeout_s)
    except TimeoutError:
        sock.close()
        raise PeerUnreachable(f"cannot connect to KV server {uri}: no answer in {config.connect_timeout_s:g} s "
                              f"({UNREACHABLE_HINT})") from None
    except OSError as exc:
        sock.close()
        raise PeerUnreachable(f"cannot connect to KV server {uri}: {exc.strerror or exc!r} "
                              f"({UNREACHABLE_HINT})") from exc
    except BaseException:
        sock.close()
        raise
    return sock


async def _resolve(uri: str, timeout_s: float, scheme: str = "tcp") -> tuple[int, tuple]:
    """``scheme://host:port`` -> (address family, socket address); numeric hosts skip the resolver thread."""
    host, port = parse_uri(uri, scheme)
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
