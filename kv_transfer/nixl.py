"""``nixl://host:port``: the KV data plane over NVIDIA NIXL, one-sided READs of registered memory.

The serving worker registers its whole KV buffer with a NIXL agent once, at start (DRAM for a host cache;
VRAM for a CUDA cache, the same code with ``mem_type`` "VRAM"). The pulling worker registers its destination
buffer with an agent of its own, loads the server's agent metadata, and READs the leased blocks straight into
its destination blocks; NIXL picks the path (UCX: RDMA, cuda_ipc, cma on one host, tcp). When the READ is
complete, NIXL delivers a notification to the server's agent; that, and only that, is the server's signal
that the read is over (the vLLM NIXL connector and Dynamo work the same way).

Control runs over a TCP connection with ``wire``'s frames, in kinds of their own (``N_*``), kept alive between
pulls (``conn_pool``), exactly as ``cma://``'s. One pull is one exchange:

    client -> N_HELLO     the client's KVLayout JSON
              N_READ      ``wire.encode_read`` (lease id and source block ids), pipelined; flags READ_CHECKSUM /
                          READ_AUTH exactly as tcp (the HMAC trailer covers N_HELLO + N_READ)
    server -> ERROR       layout mismatch: refused before any KV byte moves
           or N_HELLO_OK  the server's KVLayout JSON, then
              ERROR       unauthenticated, unknown/expired lease, block not in the lease, out of range
           or N_DESCS     8-byte incarnation | u32 device id | u8 memory kind (0 DRAM, 1 VRAM) | 16-byte
                          notification tag | u32 metadata length | u32 count | u64 base address | u64 blocks |
                          u8 flags (POSTED_READS) | the server agent's metadata | count x (u64 address,
                          u64 length): one row per layer per run of source blocks
    client               loads the agent metadata unless it holds this incarnation's already (a server
                          restarted on the same address has a new incarnation: its old agent is removed
                          first, so no READ ever targets a stale registration), pairs the rows with its
                          destination blocks, posts one READ whose completion notifies the tag, polls it
    client -> N_READ_DONE once its READ is complete (always, before it awaits DONE; sent from the agent's thread
                          the moment the READ is DONE): a hint only, never taken for the notification itself
    server               waits for the hint, then polls its agent without pause for the tag's notification (both
                          within ``io_timeout_s`` plus one second per GB), or sees the client close the connection
                          (it gave up); its agent is polled meanwhile too (a READ over UCX's tcp needs the
                          target's progress)
    server -> DONE        the lease was still live after the notification (so no block was freed and reused
                          under the read); one xxh3-64 per block, computed BEFORE N_DESCS, when asked
           or ERROR       the lease ended during the read, or no notification came in time

A pull on a connection that has read from the server before takes one round trip, if the server said it
takes posted reads (no staging, no credentials: its N_DESCS flags) and the client asks for no checksums:

    client               READs at once: it holds the server's agent (the incarnation it read from on this
                          connection; a restarted server closed the connection) and its geometry (base address,
                          blocks), so it makes the rows itself, ids range-checked first; the tag is its own
    client -> N_READ_POSTED  8-byte incarnation | 16-byte tag | ``wire.encode_read``, sent from the agent's
                          thread just before it posts the READ: the server wakes and progresses its agent during
                          the READ (a READ that UCX runs over messages needs it; one by cma completes sooner)
           -> N_READ_DONE once the READ is complete, as in the full exchange
    server               waits for the hint and the tag's notification as above (a notification that came
                          before its N_READ_POSTED, taken by a poll for another read, is kept for it)
    server -> DONE        (no checksums) if the lease is live now and covers the blocks: it was granted before
                          the client learnt its id and no lease revives, so it held for the whole READ
           or ERROR       as above; the client's destination blocks are then undefined

A client whose READ fails (state ERR: the server died mid-read) or does not complete within its bound raises
KVTransferError; its destination blocks are then undefined (the caller recomputes). A transfer the client
gave up on keeps its destination buffer referenced until NIXL lets its handle go.

NIXL moved 0.5-0.9 GB/s over tcp on host memory here (below our tcp), 2.3-4.9 GB/s with UCX's cma: it is the
transport for device memory and RDMA fabrics, so ``--kv-transport auto`` prefers it only for a CUDA cache.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Sequence

from kv_transfer import checksum
from kv_transfer.errors import KVTransferError
from kv_transfer.nixl_agent import (  # noqa: F401 - INSTALL_HINT, installed, environment: the package's face
    INSTALL_HINT, MEM_KINDS, NIXL_MODULES, Agent, Memory, environment, installed, nixl_module, unavailable_reason,
)
from kv_transfer.nixl_client import NixlClient  # noqa: F401 - the registry finds both classes here
from kv_transfer.nixl_wire import (  # noqa: F401 - the tests read the frames' shapes here
    DESCS_HEAD, KINDS, N_DESCS, N_READ_DONE, N_READ_POSTED, POSTED_READS, Descs, parse_descs, parse_posted,
)
from kv_transfer.progress import ProgressLookup
from kv_transfer.rows import buffer_iovecs
from kv_transfer.socket_server import SocketServer
from kv_transfer.tcp_wire import peek_byte, recv_frame, send_frame
from kv_transfer.tensor_buffer import AnyKVBuffer
from kv_transfer.transport import Locator, Resolver, TransportConfig
from kv_transfer.wire import DONE, ERR_PROTOCOL, ERR_REFUSED, ERROR, MAX_PAYLOAD_BYTES, READ_CHECKSUM, encode_frame

logger = logging.getLogger(__name__)
POLL_S = (0.0, 0.0, 0.0001, 0.0002, 0.0005, 0.001)  # the server's successive waits between polls of notifications
EARLY_TAGS = 1024  # notifications kept that came before their N_READ_POSTED (another read's poll took them)


class NixlServer(SocketServer):
    """Serves reads of leased blocks of ``buffer`` (registered with a NIXL agent) to clients that READ them."""

    scheme = "nixl"
    kinds = KINDS

    def __init__(self, *, buffer: AnyKVBuffer, resolve: Resolver, config: TransportConfig | None = None,
                 progress: ProgressLookup | None = None, locate: Locator | None = None) -> None:
        if progress is not None:
            raise ValueError("nixl:// does not stream layers: serve it without a progress lookup")
        super().__init__(buffer=buffer, resolve=resolve, config=config, locate=locate)
        self.memory = Memory.of(buffer)  # a CUDA cache served in place (a TensorKVBuffer): VRAM
        self.incarnation = secrets.token_bytes(8)  # a restarted server is a new incarnation, whatever its address
        self.agent: Agent | None = None
        self._metadata = b""
        self._waiting: dict[bytes, asyncio.Future[None]] = {}  # notification tag -> its read's waiter
        self._hinted: set[bytes] = set()  # tags whose client said its READ is complete: polled without pause
        self._early: OrderedDict[bytes, None] = OrderedDict()  # notified tags no read waited for (yet), newest last
        self._wake = asyncio.Event()
        self._notifications: asyncio.Task | None = None
        self.num_notifications = 0
        self.num_posted_reads = 0  # one-round-trip reads answered DONE

    @property
    def takes_posted_reads(self) -> bool:
        """A client may READ first and ask after (N_READ_POSTED): its blocks are served in place (no staging
        copies them in on request) and no credentials guard them (those sign each request before any byte)."""
        return self.locate is None and self.auth is None

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, advertise_host: str | None = None) -> str:
        if (why := unavailable_reason()) is not None:
            raise KVTransferError(f"nixl:// cannot serve here: {why}")
        if self.agent is None:
            self.agent = Agent(f"baton-kv-{os.getpid()}-{self.incarnation.hex()}")
            self.agent.register(self.memory)
            self._metadata = self.agent.metadata()
            self._notifications = asyncio.create_task(self._deliver_notifications())
        return await super().start(host, port, advertise_host=advertise_host)

    async def stop(self) -> None:
        await super().stop()
        if self._notifications is not None:
            self._notifications.cancel()
            await asyncio.gather(self._notifications, return_exceptions=True)
            self._notifications = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None

    async def _serve(self, sock: socket.socket) -> bytes | None:
        """Serve one N_HELLO + N_READ, then wait for the READ's notification (or one N_READ_POSTED); returns the
        ERROR frame to close with, None after a DONE (the connection then serves the client's next request)."""
        first = await recv_frame(sock, self.config.io_timeout_s, "KV client")
        if first.kind == N_READ_POSTED:
            return await self._serve_posted(sock, first.payload)
        accepted = await self._receive_read(sock, first)
        if isinstance(accepted, bytes):
            return accepted
        request = accepted.request
        lease_id, block_ids = request.lease_id, list(request.block_ids)
        rows = buffer_iovecs(self.buffer, block_ids)  # the registered memory's addresses (VRAM: the device's)
        head_bytes = DESCS_HEAD.size + len(self._metadata) + rows.nbytes
        if head_bytes > MAX_PAYLOAD_BYTES:
            return accepted.hello_ok + encode_frame(ERROR, f"{len(rows)} descriptors exceed one nixl:// read; read "
                                                    "fewer or less fragmented blocks".encode(), ERR_REFUSED)
        # hashed BEFORE the client may read: what it reads must be what was hashed
        sums = checksum.block_checksums(self.buffer, block_ids).tobytes() if accepted.flags & READ_CHECKSUM else b""
        tag = secrets.token_bytes(16)
        head = DESCS_HEAD.pack(self.incarnation, self.memory.device_id, MEM_KINDS.index(self.memory.kind), tag,
                               len(self._metadata), len(rows), self.buffer.base_ptr, self.buffer.num_blocks,
                               POSTED_READS if self.takes_posted_reads else 0)
        answer = accepted.hello_ok + encode_frame(N_DESCS, head + self._metadata + rows.tobytes())
        return await self._read_then_done(sock, tag, lease_id, block_ids, answer, sums)

    async def _serve_posted(self, sock: socket.socket, payload: bytes) -> bytes | None:
        """Answer a READ the client posted without asking (N_READ_POSTED: on a connection where it read from this
        incarnation before): DONE once its N_READ_DONE and notification came, if the lease was live then and
        covers its blocks (the lease was granted before the client learnt its id and, live now, was live
        throughout the READ: no lease revives); else the ERROR frame. Never checksums (a client asks for those
        by the full exchange)."""
        if not self.takes_posted_reads:
            return encode_frame(ERROR, b"this nixl:// server takes no N_READ_POSTED (it stages or authenticates "
                                b"its reads): send N_HELLO + N_READ", ERR_PROTOCOL)
        incarnation, tag, request = parse_posted(payload)
        if incarnation != self.incarnation:
            return encode_frame(ERROR, b"the READ went to another incarnation of this server", ERR_REFUSED)
        refusal = await self._read_then_done(sock, tag, request.lease_id, request.block_ids)
        self.num_posted_reads += refusal is None
        return refusal

    async def _read_then_done(self, sock: socket.socket, tag: bytes, lease_id: str, block_ids: Sequence[int],
                              answer: bytes = b"", sums: bytes = b"") -> bytes | None:
        """``answer`` sent (what the client READs by; none for a posted READ), the READ's hint and notification
        awaited (the agent progresses meanwhile), then DONE (carrying ``sums``) only if the lease held for the whole
        READ: its blocks cannot have been freed and reused. Returns the ERROR frame to close with instead."""
        io_s, what = self.config.io_timeout_s, "KV client"
        done = self._waiter(tag)
        try:
            if answer:
                await send_frame(sock, answer, io_s, what)
            self._wake.set()
            bound_s = io_s + len(block_ids) * self.buffer.layout.bytes_per_block / 1e9
            refusal = await self._await_notification(sock, tag, done, bound_s)
        finally:
            self._waiting.pop(tag, None)
            self._hinted.discard(tag)
        refusal = refusal or self._check_read(lease_id, block_ids)
        if refusal is None:
            await send_frame(sock, encode_frame(DONE, sums), io_s, what)
        return refusal

    def _waiter(self, tag: bytes) -> asyncio.Future[None]:
        """The future the notification of ``tag`` completes: already done if it came before anyone waited."""
        done = self._waiting[tag] = asyncio.get_running_loop().create_future()
        if tag in self._early:
            del self._early[tag]
            done.set_result(None)
        return done

    async def _await_notification(self, sock: socket.socket, tag: bytes, done: asyncio.Future[None],
                                  timeout_s: float) -> bytes | None:
        """None once the client's N_READ_DONE hint and then the READ's notification came; the ERROR frame if they
        did not within ``timeout_s``. The hint is awaited first (one wake-up: the client sends it once its READ is
        complete, so the notification is in, or about to be), then the notification is polled for without pause.
        KVTransferError when the client closed the connection meanwhile (it gave up on the read) or sent anything
        but one N_READ_DONE."""
        deadline = time.monotonic() + timeout_s
        try:
            if not await peek_byte(sock, timeout_s, "KV client"):
                raise KVTransferError("the client closed the connection before its READ's notification")
        except KVTransferError:
            if time.monotonic() < deadline:
                raise
            return self._no_notification(timeout_s)
        hint = await recv_frame(sock, self.config.io_timeout_s, "KV client")
        if hint.kind != N_READ_DONE:
            raise KVTransferError(f"expected the READ's notification, the client sent frame kind {hint.kind}")
        self._hinted.add(tag)
        self._poll_notifications()  # the READ is complete: its notification is most likely in already
        while not done.done() and (left_s := deadline - time.monotonic()) > 0:
            self._wake.set()  # the notifications task polls without pause for a hinted read
            gone = asyncio.ensure_future(peek_byte(sock, left_s, "KV client"))
            try:
                await asyncio.wait({done, gone}, timeout=left_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not gone.done():
                    gone.cancel()
                await asyncio.gather(gone, return_exceptions=True)
            if not done.done() and gone.done() and not gone.cancelled() and gone.exception() is None:
                raise KVTransferError("the client closed the connection before its READ's notification"
                                      if not gone.result() else "the client sent more than one N_READ_DONE")
        return None if done.done() else self._no_notification(timeout_s)

    @staticmethod
    def _no_notification(timeout_s: float) -> bytes:
        logger.warning("KV data plane (nixl): no READ notification within %.1f s", timeout_s)
        return encode_frame(ERROR, f"no READ notification within {timeout_s:.1f} s".encode(), ERR_PROTOCOL)

    async def _deliver_notifications(self) -> None:
        """Poll the agent's notifications while any read waits for one; wake the read whose tag came."""
        polls = 0
        while True:
            if not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                polls = 0
            polls = 0 if self._poll_notifications() else polls + 1
            await asyncio.sleep(0.0 if self._hinted else POLL_S[min(polls, len(POLL_S) - 1)])

    def _poll_notifications(self) -> bool:
        """Progress the agent once and wake the reads whose notifications came; True if any did."""
        try:
            notifs = self.agent.nixl.get_new_notifs()
        except Exception:  # noqa: BLE001 - a NIXL error must not end the server: the reads time out
            logger.exception("KV data plane (nixl): reading notifications failed")
            return False
        delivered = False
        for messages in notifs.values():
            for message in messages:
                self.num_notifications += 1
                tag = bytes(message)
                waiter = self._waiting.get(tag)
                if waiter is None:  # its N_READ_POSTED is still on its way (or never comes: the client died)
                    self._early[tag] = None
                    if len(self._early) > EARLY_TAGS:
                        self._early.popitem(last=False)
                elif not waiter.done():
                    waiter.set_result(None)
                    delivered = True
        return delivered
