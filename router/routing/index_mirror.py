"""An in-memory mirror of the KV block index (DESIGN.md "KV index"; version 2 in docs/architecture.md).

With the mirror on (``baton router --index-mirror``) a routing decision reads no Redis at all: the prompt's
chain is walked in this process's memory with ``index_schema.walk_sets``, the same walk as the index's Lua
script, over the same state: per block, each holder's best tier. ``router.routing.mirror_sync`` keeps it equal
to Redis from the per-holder event streams; this class is pure state, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence, Set

from kv_transfer.index_schema import (
    EVENT_CLEARED, EVENT_REMOVED, EVENT_STORED, EVENT_WORKER_DOWN, TIER_GPU, IndexEvent, TieredLookup, walk_sets,
)

_NONE: dict[str, str] = {}


class IndexMirror:
    """Which holder (worker or the store) holds which block in which tier, in memory: per block the set of its
    holders and, apart, the holders that hold it outside a KV pool (``walk_sets``'s shape: most blocks are in
    KV pools only, and the walk intersects sets)."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}  # block hash -> holders
        self._off_gpu: dict[bytes, dict[str, str]] = {}  # block hash -> {holder: tier} for tiers other than gpu
        self._held: dict[str, set[bytes]] = {}  # holder -> block hashes

    def __len__(self) -> int:
        return len(self._holders)

    def clear(self) -> None:
        self._holders.clear()
        self._off_gpu.clear()
        self._held.clear()

    def holders(self) -> list[str]:
        """Holders with at least one block, sorted."""
        return sorted(h for h, held in self._held.items() if held)

    def held(self, holder: str) -> dict[bytes, str]:
        """The holder's blocks and their best tiers (what ``{ns}:kv-of:{holder}`` holds in Redis)."""
        return {h: self._off_gpu.get(h, _NONE).get(holder, TIER_GPU) for h in self._held.get(holder, ())}

    def store(self, holder: str, hashes: Iterable[bytes], tier: str = TIER_GPU) -> None:
        """The blocks' best tier on ``holder`` is now ``tier``."""
        held = self._held.setdefault(holder, set())
        for h in hashes:
            self._holders.setdefault(h, set()).add(holder)
            if tier != TIER_GPU:
                self._off_gpu.setdefault(h, {})[holder] = tier
            else:
                self._discard_off_gpu(h, holder)
            held.add(h)

    def remove(self, holder: str, hashes: Iterable[bytes]) -> None:
        held = self._held.get(holder)
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(holder)
                if not holders:
                    del self._holders[h]
            self._discard_off_gpu(h, holder)
            if held is not None:
                held.discard(h)

    def _discard_off_gpu(self, block_hash: bytes, holder: str) -> None:
        off = self._off_gpu.get(block_hash)
        if off is not None and off.pop(holder, None) is not None and not off:
            del self._off_gpu[block_hash]

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
        return walk_sets(self._blocks(hashes))

    def _blocks(self, hashes: Sequence[bytes]) -> Iterator[tuple[set[str], Set[str] | None] | None]:
        holders, off_gpu = self._holders, self._off_gpu
        for h in hashes:
            block_holders = holders.get(h)
            if block_holders is None:
                yield None
                return
            off = off_gpu.get(h)
            yield block_holders, (off.keys() if off else None)
