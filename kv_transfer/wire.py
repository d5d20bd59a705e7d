"""The KV data plane's wire format, one for every transport (tcp, cma, ucx, nccl): control frames and the
READ request. Pure encoding: no sockets, no event loop (the socket plumbing is ``tcp_wire``).

A control frame is a 12-byte header ``magic b"BTKV" | version u8 | kind u8 | code u16 | payload_len u32``
and its payload (little-endian; no pickle, no object deserialization). Kinds 1-6 are the exchange of
``tcp://`` (``kv_transfer/tcp.py``), which ``ucx://`` reuses; ``nccl://`` (17-19) and ``cma://`` (33-38)
add kinds of their own, so peers of two transports refuse each other cleanly. ERROR carries an ``ERR_*``
code and a UTF-8 message.

Every transport's read request carries one ``ReadRequest``, encoded by ``encode_read``::

    u16 len | lease id (UTF-8) | u32 n | n x u32 source block ids
      [| u32 n | n x u32 destination block ids      (nccl: both ends post the same paired runs)
      [| u32 m | m x u32 blocks per message ]]       (ucx: the client's message plan, ``ucx_plan``)

Empty trailing sections are left out, so a tcp or cma READ is the first line alone. The frame's code (ucx:
the request's first byte) holds the ``READ_*`` flags; a server that predates one ignores it, so flags
extend version 1 without a new VERSION.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kv_transfer.errors import KVTransferError

MAGIC, VERSION = b"BTKV", 1
HEADER = struct.Struct("<4sBBHI")
HELLO, HELLO_OK, READ, DATA, DONE, ERROR = 1, 2, 3, 4, 5, 6
ERR_PROTOCOL, ERR_LAYOUT, ERR_LEASE, ERR_REFUSED, ERR_INTERNAL, ERR_AUTH = 1, 2, 3, 4, 5, 6
# READ's flags. A client that asked for one and got nothing says so (e.g. DONE without checksums).
READ_CHECKSUM = 1  # DONE carries one xxh3-64 per block, in READ order (kv_transfer/checksum.py)
READ_AUTH = 2  # the READ payload ends with an HMAC trailer (kv_transfer/auth.py)
READ_STREAM = 4  # the client reads a lease still being computed layer by layer (cma://: kv_transfer/cma_stream.py)
MAX_PAYLOAD_BYTES = 8 << 20  # control frames only; KV bytes are not framed
MAX_LEASE_ID_BYTES = 1024
IDS = struct.Struct("<I")  # the count that opens each list of block ids


class Frame(NamedTuple):
    kind: int
    code: int
    payload: bytes


def encode_frame(kind: int, payload: bytes = b"", code: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, code, len(payload)) + payload


def decode_header(header: bytes, what: str) -> tuple[int, int, int]:
    """(kind, code, payload length) of a frame header from peer ``what``; KVTransferError if it is not ours."""
    magic, version, kind, code, length = HEADER.unpack(header)
    if magic != MAGIC or version != VERSION:
        raise KVTransferError(f"{what}: not a Baton KV peer (bad magic or version {version})")
    if length > MAX_PAYLOAD_BYTES:
        raise KVTransferError(f"{what}: control frame of {length} bytes exceeds {MAX_PAYLOAD_BYTES}")
    return kind, code, length


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """What a client asks to read: leased source blocks, and what a transport needs besides them (decoded:
    tuples; an absent section is empty)."""

    lease_id: str
    block_ids: Sequence[int]  # source block ids, in wire order
    dst_block_ids: Sequence[int] = ()  # nccl: where each source block lands (empty: not sent)
    runs: Sequence[int] = ()  # ucx: blocks per KV message, in request order (empty: not sent)


def encode_read(request: ReadRequest) -> bytes:
    lease = request.lease_id.encode()
    if len(lease) > MAX_LEASE_ID_BYTES:
        raise KVTransferError(f"lease id longer than {MAX_LEASE_ID_BYTES} bytes")
    if any(not 0 <= b < 1 << 32 for b in request.block_ids):
        raise KVTransferError("source block ids must be in [0, 2**32)")
    sections = [request.block_ids, request.dst_block_ids, request.runs]
    while not sections[-1] and len(sections) > 1:  # empty trailing sections are left out
        sections.pop()
    payload = struct.pack(f"<H{len(lease)}s", len(lease), lease) + b"".join(map(_pack_ids, sections))
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise KVTransferError(f"pull of {len(request.block_ids)} blocks exceeds the {MAX_PAYLOAD_BYTES}-byte "
                              "request limit")
    return payload


def decode_read(payload: bytes) -> ReadRequest:
    try:
        (lease_len,) = struct.unpack_from("<H", payload)
        (lease,) = struct.unpack_from(f"<{lease_len}s", payload, 2)
        pos, sections = 2 + lease_len, []
        while len(sections) < 3 and (pos < len(payload) or not sections):
            ids, pos = _unpack_ids(payload, pos)
            sections.append(ids)
        if pos != len(payload):
            raise ValueError("READ length does not match its block counts")
        return ReadRequest(lease.decode(), *sections)
    except (struct.error, ValueError) as exc:
        raise KVTransferError(f"malformed READ: {exc}") from exc


def _pack_ids(ids: Sequence[int]) -> bytes:
    return struct.pack(f"<I{len(ids)}I", len(ids), *ids)


def _unpack_ids(payload: bytes, pos: int) -> tuple[tuple[int, ...], int]:
    """(the ids listed at ``pos``, the position after them)."""
    (count,) = IDS.unpack_from(payload, pos)
    return struct.unpack_from(f"<{count}I", payload, pos + IDS.size), pos + IDS.size + 4 * count
