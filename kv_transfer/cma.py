"""``cma://host:port``: the KV data plane between processes on ONE host, by cross-memory attach.

The pulling process copies the leased blocks straight out of the serving process's memory with
``process_vm_readv(2)`` (what UCX's CMA transport, and so NIXL, uses on one host): one kernel copy, no
socket buffers, no loopback TCP. Control runs over a TCP connection with ``tcp_wire``'s framing, in frame
kinds of its own (``C_*``), so a ``tcp://`` peer and a ``cma://`` peer refuse each other cleanly.
One pull is one exchange, two round trips, on a kept-alive connection (as tcp's: the server serves
exchanges one after another and closes after an ERROR; clients pool idle connections, ``conn_pool``):

    client -> C_HELLO     the client's KVLayout JSON
              C_READ      ``encode_read`` (u16 len | lease id | u32 count | count x u32 source block ids),
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
                          the server, not a recycled pid), then ``process_vm_readv``s the blocks straight
                          into its destination blocks (paired runs; at most IOV_MAX iovecs a side a call;
                          partial reads resumed)
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
import ctypes
import errno
import functools
import logging
import os
import secrets
import socket
import struct
import sys
import time
from collections.abc import Sequence

import numpy as np

from kv_transfer import auth, checksum
from kv_transfer.errors import KVTransferError, LayoutMismatch
from kv_transfer.layout import KVBuffer, KVLayout, block_runs, paired_runs
from kv_transfer.conn_pool import PooledClient, connect_socket, send_request
from kv_transfer.cma_stream import IOVECS_STREAMED, NOT_STREAMING, announce_layers, read_announced
from kv_transfer.progress import ProgressLookup
from kv_transfer.tcp import _remote_error, refuse_layout, refuse_read, refuse_unauthenticated, sign_read, verify_done
from kv_transfer.tcp_wire import (
    SocketServer,
    DONE,
    ERR_LAYOUT,
    ERR_PROTOCOL,
    ERR_REFUSED,
    ERROR,
    MAX_PAYLOAD_BYTES,
    READ_AUTH,
    READ_CHECKSUM,
    READ_STREAM,
    Frame,
    decode_read,
    encode_frame,
    encode_read,
    recv_frame,
    send_frame,
)
from kv_transfer.transport import Resolver, TransferStats, TransportConfig, check_pull_args

logger = logging.getLogger(__name__)

# kinds of their own: a tcp:// (1-6) or nccl:// (17-19) peer refuses them, and vice versa
C_HELLO, C_HELLO_OK, C_READ, C_IOVECS, C_READ_DONE = 33, 34, 35, 36, 37
IOV_MAX = 1024  # iovecs per side per process_vm_readv call (the kernel's UIO_MAXIOV)
BATCH_BYTES = 32 << 20  # bytes per process_vm_readv call: a kill or a timeout is noticed between batches
INLINE_BYTES = 1 << 20  # pulls up to this size read on the event loop; larger ones in a worker thread
IOVECS_HEAD = struct.Struct("<I16sQQ16sI")  # pid, boot id, pid-ns inode, probe address, probe, count
PTRACE_HINT = ("check /proc/sys/kernel/yama/ptrace_scope (1 allows only descendants: set it to 0, or give the "
               "puller CAP_SYS_PTRACE), that both workers run as the same user, and that no seccomp profile "
               "blocks process_vm_readv")


# --- process_vm_readv -----------------------------------------------------------------------------


@functools.cache
def _readv_fn():
    """libc's ``process_vm_readv``; raises OSError/AttributeError where there is none."""
    if not sys.platform.startswith("linux"):
        raise OSError("process_vm_readv is Linux-only")
    fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


@functools.cache
def unavailable_reason() -> str | None:
    """None when this process can use process_vm_readv (checked by reading its own memory), else why not."""
    if not sys.platform.startswith("linux"):
        return f"cma:// needs Linux (process_vm_readv); this is {sys.platform}"
    try:
        fn = _readv_fn()
    except (OSError, AttributeError) as exc:
        return f"cma:// needs process_vm_readv, which this libc lacks ({exc})"
    src, dst = np.arange(8, dtype=np.uint8), np.zeros(8, np.uint8)
    local = np.array([[dst.ctypes.data, 8]], np.uint64)
    remote = np.array([[src.ctypes.data, 8]], np.uint64)
    if fn(os.getpid(), local.ctypes.data, 1, remote.ctypes.data, 1, 0) != 8 or not np.array_equal(src, dst):
        err = ctypes.get_errno()
        return f"process_vm_readv does not work here: {os.strerror(err) if err else 'short read'}"
    return None


def _explain(err: int, pid: int, uri: str) -> KVTransferError:
    what = f"cma:// read from KV server {uri} (pid {pid}) failed: {errno.errorcode.get(err, err)} {os.strerror(err)}"
    if err == errno.EPERM:
        return KVTransferError(f"{what}: not permitted to read that process's memory; {PTRACE_HINT}")
    if err == errno.ESRCH:
        return KVTransferError(f"{what}: no such process here (it exited, or it runs in another host or pid "
                               "namespace: use tcp:// between them)")
    if err == errno.ENOSYS:
        return KVTransferError(f"{what}: this kernel has no process_vm_readv")
    if err == errno.EFAULT:
        return KVTransferError(f"{what}: the server's blocks are no longer mapped (it exited mid-read?)")
    return KVTransferError(what)


def _readv(pid: int, local: np.ndarray, remote: np.ndarray, uri: str, keep: object = None) -> int:
    """Copy every byte of ``remote`` (rows of (address, length) in pid) into ``local`` (same lengths, row by
    row) with process_vm_readv, IOV_MAX rows a call, resuming partial reads; returns the bytes read.
    ``keep``: the object owning ``local``'s memory, held while a worker thread may still be writing it."""
    fn, done, i, n = _readv_fn(), 0, 0, len(local)
    while i < n:
        j = min(i + IOV_MAX, n)
        got = fn(pid, local[i:].ctypes.data, j - i, remote[i:].ctypes.data, j - i, 0)
        if got < 0:
            raise _explain(ctypes.get_errno(), pid, uri)
        if got == 0:
            raise KVTransferError(f"cma:// read from KV server {uri} (pid {pid}) made no progress")
        done += got
        while got:  # consume ``got`` bytes from row i on; a partially read row is resumed where it stopped
            length = int(local[i, 1])
            if got >= length:
                got -= length
                i += 1
            else:
                local[i, 0] += np.uint64(got)
                local[i, 1] -= np.uint64(got)
                remote[i, 0] += np.uint64(got)
                remote[i, 1] -= np.uint64(got)
                got = 0
    return done


# --- host identity --------------------------------------------------------------------------------


@functools.cache
def boot_id() -> bytes:
    """16 bytes that differ between hosts (and boots): the kernel's boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\0")
    except (OSError, ValueError):
        return socket.gethostname().encode()[:16].ljust(16, b"\0")


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


# --- server ---------------------------------------------------------------------------------------


class CmaServer(SocketServer):
    """Serves reads of leased blocks of ``buffer`` by handing same-host clients their addresses."""

    def __init__(self, *, buffer: KVBuffer, resolve: Resolver, config: TransportConfig | None = None,
                 progress: ProgressLookup | None = None) -> None:
        self.buffer = buffer
        self.resolve = resolve
        self.progress = progress  # lease id -> LayerProgress while its prompt computes: streamed reads
        self._init_listener(config or TransportConfig())
        self.auth = auth.ReadAuth(self.config.secret) if self.config.secret else None
        # what C_IOVECS advertises (tests replace them to play a server on another host / a vanished pid)
        self.pid, self.boot_id, self.pid_namespace = os.getpid(), boot_id(), pid_namespace()

    scheme = "cma"

    def _uri_query(self) -> str:
        # the boot id lets a puller on another host skip this URI (transport.choose_uri) instead of failing
        return f"?boot={self.boot_id.hex()}"

    async def _serve(self, sock: socket.socket) -> bytes | None:
        """Serve one C_HELLO + C_READ + C_READ_DONE; returns the ERROR frame to close with, None after a DONE
        (the connection then serves the client's next request)."""
        io_s, what = self.config.io_timeout_s, "KV client"
        hello = await recv_frame(sock, io_s, what)
        if hello.kind != C_HELLO:
            return encode_frame(ERROR, b"expected C_HELLO: this is a cma:// KV server", ERR_PROTOCOL)
        refusal = refuse_layout(self.buffer.layout, hello.payload)
        if refusal is not None:
            return refusal
        hello_ok = encode_frame(C_HELLO_OK, self.buffer.layout.to_json().encode())
        read = await recv_frame(sock, io_s, what)
        if read.kind != C_READ:
            return hello_ok + encode_frame(ERROR, b"expected C_READ", ERR_PROTOCOL)
        request, trailer = auth.split_trailer(read.payload, bool(read.code & READ_AUTH))
        refusal = refuse_unauthenticated(self.auth, C_READ, hello.payload + request, trailer)
        if refusal is not None:
            return hello_ok + refusal
        lease_id, block_ids = decode_read(request)
        refusal = self._check_read(lease_id, block_ids)
        if refusal is not None:
            return hello_ok + refusal
        return await self._hand_out(sock, hello_ok, lease_id, block_ids, read.code)

    async def _hand_out(self, sock: socket.socket, hello_ok: bytes, lease_id: str, block_ids: list[int],
                        flags: int) -> bytes | None:
        """C_IOVECS (streamed: then C_LAYERS as the layers are computed), C_READ_DONE, DONE; returns the ERROR
        frame to close with, None after a DONE."""
        io_s, what = self.config.io_timeout_s, "KV client"
        progress = self.progress(lease_id) if self.progress is not None else None
        streamed = progress is not None and not progress.is_ready
        if streamed and not flags & READ_STREAM:
            return hello_ok + NOT_STREAMING
        iovecs = self._iovecs(block_ids)
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
        return None

    def _check_read(self, lease_id: str, block_ids: list[int]) -> bytes | None:
        return refuse_read(self.buffer, self.resolve, self.config, lease_id, block_ids)

    def _iovecs(self, block_ids: list[int]) -> np.ndarray:
        """uint64 [layers x runs, 2]: (address, length) per layer per run of consecutive ids, in wire order."""
        seg, num_blocks = self.buffer.segment_bytes, self.buffer.num_blocks
        runs = np.array(block_runs(block_ids), np.uint64).reshape(-1, 2)
        base = self.buffer.array.ctypes.data
        layers = np.arange(self.buffer.layout.num_layers, dtype=np.uint64)[:, None]
        out = np.empty((len(layers), len(runs), 2), np.uint64)
        out[:, :, 0] = np.uint64(base) + (layers * np.uint64(num_blocks) + runs[None, :, 0]) * np.uint64(seg)
        out[:, :, 1] = runs[None, :, 1] * np.uint64(seg)
        return out.reshape(-1, 2)


# --- client ---------------------------------------------------------------------------------------


class CmaClient(PooledClient):
    """Pulls leased blocks from ``cma://`` servers on this host over pooled control connections
    (``conn_pool``); ``close()`` closes the idle ones."""

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
        src_ids, dst_ids = [int(b) for b in src_block_ids], [int(b) for b in dst_block_ids]
        num_bytes = len(src_ids) * layout.bytes_per_block
        io_s, what = self.config.io_timeout_s, f"KV server {uri}"

        async def exchange(sock: socket.socket) -> Frame:
            hello = layout.to_json().encode()  # signed per attempt: a retry carries a fresh nonce
            request, flags = sign_read(self.config, C_READ, hello, encode_read(lease_id, src_ids))
            flags |= READ_STREAM | (READ_CHECKSUM if self.config.checksum else 0)
            await send_request(sock, [encode_frame(C_HELLO, hello), encode_frame(C_READ, request, flags)], self.config,
                               what)
            _check_hello_ok(uri, layout, await recv_frame(sock, io_s, what))
            iovecs = await recv_frame(sock, io_s, what)
            pid, remote = _check_iovecs(uri, iovecs)
            local, remote = _pair(dst_buffer, src_ids, dst_ids, remote, uri)
            read = functools.partial(self._read, pid, uri=uri, dst_buffer=dst_buffer)
            if iovecs.code & IOVECS_STREAMED:  # the lease is still being computed: layer by layer
                await read_announced(sock, uri, local, remote, layout.num_layers, read, io_s)
            else:
                await read(local, remote)
            await send_frame(sock, encode_frame(C_READ_DONE), io_s, what)
            done = await recv_frame(sock, io_s, what)
            if done.kind != DONE:
                raise _remote_error(uri, done)
            return done

        try:
            done = await self.pool.run(uri, lambda: connect_socket(uri, self.config, "cma"), exchange)
        except OSError as exc:
            raise KVTransferError(f"KV pull from {uri} failed: {exc!r}") from exc
        if self.config.checksum:
            verify_done(uri, dst_buffer, dst_ids, done.payload)
        return TransferStats(num_blocks=len(src_ids), num_bytes=num_bytes, seconds=time.perf_counter() - start)

    async def _read(self, pid: int, local: np.ndarray, remote: np.ndarray, *, uri: str, dst_buffer: KVBuffer) -> None:
        """Read ``remote`` rows into ``local`` ones: on the event loop when small, else in a worker thread."""
        if int(local[:, 1].sum()) <= INLINE_BYTES:
            _readv(pid, local, remote, uri)
        else:
            await self._read_in_thread(pid, local, remote, uri, dst_buffer)

    async def _read_in_thread(self, pid: int, local: np.ndarray, remote: np.ndarray, uri: str,
                              dst_buffer: KVBuffer) -> None:
        """Batches of at most BATCH_BYTES, each in a worker thread and bounded by io_timeout_s (the event loop
        stays free)."""
        local, remote = _split(local, remote, BATCH_BYTES)
        ends = np.cumsum(local[:, 1].astype(np.int64))
        i = 0
        while i < len(local):
            j = max(int(np.searchsorted(ends, (ends[i - 1] if i else 0) + BATCH_BYTES, side="right")), i + 1)
            # the thread holds dst_buffer: if this wait times out or the pull is cancelled, the batch may
            # still be copying, and the destination's memory must outlive it
            batch = asyncio.to_thread(_readv, pid, local[i:j], remote[i:j], uri, dst_buffer)
            try:
                await asyncio.wait_for(batch, self.config.io_timeout_s)
            except TimeoutError:
                raise KVTransferError(f"cma:// read from KV server {uri} took over {self.config.io_timeout_s:g} s "
                                      f"for {int(ends[j - 1] - (ends[i - 1] if i else 0))} bytes") from None
            i = j



def _check_hello_ok(uri: str, layout: KVLayout, frame: Frame) -> None:
    if frame.kind not in (C_HELLO_OK, ERROR) or (frame.kind == ERROR and frame.code != ERR_LAYOUT):
        raise _remote_error(uri, frame)
    layout.check_compatible(KVLayout.from_json(frame.payload))  # both carry the server's layout
    if frame.kind == ERROR:
        raise LayoutMismatch(f"KV server {uri} refused the layout")


def _check_iovecs(uri: str, frame: Frame) -> tuple[int, np.ndarray]:
    """(pid, remote iovecs) of a C_IOVECS, once its server is shown to be a process of this host and pid
    namespace and the pid is shown to be that server (its probe reads back)."""
    if frame.kind != C_IOVECS:
        raise _remote_error(uri, frame)
    try:
        pid, boot, pidns, probe_addr, probe, count = IOVECS_HEAD.unpack_from(frame.payload)
        if len(frame.payload) != IOVECS_HEAD.size + 16 * count:
            raise ValueError("length does not match its iovec count")
    except (struct.error, ValueError) as exc:
        raise KVTransferError(f"KV server {uri}: malformed C_IOVECS: {exc}") from exc
    if boot != boot_id():
        raise KVTransferError(f"KV server {uri} runs on another host (boot id {boot.hex()}, here {boot_id().hex()}): "
                              "cma:// reads only between processes of one host; use tcp://")
    if pidns and pid_namespace() and pidns != pid_namespace():
        raise KVTransferError(f"KV server {uri} runs in another pid namespace (a container?): its pid {pid} means "
                              "nothing here; cma:// needs both workers in one pid namespace (e.g. --pid=host); "
                              "use tcp://")
    got = np.zeros(16, np.uint8)
    _readv(pid, np.array([[got.ctypes.data, 16]], np.uint64), np.array([[probe_addr, 16]], np.uint64), uri)
    if got.tobytes() != probe:
        raise KVTransferError(f"KV server {uri}: pid {pid} is not the server (its probe does not read back)")
    return pid, np.frombuffer(frame.payload, np.uint64, offset=IOVECS_HEAD.size).reshape(-1, 2)


def _pair(dst: KVBuffer, src_ids: list[int], dst_ids: list[int], remote: np.ndarray,
          uri: str) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) uint64 [n, 2] rows of equal lengths: one per layer per paired run of ``src_ids`` ->
    ``dst_ids``; remote addresses come from the server's iovecs (one per layer per run of ``src_ids``)."""
    seg, layers = dst.segment_bytes, dst.layout.num_layers
    runs = block_runs(src_ids)
    if remote.shape != (layers * len(runs), 2):
        raise KVTransferError(f"KV server {uri} sent {len(remote)} iovecs, expected {layers * len(runs)}")
    if not np.array_equal(remote[:, 1].reshape(layers, -1),
                          np.tile(np.array([c * seg for _, c in runs], np.uint64), (layers, 1))):
        raise KVTransferError(f"KV server {uri} sent iovecs of the wrong lengths")
    # source block -> (index of its run, offset in the run)
    where = {}
    for r, (first, count) in enumerate(runs):
        for k in range(count):
            where[first + k] = (r, k * seg)
    pairs = paired_runs(src_ids, dst_ids)
    remote_rows = remote.reshape(layers, len(runs), 2)
    local = np.empty((layers, len(pairs), 2), np.uint64)
    out_remote = np.empty((layers, len(pairs), 2), np.uint64)
    base, num_blocks = dst.array.ctypes.data, dst.num_blocks
    lyr = np.arange(layers, dtype=np.uint64)
    for p, (s, d, count) in enumerate(pairs):
        r, offset = where[s]
        out_remote[:, p, 0] = remote_rows[:, r, 0] + np.uint64(offset)
        local[:, p, 0] = np.uint64(base) + (lyr * np.uint64(num_blocks) + np.uint64(d)) * np.uint64(seg)
        local[:, p, 1] = out_remote[:, p, 1] = np.uint64(count * seg)
    return local.reshape(-1, 2), out_remote.reshape(-1, 2)


def _split(local: np.ndarray, remote: np.ndarray, max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The same rows, those longer than ``max_bytes`` cut into pieces of at most ``max_bytes``."""
    lengths = local[:, 1].astype(np.int64)
    if (lengths <= max_bytes).all():
        return local.copy(), remote.copy()
    pieces = np.maximum(1, -(-lengths // max_bytes))
    row = np.repeat(np.arange(len(local)), pieces)
    k = np.arange(len(row)) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # piece index within its row
    offset = (k * max_bytes).astype(np.uint64)
    length = np.minimum(lengths[row] - k * max_bytes, max_bytes).astype(np.uint64)
    new_local = np.stack([local[row, 0] + offset, length], axis=1)
    new_remote = np.stack([remote[row, 0] + offset, length], axis=1)
    return new_local, new_remote
