"""``ucx://host:port``: the KV data plane over UCX, through the ``ucxx`` package's asyncio API.

Install with ``pip install ucxx-cu12==0.52.0`` (the ``ucx`` extra). This module imports without it and
raises ``KVTransferError`` when a ``ucx://`` server or client is used without it.

Why tagged messages, not RMA: UCX's one-sided ``get`` would be the natural pull, but ucxx 0.52's Python
API does not expose memory registration, packed remote keys or ``get``/``put`` (they exist only in its
C++ library), so the server sends and the client receives tagged messages.

Device memory: a CUDA cache served in place (a ``TensorKVBuffer``) is sent from and received into CUDA
tensor views, which ucxx takes by their ``__cuda_array_interface__``; UCX then moves them with cuda_copy,
cuda_ipc (same host) or RDMA (``ucx_plan.message``). The same code on a CPU tensor runs in the tests; the
CUDA branch has never run here (no GPU).

A pull is one round trip on a UCX endpoint (connection). A client keeps its idle endpoints per event loop and
URI and reuses them, one pull at a time each (``REUSE_ENDPOINTS``; ``UcxClient(reuse_endpoints=False)`` opens one
per pull): a UCX wireup costs 10-100 ms here, more than moving 32 MiB. A pooled endpoint the server closed
or that broke while idle is dropped and the pull starts over on a new one, before any byte moved; one whose
server stays silent fails the pull (``io_timeout_s``), as a fresh one would.

Every message below is a tagged message on that endpoint with its own tag, offset by ``n << 32`` for the
endpoint's n-th pull, so nothing depends on message ordering. Control messages are the frames of
``kv_transfer/wire.py`` (a 12-byte header on tag ``t``, its payload, if any, on tag ``t + 1``;
``kv_transfer/ucx_endpoint.py``)::

    client -> REQUEST   READ: u8 flags | u16 len | client KVLayout JSON | ``wire.encode_read`` with the runs
                        (blocks per message) [| HMAC trailer over all of it (READ_AUTH; kv_transfer/auth.py)]
    server -> REPLY     ERROR  layout mismatch (payload: the server's layout), then missing or bad
                               credentials, unknown/expired lease, block not in the lease or out of
                               range, bad request: nothing moves (and the server closes the endpoint)
                     or DATA   u64 num_bytes | the server's KVLayout JSON (the client checks it too), then
              KV        one message per (layer, run): layer-major, runs in request order (wire order)
              DONE      the lease was still live after the last KV byte (else ERROR: it ended mid-read);
                        with ``READ_CHECKSUM`` its payload is one xxh3-64 per block (kv_transfer/checksum.py)

The client chooses the runs (how many blocks each message carries, in request order; ``ucx_plan.plan_pull``),
splitting long ones at ``MAX_MESSAGE_BYTES``. A message is one contiguous piece of memory on each side,
and each costs far more than copying it (a rendezvous round trip, a request, a Python future: ~0.1 ms),
so: when the runs consecutive on both sides are large (>= ``DIRECT_MIN_MESSAGE_BYTES`` per message on
average), every KV message goes straight from the source blocks into the destination blocks, zero copies.
Otherwise the fragmented side copies once: a server whose blocks in a run are not consecutive sends from
one gathered copy (numpy ``take``), and a client whose destination is scattered receives into one staging
buffer and scatters it (numpy fancy indexing), so a pull stays a few large messages.
The client keeps at most ``RECV_WINDOW_BYTES`` of KV
receives posted: a rendezvous message moves once its receive is posted, and ucxx's progress call runs as long as
bytes flow, so the window bounds how long a pull can keep the event loop from its other tasks.

Every wait on the peer is bounded: connecting by ``connect_timeout_s``; each control message, and each
stretch of the KV stream in which no message completes, by ``io_timeout_s``. On any failure the
endpoint is aborted, which cancels its outstanding receives before the pull returns, so nothing lands
in the destination after an error is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import struct
import time
from typing import Any

import numpy as np

from kv_transfer import auth, checksum
from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVLayout
from kv_transfer.protocol import (
    DATA_BYTES, check_data, check_hello_ok, locate_read, refuse_layout, refuse_read, refuse_unauthenticated,
    remote_error, sign_read, verify_done,
)
from kv_transfer.tensor_buffer import AnyKVBuffer, TensorKVBuffer
from kv_transfer.transport import KVClient, Locator, Pull, Resolver, TransportConfig, parse_uri
from kv_transfer.ucx_endpoint import (
    ENDPOINT_ERROR_HANDLING, TAG_DONE, TAG_KV, TAG_REPLY, TAG_REQUEST, PeerSilent, abort, await_all, bounded, checkin,
    checkout, close, close_idle_endpoints, import_ucxx, recv_frame, send_frame, tag,
)
from kv_transfer.ucx_plan import (
    check_runs, decode_request, encode_request, plan_pull, run_starts, run_views, runs_consecutive,
)
from kv_transfer.wire import (
    DATA, DONE, ERR_PROTOCOL, ERR_REFUSED, ERROR, READ, READ_AUTH, READ_CHECKSUM, Frame, ReadRequest, encode_frame,
    encode_read,
)

logger = logging.getLogger(__name__)

RECV_WINDOW_BYTES = 16 << 20  # KV bytes the client has receives posted for at once (see UcxClient._receive)
CLOSE_LINGER_S = 1.0  # after refusing, the server waits this long for the client to close first
SERVER_IDLE_S = 60.0  # a served connection with no next request for this long is closed
# Clients keep endpoints between pulls (``reuse_endpoints``) by default: connecting costs a UCX wireup of
# 10-100 ms here, more than moving 32 MiB (tcp, cma and nixl clients keep their connections likewise).
REUSE_ENDPOINTS = True


# --- server ---------------------------------------------------------------------------------------


class UcxServer:
    """Serves reads of leased blocks of ``buffer`` over UCX; ``resolve`` maps a lease id to its block ids."""

    def __init__(self, *, buffer: AnyKVBuffer, resolve: Resolver, config: TransportConfig | None = None,
                 locate: Locator | None = None) -> None:
        self.buffer, self.resolve, self.config = buffer, resolve, config or TransportConfig()
        self.locate = locate  # where a read's blocks are in ``buffer`` (host staging translates them)
        self.auth = auth.ReadAuth(self.config.secret) if self.config.secret else None
        self.uri: str | None = None
        self._listener: Any = None
        self._connections: set[asyncio.Task] = set()
        self.num_accepted = 0  # connections accepted so far (clients keep and reuse theirs)

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, advertise_host: str | None = None) -> str:
        """Listen on ``port`` (0: a free one; UCX listens on every interface); the URI names
        ``advertise_host`` or else ``host``. A port just released may stay busy for a while (the kernel's
        TIME_WAIT): a requested port is retried for up to ``connect_timeout_s``."""
        if self.uri is not None:
            return self.uri
        ucxx = import_ucxx()
        deadline = time.monotonic() + self.config.connect_timeout_s
        while True:
            try:
                listener = ucxx.create_listener(
                    self._handle,
                    port=port,
                    endpoint_error_handling=ENDPOINT_ERROR_HANDLING,
                    connect_timeout=self.config.connect_timeout_s,
                )
                break
            except ucxx.exceptions.UCXBusyError as exc:  # "Device is busy": the port is still in use
                if port == 0 or time.monotonic() >= deadline:
                    raise KVTransferError(f"cannot listen on UCX port {port}: {exc}") from exc
                # An endpoint this process accepted keeps its UCP listener (and port) alive until the
                # endpoint's Python wrapper is freed, which asyncio's task/traceback cycles can delay.
                gc.collect()
                await asyncio.sleep(0.1)
            except Exception as exc:
                raise KVTransferError(f"cannot listen on UCX port {port}: {type(exc).__name__}: {exc}") from exc
        self._listener = listener
        shown = advertise_host or host
        self.uri = f"ucx://{f'[{shown}]' if ':' in shown else shown}:{listener.port}"
        logger.info("KV data plane serving %s", self.uri)
        return self.uri

    async def stop(self) -> None:
        listener, self._listener, self.uri = self._listener, None, None  # connections arriving now: refused
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # let ucxx retire its handler futures before the listener goes
        if listener is not None:
            # ucxx hazard: the C++ listener lives (and listens) as long as any endpoint it accepted, but the
            # Python callback data dies with the Python listener: a client connecting in between crashes
            # the process (segfault in ucp_cm_server_conn_request_progress). ucxx frees an endpoint only
            # when its Python wrapper is freed, which asyncio's task/traceback cycles delay until a GC: so
            # collect first, then close the listener; its port is free when stop() returns.
            gc.collect()
            listener.close()
            del listener

    async def _handle(self, ep: Any) -> None:
        """One connection: pulls one after another (request ``seq`` uses tags offset by ``seq << 32``)
        until the client closes it or leaves it idle. Runs as the task ucxx's listener starts for it."""
        if self._listener is None or asyncio.current_task() is None:  # stopping
            abort(ep)
            return
        self._connections.add(asyncio.current_task())
        self.num_accepted += 1
        try:
            seq = 0
            while (request := await self._next_request(ep, seq)) is not None:
                refusal = await self._serve(ep, seq, request)
                if refusal is not None:
                    reply = send_frame(ep, tag(seq, TAG_REPLY), refusal)
                    await bounded(reply, self.config.io_timeout_s, "KV client")
                    await self._linger(ep)
                    return
                seq += 1
        except KVTransferError as exc:  # malformed or vanished client
            logger.info("KV data plane: dropped a client: %s", exc)
        except Exception:
            logger.exception("KV data plane: serving a client failed")
        finally:
            abort(ep)
            self._connections.discard(asyncio.current_task())

    async def _next_request(self, ep: Any, seq: int) -> Frame | bytes | None:
        """The next request frame; an ERROR frame to refuse with (bad or no first request); None when a
        client that was served closes the connection or leaves it idle for ``SERVER_IDLE_S``."""
        what = "KV client"
        timeout_s = self.config.io_timeout_s if seq == 0 else SERVER_IDLE_S
        try:
            return await bounded(recv_frame(ep, tag(seq, TAG_REQUEST), what), timeout_s, what)
        except KVTransferError as exc:
            if seq:
                logger.debug("KV data plane: a client connection ended: %s", exc)
                return None
            logger.info("KV data plane: refused a client: %s", exc)  # silent, or not a Baton client
            return encode_frame(ERROR, str(exc).encode(), ERR_PROTOCOL)

    async def _serve(self, ep: Any, seq: int, request: Frame | bytes) -> bytes | None:
        """Serve one READ; returns the ERROR frame to reply with, None when the pull was served."""
        io_s, what = self.config.io_timeout_s, "KV client"
        if isinstance(request, bytes):
            return request
        if request.kind != READ:
            return encode_frame(ERROR, b"expected READ", ERR_PROTOCOL)
        try:
            flags = request.payload[0] if request.payload else 0
            body, trailer = auth.split_trailer(request.payload, bool(flags & READ_AUTH))
            flags, layout_json, read = decode_request(body)
        except KVTransferError as exc:
            return encode_frame(ERROR, str(exc).encode(), ERR_PROTOCOL)
        # the layouts first, then the credentials (over the whole request, flags included), then the lease
        refusal = refuse_layout(self.buffer.layout, layout_json) or refuse_unauthenticated(self.auth, READ, body,
                                                                                            trailer)
        read = refusal or locate_read(self.locate, read)
        refusal = read if isinstance(read, bytes) else self._check_read(read)
        if refusal is not None:
            return refusal
        block_ids, runs = list(read.block_ids), list(read.runs)
        num_bytes = len(block_ids) * self.buffer.layout.bytes_per_block
        reply = encode_frame(DATA, struct.pack("<Q", num_bytes) + self.buffer.layout.to_json().encode())
        sends = [send_frame(ep, tag(seq, TAG_REPLY), reply)]
        sends += [ep.send(view, tag=tag(seq, TAG_KV + i)) for i, view in enumerate(self._messages(block_ids, runs))]
        await await_all(sends, io_s, what)
        # DONE only if the lease held for the whole read: its blocks cannot have been freed and reused.
        done = self._check_read(read)
        if done is None:
            sums = checksum.block_checksums(self.buffer, block_ids).tobytes() if flags & READ_CHECKSUM else b""
            done = encode_frame(DONE, sums)
        await bounded(send_frame(ep, tag(seq, TAG_DONE), done), io_s, what)
        return None

    def _messages(self, block_ids: list[int], runs: list[int]) -> list[Any]:
        """The KV messages in wire order: per layer, one contiguous view per run; straight out of the
        buffer when each run is consecutive here, else out of one gathered copy of the blocks (on the
        buffer's device)."""
        starts = run_starts(runs)
        if runs_consecutive(block_ids, runs):
            return run_views(_blocks(self.buffer), [block_ids[pos] for pos in starts], runs)
        if isinstance(self.buffer, TensorKVBuffer):
            return run_views(self.buffer.take(block_ids), starts, runs)
        staged = np.take(self.buffer.array, block_ids, axis=1)  # [L, n, seg], contiguous: one gather copy
        return run_views(staged, starts, runs)

    def _check_read(self, read: ReadRequest) -> bytes | None:
        """The lease and block checks (``refuse_read``), then the runs must partition the request."""
        refusal = refuse_read(self.buffer, self.resolve, self.config, read.lease_id, read.block_ids)
        if refusal is not None:
            return refusal
        try:
            check_runs(read.block_ids, read.runs)
        except KVTransferError as exc:
            return encode_frame(ERROR, str(exc).encode(), ERR_REFUSED)
        return None

    async def _linger(self, ep: Any) -> None:
        """Give the client a moment to close first, so the connection's TIME_WAIT is not on our port."""
        if ep.closed:
            return
        closed = asyncio.get_running_loop().create_future()

        def on_close(*_: Any) -> None:
            if not closed.done():
                closed.set_result(None)

        with contextlib.suppress(Exception):
            ep.set_close_callback(on_close)
            await asyncio.wait_for(closed, min(CLOSE_LINGER_S, self.config.io_timeout_s))


# --- client ---------------------------------------------------------------------------------------


class UcxClient(KVClient):
    """Pulls leased blocks from ``ucx://`` servers: one endpoint per pull, or, with ``reuse_endpoints``,
    endpoints kept idle between pulls (per event loop and URI; one pull at a time on each)."""

    pulls_into_tensors = True

    def __init__(
        self, config: TransportConfig | None = None, *, staging: bool | None = None, reuse_endpoints: bool | None = None
    ) -> None:
        super().__init__(config)
        self.staging = staging  # None: choose per pull (plan_pull); True/False force it (benchmarks, tests)
        self.reuse_endpoints = REUSE_ENDPOINTS if reuse_endpoints is None else reuse_endpoints

    def close(self) -> None:
        """Close the idle endpoints (they are kept per event loop and URI, for every client of this process)."""
        close_idle_endpoints()

    async def _pull(self, request: Pull) -> None:
        uri, layout, src_ids, dst_ids = request.uri, request.layout, request.src_ids, request.dst_ids
        host, port = parse_uri(uri, "ucx")
        runs, staged = plan_pull(layout, src_ids, dst_ids, staging=self.staging)
        flags = (READ_CHECKSUM if self.config.checksum else 0) | (READ_AUTH if self.config.secret else 0)
        read = encode_read(ReadRequest(request.lease_id, src_ids, runs=runs))
        payload, _ = sign_read(self.config, READ, b"", encode_request(layout, read, flags))  # flags signed too
        frame = encode_frame(READ, payload)
        ep, seq, reply = await self._pooled_request(uri, frame)
        if ep is None:
            ep = await self._connect(import_ucxx(), uri, host, port)
        try:
            if reply is None:
                reply = await self._request(ep, seq, frame, f"KV server {uri}")
            _check_reply(uri, layout, request.num_bytes, reply)
            staging = _new_blocks(request.dst_buffer, len(src_ids)) if staged else None
            done = await self._receive(ep, seq, request, runs, staging)
        except BaseException:
            abort(ep)  # cancels any receive still posted into the destination before we return
            raise
        if done.kind != DONE:
            abort(ep)
            raise remote_error(uri, done)
        if self.reuse_endpoints:
            checkin(uri, ep, seq + 1)
        else:
            await close(ep)
        if staging is not None:  # [L, n, seg] -> the scattered destination blocks
            if isinstance(request.dst_buffer, TensorKVBuffer):
                request.dst_buffer.put(dst_ids, staging)
            else:
                request.dst_buffer.array[:, dst_ids] = staging
        if self.config.checksum:
            verify_done(uri, request.dst_buffer, dst_ids, done.payload)

    async def _pooled_request(self, uri: str, frame: bytes) -> tuple[Any, int, Frame | None]:
        """(endpoint, its next seq, the reply) of the request sent on a pooled endpoint; (None, 0, None)
        without one, or when it failed before anything moved (the pull then starts over)."""
        if not self.reuse_endpoints or (pooled := checkout(uri)) is None:
            return None, 0, None
        ep, seq = pooled
        try:
            return ep, seq, await self._request(ep, seq, frame, f"KV server {uri}")
        except PeerSilent:
            abort(ep)
            raise
        except KVTransferError as exc:  # e.g. the server closed it while idle: nothing moved, start over
            logger.debug("KV pull from %s: a pooled endpoint failed (%s); reconnecting", uri, exc)
            abort(ep)
            return None, 0, None
        except BaseException:
            abort(ep)
            raise

    async def _receive(self, ep: Any, seq: int, request: Pull, runs: list[int],
                       staging: Any) -> Frame:
        """Receive the KV messages into the destination blocks (or ``staging``), then DONE."""
        what = f"KV server {request.uri}"
        starts = run_starts(runs)
        if staging is not None:
            views = run_views(staging, starts, runs)
        else:
            views = run_views(_blocks(request.dst_buffer), [request.dst_ids[pos] for pos in starts], runs)
        receives = [recv_frame(ep, tag(seq, TAG_DONE), what)]
        receives += [ep.recv(view, tag=tag(seq, TAG_KV + i)) for i, view in enumerate(views)]
        # A bounded window of posted receives: UCX moves a rendezvous message's bytes once its receive
        # is posted, and ucxx's progress call runs until no more progress is possible, starving the
        # event loop for as long as bytes keep flowing. The window bounds that to a few MiB.
        sizes = [0] + [view.nbytes for view in views]
        results = await await_all(receives, self.config.io_timeout_s, what, sizes=sizes, budget=RECV_WINDOW_BYTES)
        return results[0]

    async def _request(self, ep: Any, seq: int, request: bytes, what: str) -> Frame:
        """Send the READ, return the reply; no KV byte has moved yet (its receives are not posted)."""
        io_s = self.config.io_timeout_s
        await bounded(send_frame(ep, tag(seq, TAG_REQUEST), request), io_s, what)
        return await bounded(recv_frame(ep, tag(seq, TAG_REPLY), what), io_s, what)

    async def _connect(self, ucxx: Any, uri: str, host: str, port: int) -> Any:
        timeout_s = self.config.connect_timeout_s
        task = asyncio.ensure_future(
            ucxx.create_endpoint(host, port, endpoint_error_handling=ENDPOINT_ERROR_HANDLING, connect_timeout=timeout_s)
        )
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except asyncio.TimeoutError:
            raise KVTransferError(f"cannot connect to KV server {uri}: timed out after {timeout_s:g} s") from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise KVTransferError(f"cannot connect to KV server {uri}: {type(exc).__name__}: {exc}") from exc
        finally:
            if not task.done():  # timed out or cancelled: an endpoint that connects later is closed at once
                task.add_done_callback(lambda t: t.cancelled() or t.exception() or abort(t.result()))


def _check_reply(uri: str, layout: KVLayout, expected: int, frame: Frame) -> None:
    """The reply to a READ: DATA (u64 num_bytes | the server's KVLayout JSON) or an ERROR."""
    if frame.kind == DATA and len(frame.payload) < DATA_BYTES.size:
        raise KVTransferError(f"KV server {uri}: malformed DATA")
    server_layout = frame._replace(payload=frame.payload[DATA_BYTES.size :]) if frame.kind == DATA else frame
    check_hello_ok(uri, layout, server_layout, ok_kind=DATA)  # names the differing fields of a mismatch
    check_data(uri, expected, frame)


def _blocks(buffer: AnyKVBuffer) -> Any:
    """The buffer's ``[num_layers, num_blocks, segment_bytes]`` bytes: a numpy array, or a tensor (any device)."""
    return buffer.tensor if isinstance(buffer, TensorKVBuffer) else buffer.array


def _new_blocks(buffer: AnyKVBuffer, count: int) -> Any:
    """Room for ``count`` blocks where ``buffer`` lives (a scattered receive lands there first)."""
    if isinstance(buffer, TensorKVBuffer):
        return buffer.new_blocks(count)
    return np.empty((buffer.layout.num_layers, count, buffer.segment_bytes), np.uint8)
