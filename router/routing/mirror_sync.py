"""Keeps an ``IndexMirror`` equal to the Redis KV index (version 2: per-holder streams with sequence numbers).

What it follows: the control stream ``{ns}:worker-events`` (worker-up / worker-down) and, for every holder
(each registered worker, and the store), its stream ``{ns}:events:{holder}``, all in one blocking XREAD.

Per-holder protocol, correct under concurrent writers (every write of a holder is one Lua script):

1. resync the holder: in one MULTI read its ``{ns}:kv-of:{holder}`` (block -> best tier), its last sequence
   number and its stream's newest id; the mirror's entries for it become exactly those;
2. apply its stream's entries after that id, each of which must carry the next sequence number. A number
   other than the next one means entries were lost (MAXLEN trimmed them before they were read, or the
   stream was recreated: a re-registered worker after a Redis restart): resync that holder alone (step 1).
   When a read finds nothing new, every holder's last sequence number (one MGET) must be the one applied
   (entries no later entry reveals as missing: a stream emptied outright); a holder's that is not, resyncs.

Control: a worker-up resyncs that worker (a new worker is followed from then on), a worker-down drops it.
A full sync (at start, after the connection failed, or when control entries were lost: the control stream
was trimmed past the mirror or recreated, counted against XINFO's ``entries-added``) notes the control
stream's position, lists the registered workers and resyncs each holder into a fresh mirror, swapped in
whole. Until the first sync completes, and while resyncing after a failure, ``ready`` is False and the
directory falls back to ``KVIndex.lookup``. A mirror that has not heard from Redis for ``stale_after_s`` (Redis
frozen, or cut off by a partition: its socket may stay open for a long time without an error) answers nothing
either: routing must not go on serving holders that may have left since.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence

from kv_transfer.index_schema import EVENT_WORKER_DOWN, EVENT_WORKER_UP, IndexEvent, TieredLookup
from kv_transfer.redis_index import KVIndex
from router.routing.chain_match import ChainMatch
from router.routing.index_mirror import IndexMirror

log = logging.getLogger(__name__)

# (block, holder) entries past which the mirror is dropped and lookups go to Redis: ~150 B each (docs/benchmarks.md,
# "Index and router at 1,000 workers"), so about 2.4 GB
DEFAULT_MIRROR_MAX_ENTRIES = 16_000_000


class MirrorSync:
    """Keeps ``mirror`` equal to the index: per-holder snapshots, then one tail of every holder's stream."""

    def __init__(self, index: KVIndex, *, block_ms: int = 1000, batch: int = 1000, retry_s: float = 1.0,
                 max_entries: int = DEFAULT_MIRROR_MAX_ENTRIES, stale_after_s: float | None = None) -> None:
        """``max_entries``: past this many (block, holder) entries the mirror gives up (``over_limit``): its
        memory is freed and lookups go to Redis, for good (a warning says so; restart with a larger limit).
        ``stale_after_s``: lookups get no answer while Redis last answered the tail longer ago than this
        (default: one blocking read, ``block_ms``, plus a second)."""
        self.index = index
        self.stale_after_s = block_ms / 1000 + 1.0 if stale_after_s is None else stale_after_s
        self._heard_s = float("-inf")  # monotonic: when Redis last answered a sync or a read
        self.max_entries = max_entries
        self.over_limit = False
        self.mirror = IndexMirror()
        self.ready = False
        self.control_id = "0-0"  # the newest control entry applied
        self.position = 0  # how many entries the control stream had ever added up to control_id
        self.resyncs = 0  # full syncs (the first one included)
        self.holder_resyncs: Counter[str] = Counter()  # per-holder resyncs after a sequence gap or worker-up
        self._cursors: dict[str, str] = {}  # followed holder -> its stream's id last read
        self._seqs: dict[str, int] = {}  # followed holder -> its last sequence number applied
        self._block_ms, self._batch, self._retry_s = block_ms, batch, retry_s
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def in_sync(self) -> bool:
        """Synced, and Redis answered within ``stale_after_s``: the mirror's answers are the index's."""
        return self.ready and time.monotonic() - self._heard_s <= self.stale_after_s

    @property
    def followed(self) -> list[str]:
        """The holders whose streams this mirror follows (sorted)."""
        return sorted(self._cursors)

    def lookup(self, hashes: Sequence[bytes]) -> dict[str, int] | None:
        """The mirror's KV-pool answer, or None while it is not in sync (ask Redis instead)."""
        return self.mirror.lookup(hashes) if self.in_sync else None

    def lookup_tiers(self, hashes: Sequence[bytes]) -> TieredLookup | None:
        """The mirror's answer per tier, or None while it is not in sync."""
        return self.mirror.lookup_tiers(hashes) if self.in_sync else None

    def store_run(self, hashes: Sequence[bytes], holder: str) -> int | None:
        """``IndexMirror.store_run``, or None while the mirror is not in sync."""
        return self.mirror.store_run(hashes, holder) if self.in_sync else None

    def match(self, hashes: Sequence[bytes]) -> ChainMatch | None:
        """The mirror's walk (``IndexMirror.match``), or None while it is not in sync."""
        return self.mirror.match(hashes) if self.in_sync else None

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
        """A full sync into a fresh mirror, swapped in when complete (lookups never see half of one)."""
        control_id, position = await self.index.control_position()
        mirror, cursors, seqs = IndexMirror(), {}, {}
        for holder in await self.index.list_holders():
            state = await self.index.holder_state(holder)
            mirror.replace(holder, state.holdings)
            cursors[holder], seqs[holder] = state.stream_id, state.seq
        self.mirror, self._cursors, self._seqs = mirror, cursors, seqs
        self.control_id, self.position = control_id, position
        self.resyncs += 1
        self._heard_s = time.monotonic()

    async def resync_holder(self, holder: str) -> None:
        """Re-read one holder (step 1) and follow its stream from there."""
        state = await self.index.holder_state(holder)
        self.mirror.replace(holder, state.holdings)
        self._cursors[holder], self._seqs[holder] = state.stream_id, state.seq
        self.holder_resyncs[holder] += 1

    async def catch_up(self, *, block_ms: int | None = None) -> int:
        """Read and apply one batch of the control stream and every followed holder's stream; returns how
        many entries were applied. Resyncs what lost entries (a holder, or everything for control)."""
        batch = await self.index.read_events(self.control_id, dict(self._cursors), count=self._batch,
                                             block_ms=block_ms)
        self._heard_s = time.monotonic()
        idle = not batch.control and not any(batch.holders.values())
        if (batch.control or idle) and await self._lost_control(len(batch.control)):
            log.warning("KV index mirror: worker events were trimmed or the stream was recreated; resyncing")
            await self.sync()
            return 0
        if idle:
            await self._check_seqs()
            return 0
        applied = 0
        for event in batch.control:
            await self._apply_control(event)
            applied += 1
        for holder, events in batch.holders.items():
            applied += await self._apply_holder(holder, events)
        return applied

    async def _apply_control(self, event: IndexEvent) -> None:
        if event.type == EVENT_WORKER_UP:
            await self.resync_holder(event.worker_id)
        elif event.type == EVENT_WORKER_DOWN:
            self.mirror.drop(event.worker_id)
            self._cursors.pop(event.worker_id, None)
            self._seqs.pop(event.worker_id, None)
        self.control_id = event.stream_id
        self.position += 1

    async def _apply_holder(self, holder: str, events: list[IndexEvent]) -> int:
        applied = 0
        for event in events:
            cursor = self._cursors.get(holder)
            if cursor is None:  # dropped by a worker-down of this batch
                break
            if _id(event.stream_id) <= _id(cursor):  # a resync of this batch already reflects it
                continue
            if event.seq != self._seqs[holder] + 1:
                log.warning("KV index mirror: %s's events jump from seq %d to %s; resyncing it", holder,
                            self._seqs[holder], event.seq)
                await self.resync_holder(holder)
                break
            self.mirror.apply(event)
            self._cursors[holder], self._seqs[holder] = event.stream_id, event.seq
            applied += 1
        return applied

    async def _check_seqs(self) -> None:
        """With nothing left to read, every followed holder's last sequence number must be the one applied:
        one that is not lost its newest entries (a stream emptied outright, which no later entry reveals)."""
        for holder, seq in (await self.index.holder_seqs(self.followed)).items():
            if holder in self._seqs and seq != self._seqs[holder]:
                log.warning("KV index mirror: %s is at seq %d, the mirror at %d; resyncing it", holder, seq,
                            self._seqs[holder])
                await self.resync_holder(holder)

    async def _lost_control(self, num_read: int) -> bool:
        """True when control entries this mirror has not applied are gone: the stream was recreated (a Redis
        restart: it vanished, its ids went backwards, or it holds fewer entries than this mirror read), or
        MAXLEN trimmed past this mirror's position. ``num_read``: entries just read, not yet applied."""
        info = await self.index.control_info()
        if info is None:
            return self.control_id != "0-0"
        last_id, added, length = info
        if _id(last_id) < _id(self.control_id):
            return True
        return added < self.position + num_read or self.position < added - length

    def within_limit(self) -> bool:
        """False, and the mirror emptied for good, once it holds more than ``max_entries`` entries."""
        if self.mirror.num_entries <= self.max_entries:
            return True
        log.warning("KV index mirror: %d entries, more than --index-mirror-max-entries %d; dropping it, routing "
                    "reads the index in Redis from now on", self.mirror.num_entries, self.max_entries)
        self.over_limit, self.ready = True, False
        self.mirror = IndexMirror()
        return False

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self.sync()
                if not self.within_limit():
                    return
                self.ready = True
                while not self._stopping:
                    await self.catch_up(block_ms=self._block_ms)
                    if not self.within_limit():
                        return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis down or restarted: fall back, retry, resync
                self.ready = False
                log.warning("KV index mirror lost Redis (%r); routing reads the index in Redis until resynced", exc)
                await asyncio.sleep(self._retry_s)


def _id(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)
