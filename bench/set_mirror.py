"""The in-memory index mirror before issue 23 (KV index v2's ``IndexMirror``), kept verbatim for the benches'
baseline: per block a Python set of holder-name strings, per holder a set of its blocks; the walk intersects the
sets along the chain (``walk_sets``), so it costs O(blocks x holders) and ~380 B per (block, holder)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence, Set

from kv_transfer.index_schema import TIER_GPU, TieredLookup, walk_sets


class SetMirror:
    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}  # block hash -> holders
        self._off_gpu: dict[bytes, dict[str, str]] = {}  # block hash -> {holder: tier} for tiers other than gpu
        self._held: dict[str, set[bytes]] = {}  # holder -> block hashes

    def store(self, holder: str, hashes: Iterable[bytes], tier: str = TIER_GPU) -> None:
        held = self._held.setdefault(holder, set())
        for h in hashes:
            self._holders.setdefault(h, set()).add(holder)
            if tier != TIER_GPU:
                self._off_gpu.setdefault(h, {})[holder] = tier
            else:
                self._discard_off_gpu(h, holder)
            held.add(h)

    def _discard_off_gpu(self, block_hash: bytes, holder: str) -> None:
        off = self._off_gpu.get(block_hash)
        if off is not None and off.pop(holder, None) is not None and not off:
            del self._off_gpu[block_hash]

    def lookup_tiers(self, hashes: Sequence[bytes]) -> TieredLookup:
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
