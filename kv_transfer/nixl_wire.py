"""``nixl://``'s frames (``kv_transfer/nixl.py`` describes the exchange): its kinds, the N_DESCS answer parsed."""

from __future__ import annotations

import struct

import numpy as np

from kv_transfer.errors import KVTransferError
from kv_transfer.nixl_agent import MEM_KINDS
from kv_transfer.protocol import remote_error
from kv_transfer.socket_server import ReadKinds
from kv_transfer.wire import Frame, encode_frame

# kinds of their own: a tcp:// (1-6), nccl:// (17-19) or cma:// (33-37) peer refuses them, and vice versa
N_HELLO, N_HELLO_OK, N_READ, N_DESCS, N_READ_DONE = 49, 50, 51, 52, 53
KINDS = ReadKinds(N_HELLO, N_HELLO_OK, N_READ, not_hello=b"expected N_HELLO: this is a nixl:// KV server",
                  not_read=b"expected N_READ")
DESCS_HEAD = struct.Struct("<8sIB16sII")  # incarnation, device id, memory kind, notification tag, md length, count
READ_DONE_FRAME = encode_frame(N_READ_DONE)


class Descs:
    __slots__ = ("incarnation", "device_id", "memory_kind", "tag", "metadata", "rows")

    def __init__(self, incarnation: bytes, device_id: int, memory_kind: int, tag: bytes, metadata: bytes,
                 rows: np.ndarray) -> None:
        self.incarnation, self.device_id, self.memory_kind = incarnation, device_id, memory_kind
        self.tag, self.metadata, self.rows = tag, metadata, rows


def parse_descs(uri: str, frame: Frame) -> Descs:
    if frame.kind != N_DESCS:
        raise remote_error(uri, frame)
    try:
        incarnation, device_id, kind, tag, md_len, count = DESCS_HEAD.unpack_from(frame.payload)
        if len(frame.payload) != DESCS_HEAD.size + md_len + 16 * count or kind >= len(MEM_KINDS):
            raise ValueError("length does not match its counts, or an unknown memory kind")
    except (struct.error, ValueError) as exc:
        raise KVTransferError(f"KV server {uri}: malformed N_DESCS: {exc}") from exc
    metadata = frame.payload[DESCS_HEAD.size: DESCS_HEAD.size + md_len]
    rows = np.frombuffer(frame.payload, np.uint64, offset=DESCS_HEAD.size + md_len).reshape(-1, 2)
    return Descs(incarnation, device_id, kind, tag, metadata, rows)
