"""The ``nccl://`` transport's plumbing: private 2-rank process groups and the channels that carry them.

A **channel** is one TCP control socket, one 2-rank group (gloo for CPU tensors, NCCL for CUDA ones) built
directly over a ``PrefixStore`` of the serving side's ``TCPStore`` (never the global ``init_process_group``),
and one thread that runs the group's blocking calls, so the event loop never blocks and a slow peer on one
channel stalls nobody else. A client keeps its idle channels per server URI (``take_idle`` / ``keep_idle``)
and closes those of a garbage-collected client on a reaper thread. The protocol itself is described in
``kv_transfer/nccl.py``.

Tearing a group down while a wait is in flight on it is not safe (gloo's ``abort`` can crash the process),
and gloo's ``abort`` does not wake a pending send; so a channel closes its socket at once and shuts its group
down on its own thread once the wait in flight there has ended, which every wait bounds by a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import queue
import socket
import struct
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist

from kv_transfer.errors import KVTransferError
from kv_transfer.protocol import DATA_BYTES
from kv_transfer.tensor_buffer import AnyKVBuffer, TensorKVBuffer
from kv_transfer.tcp_wire import tune_socket
from kv_transfer.transport import TransportConfig

GRACE_S = 1.0  # slack on top of a bounded collective wait before the event loop gives up on it
MAX_MESSAGE_BYTES = 64 << 20  # one send/recv; each is allowed TransportConfig.io_timeout_s
REUSE_S = 30.0  # a client reuses an idle channel only this long (well inside the server's nccl.IDLE_S)
# Channels per server, per client (nccl.NcclClient's lanes): one (one communicator per P/D pair), and up to
# STREAMING_CHANNELS while every busy one streams layers of a lease still being computed.
STREAMING_CHANNELS = 4
MAX_IDLE_CHANNELS = STREAMING_CHANNELS

PLAN_HEAD = struct.Struct("<I")  # DATA's message plan: the number of runs, then a u32 count each
IdleChannels = dict[str, list["Channel"]]  # a client's idle channels by server URI, most recently used last


def kv_tensor(buffer: AnyKVBuffer) -> torch.Tensor:
    """The tensor the KV moves from/into: a ``TensorKVBuffer``'s own (a CUDA cache served in place: NCCL), else
    a zero-copy view of a host buffer's bytes (gloo). ``[num_layers, num_blocks, segment_bytes]`` uint8."""
    if isinstance(buffer, TensorKVBuffer):
        return buffer.tensor
    with warnings.catch_warnings():  # a read-only source is only ever sent from
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(buffer.array)


def messages(kv: torch.Tensor, runs: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Contiguous 1-D views, layer-major: one per layer per ``(first_block, count)`` run, a long run cut
    into pieces of at most MAX_MESSAGE_BYTES (so each wait's timeout bounds a bounded amount of bytes)."""
    per_message = max(1, MAX_MESSAGE_BYTES // kv.shape[2])  # blocks; kv is [num_layers, num_blocks, seg]
    pieces = [
        (start, min(per_message, first + count - start))
        for first, count in runs
        for start in range(first, first + count, per_message)
    ]
    return [kv[layer, first : first + count].reshape(-1) for layer in range(kv.shape[0]) for first, count in pieces]


def encode_plan(counts: list[int]) -> bytes:
    """DATA's message plan: blocks per run, in request order."""
    return PLAN_HEAD.pack(len(counts)) + np.asarray(counts, "<u4").tobytes()


def decode_plan(uri: str, payload: bytes, dst_ids: list[int]) -> list[tuple[int, int]]:
    """``(first destination block, count)`` per run of the plan in DATA's payload (after its byte count); each
    run must be consecutive in ``dst_ids`` and together they must cover them."""
    try:
        (n,) = PLAN_HEAD.unpack_from(payload, DATA_BYTES.size)
        counts = np.frombuffer(payload, "<u4", n, DATA_BYTES.size + PLAN_HEAD.size).astype(np.int64)
    except (struct.error, ValueError) as exc:
        raise KVTransferError(f"KV server {uri}: malformed DATA plan: {exc}") from exc
    starts = np.cumsum(counts) - counts
    dst = np.asarray(dst_ids, np.int64)
    inner = np.ones(len(dst), bool)  # positions that continue the run before them
    inner[starts[starts < len(dst)]] = False
    if (counts < 1).any() or counts.sum() != len(dst) or (np.diff(dst)[inner[1:]] != 1).any():
        raise KVTransferError(f"KV server {uri}: its message plan does not partition the destination into runs")
    return list(zip(dst[starts].tolist(), counts.tolist()))


def zeros_like(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of one zero tensor, as long as each of ``tensors`` (what a failed stream sends instead of KV)."""
    if not tensors:
        return []
    zeros = torch.zeros(max(t.numel() for t in tensors), dtype=torch.uint8, device=tensors[0].device)
    return [zeros[: t.numel()] for t in tensors]


def new_group(store: dist.Store, rank: int, host: str, timeout_s: float, device: torch.device):
    """A private 2-rank process group (rank 0 serves); blocks until the peer joins or ``timeout_s``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        torch.cuda.set_device(device)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, 2, options)


def exchange(group, tensors: Sequence[torch.Tensor], *, send: bool, timeout_s: float) -> None:
    """Post every send (recv) to the peer in order, then wait for each, at most ``timeout_s`` apiece."""
    peer, op = (1, group.send) if send else (0, group.recv)
    works = [op([t], peer, 0) for t in tensors]
    for work in works:
        work.wait(datetime.timedelta(seconds=timeout_s))
    if tensors and tensors[0].is_cuda:  # pragma: no cover - needs a GPU: NCCL's wait only orders streams
        torch.cuda.current_stream(tensors[0].device).synchronize()


class Channel:
    """One control socket + its 2-rank group + the thread that runs the group's blocking calls."""

    def __init__(self, sock: socket.socket, uri: str) -> None:
        self.sock, self.uri, self.group = sock, uri, None
        self.store_keys: list[str] = []
        self.idle_since = time.monotonic()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-nccl")

    async def call(self, fn: Callable[[], object], *, bound_s: float, what: str):
        """``fn()`` on the channel's thread; ``fn`` bounds its own waits by ``bound_s``. Cancelled, it still
        lets ``fn`` end before re-raising: a posted receive cannot be withdrawn (neither ``shutdown`` nor
        ``abort`` stops gloo writing into its buffer), so no KV byte may land after the pull is over."""
        future = asyncio.get_running_loop().run_in_executor(self._thread, fn)
        try:
            return await asyncio.wait_for(asyncio.shield(future), bound_s + GRACE_S)
        except asyncio.CancelledError:
            await asyncio.wait({future}, timeout=bound_s + GRACE_S)
            raise
        except (RuntimeError, TimeoutError, dist.DistError) as exc:
            raise KVTransferError(f"{what} with {self.uri} failed: {exc}") from exc

    def close(self) -> None:
        """Tear down (idempotent): close the socket now; shut the group down on the channel's thread, after
        any wait in flight there has ended (bounded), since tearing a group down under a wait is not safe."""
        group, self.group = self.group, None
        self.sock.close()
        with contextlib.suppress(RuntimeError):  # already shut down
            if group is not None:
                self._thread.submit(_shutdown, group)
            self._thread.shutdown(wait=False)


def _shutdown(group) -> None:
    with contextlib.suppress(Exception):
        group.shutdown()


def channel_closed(sock: socket.socket) -> bool:
    """True if the peer closed (or broke) an idle control socket."""
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


async def unless_closed(work, sock: socket.socket, what: str) -> None:
    """Await the receive ``work``; if the peer closes the control socket meanwhile (a server that died or
    stopped mid-transfer), say so rather than report gloo's timeout, once ``work`` has ended (bounded):
    until then bytes may still land."""
    loop, readable = asyncio.get_running_loop(), asyncio.Event()
    work = asyncio.ensure_future(work)
    with _reader(loop, sock, readable.set):  # off the socket before this returns: the channel may close next
        watch = asyncio.ensure_future(readable.wait())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            await asyncio.wait({work})  # Channel.call lets the receive end before it gives up
            raise
        finally:
            watch.cancel()
    if work.done() or not channel_closed(sock):
        await work  # the socket holds the next frame: DONE may overtake the last KV bytes
        return
    with contextlib.suppress(KVTransferError):
        await work
    raise KVTransferError(f"{what}: peer closed the connection mid-transfer")


async def wait_readable(sock: socket.socket, timeout_s: float) -> bool:
    """Wait for the next frame of an idle channel; False after ``timeout_s`` of silence."""
    loop, ready = asyncio.get_running_loop(), asyncio.Event()
    with _reader(loop, sock, ready.set):
        try:
            await asyncio.wait_for(ready.wait(), timeout_s)
            return True
        except TimeoutError:
            return False


@contextlib.contextmanager
def _reader(loop: asyncio.AbstractEventLoop, sock: socket.socket, callback: Callable[[], object]):
    """``callback`` while ``sock`` is readable. The reader is removed by the fd it was added with, at once on
    exit (never from a task that may run after the socket closed: a selector left holding a closed fd breaks
    the next socket that gets the same number)."""
    fd = sock.fileno()
    loop.add_reader(fd, callback)
    try:
        yield
    finally:
        loop.remove_reader(fd)


def join_group(host: str, store_port: int, prefix: str, local_host: str, timeout_s: float, device: torch.device):
    """The client's side of ``new_group``: rank 1, through the server's store at ``host:store_port``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, store_port, None, False, timeout)
    return new_group(dist.PrefixStore(prefix, store), 1, local_host, timeout_s, device)


async def connect(host: str, port: int, config: TransportConfig) -> socket.socket:
    """A connected, non-blocking control socket, within ``connect_timeout_s``."""
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), config.connect_timeout_s)
        sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
        try:
            tune_socket(sock, config)
            await asyncio.wait_for(loop.sock_connect(sock, infos[0][4]), config.connect_timeout_s)
        except BaseException:
            sock.close()
            raise
    except (OSError, TimeoutError) as exc:
        raise KVTransferError(f"cannot connect to KV server nccl://{host}:{port}: {exc!r}") from exc
    return sock


# --- a client's idle channels ---------------------------------------------------------------------


def take_idle(idle: IdleChannels, uri: str) -> Channel | None:
    """The most recently used idle channel to ``uri`` still fit for reuse (the stale ones are closed)."""
    channels = idle.get(uri, [])
    while channels:
        channel = channels.pop()
        if time.monotonic() - channel.idle_since < REUSE_S and not channel_closed(channel.sock):
            return channel
        channel.close()
    return None


def keep_idle(idle: IdleChannels, channel: Channel) -> None:
    """Keep ``channel`` for the next pull to its server, up to MAX_IDLE_CHANNELS (else close it)."""
    channels = idle.setdefault(channel.uri, [])
    if len(channels) >= MAX_IDLE_CHANNELS:
        channel.close()
        return
    channel.idle_since = time.monotonic()
    channels.append(channel)


def close_idle(idle: IdleChannels) -> None:
    for channels in idle.values():
        for channel in channels:
            channel.close()
    idle.clear()


# A garbage-collected client's channels are closed on a reaper thread, never inside the finalizer: the
# collector may run in the middle of a ``ThreadPoolExecutor.submit`` (which holds a module-global lock),
# and ``Channel.close`` submits to its executor -- closing there would deadlock that very thread.
# ``queue.SimpleQueue.put`` is reentrant, safe from a finalizer.
_REAP: queue.SimpleQueue[Channel] = queue.SimpleQueue()
_reaper: threading.Thread | None = None
_reaper_lock = threading.Lock()


def start_reaper() -> None:
    global _reaper
    with _reaper_lock:
        if _reaper is None:
            _reaper = threading.Thread(target=_reap_forever, name="kv-nccl-reaper", daemon=True)
            _reaper.start()


def _reap_forever() -> None:
    while True:
        channel = _REAP.get()
        with contextlib.suppress(Exception):
            channel.close()


def reap_later(idle: IdleChannels) -> None:
    """Hand ``idle``'s channels to the reaper thread (from a finalizer: see above)."""
    for channels in list(idle.values()):
        for channel in channels:
            _REAP.put(channel)
    idle.clear()
