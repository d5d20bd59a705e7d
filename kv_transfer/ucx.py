"""``ucx://host:port``: the KV data plane over UCX, through the ``ucxx`` package's asyncio API.

Install with ``pip install ucxx-cu12==0.52.0`` (the ``ucx`` extra). This module imports without it and
raises ``KVTransferError`` when a ``ucx://`` server or client is used without it.

Why tagged messages, not RMA: UCX's one-sided ``get`` would be the natural pull, but ucxx 0.52's Python
API does not expose memory registration, packed remote keys or ``get``/``put`` (they exist only in its
C++ library), so the server sends and the client receives tagged messages.

A pull is one round trip on a UCX endpoint (connection): by default a fresh endpoint per pull, like
``tcp://``; with ``UcxClient(reuse_endpoints=True)`` (or ``REUSE_ENDPOINTS``) idle endpoints are kept per
event loop and URI and reused, one pull at a time each. Every message below is a tagged message on
that endpoint with its own tag, offset by ``n << 32`` for the endpoint's n-th pull, so nothing depends on
message ordering. Control messages are the ``tcp://`` frames (``kv_transfer/tcp_wire.py``: a 12-byte
header on tag ``t``, its payload, if any, on tag ``t + 1``)::

    client -> REQUEST   READ: u8 flags | u16 len | client KVLayout JSON | u16 len | lease id |
                        u32 count | count x u32 source block ids | u32 runs | runs x u32 blocks per message
                        [| HMAC trailer over all of it (FLAG_AUTH; kv_transfer/auth.py)]
    server -> REPLY     ERROR  layout mismatch (payload: the server's layout), then missing or bad
                               credentials, unknown/expired lease, block not in the lease or out of
                               range, bad request: nothing moves (and the server closes the endpoint)
                     or DATA   u64 num_bytes | the server's KVLayout JSON (the client checks it too), then
              KV        one message per (layer, run): layer-major, runs in request order (wire order)
              DONE      the lease was still live after the last KV byte (else ERROR: it ended mid-read);
                        with ``FLAG_CHECKSUM`` its payload is one xxh3-64 per block (kv_transfer/checksum.py)

The client chooses the runs (how many blocks each message carries, in request order; ``plan_pull``),
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
import os
import struct
import time
import weakref
from collections.abc import Awaitable, Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from kv_transfer import auth
from kv_transfer.checksum import DTYPE as CHECKSUM_DTYPE
from kv_transfer.checksum import block_checksums, verify
from kv_transfer.errors import KVTransferError, LayoutMismatch, LeaseNotFound
from kv_transfer.layout import KVBuffer, KVLayout, block_runs, paired_runs
from kv_transfer.tcp_wire import (
    DATA,
    DONE,
    ERR_LAYOUT,
    ERR_AUTH,
    ERR_LEASE,
    ERR_PROTOCOL,
    ERR_REFUSED,
    ERROR,
    HEADER,
    MAGIC,
    MAX_LEASE_ID_BYTES,
    MAX_PAYLOAD_BYTES,
    READ,
    VERSION,
    Frame,
    encode_frame,
)
from kv_transfer.tcp import refuse_read
from kv_transfer.transport import Resolver, TransferStats, TransportConfig, check_pull_args

logger = logging.getLogger(__name__)

INSTALL_HINT = "ucx transport needs the ucxx package: pip install ucxx-cu12==0.52.0"
# Set before ucxx is imported, unless the user set them: with UCX's defaults over loopback TCP ucxx moves
# ~0.65 GB/s; with both segment sizes ~3-4 GB/s (either alone ~1.35 GB/s). Blocking progress drives UCX
# from the event loop (its epoll fd) instead of a progress thread competing for the GIL. REUSEADDR is
# SO_REUSEADDR on the listener, as tcp:// sets it: without it a port whose connections the server closed
# stays "busy" for the kernel's TIME_WAIT (60 s), so a restarted worker could not listen on its port.
ENV_DEFAULTS = {
    "UCX_TCP_TX_SEG_SIZE": "256K",
    "UCX_TCP_RX_SEG_SIZE": "256K",
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_TCP_CM_REUSEADDR": "y",
}
# Both ends must agree; error handling makes a vanished peer an error instead of a hang or an abort.
ENDPOINT_ERROR_HANDLING = True

TAG_REQUEST, TAG_REPLY, TAG_DONE, TAG_KV = 1, 3, 5, 16  # a frame uses tags t and t + 1; KV message i: 16 + i
SEQ_SHIFT = 32  # the n-th pull on an endpoint offsets its tags by n << SEQ_SHIFT
FLAG_CHECKSUM, FLAG_AUTH = 1, 2  # FLAG_AUTH: the READ payload ends with an HMAC trailer (kv_transfer/auth.py)
MAX_MESSAGE_BYTES = 4 << 20  # longer runs are split, so progress (and the io timeout) has a fine grain
RECV_WINDOW_BYTES = 16 << 20  # KV bytes the client has receives posted for at once (see UcxClient.pull)
DIRECT_MIN_MESSAGE_BYTES = 256 << 10  # below this average, stage scattered pulls (see the docstring)
CLOSE_LINGER_S = 1.0  # after refusing, the server waits this long for the client to close first
SERVER_IDLE_S = 60.0  # a served connection with no next request for this long is closed
# Clients may keep endpoints between pulls (``reuse_endpoints``): connecting costs a UCX wireup of
# 10-100 ms here, more than moving 32 MiB. Off by default: the transport contract has clients hold no
# connection between pulls.
REUSE_ENDPOINTS = False
POOL_IDLE_S = 30.0  # an idle pooled endpoint older than this is closed, not reused (< SERVER_IDLE_S)
POOL_MAX_PER_URI = 8

_ucxx: Any = None


def _import_ucxx() -> Any:
    """The ``ucxx`` module, imported on first use with Baton's UCX environment defaults."""
    global _ucxx
    if _ucxx is None:
        for name, value in ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        try:
            import ucxx
        except (ImportError, OSError) as exc:
            raise KVTransferError(INSTALL_HINT) from exc
        _ucxx = ucxx
    return _ucxx


def ucxx_available() -> bool:
    try:
        _import_ucxx()
    except KVTransferError:
        return False
    return True


# --- the request -----------------------------------------------------------------------------------


def encode_request(
    layout: KVLayout, lease_id: str, block_ids: Sequence[int], runs: Sequence[int], flags: int = 0
) -> bytes:
    lease, layout_json = lease_id.encode(), layout.to_json().encode()
    if len(lease) > MAX_LEASE_ID_BYTES:
        raise KVTransferError(f"lease id longer than {MAX_LEASE_ID_BYTES} bytes")
    if any(not 0 <= b < 1 << 32 for b in block_ids):
        raise KVTransferError("source block ids must be in [0, 2**32)")
    payload = b"".join((
        struct.pack(f"<BH{len(layout_json)}sH{len(lease)}s", flags, len(layout_json), layout_json, len(lease), lease),
        struct.pack(f"<I{len(block_ids)}I", len(block_ids), *block_ids),
        struct.pack(f"<I{len(runs)}I", len(runs), *runs),
    ))
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise KVTransferError(f"pull of {len(block_ids)} blocks exceeds the {MAX_PAYLOAD_BYTES}-byte request limit")
    return payload


def decode_request(payload: bytes) -> tuple[int, bytes, str, list[int], list[int]]:
    """-> (flags, layout JSON, lease id, source block ids, blocks per message)."""
    try:
        flags, layout_len = struct.unpack_from("<BH", payload)
        pos = 3
        (layout_json,) = struct.unpack_from(f"<{layout_len}s", payload, pos)
        pos += layout_len
        (lease_len,) = struct.unpack_from("<H", payload, pos)
        (lease,) = struct.unpack_from(f"<{lease_len}s", payload, pos + 2)
        pos += 2 + lease_len
        (count,) = struct.unpack_from("<I", payload, pos)
        block_ids = list(struct.unpack_from(f"<{count}I", payload, pos + 4))
        pos += 4 + 4 * count
        (num_runs,) = struct.unpack_from("<I", payload, pos)
        runs = list(struct.unpack_from(f"<{num_runs}I", payload, pos + 4))
        if pos + 4 + 4 * num_runs != len(payload):
            raise ValueError("trailing bytes")
        return flags, layout_json, lease.decode(), block_ids, runs
    except (struct.error, ValueError) as exc:
        raise KVTransferError(f"malformed READ: {exc}") from exc


def check_runs(block_ids: Sequence[int], runs: Sequence[int]) -> None:
    """The runs (blocks per message, in request order) must partition the request."""
    if any(r < 1 for r in runs) or sum(runs) != len(block_ids):
        raise KVTransferError("malformed READ: the runs do not partition the block ids")


def runs_consecutive(block_ids: Sequence[int], runs: Sequence[int]) -> bool:
    """Whether every run is consecutive in ``block_ids`` (so each message is one contiguous view)."""
    pos = 0
    for count in runs:
        first = block_ids[pos]
        if any(block_ids[pos + k] != first + k for k in range(1, count)):
            return False
        pos += count
    return True


def split_runs(counts: Sequence[int], max_blocks: int) -> list[int]:
    return [min(max_blocks, count - i) for count in counts for i in range(0, count, max_blocks)]


def plan_pull(
    layout: KVLayout, src_ids: Sequence[int], dst_ids: Sequence[int], *, staging: bool | None = None
) -> tuple[list[int], bool]:
    """(blocks per message, does the client stage?). A side whose blocks within each run are not consecutive
    stages (the server gathers, the client scatters: one copy each); each message costs more than a copy
    below ``DIRECT_MIN_MESSAGE_BYTES``. In order of preference: runs consecutive on both sides (no copy);
    runs of the destination (the server gathers); runs of the source, or else one run (the client stages)."""
    n, seg = len(src_ids), layout.bytes_per_block_per_layer
    max_blocks = max(1, MAX_MESSAGE_BYTES // seg)

    def large(counts: list[int]) -> bool:
        return n * seg / max(1, len(counts)) >= DIRECT_MIN_MESSAGE_BYTES

    paired = [c for _, _, c in paired_runs(src_ids, dst_ids)]
    if staging is False:
        return split_runs(paired, max_blocks), False
    if staging is None:
        if large(paired):
            return split_runs(paired, max_blocks), False
        by_dst = [c for _, c in block_runs(dst_ids)]
        if large(by_dst):
            return split_runs(by_dst, max_blocks), False
    by_src = [c for _, c in block_runs(src_ids)]
    return split_runs(by_src if large(by_src) else [n], max_blocks), True


# --- messages ---------------------------------------------------------------------------------------


def _wrap(exc: BaseException, what: str) -> KVTransferError:
    if isinstance(exc, KVTransferError):
        return exc
    if isinstance(exc, asyncio.TimeoutError):
        return KVTransferError(f"{what}: timed out")
    return KVTransferError(f"{what}: {type(exc).__name__}: {exc}")


class _PeerSilent(KVTransferError):
    """A wait on the peer timed out (as opposed to the connection failing)."""


async def _bounded(aw: Awaitable, timeout_s: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(aw, timeout_s)
    except asyncio.TimeoutError:
        raise _PeerSilent(f"{what}: peer silent for {timeout_s:g} s") from None
    except (KVTransferError, asyncio.CancelledError):
        raise
    except Exception as exc:  # ucxx's UCXError family, closed endpoints, ...
        raise _wrap(exc, what) from exc


async def _await_all(
    aws: Sequence[Awaitable], timeout_s: float, what: str, sizes: Sequence[int] | None = None, budget: int = 0
) -> list[Any]:
    """Await every one; fail on the first error, or if none completes for ``timeout_s`` (a stalled stream).
    With ``sizes``, start them in order, only as many at a time as fit in ``budget`` bytes (at least one)."""
    results: list[Any] = [None] * len(aws)
    running: dict[asyncio.Future, int] = {}
    started, in_flight = 0, 0
    try:
        while started < len(aws) or running:
            while started < len(aws) and (
                sizes is None or not running or in_flight + sizes[started] <= budget
            ):
                running[asyncio.ensure_future(aws[started])] = started
                in_flight += 0 if sizes is None else sizes[started]
                started += 1
            done, _ = await asyncio.wait(running, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                pending = len(aws) - started + len(running)
                raise _PeerSilent(f"{what}: peer silent for {timeout_s:g} s ({pending} messages pending)")
            for task in done:
                index = running.pop(task)
                in_flight -= 0 if sizes is None else sizes[index]
                if (exc := task.exception()) is not None:
                    raise _wrap(exc, what) from exc
                results[index] = task.result()
        return results
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        for aw in aws[started:]:  # never started: no request was posted for it
            if asyncio.iscoroutine(aw):
                aw.close()


async def _send_frame(ep: Any, tag: int, frame: bytes) -> None:
    await ep.send(frame[: HEADER.size], tag=tag)
    if len(frame) > HEADER.size:
        await ep.send(frame[HEADER.size :], tag=tag + 1)


async def _recv_frame(ep: Any, tag: int, what: str) -> Frame:
    header = bytearray(HEADER.size)
    await ep.recv(header, tag=tag)
    magic, version, kind, code, length = HEADER.unpack(header)
    if magic != MAGIC or version != VERSION:
        raise KVTransferError(f"{what}: not a Baton KV peer (bad magic or version {version})")
    if length > MAX_PAYLOAD_BYTES:
        raise KVTransferError(f"{what}: control frame of {length} bytes exceeds {MAX_PAYLOAD_BYTES}")
    payload = bytearray(length)
    if length:
        await ep.recv(payload, tag=tag + 1)
    return Frame(kind, code, bytes(payload))


def _tag(seq: int, tag: int) -> int:
    return (seq << SEQ_SHIFT) + tag


def _abort(ep: Any) -> None:
    """Close ``ep`` now, without waiting for the peer; cancels (and completes) its outstanding requests."""
    if ep is None:
        return
    with contextlib.suppress(Exception):
        ep.abort()


# --- server ---------------------------------------------------------------------------------------


class UcxServer:
    """Serves reads of leased blocks of ``buffer`` over UCX; ``resolve`` maps a lease id to its block ids."""

    def __init__(self, *, buffer: KVBuffer, resolve: Resolver, config: TransportConfig | None = None) -> None:
        self.buffer = buffer
        self.resolve = resolve
        self.config = config or TransportConfig()
        self.auth = auth.ReadAuth(self.config.secret) if self.config.secret else None
        self.uri: str | None = None
        self._listener: Any = None
        self._connections: set[asyncio.Task] = set()

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, advertise_host: str | None = None) -> str:
        """Listen on ``port`` (0: a free one; UCX listens on every interface); the URI names
        ``advertise_host`` or else ``host``. A port just released may stay busy for a while (the kernel's
        TIME_WAIT): a requested port is retried for up to ``connect_timeout_s``."""
        if self.uri is not None:
            return self.uri
        ucxx = _import_ucxx()
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
            _abort(ep)
            return
        self._connections.add(asyncio.current_task())
        try:
            seq = 0
            while (request := await self._next_request(ep, seq)) is not None:
                refusal = await self._serve(ep, seq, request)
                if refusal is not None:
                    reply = _send_frame(ep, _tag(seq, TAG_REPLY), refusal)
                    await _bounded(reply, self.config.io_timeout_s, "KV client")
                    await self._linger(ep)
                    return
                seq += 1
        except KVTransferError as exc:  # malformed or vanished client
            logger.info("KV data plane: dropped a client: %s", exc)
        except Exception:
            logger.exception("KV data plane: serving a client failed")
        finally:
            _abort(ep)
            self._connections.discard(asyncio.current_task())

    async def _next_request(self, ep: Any, seq: int) -> Frame | bytes | None:
        """The next request frame; an ERROR frame to refuse with (bad or no first request); None when a
        client that was served closes the connection or leaves it idle for ``SERVER_IDLE_S``."""
        what = "KV client"
        timeout_s = self.config.io_timeout_s if seq == 0 else SERVER_IDLE_S
        try:
            return await _bounded(_recv_frame(ep, _tag(seq, TAG_REQUEST), what), timeout_s, what)
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
            body, trailer = auth.split_trailer(request.payload, bool(flags & FLAG_AUTH))
            flags, layout_json, lease_id, block_ids, runs = decode_request(body)
            client_layout = KVLayout.from_json(layout_json)
        except KVTransferError as exc:
            return encode_frame(ERROR, str(exc).encode(), ERR_PROTOCOL)
        layout = self.buffer.layout
        try:  # the layouts first, then the credentials, then the lease (as tcp://)
            layout.check_compatible(client_layout)
        except LayoutMismatch as exc:
            logger.warning("KV data plane: refused a client: %s", exc)
            return encode_frame(ERROR, layout.to_json().encode(), ERR_LAYOUT)
        try:
            auth.check(self.auth, READ, body, trailer)
        except auth.Unauthenticated:
            logger.warning("KV data plane: refused a read without valid credentials")
            return encode_frame(ERROR, b"unauthenticated: this KV server requires the data-plane secret", ERR_AUTH)
        refusal = self._check_read(lease_id, block_ids, runs)
        if refusal is not None:
            return refusal
        num_bytes = len(block_ids) * layout.bytes_per_block
        reply = encode_frame(DATA, struct.pack("<Q", num_bytes) + layout.to_json().encode())
        sends = [_send_frame(ep, _tag(seq, TAG_REPLY), reply)]
        messages = self._messages(block_ids, runs)
        sends += [ep.send(view, tag=_tag(seq, TAG_KV + i)) for i, view in enumerate(messages)]
        await _await_all(sends, io_s, what)
        # DONE only if the lease held for the whole read: its blocks cannot have been freed and reused.
        done = self._check_read(lease_id, block_ids, runs)
        if done is None:
            sums = block_checksums(self.buffer, block_ids).tobytes() if flags & FLAG_CHECKSUM else b""
            done = encode_frame(DONE, sums)
        await _bounded(_send_frame(ep, _tag(seq, TAG_DONE), done), io_s, what)
        return None

    def _messages(self, block_ids: Sequence[int], runs: Sequence[int]) -> list[memoryview]:
        """The KV messages in wire order: per layer, one contiguous view per run; straight out of the
        buffer when each run is consecutive here, else out of one gathered copy of the blocks."""
        num_layers, seg = self.buffer.layout.num_layers, self.buffer.segment_bytes
        starts, pos = [], 0
        for count in runs:
            starts.append((pos, count))
            pos += count
        if runs_consecutive(block_ids, runs):
            flat = self.buffer.array.reshape(num_layers, -1)
            return [
                memoryview(flat[layer, block_ids[pos] * seg : (block_ids[pos] + count) * seg])
                for layer in range(num_layers)
                for pos, count in starts
            ]
        staged = np.take(self.buffer.array, block_ids, axis=1)  # [L, n, seg], contiguous: one gather copy
        return [
            memoryview(staged[layer, pos : pos + count].reshape(-1))
            for layer in range(num_layers)
            for pos, count in starts
        ]

    def _check_read(self, lease_id: str, block_ids: list[int], runs: list[int]) -> bytes | None:
        """tcp's lease and block checks (``refuse_read``), then the runs must partition the request."""
        refusal = refuse_read(self.buffer, self.resolve, self.config, lease_id, block_ids)
        if refusal is not None:
            return refusal
        try:
            check_runs(block_ids, runs)
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


class UcxClient:
    """Pulls leased blocks from ``ucx://`` servers: one endpoint per pull, or, with ``reuse_endpoints``,
    endpoints kept idle between pulls (per event loop and URI; one pull at a time on each)."""

    def __init__(
        self, config: TransportConfig | None = None, *, staging: bool | None = None, reuse_endpoints: bool | None = None
    ) -> None:
        self.config = config or TransportConfig()
        self.staging = staging  # None: choose per pull (plan_pull); True/False force it (benchmarks, tests)
        self.reuse_endpoints = REUSE_ENDPOINTS if reuse_endpoints is None else reuse_endpoints

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
        host, port = _parse(uri)
        src_ids, dst_ids = [int(b) for b in src_block_ids], [int(b) for b in dst_block_ids]
        runs, staged = plan_pull(layout, src_ids, dst_ids, staging=self.staging)
        flags = (FLAG_CHECKSUM if self.config.checksum else 0) | (FLAG_AUTH if self.config.secret else 0)
        payload = encode_request(layout, lease_id, src_ids, runs, flags)
        if self.config.secret:  # sign everything the server acts on, the flags included
            payload += auth.ReadAuth(self.config.secret).sign(READ, payload)
        request = encode_frame(READ, payload)
        num_bytes = len(src_ids) * layout.bytes_per_block
        ucxx = _import_ucxx()
        io_s, what = self.config.io_timeout_s, f"KV server {uri}"
        ep, seq, reply = None, 0, None
        if self.reuse_endpoints and (pooled := _checkout(uri)) is not None:
            ep, seq = pooled
            try:
                reply = await self._request(ep, seq, request, what)
            except _PeerSilent:
                _abort(ep)
                raise
            except KVTransferError as exc:  # e.g. the server closed it while idle: nothing moved, start over
                logger.debug("KV pull from %s: a pooled endpoint failed (%s); reconnecting", uri, exc)
                _abort(ep)
                ep, seq = None, 0
            except BaseException:
                _abort(ep)
                raise
        if ep is None:
            ep = await self._connect(ucxx, uri, host, port)
        try:
            if reply is None:
                reply = await self._request(ep, seq, request, what)
            _check_reply(uri, layout, num_bytes, reply)
            shape = (layout.num_layers, len(src_ids), layout.bytes_per_block_per_layer)
            staging = np.empty(shape, np.uint8) if staged else None
            views = _landing(dst_buffer, dst_ids, runs, staging)
            receives = [_recv_frame(ep, _tag(seq, TAG_DONE), what)]
            receives += [ep.recv(view, tag=_tag(seq, TAG_KV + i)) for i, view in enumerate(views)]
            # A bounded window of posted receives: UCX moves a rendezvous message's bytes once its receive
            # is posted, and ucxx's progress call runs until no more progress is possible, starving the
            # event loop for as long as bytes keep flowing. The window bounds that to a few MiB.
            sizes = [0] + [view.nbytes for view in views]
            done = (await _await_all(receives, io_s, what, sizes=sizes, budget=RECV_WINDOW_BYTES))[0]
        except BaseException:
            _abort(ep)  # cancels any receive still posted into the destination before we return
            raise
        if done.kind != DONE:
            _abort(ep)
            raise _remote_error(uri, done)
        if self.reuse_endpoints:
            _checkin(uri, ep, seq + 1)
        else:
            await _close(ep)
        if staging is not None:
            dst_buffer.array[:, dst_ids] = staging  # [L, n, seg] -> the scattered destination blocks
        if self.config.checksum:
            if len(done.payload) != len(src_ids) * CHECKSUM_DTYPE.itemsize:
                raise KVTransferError(f"KV server {uri} sent no checksums (or the wrong number)")
            verify(dst_buffer, dst_ids, done.payload)
        seconds = time.perf_counter() - start
        return TransferStats(num_blocks=len(src_ids), num_bytes=num_bytes, seconds=seconds)

    async def _request(self, ep: Any, seq: int, request: bytes, what: str) -> Frame:
        """Send the READ, return the reply; no KV byte has moved yet (its receives are not posted)."""
        io_s = self.config.io_timeout_s
        await _bounded(_send_frame(ep, _tag(seq, TAG_REQUEST), request), io_s, what)
        return await _bounded(_recv_frame(ep, _tag(seq, TAG_REPLY), what), io_s, what)

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
                task.add_done_callback(lambda t: t.cancelled() or t.exception() or _abort(t.result()))


# --- idle endpoints kept between pulls (reuse_endpoints) ------------------------------------------

# event loop -> URI -> [(endpoint, next request seq, idle since)]; ucxx endpoints are driven by one loop.
_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, list[tuple[Any, int, float]]]] = (
    weakref.WeakKeyDictionary()
)


def _checkout(uri: str) -> tuple[Any, int] | None:
    for loop in [loop for loop in _pools if loop.is_closed()]:  # pools of finished loops: close them
        for entries in _pools.pop(loop).values():
            for ep, _, _ in entries:
                _abort(ep)
    entries = _pools.setdefault(asyncio.get_running_loop(), {}).get(uri, [])
    now = time.monotonic()
    while entries:
        ep, seq, since = entries.pop()
        if not ep.closed and now - since < POOL_IDLE_S:
            return ep, seq
        _abort(ep)
    return None


def _checkin(uri: str, ep: Any, seq: int) -> None:
    entries = _pools.setdefault(asyncio.get_running_loop(), {}).setdefault(uri, [])
    if len(entries) >= POOL_MAX_PER_URI or ep.closed:
        _abort(ep)
        return
    entries.append((ep, seq, time.monotonic()))


def close_idle_endpoints() -> None:
    """Close every pooled endpoint (of every event loop)."""
    for pools in list(_pools.values()):
        for entries in pools.values():
            for ep, _, _ in entries:
                _abort(ep)
            entries.clear()


def _landing(dst: KVBuffer, dst_ids: list[int], runs: list[int], staging: np.ndarray | None) -> list[memoryview]:
    """Where each KV message lands, in wire order: the destination blocks, or rows of ``staging``."""
    seg, num_layers = dst.segment_bytes, dst.layout.num_layers
    flat = dst.array.reshape(num_layers, -1)
    views, pos = [], 0
    starts = []
    for count in runs:
        starts.append((pos, count))
        pos += count
    for layer in range(num_layers):
        for pos, count in starts:
            if staging is not None:
                views.append(memoryview(staging[layer, pos : pos + count].reshape(-1)))
            else:
                first = dst_ids[pos]
                views.append(memoryview(flat[layer, first * seg : (first + count) * seg]))
    return views


async def _close(ep: Any) -> None:
    """Close after a pull; a peer that reset the connection must not make this hang (abort is local)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ep.close(), 1.0)
    _abort(ep)


def _parse(uri: str) -> tuple[str, int]:
    parts = urlsplit(uri)
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise KVTransferError(f"bad KV data-plane URI {uri!r}: {exc}") from exc
    if parts.scheme != "ucx" or not host or port is None:
        raise KVTransferError(f"bad KV data-plane URI {uri!r} (want ucx://host:port)")
    return host, port


def _check_reply(uri: str, layout: KVLayout, expected: int, frame: Frame) -> None:
    if frame.kind == ERROR and frame.code == ERR_LAYOUT:
        layout.check_compatible(KVLayout.from_json(frame.payload))  # names the differing fields
        raise LayoutMismatch(f"KV server {uri} refused the layout")
    if frame.kind != DATA:
        raise _remote_error(uri, frame)
    if len(frame.payload) < 8:
        raise KVTransferError(f"KV server {uri}: malformed DATA")
    (num_bytes,) = struct.unpack_from("<Q", frame.payload)
    layout.check_compatible(KVLayout.from_json(frame.payload[8:]))
    if num_bytes != expected:
        raise KVTransferError(f"KV server {uri} announced {num_bytes} bytes, expected {expected}")


def _remote_error(uri: str, frame: Frame) -> KVTransferError:
    if frame.kind != ERROR:
        return KVTransferError(f"KV server {uri}: unexpected frame kind {frame.kind}")
    message = f"KV server {uri} refused: {frame.payload.decode(errors='replace')}"
    if frame.code == ERR_AUTH:
        return auth.Unauthenticated(message)
    return LeaseNotFound(message) if frame.code == ERR_LEASE else KVTransferError(message)
