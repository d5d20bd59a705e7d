"""``nccl://host:port``: the KV data plane over ``torch.distributed`` point-to-point (NCCL on GPU, gloo on CPU).

Each (server, client) pair talks over a **channel**: one small TCP control connection (the frames of
``kv_transfer/wire.py``) plus a private 2-rank process group, built directly
(``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over a ``PrefixStore`` of the server's ``TCPStore``), never
through the global ``init_process_group``: a worker talks to many peers at once. The backend follows the KV
tensor's device: a host ``KVBuffer`` moves over gloo, a CUDA cache served in place (a ``TensorKVBuffer``,
``kv_transfer/tensor_buffer.py``) over NCCL, GPU to GPU.

    client -> N_HELLO   the client's KVLayout JSON; code = its backend (0 gloo, 1 nccl)
    server -> ERROR     layout or backend mismatch: refused before any KV byte moves, connection closed
           or HELLO_OK  the server's KVLayout JSON (the client checks it too), then
              GROUP     u16 TCPStore port | channel prefix: both sides build the group (server rank 0)
    then, once per pull, one at a time on the channel:
    client -> N_READ    ``wire.encode_read`` with the destination ids: u16 len | lease id | u32 count |
                        count x u32 source ids | u32 count | count x u32 destination ids;
                        code bit READ_CHECKSUM asks for checksums
    server -> ERROR     unknown/expired lease, block not in the lease, out of range: nothing moves, the
                        channel stays usable
           or DATA      u64 num_bytes | u32 n | n x u32: the message plan, blocks per run in request order,
                        each run consecutive in the server's buffer and in the destination (``paired_runs``
                        of the ids the server reads, which a staged server translated: the client cannot
                        derive them); then the KV moves over the group: one message per layer per run, in
                        the same order on both ends
              DONE      the lease was still live after the last byte; payload: the blocks' checksums when
                        asked (else ERROR: the lease ended mid-read)

Streaming (layer-wise, ``kv_transfer/progress.py``): a server given a ``progress`` lookup serves a lease still
being computed with DATA's code DATA_STREAMED and sends each layer's messages once that layer is computed (the
lease checked before each batch of layers and after the last); the client then receives layer by layer, each
wait bounded on its own. A layer not computed within ``io_timeout_s``, a failed progress or a lease that ends
mid-stream: the remaining messages go out as zeros (the client's receives complete, never with stale KV) and
ERROR replaces DONE. Checksums, when asked, are computed once the last layer is computed.

One pull at a time per channel keeps the two ends' message order identical (NCCL ignores tags). A client
keeps **one channel per server** (one communicator per P/D pair: NCCL's are costly to build and hold GPU
memory), built at its first pull and reused for ``nccl_channel.REUSE_S``; concurrent pulls take turns on it
(each bounded by its own timeouts), except that a pull queued behind streamed pulls only (each waiting for P's
layers) opens another, up to ``nccl_channel.STREAMING_CHANNELS``, so concurrent layer-wise requests stream side
by side. One channel is built at a time per server, and a build that times out is tried once more. The server drops a channel idle for ``IDLE_S``. Any failure
other than a refusal tears the channel down (socket closed, group shut down).
Collective waits run on the channel's own thread, each bounded by ``TransportConfig`` timeouts (a gloo timeout
also closes the group's connection, so nothing lands after it): a vanished peer surfaces within ``io_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import itertools
import logging
import secrets
import socket
import struct
import weakref

import torch
import torch.distributed as dist

from kv_transfer import auth, checksum
from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVLayout, paired_runs
from kv_transfer.nccl_channel import (
    STREAMING_CHANNELS, Channel, IdleChannels, channel_closed, close_idle, connect, decode_plan, encode_plan, exchange,
    join_group, keep_idle, kv_tensor, messages, new_group, reap_later, start_reaper, take_idle, unless_closed,
    wait_readable, zeros_like,
)
from kv_transfer.progress import LayerProgress, ProgressLookup
from kv_transfer.protocol import (
    DATA_BYTES, check_data, check_hello_ok, computed_layers, locate_read, refuse_layout, refuse_unauthenticated,
    remote_error, sign_read, verify_done,
)
from kv_transfer.socket_server import SocketServer
from kv_transfer.tcp_wire import recv_frame, send_frame, send_refusal, tune_socket
from kv_transfer.tensor_buffer import AnyKVBuffer
from kv_transfer.transport import KVClient, Locator, Pull, Resolver, TransportConfig, parse_uri
from kv_transfer.wire import (
    DATA, DONE, ERR_PROTOCOL, ERR_REFUSED, ERROR, HELLO_OK, READ_AUTH, READ_CHECKSUM, ReadRequest, decode_read,
    encode_frame, encode_read,
)

logger = logging.getLogger(__name__)

N_HELLO, GROUP, N_READ = 17, 18, 19  # kinds of their own: a tcp:// peer refuses them, and vice versa
DATA_STREAMED = 1  # DATA's code: the KV follows layer by layer as it is computed (receive each layer on its own)
BACKENDS = ("gloo", "nccl")
IDLE_S = 60.0  # the server drops a channel with no READ for this long


# --- server ---------------------------------------------------------------------------------------


class NcclServer(SocketServer):
    """Serves reads of leased blocks of ``buffer`` (host: gloo; a CUDA ``TensorKVBuffer``: NCCL) over channels."""

    scheme = "nccl"

    def __init__(self, *, buffer: AnyKVBuffer, resolve: Resolver, config: TransportConfig | None = None,
                 progress: ProgressLookup | None = None, locate: Locator | None = None) -> None:
        super().__init__(buffer=buffer, resolve=resolve, config=config, progress=progress, locate=locate)
        self.kv = kv_tensor(buffer)
        self.backend = "nccl" if self.kv.is_cuda else "gloo"
        self._store: dist.TCPStore | None = None
        self._channel_ids = itertools.count()

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, advertise_host: str | None = None) -> str:
        """Listen on ``host:port`` with a ``TCPStore`` of its own beside it (the channels' rendezvous)."""
        if self.uri is not None:
            return self.uri
        try:
            timeout = datetime.timedelta(seconds=self.config.connect_timeout_s)
            self._store = dist.TCPStore(host, 0, None, True, timeout, wait_for_workers=False)
            uri = await super().start(host, port, advertise_host=advertise_host)
        except (OSError, RuntimeError) as exc:
            self._store = None
            raise KVTransferError(f"nccl: cannot listen on {host}:{port}: {exc}") from exc
        logger.info("KV data plane %s moves KV with %s", uri, self.backend)
        return uri

    async def stop(self) -> None:
        await super().stop()
        self._store = None

    async def _serve_connection(self, sock: socket.socket) -> None:
        """One channel: HELLO (the group is built), then READs one after another until the client closes it,
        leaves it idle for ``IDLE_S``, or fails."""
        try:
            channel = Channel(sock, f"client {sock.getpeername()}")
        except OSError:  # the client is gone already
            sock.close()
            return
        try:
            tune_socket(channel.sock, self.config)
            refusal = await self._open(channel)
            while refusal is None and await self._serve_read(channel):
                pass
            if refusal is not None:
                await send_refusal(channel.sock, refusal)
        except (KVTransferError, OSError) as exc:  # malformed, silent or vanished client: drop the channel
            logger.info("KV data plane: dropped a client: %s", exc)
        finally:
            channel.close()
            self._forget(channel.store_keys)

    def _forget(self, keys: list[str]) -> None:
        """Delete a finished channel's rendezvous keys, so the store does not grow with every channel (not
        sooner: rank 0's group may be built before rank 1 has read them)."""
        for key in keys:
            with contextlib.suppress(Exception):
                self._store.delete_key(key)

    async def _open(self, channel: Channel) -> bytes | None:
        """HELLO -> HELLO_OK + GROUP, then build the group; returns an ERROR frame to close with instead."""
        hello = await recv_frame(channel.sock, self.config.io_timeout_s, channel.uri)
        if hello.kind != N_HELLO:
            return encode_frame(ERROR, b"expected an nccl:// HELLO", ERR_PROTOCOL)
        refusal = refuse_layout(self.buffer.layout, hello.payload)
        if refusal is None and hello.code != BACKENDS.index(self.backend):
            refusal = encode_frame(ERROR, f"the server moves KV with {self.backend}".encode(), ERR_REFUSED)
        if refusal is not None:
            return refusal
        prefix = f"kv/{next(self._channel_ids)}/{secrets.token_hex(4)}"
        group_frame = encode_frame(GROUP, struct.pack("<H", self._store.port) + prefix.encode())
        await send_frame(channel.sock, encode_frame(HELLO_OK, self.buffer.layout.to_json().encode()) + group_frame,
                         self.config.io_timeout_s, channel.uri)
        # A store client of its own: TCPStore serializes its calls, and one rendezvous waiting on a silent
        # client must not hold up the others.
        store, host = dist.PrefixStore(prefix, self._store.clone()), channel.sock.getsockname()[0]
        timeout_s = self.config.connect_timeout_s
        channel.store_keys = [f"{prefix}/0/{rank}" for rank in (0, 1)]  # gloo's rendezvous keys
        build = functools.partial(new_group, store, 0, host, timeout_s, self.kv.device)
        channel.group = await channel.call(build, bound_s=timeout_s, what="building the process group")
        return None

    async def _serve_read(self, channel: Channel) -> bool:
        """Serve one READ; False when the client closed the channel."""
        io_s = self.config.io_timeout_s
        if not await wait_readable(channel.sock, IDLE_S):
            return False
        try:
            read = await recv_frame(channel.sock, io_s, channel.uri)
        except KVTransferError:
            if channel_closed(channel.sock):
                return False
            raise
        if read.kind != N_READ:
            raise KVTransferError(f"expected READ, got frame kind {read.kind}")
        payload, trailer = auth.split_trailer(read.payload, bool(read.code & READ_AUTH))
        refusal = refuse_unauthenticated(self.auth, N_READ, payload, trailer)
        if refusal is not None:
            await send_frame(channel.sock, refusal, io_s, channel.uri)
            return True
        request = decode_read(payload)
        if len(request.dst_block_ids) != len(request.block_ids):
            raise KVTransferError("malformed READ: destination ids do not match the source ids")
        request = locate_read(self.locate, request)
        if isinstance(request, bytes):  # refused before any byte: the channel stays usable
            await send_frame(channel.sock, request, io_s, channel.uri)
            return True
        src_ids, dst_ids = list(request.block_ids), list(request.dst_block_ids)
        sums = bool(read.code & READ_CHECKSUM)
        done = self._check_read(request.lease_id, src_ids) or await self._send_kv(
            channel, request.lease_id, src_ids, dst_ids, sums)
        await send_frame(channel.sock, done, io_s, channel.uri)
        return True

    async def _send_kv(self, channel: Channel, lease_id: str, src_ids: list[int], dst_ids: list[int],
                       sums: bool) -> bytes:
        """DATA, then the blocks (streamed: each layer once computed); returns the DONE (or ERROR) to send."""
        progress = self._unfinished(lease_id)
        streamed = progress is not None
        # hashed BEFORE any byte moves: what is sent must be what was hashed (streamed: once computed)
        checksums = checksum.block_checksums(self.buffer, src_ids).tobytes() if sums and not streamed else b""
        num_bytes = len(src_ids) * self.buffer.layout.bytes_per_block
        runs = paired_runs(src_ids, dst_ids)
        data = encode_frame(DATA, DATA_BYTES.pack(num_bytes) + encode_plan([c for _, _, c in runs]),
                            DATA_STREAMED if streamed else 0)
        await send_frame(channel.sock, data, self.config.io_timeout_s, channel.uri)
        tensors = messages(self.kv, [(s, c) for s, _, c in runs])
        if streamed:
            return await self._stream(channel, lease_id, src_ids, tensors, progress, sums)
        await self._send(channel, tensors)
        # DONE only if the lease held for the whole read: its blocks cannot have been freed and reused.
        return self._check_read(lease_id, src_ids) or encode_frame(DONE, checksums)

    async def _stream(self, channel: Channel, lease_id: str, src_ids: list[int], tensors: list[torch.Tensor],
                      progress: LayerProgress, sums: bool) -> bytes:
        """Send each layer's messages once ``progress`` has computed it; returns the DONE (or ERROR) to send.
        A stream that fails sends its remaining messages as zeros (the client's receives are posted: never
        stale KV), then the ERROR."""
        assert progress.num_layers == self.kv.shape[0], "a progress of another model's layers"
        per_layer = len(tensors) // progress.num_layers
        check = functools.partial(self._check_read, lease_id, src_ids)
        refusal = None
        async for layers, refusal in computed_layers(progress, self.config.io_timeout_s, check):
            batch = tensors[layers.start * per_layer : layers.stop * per_layer]
            await self._send(channel, zeros_like(batch) if refusal else batch)
        if refusal is not None:
            return refusal
        checksums = checksum.block_checksums(self.buffer, src_ids).tobytes() if sums else b""
        return check() or encode_frame(DONE, checksums)

    async def _send(self, channel: Channel, tensors: list[torch.Tensor]) -> None:
        io_s = self.config.io_timeout_s
        send = functools.partial(exchange, channel.group, tensors, send=True, timeout_s=io_s)
        await channel.call(send, bound_s=io_s, what="sending KV")


# --- client ---------------------------------------------------------------------------------------


class GroupBuildFailed(KVTransferError):
    """The channel's process group did not form in time (nothing moved)."""


class _Lane:
    """A client's busy channels to one server. One channel per server (one communicator per P/D pair: NCCL's
    are costly to build and each holds GPU memory), except that a pull queued behind streamed pulls only (each
    waiting for P's layers as they are computed) opens another, up to ``STREAMING_CHANNELS``: concurrent
    layer-wise requests then stream side by side instead of one after the other."""

    def __init__(self) -> None:
        self.changed = asyncio.Condition()
        self.busy: set[Channel] = set()
        self._streaming: set[Channel] = set()

    def may_open(self) -> bool:
        return not self.busy or (len(self.busy) < STREAMING_CHANNELS and self.busy <= self._streaming)

    async def streaming(self, channel: Channel) -> None:
        async with self.changed:
            self._streaming.add(channel)
            self.changed.notify_all()

    async def give_back(self, channel: Channel, idle: IdleChannels | None) -> None:
        """The pull on ``channel`` ended: keep it in ``idle`` (else close it) and wake the queued pulls."""
        async with self.changed:
            self.busy.discard(channel)
            self._streaming.discard(channel)
            keep_idle(idle, channel) if idle is not None else channel.close()
            self.changed.notify_all()


class NcclClient(KVClient):
    """Pulls leased blocks from ``nccl://`` servers over one channel per server, kept for the next pull.

    ``dst_buffer`` may be a CUDA ``TensorKVBuffer`` (NCCL) or host memory (gloo), as the server's. Idle channels
    close with ``close()`` or when the client is garbage collected.
    """

    pulls_into_tensors = True

    def __init__(self, config: TransportConfig | None = None) -> None:
        super().__init__(config)
        self._idle: IdleChannels = {}
        self._lanes: dict[str, _Lane] = {}  # server URI -> its busy channels
        start_reaper()
        self._finalizer = weakref.finalize(self, reap_later, self._idle)

    def close(self) -> None:
        self._finalizer.detach()
        close_idle(self._idle)
        self._lanes.clear()

    async def _pull(self, request: Pull) -> None:
        kv = kv_tensor(request.dst_buffer)
        lane = self._lanes.setdefault(request.uri, _Lane())
        channel = await self._take(lane, request, kv.device)
        keep = False
        try:
            done = await self._read(channel, request, kv, lane)
            keep = True
        except _Refused as refused:  # nothing moved: the channel is still good
            keep = True
            raise refused.error from None
        finally:
            await lane.give_back(channel, self._idle if keep else None)
        if self.config.checksum:
            verify_done(request.uri, request.dst_buffer, request.dst_ids, done)

    async def _take(self, lane: _Lane, request: Pull, device: torch.device) -> Channel:
        """An idle channel to the server, else a new one while ``lane`` may open one, else the next one freed.
        One channel is built at a time per server (gloo's rendezvous of several at once on one store stalled)."""
        async with lane.changed:
            while (channel := take_idle(self._idle, request.uri)) is None and not lane.may_open():
                await lane.changed.wait()  # every busy pull's waits are bounded: it ends and wakes us
            if channel is None:
                channel = await self._open_once_more(request.uri, request.layout, device)
            lane.busy.add(channel)
        return channel

    async def _open_once_more(self, uri: str, layout: KVLayout, device: torch.device) -> Channel:
        try:
            return await self._open(uri, layout, device)
        except GroupBuildFailed as exc:  # a slow rendezvous (a loaded host): once more, on a fresh channel
            logger.warning("KV channel to %s: %s; building another", uri, exc)
            return await self._open(uri, layout, device)

    async def _open(self, uri: str, layout: KVLayout, device: torch.device) -> Channel:
        host, port = parse_uri(uri, "nccl")
        io_s, what = self.config.io_timeout_s, f"KV server {uri}"
        sock = await connect(host, port, self.config)
        channel = Channel(sock, uri)
        try:
            backend = BACKENDS.index("nccl" if device.type == "cuda" else "gloo")
            await send_frame(sock, encode_frame(N_HELLO, layout.to_json().encode(), backend), io_s, what)
            check_hello_ok(uri, layout, await recv_frame(sock, io_s, what))
            group = await recv_frame(sock, io_s, what)
            if group.kind != GROUP or len(group.payload) < 3:
                raise remote_error(uri, group)
            (store_port,), prefix = struct.unpack_from("<H", group.payload), group.payload[2:].decode()
            join = functools.partial(join_group, host, store_port, prefix, sock.getsockname()[0],
                                     self.config.connect_timeout_s, device)
            try:
                channel.group = await channel.call(join, bound_s=2 * self.config.connect_timeout_s,
                                                   what="building the process group")
            except KVTransferError as exc:
                raise GroupBuildFailed(str(exc)) from exc
        except BaseException:
            channel.close()
            raise
        return channel

    async def _read(self, channel: Channel, request: Pull, kv: torch.Tensor, lane: _Lane) -> bytes:
        """One pull on ``channel``; returns DONE's payload (the checksums, when asked)."""
        io_s, what, sock = self.config.io_timeout_s, f"KV server {channel.uri}", channel.sock
        src_ids, dst_ids = request.src_ids, request.dst_ids
        read = encode_read(ReadRequest(request.lease_id, src_ids, dst_block_ids=dst_ids))
        read, flags = sign_read(self.config, N_READ, b"", read)
        flags |= READ_CHECKSUM if self.config.checksum else 0
        await send_frame(sock, encode_frame(N_READ, read, flags), io_s, what)
        reply = await recv_frame(sock, io_s, what)
        if reply.kind == ERROR:
            raise _Refused(remote_error(channel.uri, reply))
        check_data(channel.uri, len(src_ids) * kv.shape[0] * kv.shape[2], reply)
        tensors = messages(kv, decode_plan(channel.uri, reply.payload, dst_ids))
        # streamed: one layer at a time, each wait bounded on its own (the layers come as they are computed)
        per_batch = len(tensors) // kv.shape[0] if reply.code & DATA_STREAMED else len(tensors)
        if reply.code & DATA_STREAMED:
            await lane.streaming(channel)  # waits for P's layers: a pull queued behind it may open a channel
        for first in range(0, len(tensors), max(per_batch, 1)):
            recv = functools.partial(exchange, channel.group, tensors[first : first + per_batch], send=False,
                                     timeout_s=io_s)
            await unless_closed(channel.call(recv, bound_s=io_s, what="receiving KV"), sock, what)
            if not first:
                request.landed.first_layer()
        done = await recv_frame(sock, io_s, what)
        if done.kind != DONE:
            raise remote_error(channel.uri, done)
        return done.payload


class _Refused(Exception):
    """The server refused a READ before any byte moved (carries the error to raise)."""

    def __init__(self, error: KVTransferError) -> None:
        super().__init__(str(error))
        self.error = error
