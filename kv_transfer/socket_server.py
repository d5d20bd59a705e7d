"""The serving side the socket-based transports share (``tcp://``, ``cma://``, ``nccl://``): the leased
buffer they serve, the listening socket, one task per accepted connection, stop; and, for the transports
whose exchange opens with a pipelined HELLO + READ (tcp, cma), receiving and checking that read.

A subclass sets ``scheme`` (and ``kinds``, its HELLO / HELLO_OK / READ frame kinds), implements ``_serve``
(one request on a connection; or overrides ``_serve_connection`` for a connection of its own shape, as
nccl's channels), and may add to the URI (``_uri_query``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kv_transfer import auth
from kv_transfer.errors import KVTransferError
from kv_transfer.progress import LayerProgress, ProgressLookup
from kv_transfer.protocol import locate_read, refuse_layout, refuse_read, refuse_unauthenticated
from kv_transfer.tcp_wire import open_listener, peek_byte, recv_frame, send_refusal, server_uri, tune_socket
from kv_transfer.tensor_buffer import AnyKVBuffer
from kv_transfer.transport import Locator, Resolver, TransportConfig
from kv_transfer.wire import ERR_PROTOCOL, ERROR, READ_AUTH, Frame, ReadRequest, decode_read, encode_frame

logger = logging.getLogger(__name__)

SERVER_IDLE_S = 60.0  # a server closes a connection idle this long between requests (clients: conn_pool)


class ReadKinds(NamedTuple):
    """A transport's frame kinds for HELLO, HELLO_OK and READ, and the refusals of a frame out of place."""

    hello: int
    hello_ok: int
    read: int
    not_hello: bytes
    not_read: bytes


class AcceptedRead(NamedTuple):
    hello_ok: bytes  # the HELLO_OK frame, not yet sent: it goes out with what follows, in one write
    request: ReadRequest
    flags: int  # the READ's ``READ_*`` flags


class SocketServer:
    """Serves reads of leased blocks of ``buffer``; ``resolve`` maps a lease id to its block ids; ``progress``
    (lease id -> LayerProgress while its prompt computes) enables streamed reads; ``locate`` translates a
    read's block ids to where they are in ``buffer`` (host staging), after which every check and read
    uses the translated ids."""

    scheme = ""
    kinds: ReadKinds

    def __init__(self, *, buffer: AnyKVBuffer, resolve: Resolver, config: TransportConfig | None = None,
                 progress: ProgressLookup | None = None, locate: Locator | None = None) -> None:
        self.buffer, self.resolve, self.progress, self.locate = buffer, resolve, progress, locate
        self.config = config or TransportConfig()
        self.auth = auth.ReadAuth(self.config.secret) if self.config.secret else None
        self.uri: str | None = None
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()
        self.num_accepted = 0  # connections accepted so far (pooled clients reuse theirs)
        # told (lease id, block ids as read) after each read that ended in DONE: a holder whose blocks stay pinned
        # until they are read frees them (vLLM's Baton connector); the worker's own leases end by ReleaseLease
        self.on_read: Callable[[str, list[int]], None] | None = None
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
                tune_socket(sock, self.config)
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
                await send_refusal(sock, refusal)

    async def _next_request(self, sock: socket.socket) -> bool:
        """True once the client starts its next request on this connection."""
        try:
            return await peek_byte(sock, self.idle_timeout_s, "idle KV client")
        except (KVTransferError, OSError):
            return False

    async def _serve(self, sock: socket.socket) -> bytes | None:
        """Serve one request; returns the ERROR frame to close with, None when the connection may go on."""
        raise NotImplementedError

    async def _receive_read(self, sock: socket.socket, hello: Frame | None = None) -> AcceptedRead | bytes:
        """A HELLO (``hello`` if the caller received it) and its pipelined READ, checked in order (the layouts,
        the credentials over HELLO + READ, where its blocks are, the lease): the accepted read (its block ids
        translated by ``locate``), or the ERROR frame to close with (behind HELLO_OK once the layouts match, so
        the client checks the server's layout too)."""
        io_s, what, kinds = self.config.io_timeout_s, "KV client", self.kinds
        if hello is None:
            hello = await recv_frame(sock, io_s, what)
        if hello.kind != kinds.hello:
            return encode_frame(ERROR, kinds.not_hello, ERR_PROTOCOL)
        refusal = refuse_layout(self.buffer.layout, hello.payload)
        if refusal is not None:
            return refusal
        hello_ok = encode_frame(kinds.hello_ok, self.buffer.layout.to_json().encode())
        read = await recv_frame(sock, io_s, what)
        if read.kind != kinds.read:
            return hello_ok + encode_frame(ERROR, kinds.not_read, ERR_PROTOCOL)
        payload, trailer = auth.split_trailer(read.payload, bool(read.code & READ_AUTH))
        refusal = refuse_unauthenticated(self.auth, kinds.read, hello.payload + payload, trailer)
        if refusal is not None:
            return hello_ok + refusal
        request = locate_read(self.locate, decode_read(payload))
        if isinstance(request, bytes):
            return hello_ok + request
        refusal = self._check_read(request.lease_id, request.block_ids)
        if refusal is not None:
            return hello_ok + refusal
        return AcceptedRead(hello_ok, request, read.code)

    def _served(self, lease_id: str, block_ids: list[int]) -> None:
        """A read ended in DONE: ``on_read`` is told."""
        if self.on_read is not None:
            self.on_read(lease_id, block_ids)

    def _check_read(self, lease_id: str, block_ids: Sequence[int]) -> bytes | None:
        return refuse_read(self.buffer, self.resolve, self.config, lease_id, block_ids)

    def _unfinished(self, lease_id: str) -> LayerProgress | None:
        """The lease's progress while its KV is still being computed (the read streams), else None."""
        progress = self.progress(lease_id) if self.progress is not None else None
        return progress if progress is not None and not progress.is_ready else None
