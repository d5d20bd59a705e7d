"""``nixl://``'s pulling side (the exchange: ``kv_transfer/nixl.py``): control over pooled connections, the bytes
by one NIXL READ per pull on the agent's own thread; on a connection that read from the server before, the READ
goes first and one round trip follows (N_READ_POSTED)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from weakref import WeakKeyDictionary

import numpy as np

from kv_transfer.conn_pool import NotAnswered, PooledClient
from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVLayout, check_block_ids
from kv_transfer.nixl_agent import MEM_KINDS, Agent, Memory
from kv_transfer.nixl_wire import KINDS, N_READ_DONE, POSTED_READS, READ_DONE_FRAME, Descs, encode_posted, parse_descs
from kv_transfer.protocol import remote_error
from kv_transfer.rows import pair_rows, paired_rows
from kv_transfer.tcp_wire import peek_byte, recv_frame, transfer
from kv_transfer.tensor_buffer import AnyKVBuffer
from kv_transfer.transport import Pull, TransportConfig
from kv_transfer.wire import DONE, Frame, ReadRequest

logger = logging.getLogger(__name__)
T = TypeVar("T")
REGISTERED_BUFFERS = 8  # destination buffers a client keeps registered (a worker has one or two: cache, staging)
POLL_SLEEP_S = 0.0  # the client's pause between polls of its READ, on the agent's thread (0: yield the GIL only)
POLL_SLICE_S = 0.005  # ... for at most this long a call, so other pulls' calls interleave
CLOSE_TIMEOUT_S = 5.0
NO_ROWS = np.empty((0, 2), np.uint64)


class NixlClient(PooledClient):
    """Pulls leased blocks from ``nixl://`` servers: control over pooled connections, bytes by NIXL READ.

    Every call into its agent runs on one thread of its own (NIXL agents are not thread-safe in the mode
    used, and posting a READ that UCX serves by cma copies the bytes inside the call): the event loop is
    never blocked by a copy. The agent is made at the first pull; ``close()`` removes the remote agents and
    deregisters memory. A ``TensorKVBuffer`` destination on CUDA is registered as VRAM and read into in place.

    A connection on which a pull read from a server that takes posted reads (``POSTED_READS``) remembers that
    server's incarnation and geometry: the next pull on it with the same layout READs at once and then sends
    N_READ_POSTED, one round trip instead of two (never with credentials or checksums configured: those go by
    the full exchange). A live connection is to the incarnation it first read from: a restarted server closed
    it, and the pool then opens a new one, whose first pull is a full exchange again."""

    pulls_into_tensors = True

    def __init__(self, config: TransportConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.agent: Agent | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-nixl")
        self._remotes: dict[str, tuple[bytes, str]] = {}  # server URI -> (incarnation, remote agent name)
        self._buffers: OrderedDict[tuple[int, int], Memory] = OrderedDict()  # registered destinations, LRU
        self._abandoned: list[tuple[Any, AnyKVBuffer]] = []  # READs given up on, kept until NIXL releases them
        self.num_agents_loaded = 0  # remote agent metadata loaded so far (once per server incarnation)
        self._posted: WeakKeyDictionary[socket.socket, tuple[KVLayout, Descs]] = WeakKeyDictionary()
        self.num_posted_pulls = 0  # pulls that READ first and took one round trip

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def _pull(self, request: Pull) -> None:
        uri = request.uri

        async def read(sock: socket.socket) -> bool:
            descs = parse_descs(uri, await recv_frame(sock, self.config.io_timeout_s, f"KV server {uri}"))
            local, remote = pair_rows(request.dst_buffer, request.dst_ids, descs.rows, uri)
            await self._read(descs, local, remote, request, sock, READ_DONE_FRAME)
            request.landed.first_layer()
            if descs.flags & POSTED_READS and not (self.config.secret or self.config.checksum):
                self._posted[sock] = (request.layout, Descs(descs.incarnation, descs.device_id, descs.memory_kind,
                                                            b"", b"", NO_ROWS, descs.base_ptr,
                                                            descs.num_blocks, descs.flags))
            return True  # N_READ_DONE sent

        async def posted(sock: socket.socket) -> Frame | None:
            return await self._posted_read(request, sock)

        await self.one_sided_read(request, "nixl", KINDS, N_READ_DONE, 0, read, posted)

    async def _posted_read(self, request: Pull, sock: socket.socket) -> Frame | None:
        """The pull in one round trip on a connection that read from this server's incarnation before: the READ
        at once (its rows from the server's geometry), N_READ_POSTED sent just before it is posted (the server then
        progresses its agent during the READ: a READ that UCX runs over messages needs that, and one by cma
        completes 0.5 ms sooner at 1k tokens), N_READ_DONE once it is complete, then the server's DONE (returned).
        None, having sent nothing, when the connection has not (or read with another layout)."""
        known = self._posted.get(sock)
        uri = request.uri
        if known is None or known[0] != request.layout or self._remotes.get(uri, (b"",))[0] != known[1].incarnation:
            return None
        server, dst, what = known[1], request.dst_buffer, f"KV server {uri}"
        check_block_ids(request.src_ids, server.num_blocks)  # out of its registered memory NIXL refuses anyway
        local, remote = paired_rows(dst, request.dst_ids, server.base_ptr, server.num_blocks, request.src_ids)
        read = Descs(server.incarnation, server.device_id, server.memory_kind, secrets.token_bytes(16), b"", remote)
        posted = encode_posted(server.incarnation, read.tag, ReadRequest(request.lease_id, request.src_ids))
        try:
            await self._read(read, local, remote, request, sock, posted + READ_DONE_FRAME, len(posted))
            request.landed.first_layer()
            answered = await peek_byte(sock, self.config.io_timeout_s, what)
        except OSError as exc:
            raise NotAnswered(f"{what}: connection failed before an answer: {exc!r}") from exc
        if not answered:  # closed idle meanwhile: the pool runs the full exchange on a new connection
            raise NotAnswered(f"{what} closed the connection before answering")
        done = await recv_frame(sock, self.config.io_timeout_s, what)
        if done.kind != DONE:
            raise remote_error(uri, done)
        self.num_posted_pulls += 1
        return done

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

    def _remote_agent(self, uri: str, descs: Descs) -> str:
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

    def _post(self, uri: str, descs: Descs, buffer: AnyKVBuffer, local: np.ndarray, remote: np.ndarray,
              job: dict, until: float) -> str:
        """One call for a READ that completes at once (UCX's cma copies inside ``transfer``): ``buffer``
        registered (``_prepare``), the READ prepared (``job["handle"]`` holds it as soon as it exists), what
        goes out before it sent, the READ posted, then polled until ``until``; returns its state."""
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
        self._send(job, job["early"])  # N_READ_POSTED: the server wakes and progresses its agent during the copy
        state = nixl.transfer(job["handle"])
        return self._poll(job, until) if state == "PROC" else self._finish(job, state)

    def _send(self, job: dict, upto: int) -> None:
        """``job["out"]`` up to byte ``upto`` sent on the pull's connection, as far as it takes it without waiting,
        unless the loop took the connection back (``job["sock"]`` gone: it gave up, or sends the rest itself)."""
        with job["lock"]:
            sock = job.get("sock")
            if sock is not None and job["sent"] < upto:
                with contextlib.suppress(OSError):  # BlockingIOError too: the loop sends what is left
                    job["sent"] += sock.send(memoryview(job["out"])[job["sent"]:upto])

    def _poll(self, job: dict, until: float) -> str:
        """The READ's state once it is no longer in progress, or at ``until`` (time.monotonic)."""
        state = self.agent.nixl.check_xfer_state(job["handle"])
        while state == "PROC" and time.monotonic() < until:
            if job["sent"] < job["early"]:
                self._send(job, job["early"])
            time.sleep(POLL_SLEEP_S)
            state = self.agent.nixl.check_xfer_state(job["handle"])
        return self._finish(job, state)

    def _finish(self, job: dict, state: str) -> str:
        """Once the READ is DONE, what the pull sends then (N_READ_DONE, after N_READ_POSTED if not sent yet) sent
        from this thread at once (the server starts on its DONE while the event loop wakes up); then, the READ over
        either way, its handle released here too (released later from another call, it held the GIL while the
        loop's next pull was sending: 0.5 ms per request in the bench)."""
        if state == "DONE":
            self._send(job, len(job["out"]))
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

    async def _read(self, descs: Descs, local: np.ndarray, remote: np.ndarray, request: Pull,
                    sock: socket.socket, out: bytes, early: int = 0) -> None:
        """One READ of ``remote`` rows into ``local`` ones, notifying the server's tag when complete, on the
        agent's thread (polled in slices, so other pulls' calls interleave), bounded by io_timeout_s plus
        1 s per GB; ``out`` sent on ``sock`` from the agent's thread, its first ``early`` bytes just before the READ
        is posted, the rest once it is complete (what is left of it from here). Given up on (a timeout, a
        cancellation), its handle and destination are kept until NIXL lets them go, and no more goes out."""
        uri, state = request.uri, "PROC"
        job: dict[str, Any] = {"handle": None, "sock": sock, "out": out, "early": early, "sent": 0,
                               "lock": threading.Lock()}
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
            if job["sent"] < len(out):  # the agent's thread is done with this READ: no send of its can interleave
                await transfer(sock, [memoryview(out)[job["sent"]:]], write=True,
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
