"""Publishes the engine's block events to the Redis KV index, batched, as each block's best tier.

The engine reports moves per tier (``BlockEvent.tier``: ``gpu`` = its KV pool, ``cpu`` = its host tier); a
block may sit in both at once (the host tier keeps a copy of what it gave back up). The index keeps one tier
per (block, worker), the best one (gpu over cpu), so ``TierBook`` remembers, per block, the tiers the engine
holds it in and the tier the index was last told: a block leaving its pool falls back to ``cpu`` when the
host tier still holds it, and a move that does not change the best tier publishes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.core.block_pool import TIER_HOST, TIER_POOL, BlockEvent, BlockEventKind
from kv_transfer.hashing import BlockHash

if TYPE_CHECKING:
    from worker.engine_seam import WorkerEngine

TIER_ORDER = (TIER_POOL, TIER_HOST)  # best first


@dataclass(frozen=True, slots=True)
class IndexUpdate:
    """What the index must be told: blocks whose best tier is now ``tier`` (per tier), blocks gone."""

    stored: dict[str, list[BlockHash]] = field(default_factory=dict)
    removed: list[BlockHash] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.removed) or any(self.stored.values())


class TierBook:
    """Per block hash: the engine's tiers holding it (from its events) and the best tier last published.
    Pure state, no I/O."""

    def __init__(self) -> None:
        self._tiers: dict[BlockHash, set[str]] = {}  # the engine's holdings, as its events say
        self._published: dict[BlockHash, str] = {}  # what the index holds for this worker
        self._dirty: set[BlockHash] = set()  # hashes whose tiers changed since the last publish

    def apply(self, event: BlockEvent) -> None:
        if event.tier not in TIER_ORDER:
            raise ValueError(f"block event with unknown tier {event.tier!r}")
        tiers = self._tiers.setdefault(event.block_hash, set())
        if event.kind is BlockEventKind.STORED:
            tiers.add(event.tier)
        else:
            tiers.discard(event.tier)
        if not tiers:
            del self._tiers[event.block_hash]
        self._dirty.add(event.block_hash)

    def reset(self, holdings: Mapping[str, Iterable[BlockHash]]) -> None:
        """The engine holds exactly ``holdings`` (tier -> hashes) and the index holds nothing of this worker."""
        self._tiers, self._published = {}, {}
        for tier, hashes in holdings.items():
            for block_hash in hashes:
                self._tiers.setdefault(block_hash, set()).add(tier)
        self._dirty = set(self._tiers)

    def best(self, block_hash: BlockHash) -> str | None:
        tiers = self._tiers.get(block_hash, ())
        return next((tier for tier in TIER_ORDER if tier in tiers), None)

    def pending(self) -> IndexUpdate:
        """The differences between the engine's best tiers and the published ones."""
        update = IndexUpdate()
        for block_hash in self._dirty:
            best = self.best(block_hash)
            if best == self._published.get(block_hash):
                continue
            if best is None:
                update.removed.append(block_hash)
            else:
                update.stored.setdefault(best, []).append(block_hash)
        return update

    def mark_published(self, update: IndexUpdate) -> None:
        """``update`` reached the index; nothing else is pending (the caller held the book meanwhile)."""
        for tier, hashes in update.stored.items():
            self._published.update((h, tier) for h in hashes)
        for block_hash in update.removed:
            self._published.pop(block_hash, None)
        self._dirty.clear()


class IndexPublisher:
    """Feeds ``index`` (``kv_transfer.index.KVIndex``) from an engine's block events, as worker ``worker_id()``."""

    def __init__(self, seam: WorkerEngine, index: Any, worker_id: Callable[[], str]) -> None:
        self.seam, self.index, self.worker_id = seam, index, worker_id
        self.book = TierBook()
        self._lock = asyncio.Lock()  # the housekeeping loop and the heartbeat's republish never interleave

    async def publish_pending(self) -> None:
        """One round trip for everything since the last call; kept for the next call if Redis fails (or the
        worker is not registered: it republishes everything once registered again)."""
        async with self._lock:
            events = await self.seam.take_block_events()
            for event in events:
                self.book.apply(event)
            await self._publish()

    async def republish_all(self) -> None:
        """After Redis lost this worker's entries (restart, pruning): publish the whole cache again. The
        engine's holdings and its unread events are taken together; the holdings supersede those events."""
        async with self._lock:
            self.book.reset(await self.seam.holdings())
            await self._publish()

    async def _publish(self) -> None:
        update = self.book.pending()
        if update:
            await self.index.publish_tiers(self.worker_id(), update.stored, update.removed)
        self.book.mark_published(update)
