"""The rules of one read, both sides, shared by every transport (tcp, cma, ucx, nccl).

Serving side: each check answers None (go on) or the ERROR frame to send, in the order every server
applies them before any KV byte moves: the layouts (``refuse_layout``), the credentials
(``refuse_unauthenticated``), where the blocks are (``locate_read``), the lease and its blocks (``refuse_read``,
again after the last byte);
a streamed read waits for its layers with ``computed_layers``.
Pulling side: ``sign_read`` adds the HMAC trailer (kv_transfer/auth.py); ``check_hello_ok``, ``check_data``
and ``verify_done`` check the server's answers, and ``remote_error`` turns an ERROR into the typed error
to raise (LayoutMismatch, LeaseNotFound, Unauthenticated, KVTransferError).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import struct
from collections.abc import AsyncIterator, Callable, Sequence

from kv_transfer import auth, checksum
from kv_transfer.errors import KVTransferError, LayoutMismatch, LeaseNotFound
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.progress import LayerProgress
from kv_transfer.transport import Locator, Resolver, TransportConfig, check_read
from kv_transfer.wire import (
    DATA, ERR_AUTH, ERR_INTERNAL, ERR_LAYOUT, ERR_LEASE, ERR_PROTOCOL, ERR_REFUSED, ERROR, HELLO_OK, READ_AUTH, Frame,
    ReadRequest, encode_frame,
)

logger = logging.getLogger(__name__)
DATA_BYTES = struct.Struct("<Q")  # DATA's payload opens with the number of KV bytes that follow


# --- serving side ---------------------------------------------------------------------------------


def refuse_layout(layout: KVLayout, payload: bytes) -> bytes | None:
    """None if the client's layout JSON matches ``layout``, else the ERROR frame to send."""
    try:
        layout.check_compatible(_parse_layout(payload))
    except LayoutMismatch as exc:
        logger.warning("KV data plane: refused a client: %s", exc)
        return encode_frame(ERROR, layout.to_json().encode(), ERR_LAYOUT)
    except KVTransferError as exc:
        return encode_frame(ERROR, str(exc).encode(), ERR_PROTOCOL)
    return None


@functools.lru_cache(maxsize=64)
def _parse_layout(payload: bytes) -> KVLayout:
    """A client's layout JSON, parsed once per distinct payload (every read of a client sends the same)."""
    return KVLayout.from_json(payload)


def refuse_unauthenticated(read_auth: auth.ReadAuth | None, kind: int, request: bytes,
                           trailer: bytes | None) -> bytes | None:
    """None if the read may go on (no secret configured, or a valid trailer), else the ERROR frame."""
    try:
        auth.check(read_auth, kind, request, trailer)
    except auth.Unauthenticated:
        logger.warning("KV data plane: refused a read without valid credentials")
        return encode_frame(ERROR, b"unauthenticated: this KV server requires the data-plane secret", ERR_AUTH)
    return None


def refuse_read(buffer: KVBuffer, resolve: Resolver, config: TransportConfig, lease_id: str,
                block_ids: Sequence[int]) -> bytes | None:
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


def locate_read(locate: Locator | None, request: ReadRequest) -> ReadRequest | bytes:
    """The read with its source ids where the blocks are in the served buffer (``locate``: a staged server
    translates the lease's block ids to its staging ids), or the ERROR frame to send; no ``locate``: as is."""
    if locate is None:
        return request
    try:
        return dataclasses.replace(request, block_ids=locate(request.lease_id, request.block_ids))
    except LeaseNotFound as exc:
        return encode_frame(ERROR, str(exc).encode(), ERR_LEASE)
    except KVTransferError as exc:
        return encode_frame(ERROR, str(exc).encode(), ERR_REFUSED)


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


# --- pulling side ---------------------------------------------------------------------------------


def sign_read(config: TransportConfig, kind: int, context: bytes, request: bytes) -> tuple[bytes, int]:
    """(payload, flag bits) of a read: ``request`` plus an HMAC trailer over ``context + request`` when the
    client holds a secret."""
    if not config.secret:
        return request, 0
    return request + auth.ReadAuth(config.secret).sign(kind, context + request), READ_AUTH


def check_hello_ok(uri: str, layout: KVLayout, frame: Frame, ok_kind: int = HELLO_OK) -> None:
    """The server's answer to the client's layout: ``ok_kind`` or an ERR_LAYOUT ERROR, both carrying the
    server's layout JSON (checked here too, so a mismatch names the differing fields)."""
    if frame.kind not in (ok_kind, ERROR) or (frame.kind == ERROR and frame.code != ERR_LAYOUT):
        raise remote_error(uri, frame)
    layout.check_compatible(_parse_layout(frame.payload))
    if frame.kind == ERROR:
        raise LayoutMismatch(f"KV server {uri} refused the layout")


def check_data(uri: str, expected: int, frame: Frame) -> None:
    """A DATA announcing ``expected`` KV bytes (its payload's first 8 bytes)."""
    if frame.kind != DATA:
        raise remote_error(uri, frame)
    if len(frame.payload) < DATA_BYTES.size:
        raise KVTransferError(f"KV server {uri}: malformed DATA")
    (num_bytes,) = DATA_BYTES.unpack_from(frame.payload)
    if num_bytes != expected:
        raise KVTransferError(f"KV server {uri} announced {num_bytes} bytes, expected {expected}")


def verify_done(uri: str, dst_buffer: KVBuffer, dst_block_ids: Sequence[int], payload: bytes) -> None:
    """Check the landed blocks against the checksums DONE carried (ChecksumMismatch names the bad ones)."""
    if len(payload) != checksum.DTYPE.itemsize * len(dst_block_ids):
        raise KVTransferError(f"KV server {uri} sent {len(payload)} bytes of checksums for {len(dst_block_ids)} "
                              "blocks (a server without checksum support?)")
    checksum.verify(dst_buffer, dst_block_ids, payload)


def remote_error(uri: str, frame: Frame) -> KVTransferError:
    """The error to raise for a frame the server sent instead of the expected one."""
    if frame.kind != ERROR:
        return KVTransferError(f"KV server {uri}: unexpected frame kind {frame.kind}")
    message = f"KV server {uri} refused: {frame.payload.decode(errors='replace')}"
    if frame.code == ERR_AUTH:
        return auth.Unauthenticated(message)
    return LeaseNotFound(message) if frame.code == ERR_LEASE else KVTransferError(message)
