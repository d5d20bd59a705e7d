"""Layer-wise streaming for ``cma://`` (``kv_transfer/cma.py``): the client reads a lease's KV layer by layer
while the prefill still computes it (``kv_transfer/progress.py``).

A client that can (``READ_STREAM`` on its C_READ) pulling a lease whose ``LayerProgress`` is not yet ready:

    server -> C_IOVECS     as always, but with code IOVECS_STREAMED: read nothing yet
              C_LAYERS     u32 n: layers [0, n) are computed and the lease was live: read them; each
                           C_LAYERS names more layers than the one before, the last names every layer
           or ERROR        a layer not computed within ``io_timeout_s``, a failed progress, a lease that
                           ended: the client raises (the layers it has not read stay untouched, never
                           unwritten KV), and the connection closes
    client -> C_READ_DONE  once the last layer is read; DONE (or ERROR) as for any read

Checksums (READ_CHECKSUM) are computed once the last layer is computed, before the last C_LAYERS goes out
(as tcp's streamed reads do). A client without READ_STREAM pulling such a lease is refused (ERR_LEASE,
"still being computed"), as a non-streaming server refuses it: it would read unwritten KV.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Awaitable, Callable

import numpy as np

from kv_transfer.errors import KVTransferError
from kv_transfer.progress import LayerProgress
from kv_transfer.protocol import computed_layers, remote_error
from kv_transfer.tcp_wire import recv_frame, send_frame
from kv_transfer.transport import LayerClock
from kv_transfer.wire import ERR_LEASE, ERROR, Frame, encode_frame

C_LAYERS = 38  # after C_HELLO .. C_READ_DONE (33-37): a kind of cma's own
IOVECS_STREAMED = 1  # C_IOVECS code: read each layer only once a C_LAYERS names it
LAYERS = struct.Struct("<I")
NOT_STREAMING = encode_frame(ERROR, b"the lease's KV is still being computed (this client does not read layer "
                             b"by layer)", ERR_LEASE)

# (local rows, remote rows) -> read them (cma.CmaClient's process_vm_readv, inline or in a thread)
ReadRows = Callable[[np.ndarray, np.ndarray], Awaitable[None]]


async def announce_layers(sock: socket.socket, progress: LayerProgress, timeout_s: float,
                          check_lease: Callable[[], bytes | None],
                          hash_blocks: Callable[[], np.ndarray] | None) -> tuple[bytes | None, bytes | None]:
    """Send C_LAYERS as ``progress`` computes layers, up to the last; returns (None, the blocks' checksums
    from ``hash_blocks``, or None without it), or (the ERROR frame to close with, None)."""
    refusal, sums = None, None
    async for layers, refusal in computed_layers(progress, timeout_s, check_lease):
        if refusal is None:
            if layers.stop == progress.num_layers and hash_blocks is not None:
                sums = hash_blocks().tobytes()  # every layer computed, the last one not yet readable
            await send_frame(sock, encode_frame(C_LAYERS, LAYERS.pack(layers.stop)), timeout_s, "KV client")
    return refusal, sums


async def read_announced(sock: socket.socket, uri: str, local: np.ndarray, remote: np.ndarray, num_layers: int,
                         read: ReadRows, timeout_s: float, landed: LayerClock) -> None:
    """Read the rows of ``local``/``remote`` (layer-major, as many per layer) of each layer a C_LAYERS names,
    as they come (``landed`` marks the first); raises what an ERROR says (the unread layers stay untouched)."""
    rows, done = len(local) // num_layers, 0
    while done < num_layers:
        ready = _layers_ready(uri, await recv_frame(sock, timeout_s, f"KV server {uri}"), done, num_layers)
        await read(local[done * rows : ready * rows], remote[done * rows : ready * rows])
        if not done:
            landed.first_layer()
        done = ready


def _layers_ready(uri: str, frame: Frame, done: int, num_layers: int) -> int:
    """The layer count a C_LAYERS names (more than ``done``, at most ``num_layers``)."""
    if frame.kind != C_LAYERS:
        raise remote_error(uri, frame)
    if len(frame.payload) != LAYERS.size:
        raise KVTransferError(f"KV server {uri}: malformed C_LAYERS ({len(frame.payload)} bytes)")
    (ready,) = LAYERS.unpack(frame.payload)
    if not done < ready <= num_layers:
        raise KVTransferError(f"KV server {uri}: C_LAYERS names {ready} layers after {done} (of {num_layers})")
    return ready
