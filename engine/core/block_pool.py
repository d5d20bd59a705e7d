"""BlockPool: the only place that changes KV block ref counts (STYLE.md rule 7).

Free blocks live in two places: ``_free`` (never cached, or whose hash was dropped) is used first;
``_evictable`` holds blocks whose ref count reached zero but still carry a committed hash, in LRU
order, so a later request with the same prefix can take them back. Allocation evicts from the LRU
head only when no plain free block is left. Every commit and eviction is recorded as a ``BlockEvent``
so a shell can publish the index to Redis.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from kv_transfer.hashing import BlockHash


class BlockEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


TIER_POOL, TIER_HOST = "gpu", "cpu"  # the index's tier names: the KV pool (whatever its device), the host tier


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """A block hash entered (STORED) or left (REMOVED) one tier of this engine. A hash may be in both tiers at
    once (the host tier keeps a copy of what it gave back); ``block_id`` is the block's id in its tier."""

    kind: BlockEventKind
    block_hash: BlockHash
    block_id: int
    tier: str = TIER_POOL


class BlockPool:
    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._cached: dict[BlockHash, int] = {}
        self._events: list[BlockEvent] = []
        self._evicted: list[tuple[BlockHash, int]] = []  # (hash, block) evicted by allocate, until taken
        self.num_cache_queries = 0
        self.num_cache_hits = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (plain free plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hashes[block_id]

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding ``block_hash``, if it is cached (in use or evictable)."""
        return self._cached.get(block_hash)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the pool can serve now (to republish the index after Redis lost it)."""
        return list(self._cached)

    def longest_cached_prefix(self, hashes: Iterable[BlockHash]) -> list[int]:
        """Block ids of the leading run of ``hashes`` that is cached."""
        found: list[int] = []
        for block_hash in hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    # ---- ref counting --------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` fresh blocks (ref count 1); the caller checked ``num_free_blocks``."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"allocate({num_blocks}) with only {self.num_free_blocks} free blocks")
        out = []
        for _ in range(num_blocks):
            block_id = self._free.popleft() if self._free else self._evict_lru(keep=True)
            self._ref_counts[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Share cached blocks with one more request (a prefix-cache hit)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; pass a request's blocks tail first so they evict first."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                if self._hashes[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None

    # ---- prefix cache --------------------------------------------------------------------
    def commit(self, block_id: int, block_hash: BlockHash) -> bool:
        """Publish a full, computed block under its hash; False if caching is off or the hash is taken."""
        if self._ref_counts[block_id] == 0:
            raise RuntimeError(f"commit of block {block_id}, which no request holds")
        if not self.enable_caching or block_hash in self._cached or self._hashes[block_id] is not None:
            return False
        self._hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        self._events.append(BlockEvent(BlockEventKind.STORED, block_hash, block_id))
        return True

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.num_cache_queries += num_queried
        self.num_cache_hits += num_hit

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached block (used blocks keep their hashes)."""
        while self._evictable:
            self._free.append(self._evict_lru())

    def take_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    def take_evicted(self) -> list[tuple[BlockHash, int]]:
        """(hash, block) of each cached block ``allocate`` evicted since the last call: its bytes are still
        there until the block's new owner writes it (a host tier copies them down first)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def _evict_lru(self, keep: bool = False) -> int:
        block_id, _ = self._evictable.popitem(last=False)
        block_hash = self._hashes[block_id]
        self._hashes[block_id] = None
        del self._cached[block_hash]
        self._events.append(BlockEvent(BlockEventKind.REMOVED, block_hash, block_id))
        if keep:
            self._evicted.append((block_hash, block_id))
        return block_id

    # ---- invariants ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's books do not balance (tests call this after every scenario)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is twice in the free queue"
        assert not free & evictable, "a block is both free and evictable"
        used = [b for b, count in enumerate(self._ref_counts) if count > 0]
        assert all(count >= 0 for count in self._ref_counts), "negative ref count"
        assert len(used) + len(free) + len(evictable) == self.num_blocks, "free + used != total"
        assert not (free | evictable) & set(used), "a used block is on a free list"
        assert all(self._hashes[b] is None for b in free), "a plain free block still carries a hash"
        assert all(self._hashes[b] is not None for b in evictable), "an evictable block has no hash"
        for block_hash, block_id in self._cached.items():
            assert self._hashes[block_id] == block_hash, f"hash map out of sync at block {block_id}"
        assert sum(h is not None for h in self._hashes) == len(self._cached), "hash count mismatch"
