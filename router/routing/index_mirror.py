"""An in-memory mirror of the KV block index (DESIGN.md "KV index"; version 2 in docs/architecture.md).

With the mirror on (the router's default; ``--no-index-mirror`` turns it off) a routing decision reads no Redis
at all: the prompt's chain is walked in this process's memory, the same walk as the index's Lua script
(``index_schema.walk_chain``), over the same state: per block, each holder's best tier.
``router.routing.mirror_sync`` keeps it equal to Redis from the per-holder event streams; this class is pure
state, no I/O.

Shape (issue 23, item 4: a lookup whose cost does not grow with the holders of a block, in bounded memory):

- every holder gets a **compact id** (the lowest free one; a dropped holder's id is reused once its bits are
  cleared), and a block's holders are **one Python int used as a bitmap** over those ids; a block held by a
  single holder (most of them) stores ``~id`` instead, a small negative int, not a bitmap as wide as the id;
- the walk ANDs the chain's bitmaps (one C operation per block, ~N/64 machine words for N holders in all),
  stops at the first block that continues nobody's prefix, and records only where prefixes *end*
  (``ChainMatch``): no holder is named unless someone asks about it;
- per holder, its blocks (a dict of the same ``bytes`` objects as the keys): a holder's drop or resync clears
  exactly its bits.

No per-(block, holder) Python object: per distinct block one dict entry, its key and its int; per
(block, holder) one slot in the holder's dict. Nothing the garbage collector tracks grows with the index. The memory per million entries is measured by
``python -m bench decision-latency`` (docs/benchmarks.md, "Index and router at 1,000 workers").
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence

from kv_transfer.index_schema import (
    EVENT_CLEARED, EVENT_REMOVED, EVENT_STORED, EVENT_WORKER_DOWN, STORE, TIER_CPU, TIER_GPU, TIER_STORE,
    IndexEvent, TieredLookup,
)
from router.routing.chain_match import ChainMatch


def _bits(value: int) -> int:
    """A stored value as a bitmap (``~id`` stands for a single holder)."""
    return value if value >= 0 else 1 << ~value


def _packed(bits: int) -> int:
    """A bitmap as stored: ``~id`` when it has exactly one bit (0: none; the caller deletes the entry)."""
    return ~(bits.bit_length() - 1) if bits and bits & (bits - 1) == 0 else bits


class IndexMirror:
    """Which holder (worker or the store) holds which block in which tier, in memory: per block a bitmap of its
    holders and, apart, one of the holders that hold it outside a KV pool (most blocks are in KV pools only)."""

    def __init__(self) -> None:
        self._holders: dict[bytes, int] = {}  # block hash -> holders (packed bitmap over ids)
        self._off_gpu: dict[bytes, int] = {}  # block hash -> holders holding it outside their KV pool (packed)
        # id -> the holder's block hashes (None: a free id). A dict of None, not a set: a dict of atomic keys and
        # values is one the garbage collector does not track, while a set always is (and a full collection then
        # visits every entry: ~0.1 s at 10M)
        self._held: list[dict[bytes, None] | None] = []
        # (id, block) -> tier, for a tier this version does not name (off its KV pool a worker's is cpu, the store's
        # store)
        self._off_tier: dict[tuple[int, bytes], str] = {}
        # copied on write (a holder joining or leaving): a ChainMatch keeps the tables of its lookup
        self._ids: dict[str, int] = {}
        self._names: tuple[str | None, ...] = ()
        self._free: list[int] = []  # heap of free ids

    def __len__(self) -> int:
        """Distinct blocks held by anyone."""
        return len(self._holders)

    @property
    def num_entries(self) -> int:
        """(block, holder) pairs: what ``{ns}:kv:*`` holds in Redis, summed over fields."""
        return sum(len(held) for held in self._held if held)

    def clear(self) -> None:
        self._holders.clear()
        self._off_gpu.clear()
        self._held.clear()
        self._off_tier.clear()
        self._ids, self._names, self._free = {}, (), []

    def holders(self) -> list[str]:
        """Holders with at least one block, sorted."""
        return sorted(name for name, i in self._ids.items() if self._held[i])

    def held(self, holder: str) -> dict[bytes, str]:
        """The holder's blocks and their best tiers (what ``{ns}:kv-of:{holder}`` holds in Redis)."""
        i = self._ids.get(holder)
        if i is None:
            return {}
        return {h: self._tier(i, h) for h in self._held[i] or ()}

    def _tier(self, i: int, block_hash: bytes) -> str:
        if not _bits(self._off_gpu.get(block_hash, 0)) >> i & 1:
            return TIER_GPU
        return self._off_tier.get((i, block_hash), TIER_STORE if self._names[i] == STORE else TIER_CPU)

    def store(self, holder: str, hashes: Iterable[bytes], tier: str = TIER_GPU) -> None:
        """The blocks' best tier on ``holder`` is now ``tier``."""
        i = self._id(holder)
        bit, held, blocks = 1 << i, self._held[i], self._holders
        assert held is not None
        for h in hashes:
            blocks[h] = _packed(_bits(blocks.get(h, 0)) | bit)
            held[h] = None
            if tier == TIER_GPU:
                self._discard_off_gpu(h, i)
            else:
                self._off_gpu[h] = _packed(_bits(self._off_gpu.get(h, 0)) | bit)
                if tier not in (TIER_CPU, TIER_STORE):
                    self._off_tier[i, h] = tier

    def remove(self, holder: str, hashes: Iterable[bytes]) -> None:
        i = self._ids.get(holder)
        if i is None:
            return
        held, blocks, mask = self._held[i], self._holders, ~(1 << i)
        assert held is not None
        for h in hashes:
            value = blocks.get(h)
            if value is None:
                continue
            left = _bits(value) & mask
            if left:
                blocks[h] = _packed(left)
            else:
                del blocks[h]
            self._discard_off_gpu(h, i)
            held.pop(h, None)

    def _discard_off_gpu(self, block_hash: bytes, i: int) -> None:
        value = self._off_gpu.get(block_hash)
        if value is None:
            return
        left = _bits(value) & ~(1 << i)
        if left:
            self._off_gpu[block_hash] = _packed(left)
        else:
            del self._off_gpu[block_hash]
        self._off_tier.pop((i, block_hash), None)

    def drop(self, holder: str) -> None:
        """Forget every block of ``holder`` (its id becomes free)."""
        i = self._ids.get(holder)
        if i is None:
            return
        self.remove(holder, list(self._held[i] or ()))
        self._held[i] = None
        ids = dict(self._ids)
        del ids[holder]
        names = list(self._names)
        names[i] = None
        self._ids, self._names = ids, tuple(names)
        heapq.heappush(self._free, i)

    def replace(self, holder: str, holdings: Mapping[bytes, str]) -> None:
        """The holder's blocks are exactly ``holdings`` (a resync from its ``{ns}:kv-of:{holder}``)."""
        self.drop(holder)
        by_tier: dict[str, list[bytes]] = {}
        for block_hash, tier in holdings.items():
            by_tier.setdefault(tier, []).append(block_hash)
        for tier, hashes in by_tier.items():
            self.store(holder, hashes, tier)

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
        """``KVIndex.lookup_tiers``'s answer, from memory (names every holder: O(holders) on top of the walk)."""
        return self.match(hashes).to_tiered()

    def match(self, hashes: Sequence[bytes]) -> ChainMatch:
        """The walk of ``walk_chain`` over bitmaps: ``alive`` holds every holder still holding each block so far
        (any tier), ``alive_gpu`` those holding each in their KV pool; a group ends where a block lacks it."""
        holders, off_gpu = self._holders, self._off_gpu
        store_bit = 1 << self._ids[STORE] if STORE in self._ids else 0
        workers = ~store_bit  # the store's prefix is counted apart (``store``)
        gpu_ends: list[tuple[int, int]] = []
        any_ends: list[tuple[int, int]] = []
        alive = alive_gpu = workers  # every worker, before the first block
        store = depth = 0
        for h in hashes:
            value = holders.get(h)
            if value is None:
                break
            bits = value if value >= 0 else 1 << ~value  # _bits, inlined: this loop runs per prompt block
            next_alive = alive & bits
            off = off_gpu.get(h) if off_gpu else None  # most indexes hold every block in KV pools only
            next_gpu = alive_gpu & next_alive if off is None else alive_gpu & bits & ~_bits(off)
            store_extends = store == depth and bits & store_bit
            if not next_alive and not store_extends:
                break
            if depth:
                if next_alive != alive:
                    any_ends.append((depth, alive & ~next_alive))
                if next_gpu != alive_gpu:
                    gpu_ends.append((depth, alive_gpu & ~next_gpu))
            alive, alive_gpu, depth = next_alive, next_gpu, depth + 1
            if store_extends:
                store = depth
        if depth:
            if alive:
                any_ends.append((depth, alive))
            if alive_gpu:
                gpu_ends.append((depth, alive_gpu))
        return ChainMatch(tuple(gpu_ends), tuple(any_ends), store, self._ids, self._names)

    def store_run(self, hashes: Sequence[bytes], holder: str) -> int:
        """Leading blocks of ``hashes`` that ``holder`` (in any tier) or the store holds, each block one or the
        other: what the store can add to what ``holder`` has (the store's own prefix, ``match``'s ``store``,
        starts at block 0, which a hot first block kept in every pool never leaves for the store)."""
        ids = self._ids
        if STORE not in ids:
            return 0
        mask = 1 << ids[STORE] | (1 << ids[holder] if holder in ids else 0)
        depth = 0
        for h in hashes:
            value = self._holders.get(h)
            if value is None or not (value if value >= 0 else 1 << ~value) & mask:
                break
            depth += 1
        return depth

    def _id(self, holder: str) -> int:
        i = self._ids.get(holder)
        if i is not None:
            return i
        ids, names = dict(self._ids), list(self._names)
        if self._free:
            i = heapq.heappop(self._free)
            names[i] = holder
            self._held[i] = {}
        else:
            i = len(names)
            names.append(holder)
            self._held.append({})
        ids[holder] = i
        self._ids, self._names = ids, tuple(names)
        return i
