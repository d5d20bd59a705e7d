"""Baton's data plane for vLLM's connector API, without vLLM: what ``worker/vllm_engine/connector.py`` (the
``KVConnectorBase_V1`` vLLM loads) delegates to, so the tests run it here, in Baton's environment.

- ``PlaneScheduler`` (vLLM's scheduler side): a prefill for a remote decoder (``do_remote_decode``) that finished
  keeps its blocks: a lease id, its block ids and the worker side's URIs go back in ``kv_transfer_params``
  (``KVHandle.engine_params`` carries them); a decode handed those params (``do_remote_prefill``) asks for the
  prompt tokens its own cache lacks, loaded asynchronously, and once vLLM allocated blocks for them (its unhashed
  ones) orders the pull, or a release (a read of no blocks) when it needs none or ended first.
- ``PlaneWorker`` (beside vLLM's KV cache): serves the cache in place (``kv_buffer_of``: one ``KVBuffer`` over vLLM's
  layer-major allocation, no copy) on one server per transport (cma, tcp), on a thread with an event loop of its own;
  registers the leases the scheduler ordered; pulls into its own blocks with pooled clients (``pull_lease``).
  ``finished`` reports a lease read (its server's ``on_read``, a lease has one reader) or past its TTL as sent, a
  pull ended as received; a failed pull's blocks are load errors (vLLM recomputes them).

Not done: layers streamed while P computes (P's prompt is whole when its lease opens); tensor parallelism; device
caches (vLLM on CPU here: host memory).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kv_transfer.errors import KVTransferError, LeaseNotFound, TransportUnusable
from kv_transfer.layout import KVBuffer, KVLayout
from kv_transfer.transport import TransportConfig, connect, make_server, parse_kinds, uris_in_order

logger = logging.getLogger("vllm.baton_connector")  # through vLLM's handlers, in its processes
IDLE_WAIT_S = 0.002  # how long an empty engine step waits for a pending pull or lease to end (``finished``)
# A reader may arrive before P's worker side registered the lease: that happens at P's next engine step, which waits
# for the step running (a long prefill on a busy P: seconds; 2 s of asking failed 11 of 60 trace requests here)
LEASE_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class ServeOrder:
    request_id: str
    lease_id: str
    block_ids: list[int]
    ttl_s: float


@dataclass(frozen=True, slots=True)
class PullOrder:
    request_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_uris: str
    lease_id: str
    release: bool = False  # read nothing: tell P its blocks are not wanted (a read of no blocks ends its lease)


class Orders:
    """What the scheduler side hands the worker side with a step (vLLM's connector metadata)."""

    def __init__(self, to_serve: list[ServeOrder], to_pull: list[PullOrder]) -> None:
        self.to_serve, self.to_pull = to_serve, to_pull


class PlaneScheduler:
    """The scheduler side: what to serve (finished prefills) and what to pull (decodes handed P's params)."""

    def __init__(self, engine_id: str, settings: dict[str, Any]) -> None:
        self.engine_id = engine_id
        self.ttl_s = float(settings.get("lease_ttl_s", 30.0))
        self.uris = ""  # the worker side's, from its handshake metadata
        self._serve: list[ServeOrder] = []
        self._pull: list[PullOrder] = []

    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """A decode with P's params loads every prompt token its own cache lacks, asynchronously."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and params.get("remote_block_ids"):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # asked once: the second call (after the load) orders nothing
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        self._pull.append(PullOrder(request.request_id, local, list(params["remote_block_ids"]),
                                    params["remote_uris"], params["remote_lease_id"], release=not local))

    def take_orders(self) -> Orders:
        orders = Orders(self._serve, self._pull)
        self._serve, self._pull = [], []
        return orders

    def finished(self, request: Any, block_ids: list[int], completed: bool) -> tuple[bool, dict[str, Any] | None]:
        """A prefill for a remote decoder that ``completed`` (stopped or reached its length, not aborted) keeps its
        blocks under a lease; anything else frees them now."""
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # a decode that ended before its pull was ordered: P is told
            params["do_remote_prefill"] = False
            if params.get("remote_lease_id"):
                self._pull.append(PullOrder(request.request_id, [], [], params.get("remote_uris", ""),
                                            params["remote_lease_id"], release=True))
            return False, None
        if not params.get("do_remote_decode") or not block_ids or not completed:
            return False, None
        lease_id = secrets.token_hex(16)
        self._serve.append(ServeOrder(request.request_id, lease_id, list(block_ids), self.ttl_s))
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "connector": "baton",
                      "remote_engine_id": self.engine_id, "remote_block_ids": list(block_ids),
                      "remote_uris": self.uris, "remote_lease_id": lease_id,
                      "remote_num_tokens": request.num_computed_tokens}


@dataclass
class _Lease:
    request_id: str
    block_ids: tuple[int, ...]
    expires_at: float  # monotonic


@dataclass(frozen=True, slots=True)
class _Pull:
    local_block_ids: list[int]
    future: concurrent.futures.Future


class PlaneWorker:
    """The worker side: serves the cache, registers leases, pulls; ``finished`` reports to vLLM."""

    def __init__(self, layout: KVLayout, settings: dict[str, Any]) -> None:
        self.layout = layout  # in vLLM's blocks
        self.kinds = parse_kinds(str(settings.get("transports", "cma,tcp")))
        self.host = str(settings.get("host", "127.0.0.1"))
        self.config = TransportConfig(checksum=bool(settings.get("checksum", False)))
        self.lease_wait_s = min(float(settings.get("lease_ttl_s", LEASE_WAIT_S)), LEASE_WAIT_S)
        self.uris = ""
        self._lock = threading.Lock()
        self._changed = threading.Event()  # a pull or a lease ended (``finished`` may wait for it)
        self._leases: dict[str, _Lease] = {}
        self._sent: set[str] = set()
        self._pulls: dict[str, _Pull] = {}
        self._load_errors: set[int] = set()
        self._stats: list[list[Any]] = []
        self._clients: dict[str, Any] = {}
        self._servers: list[Any] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="baton-kv", daemon=True)
        self._thread.start()

    def register(self, kv_caches: dict[str, Any]) -> None:
        self._caches = kv_caches  # kept: the servers and pulls use their memory
        self.buffer = kv_buffer_of(self.layout, kv_caches)
        self.uris = " ".join(self._run(self._serve(kind)) for kind in self.kinds)
        logger.info("Baton KV connector: %d blocks of %d bytes served on %s", self.buffer.num_blocks,
                    self.layout.bytes_per_block, self.uris)

    async def _serve(self, kind: str) -> str:
        server = make_server(kind, buffer=self.buffer, resolve=self._resolve, config=self.config)
        server.on_read = self._read
        self._servers.append(server)
        return await server.start(self.host, 0)

    def _run(self, coro: Any, timeout_s: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # ---- serving (the loop's thread) ----
    def _resolve(self, lease_id: str) -> tuple[int, ...] | None:
        with self._lock:
            lease = self._leases.get(lease_id)
        return lease.block_ids if lease is not None and lease.expires_at > time.monotonic() else None

    def _read(self, lease_id: str, block_ids: list[int]) -> None:
        """The lease's reader read it (a lease has one reader): its blocks go back to vLLM."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._sent.add(lease.request_id)
        self._changed.set()

    # ---- the engine's thread ----
    def start(self, meta: Orders) -> None:
        now = time.monotonic()
        with self._lock:
            for order in meta.to_serve:
                self._leases[order.lease_id] = _Lease(order.request_id, tuple(order.block_ids), now + order.ttl_s)
        for order in meta.to_pull:
            future = asyncio.run_coroutine_threadsafe(self._pull(order), self._loop)
            future.add_done_callback(lambda _: self._changed.set())
            if not order.release:  # a release is no load: vLLM waits for nothing
                with self._lock:
                    self._pulls[order.request_id] = _Pull(order.local_block_ids, future)

    def finished(self, wait_s: float = 0.0) -> tuple[set[str] | None, set[str] | None]:
        """What ended since the last call. ``wait_s``: in a step that ran no model (vLLM steps on, empty, while a pull
        or a lease is pending), wait up to that long for one to end first: the empty steps of the engine core and
        its worker process otherwise spin, and on a small machine slow the very transfer they wait for."""
        with self._lock:
            pending = bool(self._pulls or self._leases) and not self._sent
        if wait_s and pending:
            self._changed.wait(wait_s)
        self._changed.clear()
        now = time.monotonic()
        with self._lock:
            for lease_id, lease in list(self._leases.items()):
                if lease.expires_at <= now:  # nobody read it in time: freed
                    del self._leases[lease_id]
                    self._sent.add(lease.request_id)
                    logger.info("request_id=%s Baton KV lease %s ended unread", lease.request_id, lease_id[:8])
            sent, self._sent = self._sent, set()
            received = {rid for rid, pull in self._pulls.items() if pull.future.done()}
            for rid in received:
                pull = self._pulls.pop(rid)
                if pull.future.exception() is not None:
                    self._load_errors.update(pull.local_block_ids)
                    logger.warning("request_id=%s Baton KV pull failed (vLLM recomputes): %s", rid,
                                   pull.future.exception())
        return sent or None, received or None

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> list[list[Any]]:
        """``[request_id, bytes, seconds, transport]`` of each pull ended since the last call."""
        with self._lock:
            pulls, self._stats = self._stats, []
        return pulls

    # ---- pulling (the loop's thread) ----
    async def _pull(self, order: PullOrder) -> None:
        local = order.local_block_ids
        if len(local) > len(order.remote_block_ids):
            raise KVTransferError(f"{len(local)} blocks to load but P holds {len(order.remote_block_ids)}")
        remote = order.remote_block_ids[len(order.remote_block_ids) - len(local):]  # what the local cache lacks
        try:
            stats, kind = await pull_lease(self._clients, self.kinds, self.config, order.remote_uris,
                                           order.lease_id, self.buffer, remote, local, self.lease_wait_s)
        except KVTransferError as exc:
            if order.release:
                logger.info("request_id=%s Baton KV release of %s failed: %s (P frees it at its TTL)",
                            order.request_id, order.lease_id[:8], exc)
                return
            raise
        if not order.release:
            with self._lock:
                self._stats.append([order.request_id, stats.num_bytes, stats.seconds, kind])

    def shutdown(self) -> None:
        async def close() -> None:
            for server in self._servers:
                await server.stop()
            for client in self._clients.values():
                if callable(close := getattr(client, "close", None)):
                    close()

        try:
            self._run(close(), timeout_s=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)


async def pull_lease(clients: dict[str, Any], kinds: tuple[str, ...], config: TransportConfig, uris: str,
                     lease_id: str, buffer: KVBuffer, src_ids: list[int], dst_ids: list[int],
                     lease_wait_s: float = LEASE_WAIT_S) -> tuple[Any, str]:
    """Read lease ``lease_id`` (``src_ids``: none to release it) from the first of ``uris`` that ``kinds`` reach,
    into ``dst_ids`` of ``buffer``; a lease not registered yet (P's worker side registers it at the engine's next
    step) is asked again, at most ``lease_wait_s`` (its TTL: by then it is registered or gone). ``clients`` keeps one pooled client per URI. Returns the
    ``TransferStats`` and the transport's kind."""
    deadline, pause = time.monotonic() + lease_wait_s, 0.005
    for uri in uris_in_order(uris, kinds):
        client = clients.get(uri) or clients.setdefault(uri, connect(uri, config))
        while True:
            try:
                stats = await client.pull(uri, buffer.layout, lease_id, src_ids, buffer, dst_ids)
            except TransportUnusable as exc:
                logger.info("Baton KV connector: %s unusable (%s); next transport", uri, exc)
                break
            except LeaseNotFound:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.05)
                continue
            return stats, uri.split(":", 1)[0]
    raise KVTransferError(f"no transport of {list(kinds)} reached {uris!r}")


def kv_buffer_of(layout: KVLayout, kv_caches: dict[str, Any]) -> KVBuffer:
    """vLLM's per-layer cache views (layer name -> ``[blocks, heads, block_size, 2 * head_dim]``, one allocation,
    layer-major) as one ``KVBuffer``: ``[layers, blocks, segment]`` bytes, no copy. One manager block of one layer
    is one contiguous segment (its K and V rows interleaved, in vLLM's order: opaque to the transports, read and
    written as bytes between two vLLM caches of one fingerprint). Anything else is refused, clearly."""
    names = sorted(kv_caches, key=_layer_index)
    if len(names) != layout.num_layers:
        raise ValueError(f"Baton KV connector: vLLM registered {len(names)} KV caches for {layout.num_layers} layers")
    first = kv_caches[names[0]]
    layer_bytes = first.numel() * first.element_size()
    num_blocks, rest = divmod(layer_bytes, layout.bytes_per_block_per_layer)
    for i, name in enumerate(names):
        cache = kv_caches[name]
        if (cache.device.type != "cpu" or not cache.is_contiguous() or rest
                or cache.numel() * cache.element_size() != layer_bytes
                or cache.data_ptr() != first.data_ptr() + i * layer_bytes):
            raise ValueError("Baton KV connector: vLLM's KV cache is not one layer-major host allocation of whole "
                             f"blocks (layer {name}: {tuple(cache.shape)} {cache.dtype} on {cache.device}); "
                             "use --vllm-kv-connector nixl")
    raw = (ctypes.c_uint8 * (layer_bytes * len(names))).from_address(first.data_ptr())
    return KVBuffer(layout, np.ctypeslib.as_array(raw))


def _layer_index(name: str) -> int:
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    if not found:
        raise ValueError(f"Baton KV connector: no layer index in vLLM's cache name {name!r}")
    return int(found[0])
