"""Several routers in front of the same workers: each prices the others' in-flight books beside its own.

A router's books (``router.routing.in_progress`` and ``Relay.inflight``) say what it sent each worker and has
not seen finish: streams per decode worker, prompt tokens still to compute, prefixes being computed. A worker's
heartbeat reports all of it up to a period late (2 s), so with one router the books cover the gap; with three,
each sees only its own sends, and a burst split across them lands on whichever worker looked idle in the last
heartbeat, up to three times as deep.

So each router publishes its books (``BooksDoc``: one small JSON document, keyed by its router id) and reads the
others' every ``period_s`` (``router.routing.books_sync``, one round trip that does both), and prices a worker's
load as its own books, exact and immediate, plus the others' as of their last publish:

- streams: its own count plus the others' (``SharedStreams``);
- prompts to compute: the others' backlogs join its own queue, each as sent when it was published (so they keep
  draining at the worker's rate: ``SharedPrefills``, through ``InflightPrefills.backlog``);
- pending prefixes: the others' computing workers hold the prefix too (``OtherBooks.pending_lookup``). A block
  is named by its hash's first ``HASH_BYTES`` bytes (a false match costs a mis-priced request, never wrong
  output), at most ``max_pending_hashes`` per router, the newest requests' and each one's leading blocks first.

The sums meet a worker's heartbeat as one router's books did: the larger of the two (``policy.Candidate``), since
the heartbeat counts the routers' requests too once it catches up. Within a period the routers do not see each
other's latest sends. A router whose document expired (``ttl_s`` after its last publish: it died, or lost Redis)
counts for nothing. Pure logic: documents in, documents out, an injected monotonic clock and wall clock (ms) for the ages.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kv_transfer.hashing import BlockHash
from kv_transfer.workers import WorkerInfo, WorkerLoad
from router.routing.in_progress import InflightPrefills, backlogs_of
from router.routing.preselect import Books
from router.routing.rates import Rates

HASH_BYTES = 8  # of a block hash, what other routers are told (16 hex characters)


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedBooksConfig:
    period_s: float = 0.05  # publish this router's books and read the others' this often
    ttl_s: float = 2.0  # a router's books expire this long after its last publish (it died, or lost Redis)
    max_pending_hashes: int = 2048  # pending blocks published per router (32 KB of hex at most)
    router_id: str | None = None  # None: host, pid and a random suffix (books_sync)

    def __post_init__(self) -> None:
        if not 0 < self.period_s < self.ttl_s:
            raise ValueError(f"SharedBooksConfig: need 0 < period_s < ttl_s, got {self.period_s} and {self.ttl_s}")
        if self.max_pending_hashes < 0:
            raise ValueError(f"max_pending_hashes must be >= 0, got {self.max_pending_hashes}")


@dataclass(frozen=True, slots=True, kw_only=True)
class BooksDoc:
    """One router's books as published: ``queued`` is each worker's backlog as of ``at_ms`` (wall clock)."""

    router_id: str
    at_ms: int
    streams: Mapping[str, int] = field(default_factory=dict)  # decode worker -> streams in flight
    queued: Mapping[str, int] = field(default_factory=dict)  # worker -> prompt tokens left to compute
    pending: Mapping[str, Sequence[BlockHash]] = field(default_factory=dict)  # worker -> blocks it is computing

    @property
    def empty(self) -> bool:
        return not (self.streams or self.queued or self.pending)

    def encode(self) -> str:
        return json.dumps({
            "router": self.router_id, "at_ms": self.at_ms, "streams": dict(self.streams),
            "queued": dict(self.queued),
            "pending": {w: b"".join(h[:HASH_BYTES] for h in hashes).hex() for w, hashes in self.pending.items()},
        }, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class RouterBooks:
    """Another router's document as read: its backlogs dated on this router's monotonic clock."""

    router_id: str
    as_of_s: float  # monotonic: when its backlogs were what it published
    streams: dict[str, int]
    queued: dict[str, int]
    pending: dict[str, frozenset[int]]  # worker -> hash prefixes (prefix_keys)


def decode(doc: str, now_s: float, now_ms: int) -> RouterBooks:
    """Raises ValueError (or KeyError, TypeError) on a malformed document. A publish dated later than ``now_ms``
    (another host's clock ahead of ours) counts as published now."""
    raw = json.loads(doc)
    age_s = max(0, now_ms - int(raw["at_ms"])) / 1e3
    return RouterBooks(
        router_id=str(raw["router"]), as_of_s=now_s - age_s,
        streams={str(w): int(n) for w, n in raw["streams"].items()},
        queued={str(w): int(n) for w, n in raw["queued"].items()},
        pending={str(w): frozenset(_keys(bytes.fromhex(h))) for w, h in raw["pending"].items()},
    )


def prefix_keys(hashes: Sequence[BlockHash]) -> list[int]:
    """Each hash's first ``HASH_BYTES`` bytes as an int (in C: no per-block Python step)."""
    if not hashes:
        return []
    stride = len(hashes[0]) // HASH_BYTES
    assert stride * HASH_BYTES == len(hashes[0]), "block hashes are a whole number of 8-byte words"
    return memoryview(b"".join(hashes)).cast("Q")[::stride].tolist()


def _keys(prefixes: bytes) -> list[int]:
    return memoryview(prefixes).cast("Q").tolist() if prefixes else []


@dataclass(frozen=True, slots=True)
class OtherBooks:
    """The other routers' books summed per worker, as of their last publish."""

    routers: tuple[str, ...] = ()
    streams: dict[str, int] = field(default_factory=dict)
    queued: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)  # worker -> ((tokens, as_of_s),)
    pending: dict[str, frozenset[int]] = field(default_factory=dict)

    @classmethod
    def merge(cls, books: Sequence[RouterBooks]) -> OtherBooks:
        streams: dict[str, int] = {}
        queued: dict[str, list[tuple[int, float]]] = {}
        pending: dict[str, set[int]] = {}
        for b in books:
            for w, n in b.streams.items():
                streams[w] = streams.get(w, 0) + n
            for w, n in b.queued.items():
                queued.setdefault(w, []).append((n, b.as_of_s))
            for w, keys in b.pending.items():
                pending.setdefault(w, set()).update(keys)
        return cls(tuple(sorted(b.router_id for b in books)), streams,
                   {w: tuple(q) for w, q in queued.items()}, {w: frozenset(k) for w, k in pending.items()})

    @property
    def empty(self) -> bool:
        return not (self.streams or self.queued or self.pending)

    def pending_lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per worker another router has computing a prefix of ``hashes``: how many leading blocks."""
        if not self.pending or not hashes:
            return {}
        first = prefix_keys(hashes[:1])[0]
        holders = [(w, keys) for w, keys in self.pending.items() if first in keys]
        if not holders:
            return {}
        chain = prefix_keys(hashes)
        out = {}
        for worker_id, keys in holders:
            n = 1
            while n < len(chain) and chain[n] in keys:
                n += 1
            out[worker_id] = n
        return out


NO_OTHERS = OtherBooks()


@dataclass(frozen=True, slots=True)
class SharedStreams(Mapping[str, int]):
    """This router's streams per decode worker plus the other routers'."""

    own: Mapping[str, int]
    others: Mapping[str, int]

    def get(self, worker_id: str, default: int = 0) -> int:  # type: ignore[override]
        n = self.own.get(worker_id, 0) + self.others.get(worker_id, 0)
        return n if n or worker_id in self else default

    def __getitem__(self, worker_id: str) -> int:
        if worker_id not in self:
            raise KeyError(worker_id)
        return self.own.get(worker_id, 0) + self.others.get(worker_id, 0)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self.own or worker_id in self.others

    def __iter__(self) -> Iterator[str]:
        yield from self.own
        yield from (w for w in self.others if w not in self.own)

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass(frozen=True, slots=True)
class SharedPrefills:
    """This router's prompts sent to compute, with the other routers' backlogs in the same queue."""

    own: InflightPrefills
    others: Mapping[str, tuple[tuple[int, float], ...]]

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self.own or worker_id in self.others

    def backlog(self, worker_id: str, tokens_per_s: float) -> int:
        return self.own.backlog(worker_id, tokens_per_s, also=self.others.get(worker_id, ()))

    def backlogs(self, workers: Iterable[tuple[WorkerInfo, WorkerLoad | None]], rates: Rates) -> dict[str, int]:
        return backlogs_of(self, workers, rates)


def with_others(books: Books, others: OtherBooks, hashes: Sequence[BlockHash]) -> Books:
    """``books`` (this router's) with ``others`` beside them; ``books`` itself when no other router has any."""
    if others.empty:
        return books
    pending = dict(books.pending)
    for worker_id, blocks in others.pending_lookup(hashes).items():
        pending[worker_id] = max(blocks, pending.get(worker_id, 0))
    return replace(books, inflight=SharedStreams(books.inflight, others.streams),
                   prefills=SharedPrefills(books.prefills, others.queued), pending=pending)


def own_doc(router_id: str, at_ms: int, streams: Mapping[str, int], queued: Mapping[str, int],
            pending: Mapping[str, Sequence[BlockHash]]) -> BooksDoc:
    """What this router publishes: its own ``streams`` (``Relay.inflight``), ``queued`` (its backlogs,
    ``InflightPrefills.backlogs``) and ``pending`` (``PendingPrefixes.newest``); never what it read from the
    others."""
    streams = {w: n for w, n in streams.items() if n > 0}
    return BooksDoc(router_id=router_id, at_ms=at_ms, streams=streams, queued={w: n for w, n in queued.items() if n},
                    pending={w: hashes for w, hashes in pending.items() if hashes})
