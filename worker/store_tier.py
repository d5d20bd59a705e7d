"""The worker's store tier (shell; docs/architecture.md "Store tier"): the store client (``kv_transfer.kv_store``)
on its own thread, the writer that puts the blocks the engine copied out, the reader that fetches a prompt's
continuation before it computes, and the index entries of the holder ``store``.

Writes: the engine tells (``EngineStore.on_ready``) when it copied blocks into write slots; the writer takes
them, puts them (sealed with their checksum), hands the slots back once the put has really ended (even after a
timeout), and publishes the blocks the store now holds (``KVIndex.publish_store``).

Reads (``admit``, both roles, before a request is queued): the prompt's blocks past what this worker holds (pool,
host tier) are looked up: the router's index says how many leading blocks the store holds (``store_blocks`` on the
request), or, without it, one ``batch_is_exist`` asks the store. A leading run it holds is read into read slots and
verified, then one engine hop (``StoreStart``) reserves the request's blocks (``Engine.add_prefix_request``, which
loads the host-tier part), copies the verified leading blocks in and starts the request with them counted as
cached (``activate_prefix``). A block missing, corrupt (removed from the store at once) or a call that fails or
times out ends the run: the rest is recomputed, counted by reason. Nothing waits longer than the store's
deadline; with no free read slot, or the store down, requests simply compute.

Staleness: the store evicts on its own (it says nothing); a read that finds a listed block gone unpublishes it,
and the auditor walks the index's store entries (``scan_store``) a chunk at a time and unpublishes those the
store no longer holds: an entry outlives its block by at most one pass over them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kv_transfer.bounded_thread import CallTimeout, ThreadStuck
from kv_transfer.errors import KVTransferError
from kv_transfer.kv_store import CORRUPT, FETCHED, MISSING, BlockStore, StoreConfig

if TYPE_CHECKING:
    from worker.node import WorkerNode

logger = logging.getLogger(__name__)
RECONNECT_S = 5.0  # a store that could not be reached is tried again this often
WRITE_POLL_S = 1.0  # the writer looks for copied blocks at least this often (it is woken when there are some)
AUDIT_PERIOD_S, AUDIT_CHUNK = 2.0, 512  # the auditor checks this many index entries per period


class StoreTier:
    def __init__(self, node: WorkerNode, config: StoreConfig) -> None:
        self.node, self.config = node, config
        self.engine_store = node.engine.store
        buffer = self.engine_store.buffer
        self.client = BlockStore(config, buffer.raw.numpy(), buffer.block_bytes)
        self.connected = False
        self._free_reads: deque[int] = deque(self.engine_store.read_slots)
        self._wake = asyncio.Event()
        self._unpublished: tuple[list[bytes], list[bytes]] = ([], [])  # (stored, removed) Redis has not taken
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.engine_store.on_ready = lambda: loop.call_soon_threadsafe(self._wake.set)  # engine thread
        self._tasks = [asyncio.create_task(self._run(), name="store-tier")]

    async def stop(self) -> None:
        self.engine_store.on_ready = None  # the loop may close before the engine thread ends
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.close()

    async def _run(self) -> None:
        while not self.connected:
            try:
                await self.client.start()
                self.connected = True
                logger.info("store tier: connected to %s", self.config.uri)
            except KVTransferError as exc:
                logger.warning("store tier: %s unreachable (%s); retrying in %.0f s", self.config.uri, exc,
                               RECONNECT_S)
                await asyncio.sleep(RECONNECT_S)
            except (ImportError, OSError) as exc:  # not installed, or libibverbs1 missing: it will not get better
                logger.error("store tier off: Mooncake does not load (%s); install the store extra and Debian's "
                             "libibverbs1 (make install; docs/operations.md)", exc)
                return
        self._tasks.append(asyncio.create_task(self._audit(), name="store-audit"))
        await self._write_forever()

    # ---- writes ------------------------------------------------------------------------------
    async def _write_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), WRITE_POLL_S)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                writes = await self.node.async_engine.call(lambda e: e.store.take_writes())
                self.node.metrics.kv_store_dropped(self.engine_store.books.num_dropped)
                self.node.metrics.kv_store_stuck(self.client.num_stuck)
                if writes:
                    await self.write(writes)
                await self._publish()
            except Exception:  # noqa: BLE001 - the writer must outlive any one round (the engine stopping, a bug)
                logger.exception("store tier: a write round failed")
                await asyncio.sleep(WRITE_POLL_S)

    async def write(self, writes: Sequence[tuple[bytes, int]]) -> None:
        """Put the copied blocks; their slots go back to the engine once the put has ended, whatever happened."""
        hashes, slots = [h for h, _ in writes], [s for _, s in writes]
        done = lambda: self.node.async_engine.submit(lambda e: e.store.written(slots, []))  # noqa: E731
        try:
            ok = await self.client.put(hashes, slots, ended=done)
        except KVTransferError as exc:
            logger.warning("store tier: writing %d blocks failed (%s)", len(hashes), exc)
            self.node.metrics.kv_store_write_failed(len(hashes))
            return
        stored = [h for h, good in zip(hashes, ok) if good]
        self.node.async_engine.submit(lambda e: e.store.books.remember(stored))
        self.node.metrics.kv_store_written(len(stored), len(hashes) - len(stored))
        self._unpublished[0].extend(stored)

    async def _publish(self) -> None:
        stored, removed = self._unpublished
        if not stored and not removed:
            return
        try:
            await self.node.registry.index.publish_store(stored, removed)
        except Exception as exc:  # noqa: BLE001 - Redis down: kept for the next round
            logger.debug("store tier: publishing to the index failed: %r", exc)
            return
        self._unpublished = ([], [])

    def _lost(self, hashes: Sequence[bytes]) -> None:
        """The store no longer holds ``hashes``: unpublish them, and write them again when they next leave."""
        if hashes:
            self._unpublished[1].extend(hashes)
            self.node.async_engine.submit(lambda e: e.store.forget(list(hashes)))
            self._wake.set()

    async def _audit(self) -> None:
        cursor = 0
        while True:
            await asyncio.sleep(AUDIT_PERIOD_S)
            try:
                cursor, listed = await self.node.registry.index.scan_store(cursor, AUDIT_CHUNK)
                if listed:
                    present = await self.client.exists(listed, background=True)
                    self._lost([h for h, here in zip(listed, present) if not here])
            except Exception as exc:  # noqa: BLE001 - Redis or the store away: next period
                logger.debug("store tier: audit failed: %r", exc)

    # ---- reads -------------------------------------------------------------------------------
    async def admit(self, rid: str, prompt: list[int], outputs: list[int], params, *, hold_blocks: bool = False,
                    store_blocks: int | None = None, **kwargs) -> StoreStart | None:
        """Read the store's part of this request's prefix; returns how to start the request with it (one engine
        hop: reserve, copy in, activate), or None when the store has nothing for it (queue it as usual).

        ``store_blocks``: the router's index says the store holds that many leading blocks of the prompt, so the
        store is not asked first (a round trip on every request, most of which it has nothing for); None (no
        router, or its index did not answer): one ``batch_is_exist`` says."""
        if not self.connected or not self._free_reads:
            return None
        # Read on this thread, not through the engine thread: a hop there waits for the running step (tens of ms
        # for every local request, most of which the store has nothing for). The answer is a hint, read from
        # dicts the engine thread may be changing (each lookup is atomic under the GIL): the reservation
        # recounts what is local, and the fetch verifies what the store returns.
        num_local, hashes = self.node.engine.store.candidates(prompt + outputs, kwargs.get("cache_salt", ""))
        if store_blocks is not None:
            hashes = hashes[:max(store_blocks - num_local, 0)]
        if not hashes:
            return None
        if store_blocks is not None:
            self.node.metrics.kv_store_lookup("index")
        else:
            self.node.metrics.kv_store_lookup("store")
            try:
                present = await self.client.exists(hashes)
            except KVTransferError as exc:
                self.node.metrics.kv_store_fetch_failed(_failure(exc), 1)
                logger.info("request_id=%s store lookup failed (%s); computing", rid, exc)
                return None
            hashes = hashes[:next((i for i, here in enumerate(present) if not here), len(present))]
            if not hashes:
                return None
        lease = _ReadSlots(self._free_reads, min(len(hashes), len(self._free_reads)))
        try:
            want = hashes[:len(lease.slots)]
            verdicts = await self._read(want, lease)
            good = next((i for i, v in enumerate(verdicts) if v != FETCHED), len(verdicts))
            if good < len(want):
                await self._after_read(rid, want[good:], verdicts[good:])
        except BaseException:
            lease.release()
            raise
        if not good:
            lease.release()
            return None
        broken = f"; recomputed {len(want) - good} blocks past them ({verdicts[good]})" if good < len(want) else ""
        return StoreStart(self, rid, (prompt, outputs, params, hold_blocks, kwargs), num_local, want[:good], lease,
                          broken)

    async def _read(self, want: list[bytes], lease: _ReadSlots) -> list[str]:
        """Per block FETCHED, MISSING, CORRUPT, or for all of them why the call failed (``timeout``, ``failed``)."""
        def ended() -> None:
            lease.call_ended()
            self.node.metrics.kv_store_stuck(self.client.num_stuck)

        lease.busy = True  # until the call has really ended: it may write into the slots after a timeout
        try:
            return await self.client.get(want, lease.slots[:len(want)], ended=ended)
        except KVTransferError as exc:
            self.node.metrics.kv_store_stuck(self.client.num_stuck)
            return [_failure(exc)] * len(want)

    async def _after_read(self, rid: str, hashes: list[bytes], verdicts: list[str]) -> None:
        """``hashes`` from the first block not fetched on: count and log why (blocks fetched after it are not
        used: the prefix broke before them)."""
        bad = {v: [h for h, v2 in zip(hashes, verdicts) if v2 == v] for v in set(verdicts) - {FETCHED}}
        for verdict, some in bad.items():
            self.node.metrics.kv_store_fetch_failed(verdict, len(some))
            logger.warning("request_id=%s worker_id=%s %d store blocks %s; recomputing", rid, self.node.worker_id,
                           len(some), verdict)
        corrupt = bad.get(CORRUPT, [])
        if corrupt:
            try:
                await self.client.remove(corrupt)  # forced: a value that fails its checksum must not be read again
            except KVTransferError as exc:
                logger.warning("store tier: removing %d corrupt blocks failed (%s)", len(corrupt), exc)
        self._lost(corrupt + bad.get(MISSING, []))


def store_hint(request) -> int | None:
    """A ``PrefillRequest`` / ``DecodeRequest``'s ``store_blocks``: the router's count of the prompt's leading blocks
    this worker or the store holds (None: not said; the worker asks the store)."""
    return request.store_blocks if request.HasField("store_blocks") else None


class StoreStart:
    """Starts a request with the blocks read from the store, on the engine thread in one hop: reserve its blocks
    (``Engine.add_prefix_request``, which also loads its host-tier part), copy the verified read slots into
    those past what is local now, count them as cached (``activate_prefix``). The read ran from ``num_local``:
    blocks cached here since are skipped, and a block evicted since breaks the run (nothing from the store is
    used). With no free blocks the request is queued to compute it all. ``why`` says what happened (set before
    the request's first step). The read slots go back to the store tier once the copies are made."""

    def __init__(self, tier: StoreTier, rid: str, request: tuple, num_local: int, hashes: list[bytes],
                 lease: _ReadSlots, broken: str = "") -> None:
        self.tier, self.rid, self.request = tier, rid, request
        self.num_local, self.hashes, self.lease, self.broken = num_local, hashes, lease, broken
        self.loop = asyncio.get_running_loop()
        self.why = f"fetched {len(hashes) * tier.node.layout.block_size} prefix tokens from the store{broken}"

    def __call__(self, engine) -> None:  # the engine thread
        prompt, outputs, params, hold_blocks, kwargs = self.request
        try:
            reservation = engine.add_prefix_request(self.rid, prompt, outputs, params, hold_blocks=hold_blocks,
                                                    **kwargs)
            if reservation is None:
                self.tier.node.metrics.kv_store_fetch_failed("no_free_blocks", len(self.hashes))
                self.why = "the store's blocks found no free blocks here; computing"
                engine.add_request(self.rid, prompt, params, output_token_ids=outputs, hold_blocks=hold_blocks,
                                   **kwargs)
                return
            first, size = reservation.num_local_blocks, self.tier.node.layout.block_size
            skip = first - self.num_local  # < 0: a local block was evicted since the read: the run is broken
            use = 0
            if skip >= 0:
                chain = reservation.block_hashes[first:first + len(self.hashes) - skip]
                use = next((i for i, (a, b) in enumerate(zip(chain, self.hashes[skip:])) if a != b), len(chain))
            if use:
                engine.store.fill(self.lease.slots[skip:skip + use], list(reservation.block_ids[first:first + use]),
                                  self.hashes[skip:skip + use])
            self.tier.node.metrics.kv_store_fetched(use)
            self.why = f"fetched {use * size} prefix tokens from the store{self.broken}"
            engine.activate_prefix(self.rid, (first + use) * size)
        finally:
            self.loop.call_soon_threadsafe(self.lease.release)


class _ReadSlots:
    """Read slots one admission holds: back on the free list once released and no store call uses them."""

    def __init__(self, free: deque[int], count: int) -> None:
        self.free, self.slots = free, [free.popleft() for _ in range(count)]
        self.busy = self.released = False

    def call_ended(self) -> None:
        self.busy = False
        self._give_back()

    def release(self) -> None:
        self.released = True
        self._give_back()

    def _give_back(self) -> None:
        if self.released and not self.busy:
            self.free.extend(self.slots)
            self.slots = []


def _failure(exc: Exception) -> str:
    return "timeout" if isinstance(exc, (CallTimeout, ThreadStuck)) else "failed"
