"""A prompt's chain against the KV index, as routing reads it: per holder, its leading blocks per tier.

Two shapes answer the same questions (``PrefixMatch``):

- ``ChainMatch``, the in-memory mirror's answer: which holders' prefixes *end* at which depth, each group a
  bitmap over the mirror's compact holder ids (a Python int). Building it costs O(prompt blocks) big-int
  operations whatever the number of holders; a holder is only named when asked about.
- ``TieredMatch``, a ``TieredLookup`` (the Redis script's answer, already one entry per holder) seen the same way.

What pre-selection (``router.routing.preselect``) asks: one worker's depths, and the holders from the deepest
prefix down, group by group, without naming every holder of a popular prefix.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kv_transfer.index_schema import TieredLookup


class HolderGroup(Protocol):
    """Holders sharing one prefix depth: sized, testable for a holder, iterable (names)."""

    def __len__(self) -> int: ...

    def __contains__(self, holder: object) -> bool: ...

    def __iter__(self) -> Iterator[str]: ...


class PrefixMatch(Protocol):
    store: int  # the shared store's leading blocks
    answered: bool  # False: the index could not be asked (Redis slow or down), so it names no holder

    def depths(self, holder: str) -> tuple[int, int]:
        """(leading blocks in its KV pool, leading blocks in its pool or host tier); (0, 0) for a non-holder."""
        ...

    def groups(self) -> Iterator[tuple[int, HolderGroup]]:
        """Holders by their pool-or-host depth, deepest group first (depth >= 1)."""
        ...

    def to_tiered(self) -> TieredLookup:
        """Every holder's counts (O(holders): the full-pricing path)."""
        ...


def bit_ids(bits: int) -> Iterator[int]:
    """The positions of the set bits of ``bits`` (>= 0), lowest first."""
    while bits:
        low = bits & -bits
        yield low.bit_length() - 1
        bits ^= low


@dataclass(frozen=True, slots=True)
class BitGroup:
    """Holders as set bits over compact ids; ``ids`` and ``names`` are the mirror's tables as of the lookup."""

    bits: int
    ids: Mapping[str, int]
    names: Sequence[str | None]

    def __len__(self) -> int:
        return self.bits.bit_count()

    def __contains__(self, holder: object) -> bool:
        i = self.ids.get(holder)  # type: ignore[call-overload]
        return i is not None and self.bits >> i & 1 == 1

    def __iter__(self) -> Iterator[str]:
        for i in bit_ids(self.bits):
            name = self.names[i]
            assert name is not None, f"holder id {i} is set in a block but has no name"
            yield name


@dataclass(frozen=True, slots=True)
class ChainMatch:
    """The mirror's walk of a chain: ``gpu_ends`` / ``any_ends`` are (depth, holders whose KV-pool / pool-or-host
    prefix is exactly that many blocks), by depth ascending; the tables are the mirror's, copied on write."""

    gpu_ends: tuple[tuple[int, int], ...]
    any_ends: tuple[tuple[int, int], ...]
    store: int
    ids: Mapping[str, int]
    names: Sequence[str | None]
    answered: bool = True  # the mirror answers only while in sync

    def depths(self, holder: str) -> tuple[int, int]:
        i = self.ids.get(holder)
        if i is None:
            return 0, 0
        return _depth_of(self.gpu_ends, i), _depth_of(self.any_ends, i)

    def groups(self) -> Iterator[tuple[int, BitGroup]]:
        for depth, bits in reversed(self.any_ends):
            yield depth, BitGroup(bits, self.ids, self.names)

    def to_tiered(self) -> TieredLookup:
        return TieredLookup(gpu=self._named(self.gpu_ends), gpu_or_cpu=self._named(self.any_ends), store=self.store)

    def _named(self, ends: tuple[tuple[int, int], ...]) -> dict[str, int]:
        names = self.names
        return {names[i]: depth for depth, bits in ends for i in bit_ids(bits)}  # type: ignore[misc]


def _depth_of(ends: tuple[tuple[int, int], ...], i: int) -> int:
    for depth, bits in ends:
        if bits >> i & 1:
            return depth
    return 0


@dataclass(frozen=True, slots=True)
class TieredMatch:
    """A ``TieredLookup`` (the Redis script's answer, or no answer at all) as a ``PrefixMatch``."""

    tiered: TieredLookup
    answered: bool = True

    @property
    def store(self) -> int:
        return self.tiered.store

    def depths(self, holder: str) -> tuple[int, int]:
        return self.tiered.gpu.get(holder, 0), self.tiered.gpu_or_cpu.get(holder, 0)

    def groups(self) -> Iterator[tuple[int, frozenset[str]]]:
        by_depth: dict[int, list[str]] = {}
        for holder, depth in self.tiered.gpu_or_cpu.items():
            by_depth.setdefault(depth, []).append(holder)
        for depth in sorted(by_depth, reverse=True):
            yield depth, frozenset(by_depth[depth])

    def to_tiered(self) -> TieredLookup:
        return self.tiered
