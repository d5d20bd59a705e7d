"""An in-memory mirror of the KV block index (DESIGN.md "KV index"; version 2 in docs/architecture.md).

With the mirror on (``baton router --index-mirror``) a routing decision reads no Redis at all: the prompt's
chain is walked in this process's memory with ``index_schema.walk_chain``, the same walk as the index's Lua
script, over the same state: per block, each holder's best tier. ``router.routing.mirror_sync`` keeps it equal
to Redis from the per-holder event streams; this class is pure state, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kv_transfer.index_schema import (
    EVENT_CLEARED, EVENT_REMOVED, EVENT_STORED, EVENT_WORKER_DOWN, IndexEvent, TieredLookup, walk_chain,
)


class IndexMirror:
    """Which holder (worker or the store) holds which block in which tier, in memory."""

    def __init__(self) -> None:
        self._holders: dict[bytes, dict[str, str]] = {}  # block hash -> {holder: best tier}
        self._held: dict[str, set[bytes]] = {}  # holder -> block hashes

    def __len__(self) -> int:
        return len(self._holders)

    def clear(self) -> None:
        self._holders.clear()
        self._held.clear()

    def holders(self) -> list[str]:
        """Holders with at least one block, sorted."""
        return sorted(h for h, held in self._held.items() if held)

    def held(self, holder: str) -> dict[bytes, str]:
        """The holder's blocks and their best tiers (what ``{ns}:kv-of:{holder}`` holds in Redis)."""
        return {h: self._holders[h][holder] for h in self._held.get(holder, ())}

    def store(self, holder: str, hashes: Iterable[bytes], tier: str = "gpu") -> None:
        """The blocks' best tier on ``holder`` is now ``tier``."""
        held = self._held.setdefault(holder, set())
        for h in hashes:
            self._holders.setdefault(h, {})[holder] = tier
            held.add(h)

    def remove(self, holder: str, hashes: Iterable[bytes]) -> None:
        held = self._held.get(holder)
        for h in hashes:
            tiers = self._holders.get(h)
            if tiers is not None:
                tiers.pop(holder, None)
                if not tiers:
                    del self._holders[h]
            if held is not None:
                held.discard(h)

    def drop(self, holder: str) -> None:
        """Forget every block of ``holder``."""
        self.remove(holder, list(self._held.pop(holder, ())))

    def replace(self, holder: str, holdings: Mapping[bytes, str]) -> None:
        """The holder's blocks are exactly ``holdings`` (a resync from its ``{ns}:kv-of:{holder}``)."""
        self.drop(holder)
        for block_hash, tier in holdings.items():
            self.store(holder, (block_hash,), tier)

    def apply(self, event: IndexEvent) -> None:
        """A holder's stream entry (sequence numbers are checked by the caller)."""
        if event.type == EVENT_STORED:
            self.store(event.worker_id, event.hashes, event.tier or "gpu")
        elif event.type == EVENT_REMOVED:
            self.remove(event.worker_id, event.hashes)
        elif event.type in (EVENT_CLEARED, EVENT_WORKER_DOWN):
            self.drop(event.worker_id)

    def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Per worker, its leading blocks of ``hashes`` in its KV pool (``KVIndex.lookup``'s answer)."""
        return dict(self.lookup_tiers(hashes).gpu)

    def lookup_tiers(self, hashes: Sequence[bytes]) -> TieredLookup:
        """``KVIndex.lookup_tiers``'s answer, from memory."""
        return walk_chain(self._holders.get(h) for h in hashes)
