"""Publishes the engine's block events (stored / removed) to the Redis KV index, batched."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.block_pool import TIER_POOL, BlockEventKind
from kv_transfer.hashing import BlockHash

if TYPE_CHECKING:
    from worker.node import WorkerNode


class IndexPublisher:
    def __init__(self, node: WorkerNode) -> None:
        self.node = node
        self._pending: dict[BlockHash, bool] = {}  # hash -> stored (True) or removed (False); last event wins

    async def publish_pending(self) -> None:
        """One pipeline for everything since the last call; kept for the next call if Redis fails."""
        events = await self.node.async_engine.call(lambda e: e.take_block_events())
        for event in events:
            if event.tier != TIER_POOL:
                continue  # the host tier's events reach the index with the index's next version (issue 22)
            self._pending[event.block_hash] = event.kind is BlockEventKind.STORED
        if not self._pending:
            return
        stored = [h for h, is_stored in self._pending.items() if is_stored]
        removed = [h for h, is_stored in self._pending.items() if not is_stored]
        await self.node.registry.index.publish(self.node.worker_id, stored, removed)
        self._pending.clear()

    async def republish_all(self) -> None:
        """After Redis lost this worker's entries (restart, pruning): publish the whole cache again."""
        hashes = await self.node.async_engine.call(lambda e: e.kv_cache_manager.pool.cached_hashes())
        self._pending.clear()
        await self.node.registry.index.publish(self.node.worker_id, hashes, [])
