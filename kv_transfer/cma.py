"""``cma://host:port``: the KV data plane between processes on ONE host, by cross-memory attach.

The pulling process copies the leased blocks straight out of the serving process's memory with
``process_vm_readv(2)`` (what UCX's CMA transport, and so NIXL, uses on one host): one kernel copy, no
socket buffers, no loopback TCP. Control runs over a TCP connection with ``wire``'s frames, in frame
kinds of its own (``C_*``), so a ``tcp://`` peer and a ``cma://`` peer refuse each other cleanly.
One pull is one exchange, two round trips, on a kept-alive connection (as tcp's: the server serves
exchanges one after another and closes after an ERROR; clients pool idle connections, ``conn_pool``):

    client -> C_HELLO     the client's KVLayout JSON
              C_READ      ``wire.encode_read`` (u16 len | lease id | u32 count | count x u32 source block ids),
                          pipelined; code: flags, READ_CHECKSUM / READ_AUTH exactly as tcp (the HMAC
                          trailer covers C_HELLO + C_READ)
    server -> ERROR       layout mismatch: refused before any KV byte moves
           or C_HELLO_OK  the server's KVLayout JSON (the client checks it too), then
              ERROR       unauthenticated, unknown/expired lease, block not in the lease, out of range
           or C_IOVECS    u32 pid | 16-byte boot id | u64 pid-namespace inode | u64 probe address |
                          16-byte probe | u32 count | count x (u64 address, u64 length): one iovec per
                          layer per run of consecutive source blocks, in wire order (layout.py)
    client               checks the boot id and pid namespace are its own (else refuses: another host or
                          container), reads the 16-byte probe at its address and compares it (the pid is
                          the server, not a recycled pid; any of these failing raises TransportUnusable
                          and the puller's next transport serves the pair: kv_transfer/pairs.py), then
                          ``process_vm_readv``s the blocks straight into its destination blocks (paired
                          runs; at most IOV_MAX iovecs a side a call; partial reads resumed)
    client -> C_READ_DONE
    server -> DONE        the lease was still live after the client's last byte (so no block was freed and
                          reused under the read); payload: one xxh3-64 per block, computed over the
                          source blocks BEFORE the iovecs were sent, when READ_CHECKSUM asked
           or ERROR       the lease ended during the read: the client raises, its destination is undefined

Streaming (layer-wise, ``kv_transfer/cma_stream.py``): a server given a ``progress`` lookup answers a
client that sets READ_STREAM, for a lease still being computed, with a C_IOVECS marked IOVECS_STREAMED and
then one C_LAYERS per batch of computed layers; the client reads each batch's iovecs as it is named.

The server waits for C_READ_DONE at most ``io_timeout_s`` plus one second per GB read. A client that
cannot read the server's memory raises KVTransferError naming why: EPERM (ptrace restrictions:
``/proc/sys/kernel/yama/ptrace_scope``, another user, or a seccomp profile without process_vm_readv) or
ESRCH (the server vanished, or it is in another pid namespace). A server that dies mid-read makes the
read fail (ESRCH/EFAULT) or its C_READ_DONE go unanswered: never a hang, never a successful pull.
Large reads run in a worker thread, batch by batch, each wait bounded by ``io_timeout_s``.

Trust: the client writes only into its own destination blocks (it computes those addresses itself and
checks the server's iovec lengths against the request). The server's lease and HMAC checks gate what a
well-behaved client is handed, but a process allowed to ptrace the server can read all of its memory
anyway: on one host, cma's access control is the kernel's (same user, ptrace_scope), not the lease.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import socket
import struct

import numpy as np

from kv_transfer import checksum
from kv_transfer.cma_memory import boot_id, pid_namespace, readv
from kv_transfer.cma_stream import IOVECS_STREAMED, NOT_STREAMING, announce_layers, read_announced
from kv_transfer.conn_pool import PooledClient
from kv_transfer.errors import KVTransferError, TransportUnusable
from kv_transfer.layout import KVBuffer
from kv_transfer.progress import ProgressLookup
from kv_transfer.protocol import remote_error
from kv_transfer.rows import buffer_iovecs, pair_rows, split_rows
from kv_transfer.socket_server import ReadKinds, SocketServer
from kv_transfer.tcp_wire import recv_frame, send_frame
from kv_transfer.transport import Locator, Pull, Resolver, TransportConfig
from kv_transfer.wire import (
    DONE, ERR_PROTOCOL, ERR_REFUSED, ERROR, MAX_PAYLOAD_BYTES, READ_CHECKSUM, READ_STREAM, Frame, encode_frame,
)

# kinds of their own: a tcp:// (1-6) or nccl:// (17-19) peer refuses them, and vice versa
C_HELLO, C_HELLO_OK, C_READ, C_IOVECS, C_READ_DONE = 33, 34, 35, 36, 37
BATCH_BYTES = 32 << 20  # bytes per process_vm_readv call: a kill or a timeout is noticed between batches
INLINE_BYTES = 1 << 20  # pulls up to this size read on the event loop; larger ones in a worker thread
IOVECS_HEAD = struct.Struct("<I16sQQ16sI")  # pid, boot id, pid-ns inode, probe address, probe, count


# --- server ---------------------------------------------------------------------------------------


class CmaServer(SocketServer):
    """Serves reads of leased blocks of ``buffer`` by handing same-host clients their addresses."""

    scheme = "cma"
    kinds = ReadKinds(C_HELLO, C_HELLO_OK, C_READ, not_hello=b"expected C_HELLO: this is a cma:// KV server",
                      not_read=b"expected C_READ")

    def __init__(self, *, buffer: KVBuffer, resolve: Resolver, config: TransportConfig | None = None,
                 progress: ProgressLookup | None = None, locate: Locator | None = None) -> None:
        super().__init__(buffer=buffer, resolve=resolve, config=config, progress=progress, locate=locate)
        # what C_IOVECS advertises (tests replace them to play a server on another host / a vanished pid)
        self.pid, self.boot_id, self.pid_namespace = os.getpid(), boot_id(), pid_namespace()

    def _uri_query(self) -> str:
        # the boot id lets a puller on another host skip this URI (transport.choose_uri) instead of failing
        return f"?boot={self.boot_id.hex()}"

    async def _serve(self, sock: socket.socket) -> bytes | None:
        """Serve one C_HELLO + C_READ + C_READ_DONE; returns the ERROR frame to close with, None after a DONE
        (the connection then serves the client's next request)."""
        accepted = await self._receive_read(sock)
        if isinstance(accepted, bytes):
            return accepted
        request = accepted.request
        return await self._hand_out(sock, accepted.hello_ok, request.lease_id, list(request.block_ids), accepted.flags)

    async def _hand_out(self, sock: socket.socket, hello_ok: bytes, lease_id: str, block_ids: list[int],
                        flags: int) -> bytes | None:
        """C_IOVECS (streamed: then C_LAYERS as the layers are computed), C_READ_DONE, DONE; returns the ERROR
        frame to close with, None after a DONE."""
        io_s, what = self.config.io_timeout_s, "KV client"
        progress = self._unfinished(lease_id)
        streamed = progress is not None
        if streamed and not flags & READ_STREAM:
            return hello_ok + NOT_STREAMING
        iovecs = buffer_iovecs(self.buffer, block_ids)
        if IOVECS_HEAD.size + iovecs.nbytes > MAX_PAYLOAD_BYTES:
            return hello_ok + encode_frame(ERROR, f"{len(iovecs)} iovecs exceed one cma:// read; read fewer or less "
                                           "fragmented blocks".encode(), ERR_REFUSED)
        # hashed BEFORE the client may read: what it reads must be what was hashed (streamed: once computed)
        hash_blocks = functools.partial(checksum.block_checksums, self.buffer, block_ids)
        sums = hash_blocks().tobytes() if flags & READ_CHECKSUM and not streamed else None
        probe = np.frombuffer(secrets.token_bytes(16), np.uint8).copy()  # alive until the read is done
        head = IOVECS_HEAD.pack(self.pid, self.boot_id, self.pid_namespace, probe.ctypes.data, probe.tobytes(),
                                len(iovecs))
        frame = encode_frame(C_IOVECS, head + iovecs.tobytes(), IOVECS_STREAMED if streamed else 0)
        await send_frame(sock, hello_ok + frame, io_s, what)
        if streamed:
            check = functools.partial(self._check_read, lease_id, block_ids)
            refusal, sums = await announce_layers(sock, progress, io_s, check,
                                                  hash_blocks if flags & READ_CHECKSUM else None)
            if refusal is not None:
                return refusal  # ERROR instead of the next C_LAYERS, then the connection closes
        return await self._finish(sock, lease_id, block_ids, sums, probe)

    async def _finish(self, sock: socket.socket, lease_id: str, block_ids: list[int], sums: bytes | None,
                      probe: np.ndarray) -> bytes | None:
        """Await C_READ_DONE (``probe`` is held until then), then DONE if the lease held throughout."""
        io_s, what = self.config.io_timeout_s, "KV client"
        num_bytes = len(block_ids) * self.buffer.layout.bytes_per_block
        done = await recv_frame(sock, io_s + num_bytes / 1e9, what)
        if done.kind != C_READ_DONE:
            return encode_frame(ERROR, b"expected C_READ_DONE", ERR_PROTOCOL)
        # DONE only if the lease held for the whole read: its blocks cannot have been freed and reused.
        refusal = self._check_read(lease_id, block_ids)
        if refusal is not None:
            return refusal  # the lease ended during the read: ERROR, then the connection closes
        await send_frame(sock, encode_frame(DONE, sums or b""), io_s, what)
        self._served(lease_id, block_ids)
        return None


# --- client ---------------------------------------------------------------------------------------


class CmaClient(PooledClient):
    """Pulls leased blocks from ``cma://`` servers on this host over pooled control connections
    (``conn_pool``); ``close()`` closes the idle ones."""

    async def _pull(self, request: Pull) -> None:
        uri, io_s = request.uri, self.config.io_timeout_s

        async def read(sock: socket.socket) -> None:
            iovecs = await recv_frame(sock, io_s, f"KV server {uri}")
            pid, remote = _check_iovecs(uri, iovecs)
            local, remote = pair_rows(request.dst_buffer, request.dst_ids, remote, uri)
            read_rows = functools.partial(self._read, pid, uri=uri, dst_buffer=request.dst_buffer)
            if iovecs.code & IOVECS_STREAMED:  # the lease is still being computed: layer by layer
                await read_announced(sock, uri, local, remote, request.layout.num_layers, read_rows, io_s,
                                     request.landed)
            else:
                await read_rows(local, remote)
                request.landed.first_layer()

        await self.one_sided_read(request, "cma", CmaServer.kinds, C_READ_DONE, READ_STREAM, read)

    async def _read(self, pid: int, local: np.ndarray, remote: np.ndarray, *, uri: str, dst_buffer: KVBuffer) -> None:
        """Read ``remote`` rows into ``local`` ones: on the event loop when small, else in a worker thread."""
        if int(local[:, 1].sum()) <= INLINE_BYTES:
            readv(pid, local, remote, uri)
        else:
            await self._read_in_thread(pid, local, remote, uri, dst_buffer)

    async def _read_in_thread(self, pid: int, local: np.ndarray, remote: np.ndarray, uri: str,
                              dst_buffer: KVBuffer) -> None:
        """Batches of at most BATCH_BYTES, each in a worker thread and bounded by io_timeout_s (the event loop
        stays free)."""
        local, remote = split_rows(local, remote, BATCH_BYTES)
        ends = np.cumsum(local[:, 1].astype(np.int64))
        i = 0
        while i < len(local):
            j = max(int(np.searchsorted(ends, (ends[i - 1] if i else 0) + BATCH_BYTES, side="right")), i + 1)
            # the thread holds dst_buffer: if this wait times out or the pull is cancelled, the batch may
            # still be copying, and the destination's memory must outlive it
            batch = asyncio.to_thread(readv, pid, local[i:j], remote[i:j], uri, dst_buffer)
            try:
                await asyncio.wait_for(batch, self.config.io_timeout_s)
            except TimeoutError:
                raise KVTransferError(f"cma:// read from KV server {uri} took over {self.config.io_timeout_s:g} s "
                                      f"for {int(ends[j - 1] - (ends[i - 1] if i else 0))} bytes") from None
            i = j


def _check_iovecs(uri: str, frame: Frame) -> tuple[int, np.ndarray]:
    """(pid, remote iovecs) of a C_IOVECS, once its server is shown to be a process of this host and pid
    namespace and the pid is shown to be that server (its probe reads back)."""
    if frame.kind != C_IOVECS:
        raise remote_error(uri, frame)
    try:
        pid, boot, pidns, probe_addr, probe, count = IOVECS_HEAD.unpack_from(frame.payload)
        if len(frame.payload) != IOVECS_HEAD.size + 16 * count:
            raise ValueError("length does not match its iovec count")
    except (struct.error, ValueError) as exc:
        raise KVTransferError(f"KV server {uri}: malformed C_IOVECS: {exc}") from exc
    if boot != boot_id():
        raise TransportUnusable(f"KV server {uri} runs on another host (boot id {boot.hex()}, here "
                                f"{boot_id().hex()}): cma:// reads only between processes of one host; use tcp://",
                                "other_host")
    if pidns and pid_namespace() and pidns != pid_namespace():
        raise TransportUnusable(f"KV server {uri} runs in another pid namespace (a container?): its pid {pid} means "
                                "nothing here; cma:// needs both workers in one pid namespace (e.g. --pid=host); "
                                "use tcp://", "pid_namespace")
    got = np.zeros(16, np.uint8)
    try:
        readv(pid, np.array([[got.ctypes.data, 16]], np.uint64), np.array([[probe_addr, 16]], np.uint64), uri)
    except KVTransferError as exc:  # EPERM (ptrace rules), ESRCH: this process cannot read the server's memory
        raise TransportUnusable(str(exc), "memory_unreadable") from exc
    if got.tobytes() != probe:
        raise TransportUnusable(f"KV server {uri}: pid {pid} is not the server (its probe does not read back)",
                                "memory_unreadable")
    return pid, np.frombuffer(frame.payload, np.uint64, offset=IOVECS_HEAD.size).reshape(-1, 2)
