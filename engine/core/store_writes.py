"""StoreWrites: the books of blocks on their way to the shared store tier (core: no torch, no I/O;
docs/architecture.md "Store tier").

Which blocks: a cached block leaving this worker's tiers for good (the host tier's LRU drops it; without a host
tier, or when every host block is pinned, the KV pool evicts it) and, with ``write_through`` (``--kv-store-write
through``, a prefill worker's default), every block the pool commits, as it commits it. A block is written once
while the store is known to hold it (``stored``: what this worker wrote or fetched, forgotten when the store is
found to have lost it), so under write-through the eviction finds it written already: write-through wins, and
eviction writes only what write-through could not (no free slot then, or the store lost it since).

The bytes must be read before the block holding them is reused: ``offer`` queues a copy of the source block
(the pool's or the host tier's) into a free slot of the store buffer, and the runtime makes the queued copies
(``take_copies``) before the host tier's copies and before anything else writes into those blocks, as the host
tier's own are made. The copied slots are then ready for the shell (``take_ready``), which writes them to the
store off the engine thread and gives the slots back (``written``). No free slot: the block is not written
(``num_dropped``), never waited for.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from engine.core.block_pool import TIER_HOST, TIER_POOL
from kv_transfer.hashing import BlockHash

REMEMBER_HASHES = 1 << 16  # how many hashes known to be in the store are remembered (LRU)


@dataclass(frozen=True, slots=True)
class StoreCopy:
    """Copy block ``block_id`` of ``tier`` (the pool: ``gpu``; the host tier: ``cpu``) into store slot ``slot``."""

    tier: str
    block_id: int
    slot: int


class StoreWrites:
    def __init__(self, num_slots: int, *, write_through: bool, remember: int = REMEMBER_HASHES) -> None:
        if num_slots < 1:
            raise ValueError(f"the store tier needs at least one write slot, got {num_slots}")
        self.num_slots = num_slots
        self.write_through = write_through
        self._free: deque[int] = deque(range(num_slots))
        self._hash_of: dict[int, BlockHash] = {}  # slot -> hash, from offer to written
        self._pending: set[BlockHash] = set()  # hashes in a slot
        self._copies: list[StoreCopy] = []
        self._ready: list[tuple[BlockHash, int]] = []
        self._stored: OrderedDict[BlockHash, None] = OrderedDict()  # known to be in the store, least recent first
        self._remember = remember
        self.num_offered = self.num_dropped = 0  # blocks, since start

    def offer(self, block_hash: BlockHash, tier: str, block_id: int) -> bool:
        """Queue a copy of ``block_id`` (holding ``block_hash``, in ``tier``) for the store; False when it is
        there already, on its way, or no slot is free (dropped)."""
        assert tier in (TIER_POOL, TIER_HOST), tier
        if block_hash in self._stored or block_hash in self._pending:
            return False
        self.num_offered += 1
        if not self._free:
            self.num_dropped += 1
            return False
        slot = self._free.popleft()
        self._hash_of[slot] = block_hash
        self._pending.add(block_hash)
        self._copies.append(StoreCopy(tier, block_id, slot))
        return True

    def take_copies(self) -> tuple[StoreCopy, ...]:
        """The queued copies (the caller makes them now, before the host tier's); their slots become ready."""
        copies, self._copies = tuple(self._copies), []
        self._ready.extend((self._hash_of[c.slot], c.slot) for c in copies)
        return copies

    def take_ready(self) -> list[tuple[BlockHash, int]]:
        """(hash, slot) of each copied block not yet handed out: the shell writes them to the store."""
        ready, self._ready = self._ready, []
        return ready

    def written(self, slots: Iterable[int], stored: Iterable[BlockHash]) -> None:
        """The shell is done with ``slots`` (written or not); ``stored``: the hashes the store holds now."""
        for slot in slots:
            self._pending.discard(self._hash_of.pop(slot))
            self._free.append(slot)
        self.remember(stored)

    def remember(self, hashes: Iterable[BlockHash]) -> None:
        """The store holds ``hashes`` (written by this worker, or fetched from the store)."""
        for block_hash in hashes:
            self._stored[block_hash] = None
            self._stored.move_to_end(block_hash)
        while len(self._stored) > self._remember:
            self._stored.popitem(last=False)

    def forget(self, hashes: Iterable[BlockHash]) -> None:
        """The store no longer holds ``hashes`` (evicted there, or found corrupt): write them again if offered."""
        for block_hash in hashes:
            self._stored.pop(block_hash, None)

    def is_stored(self, block_hash: BlockHash) -> bool:
        return block_hash in self._stored

    def check_invariants(self) -> None:
        assert len(self._free) + len(self._hash_of) == self.num_slots, "free + in use != slots"
        assert not set(self._free) & set(self._hash_of), "a slot is both free and in use"
        assert set(self._hash_of.values()) == self._pending, "pending hashes out of sync with the slots"
        assert not self._copies, "copies left untaken"
