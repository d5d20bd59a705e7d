"""``nixl://``'s frames (``kv_transfer/nixl.py`` describes the exchange): its kinds, the N_DESCS answer parsed,
the N_READ_POSTED request of a one-round-trip pull."""

from __future__ import annotations

import struct

import numpy as np

from kv_transfer.errors import KVTransferError
from kv_transfer.nixl_agent import MEM_KINDS
from kv_transfer.protocol import remote_error
from kv_transfer.socket_server import ReadKinds
from kv_transfer.wire import Frame, ReadRequest, decode_read, encode_frame, encode_read

# kinds of their own: a tcp:// (1-6), nccl:// (17-19) or cma:// (33-37) peer refuses them, and vice versa
N_HELLO, N_HELLO_OK, N_READ, N_DESCS, N_READ_DONE, N_READ_POSTED = 49, 50, 51, 52, 53, 54
KINDS = ReadKinds(N_HELLO, N_HELLO_OK, N_READ, not_hello=b"expected N_HELLO: this is a nixl:// KV server",
                  not_read=b"expected N_READ")
# incarnation, device id, memory kind, notification tag, metadata length, row count, then the served buffer's
# geometry (base address, blocks) and flags: what a client needs to READ from it again without asking
DESCS_HEAD = struct.Struct("<8sIB16sIIQQB")
POSTED_READS = 1  # DESCS flag: the server takes N_READ_POSTED (no credentials, no staging: its blocks are in place)
POSTED_HEAD = struct.Struct("<8s16s")  # the incarnation read from, the READ's notification tag
READ_DONE_FRAME = encode_frame(N_READ_DONE)


class Descs:
    __slots__ = ("incarnation", "device_id", "memory_kind", "tag", "metadata", "rows", "base_ptr", "num_blocks",
                 "flags")

    def __init__(self, incarnation: bytes, device_id: int, memory_kind: int, tag: bytes, metadata: bytes,
                 rows: np.ndarray, base_ptr: int = 0, num_blocks: int = 0, flags: int = 0) -> None:
        self.incarnation, self.device_id, self.memory_kind = incarnation, device_id, memory_kind
        self.tag, self.metadata, self.rows = tag, metadata, rows
        self.base_ptr, self.num_blocks, self.flags = base_ptr, num_blocks, flags


def parse_descs(uri: str, frame: Frame) -> Descs:
    if frame.kind != N_DESCS:
        raise remote_error(uri, frame)
    try:
        incarnation, device_id, kind, tag, md_len, count, base_ptr, num_blocks, flags = \
            DESCS_HEAD.unpack_from(frame.payload)
        if len(frame.payload) != DESCS_HEAD.size + md_len + 16 * count or kind >= len(MEM_KINDS):
            raise ValueError("length does not match its counts, or an unknown memory kind")
    except (struct.error, ValueError) as exc:
        raise KVTransferError(f"KV server {uri}: malformed N_DESCS: {exc}") from exc
    metadata = frame.payload[DESCS_HEAD.size: DESCS_HEAD.size + md_len]
    rows = np.frombuffer(frame.payload, np.uint64, offset=DESCS_HEAD.size + md_len).reshape(-1, 2)
    return Descs(incarnation, device_id, kind, tag, metadata, rows, base_ptr, num_blocks, flags)


def encode_posted(incarnation: bytes, tag: bytes, request: ReadRequest) -> bytes:
    """The N_READ_POSTED frame: this READ of ``request``'s blocks, from ``incarnation``, notifying ``tag``, is done."""
    return encode_frame(N_READ_POSTED, POSTED_HEAD.pack(incarnation, tag) + encode_read(request))


def parse_posted(payload: bytes) -> tuple[bytes, bytes, ReadRequest]:
    """``(incarnation, tag, request)`` of an N_READ_POSTED payload; KVTransferError if malformed."""
    try:
        incarnation, tag = POSTED_HEAD.unpack_from(payload)
        return incarnation, tag, decode_read(payload[POSTED_HEAD.size:])
    except (struct.error, ValueError) as exc:
        raise KVTransferError(f"malformed N_READ_POSTED: {exc}") from exc
