"""A modelled worker's KV pool: Baton's own ``BlockPool`` (ref counts, LRU of evictable cached blocks, hash ->
block map, stored/removed events) driven over the prompt's block hashes, as the engine's KV cache manager
drives it: reuse the longest cached prefix, allocate the rest, commit each full block once computed, free a
request's blocks tail first (so they are evicted first). No bytes: a block is its id and its hash."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.block_pool import BlockEvent, BlockPool
from kv_transfer.hashing import BlockHash


@dataclass(slots=True)
class Reservation:
    blocks: list[int]  # the request's blocks in order: cached prefix first
    cached: int  # leading blocks that were cached (a prefix hit)
    committed: int  # leading blocks committed under their hash (the hit, then each one computed or pulled)


class KVPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = BlockPool(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    def cached_prefix(self, hashes: Sequence[BlockHash], limit: int | None = None) -> int:
        """Leading blocks of ``hashes`` cached here (at most ``limit``)."""
        return len(self.blocks.longest_cached_prefix(hashes[:limit]))

    def reserve(self, hashes: Sequence[BlockHash], num_blocks: int, *, max_cached: int) -> Reservation | None:
        """Blocks for a request of ``num_blocks``: its longest cached prefix (at most ``max_cached`` blocks) reused,
        the rest allocated; None when the pool cannot hold it now (nothing changes then)."""
        hit = self.blocks.longest_cached_prefix(hashes[:max(min(max_cached, num_blocks), 0)])
        idle_hits = sum(1 for b in hit if self.blocks.ref_count(b) == 0)  # counted as free until touched
        need = num_blocks - len(hit)
        if need > self.blocks.num_free_blocks - idle_hits:
            return None
        self.blocks.touch(hit)
        fresh = self.blocks.allocate(need)
        self.blocks.take_evicted()  # no host tier below this pool: evicted blocks are gone
        return Reservation(blocks=hit + fresh, cached=len(hit), committed=len(hit))

    def pin_prefix(self, hashes: Sequence[BlockHash], max_blocks: int) -> Reservation:
        """Hold the longest cached prefix (at most ``max_blocks``) for a reader (``Engine.hold_cached_prefix``
        under a prefix lease): no block allocated; release it like any reservation."""
        hit = self.blocks.longest_cached_prefix(hashes[:max(max_blocks, 0)])
        self.blocks.touch(hit)
        return Reservation(blocks=hit, cached=len(hit), committed=len(hit))

    def commit(self, reservation: Reservation, hashes: Sequence[BlockHash], upto_blocks: int) -> None:
        """The request's first ``upto_blocks`` blocks are computed (or pulled): publish each full one's hash."""
        end = min(upto_blocks, len(hashes), len(reservation.blocks))
        for i in range(reservation.committed, end):
            self.blocks.commit(reservation.blocks[i], hashes[i])
        reservation.committed = max(reservation.committed, end)

    def release(self, reservation: Reservation) -> None:
        self.blocks.free(reversed(reservation.blocks))
        reservation.blocks = []

    def take_events(self) -> list[BlockEvent]:
        return self.blocks.take_events()

    def check_drained(self) -> None:
        """The pool's own invariants, and that no block is held any more (every request released its blocks)."""
        self.blocks.check_invariants()
        assert self.blocks.num_free_blocks == self.blocks.num_blocks, \
            f"{self.blocks.num_blocks - self.blocks.num_free_blocks} blocks still held"
