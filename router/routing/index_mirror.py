"""An in-memory mirror of the KV block index, fed by the ``{ns}:events`` stream (DESIGN.md "KV index").

With the mirror on (``baton router --index-mirror``) a routing decision reads no Redis at all: the
prompt's chain is walked in this process's memory, with the same answer as ``KVIndex.lookup``'s script
(per worker, its count of leading blocks; the walk stops at the first block nobody holds). Every router
replays the same stream, so several stateless routers agree without talking to each other.

Sync protocol (``MirrorSync``), correct under concurrent writers:

1. note the stream's last id ``L`` (``XREVRANGE + - COUNT 1``);
2. snapshot every live worker's ``{ns}:kv-of:{id}`` set in one MULTI;
3. replay events after ``L``. Each event sets or clears (hash, worker) pairs, or drops a worker: replaying
   an event the snapshot already reflects changes nothing, and events replay in order, so the mirror ends
   equal to the index.

It resyncs (from step 1) when the connection to Redis fails, when the stream was recreated (its last id
went backwards: a Redis restart) or when it fell so far behind that the stream's MAXLEN trimmed events
it had not read (it counts the events it applied against XINFO's ``entries-added`` and ``length``). Until the first sync completes, and while
resyncing after a failure, ``ready`` is False and the directory falls back to ``KVIndex.lookup``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from kv_transfer.redis_index import EVENT_REMOVED, EVENT_STORED, EVENT_WORKER_DOWN, IndexEvent, KVIndex, text

log = logging.getLogger(__name__)


class IndexMirror:
    """Which worker holds which block, in memory. Pure state: no I/O."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}  # block hash -> worker ids
        self._held: dict[str, set[bytes]] = {}  # worker id -> block hashes

    def __len__(self) -> int:
        return len(self._holders)

    def clear(self) -> None:
        self._holders.clear()
        self._held.clear()

    def store(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        held = self._held.setdefault(worker_id, set())
        for h in hashes:
            self._holders.setdefault(h, set()).add(worker_id)
            held.add(h)

    def remove(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        held = self._held.get(worker_id)
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[h]
            if held is not None:
                held.discard(h)

    def drop_worker(self, worker_id: str) -> None:
        self.remove(worker_id, list(self._held.pop(worker_id, ())))

    def apply(self, event: IndexEvent) -> None:
        if event.type == EVENT_STORED:
            self.store(event.worker_id, event.hashes)
        elif event.type == EVENT_REMOVED:
            self.remove(event.worker_id, event.hashes)
        elif event.type == EVENT_WORKER_DOWN:
            self.drop_worker(event.worker_id)
        # worker-up: nothing; a returning worker clears and republishes its blocks as events of their own

    def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Per worker, the number of leading blocks of ``hashes`` it holds (``KVIndex.lookup``'s answer)."""
        counts: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for worker_id in alive:
                counts[worker_id] = i + 1
        return counts


class MirrorSync:
    """Keeps an ``IndexMirror`` equal to the Redis index: snapshot, then tail ``{ns}:events``."""

    def __init__(self, index: KVIndex, redis: Any, *, block_ms: int = 1000, batch: int = 1000,
                 retry_s: float = 1.0) -> None:
        self.index, self._redis = index, redis
        self.mirror = IndexMirror()
        self.ready = False
        self.last_id = "0-0"  # the newest event applied
        self.position = 0  # how many events the stream had ever added up to last_id (XINFO entries-added)
        self.resyncs = 0  # how many full snapshots were taken (the first one included)
        self._block_ms, self._batch, self._retry_s = block_ms, batch, retry_s
        self._task: asyncio.Task | None = None
        self._stopping = False

    def lookup(self, hashes: Sequence[bytes]) -> dict[str, int] | None:
        """The mirror's answer, or None while it is not in sync (ask Redis instead)."""
        return self.mirror.lookup(hashes) if self.ready else None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kv-index-mirror")

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop tailing. The loop also checks a flag between reads: Python 3.11's ``asyncio.wait_for``
        (inside redis-py) can swallow a cancellation that lands as its operation completes."""
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            deadline = asyncio.get_running_loop().time() + timeout_s
            while not task.done() and asyncio.get_running_loop().time() < deadline:
                task.cancel()
                await asyncio.wait([task], timeout=0.1)
            if not task.done():
                log.warning("KV index mirror did not stop within %.1f s", timeout_s)
        self.ready = False

    async def sync(self) -> None:
        """One full snapshot (steps 1-2); the tail replays from the noted id."""
        keys = self.index.keys
        self.last_id, self.position = await self._stream_position()
        worker_ids = sorted(text(w) for w in await self._redis.smembers(keys.workers))
        pipe = self._redis.pipeline(transaction=True)
        for worker_id in worker_ids:
            pipe.smembers(keys.kv_of(worker_id))
        held = await pipe.execute() if worker_ids else []
        self.mirror.clear()
        for worker_id, hexes in zip(worker_ids, held, strict=True):
            self.mirror.store(worker_id, (bytes.fromhex(text(hx)) for hx in hexes))
        self.resyncs += 1

    async def catch_up(self, *, block_ms: int | None = None) -> int:
        """Read and apply the events after ``last_id`` (one batch); returns how many. Resyncs when the
        stream was trimmed past ``last_id`` or recreated."""
        events = await self.index.read_events(self.last_id, count=self._batch, block_ms=block_ms)
        if (len(events) == self._batch or not events) and await self._lost_events():
            log.warning("KV index mirror: events were trimmed or the stream was recreated; resyncing")
            await self.sync()
            return 0
        for event in events:
            self.mirror.apply(event)
            self.last_id = event.stream_id
        self.position += len(events)
        return len(events)

    async def _stream_position(self) -> tuple[str, int]:
        """(the newest event's id, how many events were ever added up to it), read atomically."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.xrevrange(self.index.keys.events, count=1)
        pipe.xinfo_stream(self.index.keys.events)
        newest, info = await pipe.execute(raise_on_error=False)
        if isinstance(info, Exception) or not newest:  # no stream yet
            return "0-0", 0
        return text(newest[0][0]), int(info["entries-added"])

    async def _lost_events(self) -> bool:
        """True when events this mirror has not applied are gone: the stream was recreated (a Redis
        restart: its ids went backwards, or it vanished), or MAXLEN trimmed past this mirror's position."""
        try:
            info = await self._redis.xinfo_stream(self.index.keys.events)
        except Exception as exc:  # noqa: BLE001 - "no such key": the stream is gone
            if "no such key" in str(exc).lower():
                return self.last_id != "0-0"
            raise
        if _id(text(info["last-generated-id"])) < _id(self.last_id):
            return True
        added, length = int(info["entries-added"]), int(info["length"])
        return added < self.position or self.position < added - length

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self.sync()
                self.ready = True
                while not self._stopping:
                    await self.catch_up(block_ms=self._block_ms)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis down or restarted: fall back, retry, resync
                self.ready = False
                log.warning("KV index mirror lost Redis (%r); routing reads the index in Redis until resynced", exc)
                await asyncio.sleep(self._retry_s)


def _id(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)
