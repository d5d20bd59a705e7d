"""The Mooncake-style KV block index in Redis, version 2 (DESIGN.md "KV index and registry in Redis"; the
changes from DESIGN's text are in docs/architecture.md "KV index v2").

Workers (and, later, the shared store) publish which full blocks they hold in which tier; routers ask, in one
round trip, how many leading blocks of a prompt's hash chain each worker holds in each tier. Key layout (all
under a namespace ``ns``, hashes as lowercase hex; names in ``index_schema.RedisKeys``)::

    {ns}:kv:{hash_hex}        HASH   field worker id -> its best tier ("gpu" | "cpu"); field "store" -> "store"
    {ns}:kv-of:{holder}       HASH   hash hex -> the holder's best tier (a worker's resync; cleanup when it dies)
    {ns}:events:{holder}      STREAM capped; the holder's moves, each with fields seq (the holder's sequence,
                                     1, 2, ...), type (stored|removed|cleared), tier (stored), hashes
    {ns}:events-seq:{holder}  STRING the holder's last seq
    {ns}:worker-events        STREAM capped; type (worker-up|worker-down), worker, and role + grpc_address +
                                     reason | reason: tells readers which holders' streams to follow

A holder is a worker id or ``store``. The registry (``kv_transfer.registry``) owns the worker keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_transfer import index_lua
from kv_transfer.index_schema import (  # noqa: F401 - re-exported: callers name the schema through this module
    DEFAULT_EVENTS_MAXLEN, EVENT_CLEARED, EVENT_REMOVED, EVENT_STORED, EVENT_WORKER_DOWN, EVENT_WORKER_UP, STORE,
    TIER_STORE, WORKER_TIERS, IndexEvent, RedisKeys, TieredLookup, parse_event, text,
)

TIERS = WORKER_TIERS  # the tiers a worker publishes


class KVIndexError(RuntimeError):
    """The KV index refused a write."""


class NotRegistered(KVIndexError):
    """A worker that is not in ``{ns}:workers`` published blocks: nothing was written (it republishes its whole
    cache once its heartbeat registers it again)."""


@dataclass(frozen=True, slots=True)
class HolderState:
    """One holder's entries and stream position, read atomically (a mirror's per-holder resync)."""

    holdings: dict[bytes, str]  # block hash -> best tier
    seq: int  # the last sequence number written (0: none since its keys were created)
    stream_id: str  # the newest entry's id ("0-0": none); a reader continues after it


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One read of the control stream and the followed holders' streams."""

    control: list[IndexEvent] = field(default_factory=list)
    holders: dict[str, list[IndexEvent]] = field(default_factory=dict)


class KVIndex:
    """Which worker holds which KV block in which tier: batched writes by workers, one-round-trip lookups."""

    def __init__(self, redis: Any, ns: str = "baton", *, events_maxlen: int = DEFAULT_EVENTS_MAXLEN) -> None:
        self._redis = redis
        self.keys = RedisKeys(ns)
        self.events_maxlen = events_maxlen
        self._lookup = redis.register_script(index_lua.LOOKUP)
        self._publish = redis.register_script(index_lua.PUBLISH)
        self._drop = redis.register_script(index_lua.DROP_WORKER)

    async def publish(
        self, worker_id: str, stored: Sequence[bytes], removed: Sequence[bytes], tier: str = "gpu"
    ) -> None:
        """Record a batch of blocks whose best tier is now ``tier`` (``stored``) and blocks gone from every tier
        of the worker (``removed``), in one round trip. Removals apply after stores, so a hash in both lists
        ends up absent (under-reporting a block costs a cache miss; over-reporting sends work where it is not).
        """
        await self.publish_tiers(worker_id, {tier: stored}, removed)

    async def publish_tiers(
        self, worker_id: str, stored: Mapping[str, Sequence[bytes]], removed: Sequence[bytes]
    ) -> int | None:
        """``publish`` for several tiers at once: ``stored`` maps a tier to the blocks whose best tier it now
        is. One round trip, one stream entry per non-empty list. Returns the worker's last sequence number
        (None: nothing to write). Raises ``NotRegistered`` when the worker is not in ``{ns}:workers``."""
        bad = set(stored) - set(TIERS)
        if bad:
            raise ValueError(f"tier must be one of {TIERS}, got {sorted(bad)!r}")
        if worker_id == STORE:
            raise ValueError(f"{STORE!r} is the store's holder id, not a worker's")
        seq = await self._write(worker_id, [(t, stored[t]) for t in TIERS if stored.get(t)], removed, True)
        return seq

    async def publish_store(self, stored: Sequence[bytes], removed: Sequence[bytes]) -> int | None:
        """The shared store gained (``stored``) or lost (``removed``) blocks: its field ``store`` in
        ``{ns}:kv:{hash}``, its own stream and sequence (any worker writes them: ``worker/store_tier.py``)."""
        return await self._write(STORE, [(TIER_STORE, stored)] if stored else [], removed, False)

    async def scan_store(self, cursor: int, count: int) -> tuple[int, list[bytes]]:
        """One HSCAN step over the hashes the index says the store holds: (next cursor, 0 when done; hashes)."""
        cursor, found = await self._redis.hscan(self.keys.kv_of(STORE), cursor, count=count)
        return int(cursor), [bytes.fromhex(text(h)) for h in found]

    async def _write(self, holder: str, stored: list[tuple[str, Sequence[bytes]]], removed: Sequence[bytes],
                     registered_only: bool) -> int | None:
        ops = [(tier, " ".join(h.hex() for h in hashes)) for tier, hashes in stored]
        if removed:
            ops.append((EVENT_REMOVED, " ".join(h.hex() for h in removed)))
        if not ops:
            return None
        k = self.keys
        args = [holder, k.kv_prefix, self.events_maxlen, "1" if registered_only else "0"]
        args += [value for op in ops for value in op]
        seq = await self._publish(keys=[k.kv_of(holder), k.events(holder), k.events_seq(holder), k.workers],
                                  args=args)
        if seq is None:
            raise NotRegistered(f"worker_id={holder} is not registered; its blocks were not indexed")
        return int(seq)

    async def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Per worker, the number of leading blocks of ``hashes`` (a prompt's chain) in its KV pool.

        One round trip. Workers with no leading block are absent; the walk stops at the first block no
        holder continues. Callers intersect the result with the live, non-draining workers.
        """
        return dict((await self.lookup_tiers(hashes)).gpu)

    async def lookup_tiers(self, hashes: Sequence[bytes]) -> TieredLookup:
        """Per worker its leading blocks in its KV pool and in its pool or host tier, plus the store's (one
        round trip; ``index_schema.walk_chain`` is the same walk in Python)."""
        if not hashes:
            return TieredLookup()
        flat = await self._lookup(keys=[self.keys.kv(h) for h in hashes])
        gpu, local = {}, {}
        for i in range(1, len(flat), 3):
            worker_id, num_gpu, num_any = text(flat[i]), int(flat[i + 1]), int(flat[i + 2])
            local[worker_id] = num_any
            if num_gpu:
                gpu[worker_id] = num_gpu
        return TieredLookup(gpu=gpu, gpu_or_cpu=local, store=int(flat[0]))

    async def remove_worker(self, worker_id: str) -> int:
        """Drop every index entry of ``worker_id`` (its registry keys stay; a 'cleared' entry on its stream);
        returns how many."""
        return int(await self.drop_worker(worker_id, "index"))

    async def drop_worker(self, worker_id: str, mode: str) -> int:
        """Atomic cleanup shared with the registry; ``mode`` is "index", "deregister" or "expired"."""
        k = self.keys
        keys = [k.worker(worker_id), k.load(worker_id), k.workers, k.kv_of(worker_id), k.worker_events,
                k.draining, k.events(worker_id), k.events_seq(worker_id)]
        return int(await self._drop(keys=keys, args=[worker_id, mode, k.kv_prefix, self.events_maxlen]))

    def add_worker_event(self, pipe: Any, event_type: str, worker_id: str, **fields: str) -> None:
        """Queue one XADD to the control stream on ``pipe`` (capped, approximate MAXLEN)."""
        entry = {"type": event_type, "worker": worker_id, **fields}
        pipe.xadd(self.keys.worker_events, entry, maxlen=self.events_maxlen, approximate=True)

    async def has_events(self) -> bool:
        """Whether the control stream exists: it does from the first registration on, until Redis loses
        its data (a restart without persistence), which is how a listing that came back empty tells a
        restarted Redis from workers that all left."""
        return bool(await self._redis.exists(self.keys.worker_events))

    async def holder_state(self, holder: str) -> HolderState:
        """A holder's entries, last sequence number and newest stream id, in one MULTI (a consistent cut:
        every write of a holder is one script)."""
        k = self.keys
        pipe = self._redis.pipeline(transaction=True)
        pipe.hgetall(k.kv_of(holder))
        pipe.get(k.events_seq(holder))
        pipe.xrevrange(k.events(holder), count=1)
        held, seq, newest = await pipe.execute()
        holdings = {bytes.fromhex(text(hx)): text(tier) for hx, tier in held.items()}
        return HolderState(holdings, int(seq or 0), text(newest[0][0]) if newest else "0-0")

    async def holder_seqs(self, holders: Sequence[str]) -> dict[str, int]:
        """Each holder's last sequence number (0: none), in one round trip."""
        if not holders:
            return {}
        values = await self._redis.mget([self.keys.events_seq(h) for h in holders])
        return {h: int(v or 0) for h, v in zip(holders, values, strict=True)}

    async def control_position(self) -> tuple[str, int]:
        """(the control stream's newest id, how many entries it ever added up to it), read atomically."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.xrevrange(self.keys.worker_events, count=1)
        pipe.xinfo_stream(self.keys.worker_events)
        newest, info = await pipe.execute(raise_on_error=False)
        if isinstance(info, Exception) or not newest:  # no stream yet
            return "0-0", 0
        return text(newest[0][0]), int(info["entries-added"])

    async def control_info(self) -> tuple[str, int, int] | None:
        """(last-generated-id, entries-added, length) of the control stream; None when it does not exist."""
        try:
            info = await self._redis.xinfo_stream(self.keys.worker_events)
        except Exception as exc:  # noqa: BLE001 - "no such key": the stream is gone
            if "no such key" in str(exc).lower():
                return None
            raise
        return text(info["last-generated-id"]), int(info["entries-added"]), int(info["length"])

    async def list_holders(self) -> list[str]:
        """Every registered worker id (sorted), then the store: the holders whose streams a mirror follows."""
        return sorted(text(w) for w in await self._redis.smembers(self.keys.workers)) + [STORE]

    async def read_events(
        self, control_after: str, holders_after: Mapping[str, str], *, count: int = 1000,
        block_ms: int | None = None,
    ) -> EventBatch:
        """One XREAD of the control stream after ``control_after`` and each holder's stream after its id
        (``stream_id`` of the last entry read; "0-0" for all)."""
        k = self.keys
        streams = {k.worker_events: control_after, **{k.events(h): after for h, after in holders_after.items()}}
        holder_of = {k.events(h): h for h in holders_after}
        reply = await self._redis.xread(streams, count=count, block=block_ms)
        batch = EventBatch()
        for key, entries in _stream_entries(reply):
            holder = holder_of.get(key)
            if holder is None:
                batch.control.extend(parse_event(i, f) for i, f in entries)
            else:
                batch.holders[holder] = [parse_event(i, f, holder) for i, f in entries]
        return batch


def _stream_entries(reply: Any) -> list[tuple[str, list[Any]]]:
    """XREAD's reply as (stream key, entries) pairs, for RESP2 lists and RESP3 maps alike."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [(text(key), value[0]) for key, value in reply.items()]  # RESP3: {key: [entries]}
    return [(text(key), entries) for key, entries in reply]
