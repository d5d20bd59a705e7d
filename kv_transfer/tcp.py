"""``tcp://host:port``: the KV data plane over TCP, zero-copy on both ends.

Wire protocol (little-endian; no pickle, no object deserialization). Every control message is a frame,
a 12-byte header ``magic b"BTKV" | version u8 | kind u8 | code u16 | payload_len u32`` and a payload.
One pull is one exchange, one round trip:

    client -> HELLO     the client's KVLayout JSON
              READ      u16 len | lease id | u32 count | count x u32 source block ids   (pipelined);
                        code: flags, READ_CHECKSUM asks for per-block checksums
    server -> ERROR     layout mismatch: refused before any KV byte moves (the READ is drained unread)
           or HELLO_OK  the server's KVLayout JSON (the client checks it too), then
              ERROR     unknown/expired lease, block not in the lease, out of range: nothing moves
           or DATA      u64 num_bytes, then num_bytes raw KV bytes in wire order (layout.py), then
              DONE      the lease was still live after the last byte (else ERROR: it ended mid-read);
                        payload: count x u64 xxh3-64 of the blocks as sent, when READ_CHECKSUM asked

ERROR carries a code (``ERR_*``) and a UTF-8 message; the client raises LayoutMismatch, LeaseNotFound,
Unauthenticated or KVTransferError from it. With a data-plane secret (``TransportConfig.secret``) the READ
sets ``READ_AUTH`` and ends with an HMAC trailer over HELLO + READ (``kv_transfer/auth.py``); a server with
a secret refuses (``ERR_AUTH``) any READ without a valid one before any KV byte moves. HELLO_OK goes out with DATA in one write, once the READ is checked.
Streaming (layer-wise, ``kv_transfer/progress.py``): a server given a ``progress`` lookup serves a lease
whose ``LayerProgress`` is not yet complete and ready by sending each layer's segments once that layer is
computed, with the lease checked before each layer and after the last byte; the bytes and frames are the
same, the client needs no change and only gets them earlier. A layer not computed within ``io_timeout_s``,
a failed progress or a lease that ends mid-stream: the rest of DATA is sent as zeros and ERROR replaces DONE.
Checksums (``TransportConfig.checksum`` on the client) are computed before the first byte is sent (when
streaming: once the last layer is computed) and verified by the client once DONE arrives
(``ChecksumMismatch`` names the bad destination blocks); with the flag off neither side touches the bytes.
Flags extend version 1 compatibly (see ``tcp_wire.READ_CHECKSUM``).

Connections are kept alive (the frames of one exchange are unchanged): the server serves exchanges one after
another on a connection until the client closes it, it sits idle for ``tcp_wire.SERVER_IDLE_S``, or an
exchange ends in ERROR (the server then closes it). Each READ is authenticated on its own. A client keeps a
few idle connections per server (``kv_transfer/conn_pool.py``) and reuses one only after a clean DONE; a
server that predates keep-alive closes after each exchange, which its clients notice and reconnect.

Zero copy: the server hands the leased blocks' memoryviews (one per layer per run of consecutive
block ids) to ``sendmsg`` (gather), and the client ``recvmsg_into``s the stream straight into the
destination blocks' memoryviews (scatter), up to IOV_MAX views per system call, on non-blocking
sockets driven by the event loop. Every wait on the peer is bounded by ``TransportConfig`` timeouts.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable, Sequence

from kv_transfer import auth, checksum
from kv_transfer.conn_pool import PooledClient, connect_socket, send_request
from kv_transfer.errors import KVTransferError, LayoutMismatch, LeaseNotFound
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.progress import LayerProgress, ProgressLookup
from kv_transfer.tcp_wire import (  # noqa: F401 - re-exported: the protocol's names live with it
    DATA, DONE, ERR_AUTH, ERR_INTERNAL, ERR_LAYOUT, ERR_LEASE, ERR_PROTOCOL, ERR_REFUSED, ERROR, HEADER, HELLO,
    HELLO_OK, READ, READ_AUTH, READ_CHECKSUM, Frame, SocketServer, _refuse, _transfer, decode_read, encode_frame,
    encode_read, recv_frame, send_frame,
)
from kv_transfer.transport import Resolver, TransferStats, TransportConfig, check_pull_args, check_read

logger = logging.getLogger(__name__)

class TcpServer(SocketServer):
    """Serves reads of leased blocks of ``buffer``; ``resolve`` maps a lease id to its block ids."""

    scheme = "tcp"

    def __init__(self, *, buffer: KVBuffer, resolve: Resolver, config: TransportConfig | None = None,
                 progress: ProgressLookup | None = None) -> None:
        self.buffer = buffer
        self.resolve = resolve
        self.progress = progress  # lease id -> LayerProgress while its prompt computes: streamed reads
        self._init_listener(config or TransportConfig())
        self.auth = auth.ReadAuth(self.config.secret) if self.config.secret else None

    async def _serve(self, sock: socket.socket) -> bytes | None:
        """Serve one HELLO + READ; returns the ERROR frame to close with, None after a DONE (the connection
        then serves the client's next request)."""
        io_s, what = self.config.io_timeout_s, "KV client"
        hello = await recv_frame(sock, io_s, what)
        refusal = self._check_hello(hello)
        if refusal is not None:
            return refusal
        hello_ok = encode_frame(HELLO_OK, self.buffer.layout.to_json().encode())
        read = await recv_frame(sock, io_s, what)  # pipelined by the client right behind its HELLO
        if read.kind != READ:
            return hello_ok + encode_frame(ERROR, b"expected READ", ERR_PROTOCOL)
        request, trailer = auth.split_trailer(read.payload, bool(read.code & READ_AUTH))
        refusal = refuse_unauthenticated(self.auth, READ, hello.payload + request, trailer)
        if refusal is not None:
            return hello_ok + refusal
        lease_id, block_ids = decode_read(request)
        refusal = self._check_read(lease_id, block_ids)
        if refusal is not None:
            return hello_ok + refusal
        num_bytes = len(block_ids) * self.buffer.layout.bytes_per_block
        header = memoryview(hello_ok + encode_frame(DATA, struct.pack("<Q", num_bytes)))
        progress = self.progress(lease_id) if self.progress is not None else None
        if progress is not None and not progress.is_ready:
            done = await self._stream(sock, header, lease_id, block_ids, progress, bool(read.code & READ_CHECKSUM))
        else:
            sums = checksum.block_checksums(self.buffer, block_ids) if read.code & READ_CHECKSUM else None
            await _transfer(sock, [header, *self.buffer.segments(block_ids)], write=True, timeout_s=io_s, what=what)
            # DONE only if the lease held for the whole read: its blocks cannot have been freed and reused.
            done = self._check_read(lease_id, block_ids) or encode_frame(DONE, b"" if sums is None else sums.tobytes())
        if HEADER.unpack_from(done)[2] != DONE:
            return done  # an ERROR after the bytes: sent, then the connection closes
        await send_frame(sock, done, io_s, what)
        return None

    async def _stream(self, sock: socket.socket, header: memoryview, lease_id: str, block_ids: list[int],
                      progress: LayerProgress, sums: bool) -> bytes:
        """Send DATA's bytes layer by layer as ``progress`` completes them; returns the DONE (or ERROR)."""
        io_s, what = self.config.io_timeout_s, "KV client"
        assert progress.num_layers == self.buffer.layout.num_layers, "a progress of another model's layers"
        views = self.buffer.segments(block_ids)  # layer-major: runs_per_layer views per layer
        runs_per_layer = len(views) // progress.num_layers
        await _transfer(sock, [header], write=True, timeout_s=io_s, what=what)
        refusal = None
        async for layers, refusal in computed_layers(progress, io_s, lambda: self._check_read(lease_id, block_ids)):
            if refusal is None:
                batch = views[layers.start * runs_per_layer : layers.stop * runs_per_layer]
            else:  # the rest of DATA as zeros (never stale KV), then the ERROR ends the stream
                batch = _zeros(len(layers) * len(block_ids) * self.buffer.segment_bytes)
            await _transfer(sock, batch, write=True, timeout_s=io_s, what=what)
        if refusal is not None:
            return refusal
        done = encode_frame(DONE, checksum.block_checksums(self.buffer, block_ids).tobytes() if sums else b"")
        return self._check_read(lease_id, block_ids) or done

    def _check_hello(self, frame: Frame) -> bytes | None:
        """None if the client may go on, else the ERROR frame to send."""
        if frame.kind != HELLO:
            return encode_frame(ERROR, b"expected HELLO", ERR_PROTOCOL)
        return refuse_layout(self.buffer.layout, frame.payload)

    def _check_read(self, lease_id: str, block_ids: list[int]) -> bytes | None:
        return refuse_read(self.buffer, self.resolve, self.config, lease_id, block_ids)


async def computed_layers(progress: LayerProgress, timeout_s: float,
                          check_lease: Callable[[], bytes | None]) -> AsyncIterator[tuple[range, bytes | None]]:
    """A streamed read's layers as they become computed: ``(layers, None)`` for each new range of computed
    layers while ``check_lease()`` finds the lease live, up to the last layer; or, instead, once
    ``(the layers not yet sent, ERROR frame)`` (a layer not computed within ``timeout_s``, a failed
    progress, a lease that ended), and no more. Shared by the streaming servers (tcp, cma, nccl)."""
    sent = 0
    while sent < progress.num_layers:
        ready = max(sent + 1, progress.num_complete)  # every layer complete by now, in one batch
        refusal = await _await_layers(progress, ready, timeout_s, check_lease)
        yield range(sent, progress.num_layers if refusal else ready), refusal
        if refusal is not None:
            return
        sent = ready


async def _await_layers(progress: LayerProgress, num_layers: int, timeout_s: float,
                        check_lease: Callable[[], bytes | None]) -> bytes | None:
    """None once ``num_layers`` layers are computed and the lease still holds, else the ERROR frame."""
    try:
        await progress.wait(num_layers, timeout_s)
    except KVTransferError as exc:
        logger.warning("KV data plane: streamed read failed: %s", exc)
        return encode_frame(ERROR, str(exc).encode(), ERR_REFUSED)
    return check_lease()


def refuse_unauthenticated(read_auth: auth.ReadAuth | None, kind: int, request: bytes,
                           trailer: bytes | None) -> bytes | None:
    """None if the read may go on (no secret configured, or a valid trailer), else the ERROR frame."""
    try:
        auth.check(read_auth, kind, request, trailer)
    except auth.Unauthenticated:
        logger.warning("KV data plane: refused a read without valid credentials")
        return encode_frame(ERROR, b"unauthenticated: this KV server requires the data-plane secret", ERR_AUTH)
    return None


def sign_read(config: TransportConfig, kind: int, context: bytes, request: bytes) -> tuple[bytes, int]:
    """(payload, flag bits) of a read: ``request`` plus an HMAC trailer over ``context + request`` when the
    client holds a secret."""
    if not config.secret:
        return request, 0
    return request + auth.ReadAuth(config.secret).sign(kind, context + request), READ_AUTH


def refuse_layout(layout: KVLayout, payload: bytes) -> bytes | None:
    """None if the client's layout JSON matches ``layout``, else the ERROR frame to send."""
    try:
        layout.check_compatible(KVLayout.from_json(payload))
    except LayoutMismatch as exc:
        logger.warning("KV data plane: refused a client: %s", exc)
        return encode_frame(ERROR, layout.to_json().encode(), ERR_LAYOUT)
    except KVTransferError as exc:
        return encode_frame(ERROR, str(exc).encode(), ERR_PROTOCOL)
    return None


def refuse_read(
    buffer: KVBuffer, resolve: Resolver, config: TransportConfig, lease_id: str, block_ids: list[int]
) -> bytes | None:
    """None if the lease is live and covers the blocks, else the ERROR frame to send."""
    try:
        if len(block_ids) > config.max_blocks_per_read:
            raise KVTransferError(f"{len(block_ids)} blocks exceed max_blocks_per_read")
        check_read(buffer, resolve, lease_id, block_ids)
    except LeaseNotFound as exc:
        return encode_frame(ERROR, str(exc).encode(), ERR_LEASE)
    except KVTransferError as exc:
        return encode_frame(ERROR, str(exc).encode(), ERR_REFUSED)
    except Exception:
        logger.exception("KV data plane: lease resolver failed")
        return encode_frame(ERROR, b"internal error resolving the lease", ERR_INTERNAL)
    return None


def _zeros(num_bytes: int, chunk_bytes: int = 1 << 20) -> list[memoryview]:
    """Views of zeros totalling ``num_bytes`` (the rest of a stream that failed: never stale KV)."""
    chunk = memoryview(bytes(min(num_bytes, chunk_bytes)))
    full, rest = divmod(num_bytes, chunk_bytes)
    return [chunk] * full + ([chunk[:rest]] if rest else [])


# --- client ---------------------------------------------------------------------------------------


class TcpClient(PooledClient):
    """Pulls leased blocks from ``tcp://`` servers: one exchange per pull (HELLO and READ pipelined) on a
    pooled connection (``conn_pool``); ``close()`` closes the idle ones."""

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
        src_ids = [int(b) for b in src_block_ids]
        num_bytes = len(src_ids) * layout.bytes_per_block
        io_s, what = self.config.io_timeout_s, f"KV server {uri}"

        async def exchange(sock: socket.socket) -> Frame:
            hello = layout.to_json().encode()  # signed per attempt: a retry carries a fresh nonce
            read, flags = sign_read(self.config, READ, hello, encode_read(lease_id, src_ids))
            flags |= READ_CHECKSUM if self.config.checksum else 0
            await send_request(sock, [encode_frame(HELLO, hello), encode_frame(READ, read, flags)], self.config, what)
            _check_hello_ok(uri, layout, await recv_frame(sock, io_s, what))
            _check_data(uri, num_bytes, await recv_frame(sock, io_s, what))
            views = dst_buffer.segments(dst_block_ids)  # [num_layers x runs of dst ids], views into dst
            await _transfer(sock, views, write=False, timeout_s=io_s, what=what)
            done = await recv_frame(sock, io_s, what)
            if done.kind != DONE:
                raise _remote_error(uri, done)
            if self.config.checksum:  # inside the exchange: a link that corrupted bytes is not reused
                verify_done(uri, dst_buffer, dst_block_ids, done.payload)
            return done

        try:
            await self.pool.run(uri, lambda: connect_socket(uri, self.config), exchange)
        except OSError as exc:
            raise KVTransferError(f"KV pull from {uri} failed: {exc!r}") from exc
        seconds = time.perf_counter() - start
        return TransferStats(num_blocks=len(src_ids), num_bytes=num_bytes, seconds=seconds)


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


def verify_done(uri: str, dst_buffer: KVBuffer, dst_block_ids: Sequence[int], payload: bytes) -> None:
    """Check the landed blocks against the checksums DONE carried (ChecksumMismatch names the bad ones)."""
    if len(payload) != checksum.DTYPE.itemsize * len(dst_block_ids):
        raise KVTransferError(f"KV server {uri} sent {len(payload)} bytes of checksums for {len(dst_block_ids)} "
                              "blocks (a server without checksum support?)")
    checksum.verify(dst_buffer, dst_block_ids, payload)


def _remote_error(uri: str, frame: Frame) -> KVTransferError:
    if frame.kind != ERROR:
        return KVTransferError(f"KV server {uri}: unexpected frame kind {frame.kind}")
    message = f"KV server {uri} refused: {frame.payload.decode(errors='replace')}"
    if frame.code == ERR_AUTH:
        return auth.Unauthenticated(message)
    return LeaseNotFound(message) if frame.code == ERR_LEASE else KVTransferError(message)
