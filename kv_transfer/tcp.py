"""``tcp://host:port``: the KV data plane over TCP, zero-copy on both ends.

Wire protocol: the frames of ``kv_transfer/wire.py`` (a 12-byte header and a payload; no pickle, no object
deserialization).
One pull is one exchange, one round trip:

    client -> HELLO     the client's KVLayout JSON
              READ      ``wire.encode_read``: u16 len | lease id | u32 count | count x u32 source block ids
                        (pipelined);
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
a secret refuses (``ERR_AUTH``) any READ without a valid one before any KV byte moves. HELLO_OK goes out
with DATA in one write, once the READ is checked (``socket_server.SocketServer._receive_read``).
Streaming (layer-wise, ``kv_transfer/progress.py``): a server given a ``progress`` lookup serves a lease
whose ``LayerProgress`` is not yet complete and ready by sending each layer's segments once that layer is
computed, with the lease checked before each layer and after the last byte; the bytes and frames are the
same, the client needs no change and only gets them earlier. A layer not computed within ``io_timeout_s``,
a failed progress or a lease that ends mid-stream: the rest of DATA is sent as zeros and ERROR replaces DONE.
Checksums (``TransportConfig.checksum`` on the client) are computed before the first byte is sent (when
streaming: once the last layer is computed) and verified by the client once DONE arrives
(``ChecksumMismatch`` names the bad destination blocks); with the flag off neither side touches the bytes.
Flags extend version 1 compatibly (see ``wire.READ_CHECKSUM``).

Connections are kept alive (the frames of one exchange are unchanged): the server serves exchanges one after
another on a connection until the client closes it, it sits idle for ``socket_server.SERVER_IDLE_S``, or an
exchange ends in ERROR (the server then closes it). Each READ is authenticated on its own. A client keeps a
few idle connections per server (``kv_transfer/conn_pool.py``) and reuses one only after a clean DONE; a
server that predates keep-alive closes after each exchange, which its clients notice and reconnect.

Zero copy: the server hands the leased blocks' memoryviews (one per layer per run of consecutive
block ids) to ``sendmsg`` (gather), and the client ``recvmsg_into``s the stream straight into the
destination blocks' memoryviews (scatter), each system call handed the views its next 2 MiB cover
(``tcp_wire.CALL_BYTES``, IOV_MAX at most), on non-blocking sockets driven by the event loop. Every wait
on the peer is bounded by ``TransportConfig`` timeouts.
"""

from __future__ import annotations

import socket
import struct

from kv_transfer import checksum
from kv_transfer.conn_pool import PooledClient, connect_socket, send_request
from kv_transfer.errors import KVTransferError
from kv_transfer.progress import LayerProgress
from kv_transfer.protocol import check_data, check_hello_ok, computed_layers, remote_error, sign_read, verify_done
from kv_transfer.socket_server import ReadKinds, SocketServer
from kv_transfer.tcp_wire import recv_frame, send_frame, transfer
from kv_transfer.transport import Pull
from kv_transfer.wire import (
    DATA, DONE, HEADER, HELLO, HELLO_OK, READ, READ_CHECKSUM, Frame, ReadRequest, encode_frame, encode_read,
)


class TcpServer(SocketServer):
    """Serves reads of leased blocks of ``buffer``; ``resolve`` maps a lease id to its block ids."""

    scheme = "tcp"
    kinds = ReadKinds(HELLO, HELLO_OK, READ, not_hello=b"expected HELLO", not_read=b"expected READ")

    async def _serve(self, sock: socket.socket) -> bytes | None:
        """Serve one HELLO + READ; returns the ERROR frame to close with, None after a DONE (the connection
        then serves the client's next request)."""
        io_s, what = self.config.io_timeout_s, "KV client"
        accepted = await self._receive_read(sock)
        if isinstance(accepted, bytes):
            return accepted
        lease_id, block_ids = accepted.request.lease_id, list(accepted.request.block_ids)
        num_bytes = len(block_ids) * self.buffer.layout.bytes_per_block
        header = memoryview(accepted.hello_ok + encode_frame(DATA, struct.pack("<Q", num_bytes)))
        sums = bool(accepted.flags & READ_CHECKSUM)
        if (progress := self._unfinished(lease_id)) is not None:
            done = await self._stream(sock, header, lease_id, block_ids, progress, sums)
        else:
            checksums = checksum.block_checksums(self.buffer, block_ids) if sums else None
            await transfer(sock, [header, *self.buffer.segments(block_ids)], write=True, timeout_s=io_s, what=what)
            # DONE only if the lease held for the whole read: its blocks cannot have been freed and reused.
            done = self._check_read(lease_id, block_ids) or encode_frame(
                DONE, b"" if checksums is None else checksums.tobytes())
        if HEADER.unpack_from(done)[2] != DONE:
            return done  # an ERROR after the bytes: sent, then the connection closes
        await send_frame(sock, done, io_s, what)
        self._served(lease_id, block_ids)
        return None

    async def _stream(self, sock: socket.socket, header: memoryview, lease_id: str, block_ids: list[int],
                      progress: LayerProgress, sums: bool) -> bytes:
        """Send DATA's bytes layer by layer as ``progress`` completes them; returns the DONE (or ERROR)."""
        io_s, what = self.config.io_timeout_s, "KV client"
        assert progress.num_layers == self.buffer.layout.num_layers, "a progress of another model's layers"
        views = self.buffer.segments(block_ids)  # layer-major: runs_per_layer views per layer
        runs_per_layer = len(views) // progress.num_layers
        await transfer(sock, [header], write=True, timeout_s=io_s, what=what)
        refusal = None
        async for layers, refusal in computed_layers(progress, io_s, lambda: self._check_read(lease_id, block_ids)):
            if refusal is None:
                batch = views[layers.start * runs_per_layer : layers.stop * runs_per_layer]
            else:  # the rest of DATA as zeros (never stale KV), then the ERROR ends the stream
                batch = _zeros(len(layers) * len(block_ids) * self.buffer.segment_bytes)
            await transfer(sock, batch, write=True, timeout_s=io_s, what=what)
        if refusal is not None:
            return refusal
        done = encode_frame(DONE, checksum.block_checksums(self.buffer, block_ids).tobytes() if sums else b"")
        return self._check_read(lease_id, block_ids) or done


def _zeros(num_bytes: int, chunk_bytes: int = 1 << 20) -> list[memoryview]:
    """Views of zeros totalling ``num_bytes`` (the rest of a stream that failed: never stale KV)."""
    chunk = memoryview(bytes(min(num_bytes, chunk_bytes)))
    full, rest = divmod(num_bytes, chunk_bytes)
    return [chunk] * full + ([chunk[:rest]] if rest else [])


# --- client ---------------------------------------------------------------------------------------


class TcpClient(PooledClient):
    """Pulls leased blocks from ``tcp://`` servers: one exchange per pull (HELLO and READ pipelined) on a
    pooled connection (``conn_pool``); ``close()`` closes the idle ones."""

    async def _pull(self, request: Pull) -> None:
        uri, layout = request.uri, request.layout
        io_s, what = self.config.io_timeout_s, f"KV server {uri}"

        async def exchange(sock: socket.socket) -> Frame:
            hello = layout.to_json().encode()  # signed per attempt: a retry carries a fresh nonce
            read = encode_read(ReadRequest(request.lease_id, request.src_ids))
            read, flags = sign_read(self.config, READ, hello, read)
            flags |= READ_CHECKSUM if self.config.checksum else 0
            await send_request(sock, [encode_frame(HELLO, hello), encode_frame(READ, read, flags)], self.config, what)
            check_hello_ok(uri, layout, await recv_frame(sock, io_s, what))
            check_data(uri, request.num_bytes, await recv_frame(sock, io_s, what))
            views = request.dst_buffer.segments(request.dst_ids)  # [num_layers x runs of dst ids], views into dst
            first = len(views) // layout.num_layers  # layer 0's runs: when they land is the pull's first layer
            await transfer(sock, views[:first], write=False, timeout_s=io_s, what=what)
            request.landed.first_layer()
            await transfer(sock, views[first:], write=False, timeout_s=io_s, what=what)
            done = await recv_frame(sock, io_s, what)
            if done.kind != DONE:
                raise remote_error(uri, done)
            if self.config.checksum:  # inside the exchange: a link that corrupted bytes is not reused
                verify_done(uri, request.dst_buffer, request.dst_ids, done.payload)
            return done

        try:
            await self.pool.run(uri, lambda: connect_socket(uri, self.config), exchange)
        except OSError as exc:
            raise KVTransferError(f"KV pull from {uri} failed: {exc!r}") from exc
