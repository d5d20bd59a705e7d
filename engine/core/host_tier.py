"""HostTier: the books of the host-memory tier below the KV pool (core: no torch; DESIGN.md "KV tiers").

A cached block the KV pool evicts is copied down here instead of dropped (``save``); a request whose prefix
continues past the pool's cached blocks into blocks held here gets them copied back up into fresh pool blocks
before it computes (``load``), which is cheaper than recomputing them (``worth_loading``, set by the engine from
measured rates). The tier has its own LRU over block hashes (the same hashes as the pool) and its own events
(tier ``cpu``), which the worker publishes to the index beside the pool's (tier ``gpu``). It keeps a copy of
what it gives back, so a hash may be in both tiers.

Copies are not made here: ``save`` and ``load`` queue (pool block, host block) pairs, and the runtime copies
them (``take_copies``) before anything else writes into those pool blocks: saves first (a block evicted and
reused in the same step is read before it is overwritten), then loads. A host block named in a queued copy is
pinned until then: the LRU never hands it out twice in one batch.

Swap (``--preemption-mode swap``): a preempted request's blocks, all of them (its partial last block and its
blocks not yet committed too), are copied into host blocks held for it alone (``swap_out``), outside the LRU
and the index, and copied back into fresh pool blocks when it is admitted again (``swap_in``), so it resumes
where it stopped instead of recomputing. Its host blocks return to the free list once those copies are made.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.block_pool import TIER_HOST, BlockEvent, BlockEventKind
from kv_transfer.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class HostCopies:
    """The copies one batch needs, in order: ``saves`` (pool block -> host block), then ``loads`` (host -> pool)."""

    saves: tuple[tuple[int, int], ...] = ()
    loads: tuple[tuple[int, int], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> host block, least recent first
        self._hash_of: dict[int, BlockHash] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._pinned: Counter[int] = Counter()  # host block -> holds (a queued save, loads about to be queued)
        self._saves: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self._events: list[BlockEvent] = []
        self._swapped: dict[str, list[int]] = {}  # request id -> the host blocks holding its KV, in order
        self._released: list[int] = []  # host blocks free once this batch's copies are made
        self._dropped: list[tuple[BlockHash, int]] = []  # (hash, host block) the LRU dropped, until taken
        self.worth_loading = True  # copying a block up beats recomputing it (the engine measures both)
        self.num_saved = self.num_loaded = self.num_dropped = 0  # blocks, since start
        self.num_swapped_out = self.num_swapped_in = 0  # requests, since start

    def __len__(self) -> int:
        return len(self._lru)

    def hashes(self) -> list[BlockHash]:
        """Every hash the tier holds (to republish the index)."""
        return list(self._lru)

    def prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Host blocks of the leading run of ``hashes`` held here (empty when loading is not worth it)."""
        found: list[int] = []
        if not self.worth_loading:
            return found
        for block_hash in hashes:
            host_id = self._lru.get(block_hash)
            if host_id is None:
                break
            found.append(host_id)
        return found

    def save(self, block_hash: BlockHash, block_id: int) -> bool:
        """The pool evicts ``block_id`` holding ``block_hash``: keep a copy (unless held already, or every host
        block is pinned by this batch's copies: then the block is dropped, as without a host tier, and this
        returns False)."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return True
        host_id = self._take()
        if host_id is None:
            return False
        self._lru[block_hash] = host_id
        self._hash_of[host_id] = block_hash
        self._pinned[host_id] += 1
        self._saves.append((block_id, host_id))
        self._events.append(BlockEvent(BlockEventKind.STORED, block_hash, host_id, TIER_HOST))
        self.num_saved += 1
        return True

    def pin(self, host_ids: Sequence[int]) -> None:
        """Hold ``host_ids`` (a ``prefix`` about to be loaded) while the pool makes room for them: the saves of
        what it evicts must not take these blocks. ``load`` them, or ``unpin`` if the room cannot be made."""
        self._pinned.update(host_ids)

    def unpin(self, host_ids: Sequence[int]) -> None:
        self._pinned.subtract(host_ids)
        self._pinned = +self._pinned  # drop counts that reached zero

    def load(self, host_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy ``host_ids`` (a pinned ``prefix``) up into the fresh pool blocks ``block_ids``."""
        for host_id, block_id in zip(host_ids, block_ids, strict=True):
            assert self._pinned[host_id] > 0, "load of a host block that was not pinned"
            self._lru.move_to_end(self._hash_of[host_id])
            self._loads.append((host_id, block_id))
        self.num_loaded += len(host_ids)

    def take_copies(self) -> HostCopies:
        """The queued copies (the caller makes them now); their host blocks are no longer pinned, and the host
        blocks of requests swapped back in (or ended while swapped) are free again."""
        copies = HostCopies(tuple(self._saves), tuple(self._loads))
        self._saves, self._loads = [], []
        self._pinned.clear()
        self._free.extend(self._released)
        self._released = []
        return copies

    # ---- swap ------------------------------------------------------------------------------
    def swap_out(self, request_id: str, block_ids: Sequence[int]) -> bool:
        """Hold copies of a preempted request's ``block_ids``; False (nothing taken) when the tier cannot."""
        room = len(self._free) + sum(1 for h in self._lru.values() if h not in self._pinned)
        if len(block_ids) > room:
            return False
        host_ids = [self._take() for _ in block_ids]
        for block_id, host_id in zip(block_ids, host_ids):
            self._pinned[host_id] += 1
            self._saves.append((block_id, host_id))
        self._swapped[request_id] = host_ids
        self.num_swapped_out += 1
        return True

    def swapped(self, request_id: str) -> int | None:
        """How many blocks of ``request_id`` are swapped out, or None."""
        host_ids = self._swapped.get(request_id)
        return None if host_ids is None else len(host_ids)

    def swap_in(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Copy the request's swapped blocks back into the fresh pool blocks ``block_ids``."""
        host_ids = self._swapped.pop(request_id)
        for host_id, block_id in zip(host_ids, block_ids, strict=True):
            self._pinned[host_id] += 1
            self._loads.append((host_id, block_id))
        self._released.extend(host_ids)
        self.num_swapped_in += 1

    def drop_swap(self, request_id: str) -> None:
        """The request ended while swapped out: its host blocks go back (after this batch's copies)."""
        self._released.extend(self._swapped.pop(request_id, ()))

    def take_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    def take_dropped(self) -> list[tuple[BlockHash, int]]:
        """(hash, host block) of each block the LRU dropped since the last call: its bytes are still there until
        the save that took the block is copied (the store tier copies them out first)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def _take(self) -> int | None:
        if self._free:
            return self._free.popleft()
        victim = next((h for h, host_id in self._lru.items() if host_id not in self._pinned), None)
        if victim is None:
            return None
        host_id = self._lru.pop(victim)
        del self._hash_of[host_id]
        self._events.append(BlockEvent(BlockEventKind.REMOVED, victim, host_id, TIER_HOST))
        self._dropped.append((victim, host_id))
        self.num_dropped += 1
        return host_id

    def check_invariants(self) -> None:
        held = set(self._lru.values())
        swapped = {h for ids in self._swapped.values() for h in ids}
        assert len(held) == len(self._lru), "a host block holds two hashes"
        assert not held & set(self._free) and not swapped & (held | set(self._free)), "a host block used twice"
        assert len(held) + len(self._free) + len(swapped) == self.num_blocks, "held + free + swapped != total"
        assert all(self._hash_of[h] == k for k, h in self._lru.items()), "hash map out of sync"
        assert not self._pinned and not self._saves and not self._loads, "copies left untaken"
