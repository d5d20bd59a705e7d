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
                          notification tag | u32 metadata length | u32 count | the server agent's metadata |
                          count x (u64 address, u64 length): one row per layer per run of source blocks
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

A client whose READ fails (state ERR: the server died mid-read) or does not complete within its bound raises
KVTransferError; its destination blocks are then undefined (the caller recomputes). A transfer the client
gave up on keeps its destination buffer referenced until NIXL lets its handle go.

NIXL moved 0.5-0.9 GB/s over tcp on host memory here (below our tcp), 2.3-4.9 GB/s with UCX's cma: it is the
transport for device memory and RDMA fabrics, so ``--kv-transport auto`` prefers it only for a CUDA cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kv_transfer import checksum
from kv_transfer.conn_pool import PooledClient
from kv_transfer.errors import KVTransferError
from kv_transfer.progress import ProgressLookup
from kv_transfer.protocol import remote_error
from kv_transfer.rows import buffer_iovecs, pair_rows
from kv_transfer.socket_server import ReadKinds, SocketServer
from kv_transfer.tcp_wire import peek_byte, recv_frame, send_frame, transfer
from kv_transfer.tensor_buffer import AnyKVBuffer, TensorKVBuffer
from kv_transfer.transport import Locator, Pull, Resolver, TransportConfig
from kv_transfer.wire import (
    DONE, ERR_PROTOCOL, ERR_REFUSED, ERROR, MAX_PAYLOAD_BYTES, READ_CHECKSUM, Frame, encode_frame,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

# kinds of their own: a tcp:// (1-6), nccl:// (17-19) or cma:// (33-37) peer refuses them, and vice versa
N_HELLO, N_HELLO_OK, N_READ, N_DESCS, N_READ_DONE = 49, 50, 51, 52, 53
DESCS_HEAD = struct.Struct("<8sIB16sII")  # incarnation, device id, memory kind, notification tag, md length, count
MEM_KINDS = ("DRAM", "VRAM")
# the packages NIXL ships as, newest CUDA first; each exposes ``nixl_agent`` and ``nixl_agent_config``
NIXL_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
INSTALL_HINT = "nixl:// needs NVIDIA NIXL: pip install nixl-cu12 (or nixl-cu13), after the pinned torch"
REGISTERED_BUFFERS = 8  # destination buffers a client keeps registered (a worker has one or two: cache, staging)
POLL_S = (0.0, 0.0, 0.0001, 0.0002, 0.0005, 0.001)  # the server's successive waits between polls of notifications
POLL_SLEEP_S = 0.0  # the client's pause between polls of its READ, on the agent's thread (0: yield the GIL only)
POLL_SLICE_S = 0.005  # ... for at most this long a call, so other pulls' calls interleave
CLOSE_TIMEOUT_S = 5.0
READ_DONE_FRAME = encode_frame(N_READ_DONE)


@functools.cache
def nixl_module() -> Any:
    """The NIXL Python API; raises ImportError with the install hint where there is none."""
    for name in NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module
    raise ImportError(INSTALL_HINT)


def installed() -> bool:
    """Whether a NIXL package is installed, found without importing it. Importing NIXL loads the libraries it
    bundles (its own UCX, gRPC, protobuf, absl) into the process: in a process that later loads grpc_tools'
    protoc that crashed it here, so test processes ask this instead (a worker serving nixl imports it)."""
    return any(importlib.util.find_spec(name) is not None for name in NIXL_MODULES)


def unavailable_reason() -> str | None:
    """None when NIXL imports here, else why not."""
    try:
        nixl_module()
    except ImportError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - a broken install (a missing shared library) must not crash a worker
        return f"NIXL is installed but does not import: {exc!r}"
    return None


@contextlib.contextmanager
def _ucx_env() -> Iterator[None]:
    """NIXL's bundled UCX reads its environment when an agent is made. Without RDMA devices its ib module is
    not loaded (NIXL 1.5.1 crashes at exit tearing it down on a host without any); the process's own
    environment is restored afterwards, so another UCX in the process (ucxx) is not affected."""
    ib = Path("/sys/class/infiniband")
    wanted = {} if ib.is_dir() and any(ib.iterdir()) else {"UCX_MODULES": os.environ.get("UCX_MODULES", "^ib")}
    # No memory-event hooks, a precaution: another UCX in the process (ucxx's) hooks mmap/munmap as well.
    # NIXL registers the KV buffers once and Baton keeps them mapped while registered, so no registration
    # cache needs invalidating. (The crashes seen beside ucxx came from NIXL's bundled libraries being loaded
    # at all: tests/unit/test_kv_nixl.py.)
    wanted["UCX_MEM_EVENTS"] = os.environ.get("BATON_NIXL_UCX_MEM_EVENTS", "no")
    with environment(wanted):
        yield


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` set in the environment for the block (a UCX context reads it when made), restored after."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Memory:
    """Where a KV buffer's bytes live, as NIXL registers them: base address, length, memory kind, device id.
    A ``KVBuffer`` is host memory (DRAM, device 0); a ``TensorKVBuffer`` on CUDA is VRAM on its device."""

    __slots__ = ("address", "nbytes", "kind", "device_id", "owner")

    def __init__(self, address: int, nbytes: int, kind: str = "DRAM", device_id: int = 0, owner: Any = None) -> None:
        if kind not in MEM_KINDS:
            raise ValueError(f"memory kind must be one of {MEM_KINDS}, got {kind!r}")
        self.address, self.nbytes, self.kind, self.device_id = address, nbytes, kind, device_id
        self.owner = owner  # what keeps the memory alive while it is registered

    @classmethod
    def of(cls, buffer: AnyKVBuffer) -> Memory:
        if isinstance(buffer, TensorKVBuffer):
            return cls(buffer.base_ptr, buffer.nbytes, "VRAM" if buffer.is_cuda else "DRAM", buffer.device_id, buffer)
        return cls(buffer.base_ptr, buffer.array.nbytes, "DRAM", 0, buffer)


class Agent:
    """One NIXL agent (UCX backend) and the memory registered with it; ``close()`` deregisters it all."""

    def __init__(self, name: str) -> None:
        nixl = nixl_module()
        with _ucx_env():
            # No progress thread: NIXL 1.5's runs without a pause (a whole core per agent, idle or not). The
            # agent progresses when polled instead: the client polls its READ, the server its notifications
            # (kv_transfer/nixl.py's docstring), and nothing needs progress between reads.
            self.nixl = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in self.nixl.backends:
            raise KVTransferError("NIXL has no UCX backend here (its plugin did not load)")
        self.name = name
        self._registered: dict[tuple[int, int], tuple[Memory, Any]] = {}

    def register(self, memory: Memory) -> None:
        key = (memory.address, memory.nbytes)
        if key not in self._registered:
            descs = self.nixl.register_memory([(memory.address, memory.nbytes, memory.device_id, "")], memory.kind)
            self._registered[key] = (memory, descs)

    def deregister(self, memory: Memory) -> None:
        entry = self._registered.pop((memory.address, memory.nbytes), None)
        if entry is not None:
            self.nixl.deregister_memory(entry[1])

    def metadata(self) -> bytes:
        return self.nixl.get_agent_metadata()

    def close(self) -> None:
        for memory, _ in list(self._registered.values()):
            with contextlib.suppress(Exception):
                self.deregister(memory)


# --- server ---------------------------------------------------------------------------------------


class NixlServer(SocketServer):
    """Serves reads of leased blocks of ``buffer`` (registered with a NIXL agent) to clients that READ them."""

    scheme = "nixl"
    kinds = ReadKinds(N_HELLO, N_HELLO_OK, N_READ, not_hello=b"expected N_HELLO: this is a nixl:// KV server",
                      not_read=b"expected N_READ")

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
        self._wake = asyncio.Event()
        self._notifications: asyncio.Task | None = None
        self.num_notifications = 0

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
        """Serve one N_HELLO + N_READ, then wait for the READ's notification; returns the ERROR frame to close
        with, None after a DONE (the connection then serves the client's next request)."""
        accepted = await self._receive_read(sock)
        if isinstance(accepted, bytes):
            return accepted
        request, io_s, what = accepted.request, self.config.io_timeout_s, "KV client"
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
                               len(self._metadata), len(rows))
        done = self._waiting[tag] = asyncio.get_running_loop().create_future()
        try:
            await send_frame(sock, accepted.hello_ok + encode_frame(N_DESCS, head + self._metadata + rows.tobytes()),
                             io_s, what)
            self._wake.set()
            bound_s = io_s + len(block_ids) * self.buffer.layout.bytes_per_block / 1e9
            refusal = await self._await_notification(sock, tag, done, bound_s)
        finally:
            self._waiting.pop(tag, None)
            self._hinted.discard(tag)
        if refusal is not None:
            return refusal
        # DONE only if the lease held for the whole read: its blocks cannot have been freed and reused.
        refusal = self._check_read(lease_id, block_ids)
        if refusal is not None:
            return refusal
        await send_frame(sock, encode_frame(DONE, sums), io_s, what)
        return None

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
                waiter = self._waiting.get(bytes(message))
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
                    delivered = True
        return delivered


# --- client ---------------------------------------------------------------------------------------


class NixlClient(PooledClient):
    """Pulls leased blocks from ``nixl://`` servers: control over pooled connections, bytes by NIXL READ.

    Every call into its agent runs on one thread of its own (NIXL agents are not thread-safe in the mode
    used, and posting a READ that UCX serves by cma copies the bytes inside the call): the event loop is
    never blocked by a copy. The agent is made at the first pull; ``close()`` removes the remote agents and
    deregisters memory. A ``TensorKVBuffer`` destination on CUDA is registered as VRAM and read into in place."""

    pulls_into_tensors = True

    def __init__(self, config: TransportConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.agent: Agent | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-nixl")
        self._remotes: dict[str, tuple[bytes, str]] = {}  # server URI -> (incarnation, remote agent name)
        self._buffers: OrderedDict[tuple[int, int], Memory] = OrderedDict()  # registered destinations, LRU
        self._abandoned: list[tuple[Any, AnyKVBuffer]] = []  # READs given up on, kept until NIXL releases them
        self.num_agents_loaded = 0  # remote agent metadata loaded so far (once per server incarnation)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def _pull(self, request: Pull) -> None:
        uri = request.uri

        async def read(sock: socket.socket) -> bool:
            descs = _parse_descs(uri, await recv_frame(sock, self.config.io_timeout_s, f"KV server {uri}"))
            local, remote = pair_rows(request.dst_buffer, request.dst_ids, descs.rows, uri)
            await self._read(descs, local, remote, request, sock)
            request.landed.first_layer()
            return True  # N_READ_DONE sent

        await self.one_sided_read(request, "nixl", NixlServer.kinds, N_READ_DONE, 0, read)

    # --- on the agent's thread -------------------------------------------------------------------

    def _prepare(self, buffer: AnyKVBuffer) -> Memory:
        """The agent (made at the first pull), ``buffer`` registered (returned), READs given up on released if
        done."""
        if self.agent is None:
            self.agent = Agent(f"baton-kv-client-{os.getpid()}-{secrets.token_hex(4)}")
        memory = Memory.of(buffer)
        key = (memory.address, memory.nbytes)
        if key in self._buffers:
            self._buffers.move_to_end(key)
        else:
            self.agent.register(memory)
            self._buffers[key] = memory
            while len(self._buffers) > REGISTERED_BUFFERS:
                _, old = self._buffers.popitem(last=False)
                self.agent.deregister(old)
        self._release_abandoned()
        return memory

    def _remote_agent(self, uri: str, descs: _Descs) -> str:
        """The server's agent, loaded once per incarnation; a new incarnation at the same URI (the server
        restarted) replaces the old one's, which is removed first."""
        known = self._remotes.get(uri)
        if known is not None and known[0] == descs.incarnation:
            return known[1]
        if known is not None:
            logger.info("KV server %s restarted (new incarnation %s): dropping its old NIXL agent", uri,
                        descs.incarnation.hex())
            self._remotes.pop(uri)
            with contextlib.suppress(Exception):
                self.agent.nixl.remove_remote_agent(known[1])
        try:
            name = self.agent.nixl.add_remote_agent(descs.metadata)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
            raise KVTransferError(f"KV server {uri}: NIXL refused its agent metadata: {exc!r}") from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes[uri] = (descs.incarnation, name)
        self.num_agents_loaded += 1
        return name

    def _post(self, uri: str, descs: _Descs, buffer: AnyKVBuffer, local: np.ndarray, remote: np.ndarray,
              job: dict, until: float) -> str:
        """One call for a READ that completes at once (UCX's cma copies inside ``transfer``): ``buffer``
        registered (``_prepare``), the READ prepared and posted (``job["handle"]`` holds it as soon as it
        exists), then polled until ``until``; returns its state."""
        memory = self._prepare(buffer)
        nixl = self.agent.nixl
        remote_name = self._remote_agent(uri, descs)
        zeros = np.zeros((len(local), 1), np.uint64)
        try:
            local_descs = nixl.get_xfer_descs(np.hstack([local, zeros + np.uint64(memory.device_id)]), memory.kind)
            remote_descs = nixl.get_xfer_descs(np.hstack([remote, zeros + np.uint64(descs.device_id)]),
                                               MEM_KINDS[descs.memory_kind])
            job["handle"] = nixl.initialize_xfer("READ", local_descs, remote_descs, remote_name, descs.tag)
        except Exception as exc:  # noqa: BLE001
            raise KVTransferError(f"KV server {uri}: NIXL could not prepare the READ: {exc!r}") from exc
        state = nixl.transfer(job["handle"])
        return self._poll(job, until) if state == "PROC" else self._finish(job, state)

    def _poll(self, job: dict, until: float) -> str:
        """The READ's state once it is no longer in progress, or at ``until`` (time.monotonic)."""
        state = self.agent.nixl.check_xfer_state(job["handle"])
        while state == "PROC" and time.monotonic() < until:
            time.sleep(POLL_SLEEP_S)
            state = self.agent.nixl.check_xfer_state(job["handle"])
        return self._finish(job, state)

    def _finish(self, job: dict, state: str) -> str:
        """Once the READ is DONE, N_READ_DONE sent from this thread at once (the server starts on its DONE while
        the event loop wakes up), unless the loop took the connection back (``job["sock"]`` gone: it gave up);
        then, the READ over either way, its handle released here too (released later from another call, it
        held the GIL while the loop's next pull was sending: 0.5 ms per request in the bench)."""
        if state == "DONE":
            with job["lock"]:
                sock = job.pop("sock", None)
                if sock is not None:
                    with contextlib.suppress(OSError):  # BlockingIOError too: the loop sends what is left
                        job["hinted"] = sock.send(READ_DONE_FRAME)
        if state != "PROC":
            job["released"] = self._release(job["handle"])
        return state

    def _release(self, handle: Any) -> bool:
        try:
            self.agent.nixl.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - NIXL refuses to release a transfer still in progress
            return False
        return True

    def _release_abandoned(self) -> None:
        still = []
        for handle, buffer in self._abandoned:
            if self.agent.nixl.check_xfer_state(handle) == "PROC" or not self._release(handle):
                still.append((handle, buffer))
        self._abandoned = still

    def _close(self) -> None:
        self._release_abandoned()
        for _, name in self._remotes.values():
            with contextlib.suppress(Exception):
                self.agent.nixl.remove_remote_agent(name)
        self._remotes.clear()
        if not self._abandoned:  # memory a READ may still write stays registered (and referenced)
            self.agent.close()
            self._buffers.clear()

    # ---------------------------------------------------------------------------------------------

    async def _read(self, descs: _Descs, local: np.ndarray, remote: np.ndarray, request: Pull,
                    sock: socket.socket) -> None:
        """One READ of ``remote`` rows into ``local`` ones, notifying the server's tag when complete, on the
        agent's thread (polled in slices, so other pulls' calls interleave), bounded by io_timeout_s plus
        1 s per GB; then N_READ_DONE on ``sock`` (from the agent's thread as the READ completes, or what is left
        of it from here). Given up on (a timeout, a cancellation), its handle and destination are kept until
        NIXL lets them go, and no hint goes out."""
        uri, state = request.uri, "PROC"
        job: dict[str, Any] = {"handle": None, "sock": sock, "lock": threading.Lock(), "hinted": 0}
        budget_s = self.config.io_timeout_s + request.num_bytes / 1e9
        deadline = time.monotonic() + budget_s
        try:
            until = min(deadline, time.monotonic() + POLL_SLICE_S)
            post = functools.partial(self._post, uri, descs, request.dst_buffer, local, remote, job, until)
            state = await asyncio.shield(self._call(post))
            while state == "PROC" and time.monotonic() < deadline:
                until = min(deadline, time.monotonic() + POLL_SLICE_S)
                state = await asyncio.shield(self._call(self._poll, job, until))
            if state == "ERR":
                raise KVTransferError(f"NIXL READ from KV server {uri} failed (the server died mid-read?)")
            if state != "DONE":
                raise KVTransferError(f"NIXL READ from KV server {uri} did not complete in {budget_s:.1f} s")
            if job["hinted"] < len(READ_DONE_FRAME):
                await transfer(sock, [memoryview(READ_DONE_FRAME)[job["hinted"]:]], write=True,
                               timeout_s=self.config.io_timeout_s, what=f"KV server {uri}")
        finally:
            with job["lock"]:
                job.pop("sock", None)  # from now on the agent's thread never touches the connection
            if job["handle"] is not None:
                if state == "PROC":  # still in flight (or cancelled mid-call): NIXL may yet write the destination
                    self._abandoned.append((job["handle"], request.dst_buffer))
                elif not job.get("released"):
                    self._thread.submit(self._release, job["handle"])

    def close(self) -> None:
        """Close idle connections; on the agent's thread, release what it can and deregister (bounded)."""
        super().close()
        if self.agent is not None:
            with contextlib.suppress(Exception):
                self._thread.submit(self._close).result(timeout=CLOSE_TIMEOUT_S)
        self._thread.shutdown(wait=False)


class _Descs:
    __slots__ = ("incarnation", "device_id", "memory_kind", "tag", "metadata", "rows")

    def __init__(self, incarnation: bytes, device_id: int, memory_kind: int, tag: bytes, metadata: bytes,
                 rows: np.ndarray) -> None:
        self.incarnation, self.device_id, self.memory_kind = incarnation, device_id, memory_kind
        self.tag, self.metadata, self.rows = tag, metadata, rows


def _parse_descs(uri: str, frame: Frame) -> _Descs:
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
    return _Descs(incarnation, device_id, kind, tag, metadata, rows)
