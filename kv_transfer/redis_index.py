"""The Mooncake-style KV block index in Redis (DESIGN.md "KV index and registry in Redis").

Workers publish which full blocks they hold; routers ask, in one round trip, how many leading blocks of a
prompt's hash chain each worker holds. Key layout (all under a namespace ``ns``, hashes as lowercase hex)::

    {ns}:kv:{hash_hex}   HASH   field worker id -> tier ("gpu" | "cpu")
    {ns}:kv-of:{id}      SET    hash hexes the worker holds (cleanup when it dies)
    {ns}:events          STREAM capped; fields: type (stored|removed|worker-up|worker-down), worker,
                                and per type: tier + hashes (space-separated hex) | role + grpc_address | reason

The registry (``kv_transfer.registry``) owns the worker keys; ``RedisKeys`` names every key of both.
Scripts touch keys they compute from their arguments, so this targets a standalone Redis (or one
shard per namespace), not Redis Cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TIERS = ("gpu", "cpu")
EVENT_STORED, EVENT_REMOVED = "stored", "removed"
EVENT_WORKER_UP, EVENT_WORKER_DOWN = "worker-up", "worker-down"
DEFAULT_EVENTS_MAXLEN = 100_000


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Every Redis key name Baton uses, under one namespace."""

    ns: str = "baton"

    @property
    def workers(self) -> str:
        return f"{self.ns}:workers"

    @property
    def events(self) -> str:
        return f"{self.ns}:events"

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

    def kv_of(self, worker_id: str) -> str:
        return f"{self.ns}:kv-of:{worker_id}"

    def pool_desired(self, role: str) -> str:
        return f"{self.ns}:pool:{role}:desired"

    def profile(self, role: str) -> str:
        return f"{self.ns}:profile:{role}"  # JSON curves from `baton admin profile`, read by Plan


@dataclass(frozen=True, slots=True)
class IndexEvent:
    """One entry of ``{ns}:events``, for routers that mirror the index in memory."""

    stream_id: str
    type: str
    worker_id: str
    tier: str | None = None
    hashes: tuple[bytes, ...] = ()
    fields: tuple[tuple[str, str], ...] = ()  # every field as written, for types' extras (role, reason, ...)


def text(value: Any) -> str:
    """A reply value as ``str`` whether or not the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else str(value)


# Walk the chain in order; a worker's count is its number of leading blocks; stop at the first block
# nobody holds, or as soon as no worker still has an unbroken prefix. KEYS = the chain's kv keys.
_LOOKUP_LUA = """
local alive, counts = {}, {}
for i = 1, #KEYS do
  local next_alive, any = {}, false
  for _, w in ipairs(redis.call('HKEYS', KEYS[i])) do
    if i == 1 or alive[w] then next_alive[w] = true; counts[w] = i; any = true end
  end
  if not any then break end
  alive = next_alive
end
local out = {}
for w, n in pairs(counts) do out[#out + 1] = w; out[#out + 1] = n end
return out
"""

# Drop a worker's index entries (mode "index") or the worker entirely (modes "deregister", "expired").
# "expired" does nothing while the worker key still exists, so a live worker is never pruned by a race.
# KEYS: worker, load, workers, kv-of, events, draining. ARGV: id, mode, kv key prefix, events maxlen.
_DROP_WORKER_LUA = """
local id, mode, prefix, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if mode == 'expired' and redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local hashes = redis.call('SMEMBERS', KEYS[4])
for _, h in ipairs(hashes) do redis.call('HDEL', prefix .. h, id) end
redis.call('DEL', KEYS[4])
if mode == 'index' then
  if #hashes > 0 then
    redis.call('XADD', KEYS[5], 'MAXLEN', '~', maxlen, '*', 'type', 'removed', 'worker', id,
               'hashes', table.concat(hashes, ' '))
  end
  return #hashes
end
local gone = redis.call('SREM', KEYS[3], id) + redis.call('DEL', KEYS[1], KEYS[2]) + #hashes
if mode == 'deregister' then redis.call('SREM', KEYS[6], id) end
if gone == 0 then return 0 end
redis.call('XADD', KEYS[5], 'MAXLEN', '~', maxlen, '*', 'type', 'worker-down', 'worker', id, 'reason', mode)
return 1
"""


class KVIndex:
    """Which worker holds which KV block: batched writes by workers, one-round-trip lookups by routers."""

    def __init__(self, redis: Any, ns: str = "baton", *, events_maxlen: int = DEFAULT_EVENTS_MAXLEN) -> None:
        self._redis = redis
        self.keys = RedisKeys(ns)
        self.events_maxlen = events_maxlen
        self._lookup = redis.register_script(_LOOKUP_LUA)
        self._drop = redis.register_script(_DROP_WORKER_LUA)

    async def publish(
        self, worker_id: str, stored: list[bytes], removed: list[bytes], tier: str = "gpu"
    ) -> None:
        """Record a batch of committed (``stored``) and evicted (``removed``) blocks in one round trip.

        Removals apply after stores, so a hash in both lists ends up absent (under-reporting a block
        costs a cache miss; over-reporting would send work where the KV is not).
        """
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        if not stored and not removed:
            return
        pipe = self._redis.pipeline(transaction=True)
        if stored:
            hexes = [h.hex() for h in stored]
            for hx in hexes:
                pipe.hset(self.keys.kv_prefix + hx, worker_id, tier)
            pipe.sadd(self.keys.kv_of(worker_id), *hexes)
            self.add_event(pipe, EVENT_STORED, worker_id, tier=tier, hashes=" ".join(hexes))
        if removed:
            hexes = [h.hex() for h in removed]
            for hx in hexes:
                pipe.hdel(self.keys.kv_prefix + hx, worker_id)
            pipe.srem(self.keys.kv_of(worker_id), *hexes)
            self.add_event(pipe, EVENT_REMOVED, worker_id, hashes=" ".join(hexes))
        await pipe.execute()

    async def lookup(self, hashes: list[bytes]) -> dict[str, int]:
        """Per worker, the number of leading blocks of ``hashes`` (a prompt's chain) it holds.

        One round trip. Workers with no leading block are absent; the walk stops at the first block
        nobody holds. Callers intersect the result with the live, non-draining workers.
        """
        if not hashes:
            return {}
        flat = await self._lookup(keys=[self.keys.kv(h) for h in hashes])
        return {text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def remove_worker(self, worker_id: str) -> int:
        """Drop every index entry of ``worker_id`` (its registry keys stay); returns how many."""
        return int(await self.drop_worker(worker_id, "index"))

    async def drop_worker(self, worker_id: str, mode: str) -> int:
        """Atomic cleanup shared with the registry; ``mode`` is "index", "deregister" or "expired"."""
        k = self.keys
        keys = [k.worker(worker_id), k.load(worker_id), k.workers, k.kv_of(worker_id), k.events, k.draining]
        return int(await self._drop(keys=keys, args=[worker_id, mode, k.kv_prefix, self.events_maxlen]))

    def add_event(self, pipe: Any, event_type: str, worker_id: str, **fields: str) -> None:
        """Queue one XADD on ``pipe`` (capped, approximate MAXLEN)."""
        entry = {"type": event_type, "worker": worker_id, **fields}
        pipe.xadd(self.keys.events, entry, maxlen=self.events_maxlen, approximate=True)

    async def has_events(self) -> bool:
        """Whether the events stream exists: it does from the first registration on, until Redis loses
        its data (a restart without persistence), which is how a listing that came back empty tells a
        restarted Redis from workers that all left."""
        return bool(await self._redis.exists(self.keys.events))

    async def read_events(
        self, after_id: str = "0-0", *, count: int = 1000, block_ms: int | None = None
    ) -> list[IndexEvent]:
        """Events after ``after_id`` (pass the last one's ``stream_id`` to continue; "$" for new only)."""
        reply = await self._redis.xread({self.keys.events: after_id}, count=count, block=block_ms)
        if not reply:
            return []
        entries = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
        return [_parse_event(entry_id, fields) for entry_id, fields in entries]


def _parse_event(entry_id: Any, raw: dict[Any, Any]) -> IndexEvent:
    fields = {text(k): text(v) for k, v in raw.items()}
    hashes = tuple(bytes.fromhex(h) for h in fields.get("hashes", "").split())
    return IndexEvent(
        stream_id=text(entry_id),
        type=fields.get("type", ""),
        worker_id=fields.get("worker", ""),
        tier=fields.get("tier"),
        hashes=hashes,
        fields=tuple(sorted(fields.items())),
    )
