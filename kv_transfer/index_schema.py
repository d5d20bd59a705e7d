"""The KV block index's schema, version 2 (docs/architecture.md "KV index v2"): key names, tiers, events and
the lookup's walk, as plain values with no I/O (the Redis side is ``kv_transfer.redis_index``; the router's
in-memory mirror, ``router.routing.index_mirror``, walks with ``walk_chain`` exactly as the Lua script does).

Holders: every worker, plus the shared store under the reserved holder id ``store`` (no worker may take it).
A holder's field in ``{ns}:kv:{hash}`` names the best tier it holds the block in: ``gpu`` (its KV pool) over
``cpu`` (its host tier); the store's field is ``store`` -> ``store``. A holder's moves are events on a stream
of its own, each entry with the next number of the holder's sequence, so a reader that sees a number other
than the one it expects knows it lost events of that holder and resyncs that holder alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Any

TIER_GPU, TIER_CPU, TIER_STORE = "gpu", "cpu", "store"
WORKER_TIERS = (TIER_GPU, TIER_CPU)  # best first
STORE = "store"  # the store's holder id (its field in {ns}:kv:{hash}, its stream, its kv-of hash)

# Per-holder stream entries: a block's best tier became ``tier`` (stored), it left every tier (removed), or
# every entry of the holder was dropped at once (cleared: a worker that (re)registers starts empty).
EVENT_STORED, EVENT_REMOVED, EVENT_CLEARED = "stored", "removed", "cleared"
# Control stream entries: a worker (re)registered (a reader starts following its stream) or left.
EVENT_WORKER_UP, EVENT_WORKER_DOWN = "worker-up", "worker-down"
# Per stream (each holder's, and the control stream). A reader that falls further behind one holder re-reads
# that holder alone (one HGETALL), so a short backlog suffices: at 4 batches a second, about 4 minutes.
DEFAULT_EVENTS_MAXLEN = 1_000


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Every Redis key name Baton uses, under one namespace."""

    ns: str = "baton"

    @property
    def workers(self) -> str:
        return f"{self.ns}:workers"

    @property
    def worker_events(self) -> str:
        """The control STREAM: worker-up / worker-down (no block moves), capped."""
        return f"{self.ns}:worker-events"

    @property
    def draining(self) -> str:
        return f"{self.ns}:draining"

    @property
    def restarts(self) -> str:
        """HASH worker id -> how many times its supervisor (``baton up``) restarted it."""
        return f"{self.ns}:restarts"

    @property
    def kv_prefix(self) -> str:
        return f"{self.ns}:kv:"

    def worker(self, worker_id: str) -> str:
        return f"{self.ns}:worker:{worker_id}"

    def load(self, worker_id: str) -> str:
        return f"{self.ns}:load:{worker_id}"

    def kv(self, block_hash: bytes) -> str:
        return f"{self.kv_prefix}{block_hash.hex()}"

    def kv_of(self, holder: str) -> str:
        """HASH block hash hex -> the holder's best tier (what its fields in ``{ns}:kv:*`` say)."""
        return f"{self.ns}:kv-of:{holder}"

    def events(self, holder: str) -> str:
        """The holder's STREAM of block moves, capped; every entry carries the holder's next ``seq``."""
        return f"{self.ns}:events:{holder}"

    def events_seq(self, holder: str) -> str:
        """STRING: the holder's last sequence number (INCR'd by every entry of its stream)."""
        return f"{self.ns}:events-seq:{holder}"

    @property
    def routers(self) -> str:
        """SET of router ids that published books (pruned by readers when a router's books expired)."""
        return f"{self.ns}:routers"

    def router_books(self, router_id: str) -> str:
        """STRING (JSON, ``router.routing.shared_books.BooksDoc``): a router's in-flight books, with a short TTL."""
        return f"{self.ns}:router-books:{router_id}"

    def pool_desired(self, role: str) -> str:
        return f"{self.ns}:pool:{role}:desired"

    def profile(self, role: str) -> str:
        return f"{self.ns}:profile:{role}"  # JSON curves from `baton admin profile`, read by Plan


@dataclass(frozen=True, slots=True)
class IndexEvent:
    """One stream entry: a holder's block move (with its ``seq``), or a worker-up / worker-down."""

    stream_id: str
    type: str
    worker_id: str  # the holder (a worker id, or ``store``)
    tier: str | None = None
    hashes: tuple[bytes, ...] = ()
    seq: int | None = None  # per-holder entries only
    fields: tuple[tuple[str, str], ...] = ()  # every field as written, for types' extras (role, reason, ...)


@dataclass(frozen=True, slots=True)
class TieredLookup:
    """A prompt's chain against the index: per worker, its leading blocks in its KV pool (``gpu``) and in its
    KV pool or host tier (``gpu_or_cpu``); the store's leading blocks (``store``). Workers with no leading
    block are absent from a mapping; ``gpu[w] <= gpu_or_cpu[w]``."""

    gpu: Mapping[str, int] = field(default_factory=dict)
    gpu_or_cpu: Mapping[str, int] = field(default_factory=dict)
    store: int = 0


def walk_chain(holders_per_block: Iterable[Mapping[str, str] | None]) -> TieredLookup:
    """The lookup's walk over each block's ``{holder: tier}`` in chain order (the Lua script's twin).

    A worker's ``gpu_or_cpu`` count grows while it holds every block so far in some tier, its ``gpu`` count
    while it holds every block so far in the KV pool; the store's while it holds every block so far. The walk
    stops at the first block that continues nobody's prefix (in particular the first block nobody holds).
    """
    return walk_sets(
        (row.keys(), {h for h, tier in row.items() if tier != TIER_GPU}) if row else None for row in holders_per_block
    )


# (every holder of a block, those holding it outside a KV pool: empty or None when none does)
BlockHolders = tuple[Set[str], Set[str] | None]


def walk_sets(blocks: Iterable[BlockHolders | None]) -> TieredLookup:
    """``walk_chain`` over set pairs: intersections run in C, and Python touches a worker only when its prefix
    ends (the mirror keeps its blocks in this shape). While no block has a holder outside a KV pool, the
    pool-only walk is the same set as the any-tier one."""
    gpu: dict[str, int] = {}
    local: dict[str, int] = {}
    store = depth = 0  # depth: blocks walked so far
    alive: set[str] = set()  # workers holding every block so far, in some tier
    alive_gpu: set[str] = alive  # ... in their KV pool (the same object while they are the same set)
    for block in blocks:
        if block is None:
            break
        holders, off_gpu = block
        if depth == 0:
            next_alive = set(holders) - {STORE}
            in_pool = next_alive
        else:
            next_alive = alive & holders
            in_pool = next_alive if alive_gpu is alive else alive_gpu & holders
        next_gpu = in_pool - off_gpu if off_gpu else in_pool
        store_extends = store == depth and STORE in holders
        if not next_alive and not store_extends:
            break
        if len(next_alive) != len(alive):
            local.update(dict.fromkeys(alive - next_alive, depth))
        if len(next_gpu) != len(alive_gpu):
            gpu.update(dict.fromkeys(alive_gpu - next_gpu, depth))
        alive, alive_gpu, depth = next_alive, next_gpu, depth + 1
        if store_extends:
            store = depth
    local.update(dict.fromkeys(alive, depth))
    gpu.update(dict.fromkeys(alive_gpu, depth))
    return TieredLookup(gpu=gpu, gpu_or_cpu=local, store=store)


def text(value: Any) -> str:
    """A reply value as ``str`` whether or not the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_event(entry_id: Any, raw: Mapping[Any, Any], holder: str | None = None) -> IndexEvent:
    """A stream entry as written by ``KVIndex``; ``holder`` names a per-holder stream's holder."""
    fields = {text(k): text(v) for k, v in raw.items()}
    hashes = tuple(bytes.fromhex(h) for h in fields.get("hashes", "").split())
    seq = fields.get("seq")
    return IndexEvent(
        stream_id=text(entry_id),
        type=fields.get("type", ""),
        worker_id=holder if holder is not None else fields.get("worker", ""),
        tier=fields.get("tier"),
        hashes=hashes,
        seq=None if seq is None else int(seq),
        fields=tuple(sorted(fields.items())),
    )
