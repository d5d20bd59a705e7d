"""Keeps this router's books published in Redis and the other routers' in ``relay.other_books``
(``router.routing.shared_books``), in one round trip every ``period_s``, on a task of its own: no request waits
on it and the decision reads only memory.

Keys (DESIGN.md "KV index and registry in Redis"; ``kv_transfer.index_schema.RedisKeys``):

- ``{ns}:router-books:{router_id}`` STRING, a ``BooksDoc`` in JSON, ``PX`` = ``ttl_s``: rewritten when the books
  changed, its TTL extended when not, deleted when they are empty (an idle router only reads, and costs the
  others nothing);
- ``{ns}:routers`` SET of router ids; a reader drops the ids whose document expired.

One script does both halves: write (or extend, or delete) this router's document, then return every other
router's. A router that dies stops extending its document: the others stop counting its books within
``ttl_s``. Redis failing: the others' books are dropped once ``ttl_s`` has passed since the last read (routing
goes on with this router's own, as with one router), and everything resumes with Redis.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kv_transfer.index_schema import RedisKeys
from router.routing.directory import Snapshot
from router.routing.in_progress import InflightPrefills, PendingPrefixes
from router.routing.policy import RoutingState
from router.routing.shared_books import NO_OTHERS, OtherBooks, RouterBooks, SharedBooksConfig, decode, own_doc

log = logging.getLogger(__name__)

# KEYS[1]: {ns}:routers. ARGV: the document key's prefix, this router's id, the TTL in ms, and its document:
# '' (no books: delete it), '-' (none, already deleted), '=' (unchanged since the last write: extend it) or the
# JSON. Returns {1 if this router's document is in Redis (0: it expired, write it again), every other router's...}.
_SYNC_LUA = """
local prefix, me, ttl, doc = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local mine, kept = prefix .. me, 1
if doc == '-' then
elseif doc == '' then
  redis.call('DEL', mine)
  redis.call('SREM', KEYS[1], me)
elseif doc == '=' then
  kept = redis.call('PEXPIRE', mine, ttl)
else
  redis.call('SET', mine, doc, 'PX', ttl)
  redis.call('SADD', KEYS[1], me)
end
local out = {kept}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if id ~= me then
    local other = redis.call('GET', prefix .. id)
    if other then out[#out + 1] = other else redis.call('SREM', KEYS[1], id) end
  end
end
return out
"""


class BooksOwner(Protocol):
    """Where the books live (``router.relay.Relay``)."""

    inflight: Mapping[str, int]
    inflight_prefills: InflightPrefills
    pending_prefixes: PendingPrefixes
    routing: RoutingState
    other_books: OtherBooks


def default_router_id() -> str:
    """Unique per process (a restarted router is a new one: its predecessor's books expire on their own)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


class BooksSync:
    def __init__(self, redis: Any, keys: RedisKeys, owner: BooksOwner, snapshot: Callable[[], Snapshot | None],
                 config: SharedBooksConfig, *, clock: Callable[[], float] = time.monotonic,
                 wall_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        """``snapshot``: the directory's last listing (the workers' rates price this router's backlogs)."""
        self.config = config
        self.router_id = config.router_id or default_router_id()
        self._script = redis.register_script(_SYNC_LUA)
        self._keys, self._owner, self._snapshot = keys, owner, snapshot
        self._clock, self._wall_ms = clock, wall_ms
        self._written: tuple | None = None  # what the document in Redis was built from (None: write it)
        self._deleted = False  # no books, and the document is deleted
        self._docs: dict[str, RouterBooks] = {}  # the others' documents last read, parsed
        self._malformed: set[str] = set()  # the others' documents last read that did not parse
        self._seen: set[str] = set()  # every other router whose books were read
        self._last_read_s = clock()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._failing = False
        self.syncs = 0  # round trips that succeeded

    @property
    def others(self) -> tuple[str, ...]:
        """The routers whose books this one counts."""
        return self._owner.other_books.routers

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop syncing and delete this router's document (its books end with it)."""
        self._stopping = True
        if self._task is not None:
            # Python 3.11's asyncio.wait_for (here and inside redis-py) can swallow a cancellation that lands as its
            # operation completes: the loop also checks the flag, and the wait for it is bounded
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=max(1.0, self.config.period_s * 10))
        try:
            await asyncio.wait_for(self._call(""), self.config.period_s * 10)
        except Exception as exc:  # noqa: BLE001 - it expires on its own
            log.info("could not delete this router's books (they expire in %.1f s): %r", self.config.ttl_s, exc)

    async def sync_once(self) -> None:
        """Publish this router's books (or extend them, or delete them) and read the others'."""
        kept, *docs = await self._call(self._document())
        if not int(kept):
            self._written = None  # expired (a stall past the TTL, a Redis restart): written in full next time
        self._install(docs)
        self._last_read_s = self._clock()
        self.syncs += 1

    async def _call(self, doc: str) -> list:
        return await self._script(keys=[self._keys.routers],
                                  args=[self._keys.router_books(""), self.router_id,
                                        max(1, round(self.config.ttl_s * 1000)), doc])

    def _document(self) -> str:
        owner = self._owner
        owner.pending_prefixes.expire()
        built_from = (owner.inflight_prefills.changes, owner.pending_prefixes.changes,
                      tuple(sorted(owner.inflight.items())))
        if built_from == self._written:
            return "="
        snapshot = self._snapshot()
        prefills = owner.inflight_prefills
        queued = prefills.backlogs(snapshot.workers, owner.routing.rates) if snapshot else prefills.tokens()
        doc = own_doc(self.router_id, self._wall_ms(), owner.inflight, queued,
                      owner.pending_prefixes.newest(self.config.max_pending_hashes))
        if doc.empty:  # deleted (once), never extended
            deleted, self._deleted, self._written = self._deleted, True, None
            return "-" if deleted else ""
        self._deleted, self._written = False, built_from
        return doc.encode()

    def _install(self, docs: list[str]) -> None:
        if docs == [*self._docs, *self._malformed]:
            return  # nobody published anything new: the merged books stand (their backlogs drain by the clock)
        now_s, now_ms = self._clock(), self._wall_ms()
        parsed: dict[str, RouterBooks | None] = {}
        for doc in docs:
            books = self._docs.get(doc)
            if books is None:
                try:
                    books = decode(doc, now_s, now_ms)
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    if doc not in self._malformed:  # warned once per document, not every period
                        log.warning("ignoring another router's malformed books: %r", exc)
                    parsed[doc] = None
                    continue
            parsed[doc] = books
        self._docs = {doc: books for doc, books in parsed.items() if books is not None}
        self._malformed = {doc for doc, books in parsed.items() if books is None}
        self._owner.other_books = OtherBooks.merge(list(self._docs.values())) if self._docs else NO_OTHERS
        if new := set(self.others) - self._seen:  # a router with nothing in flight publishes nothing: say it once
            self._seen |= new
            log.info("router_id=%s prices the books of other routers too: %s", self.router_id, ", ".join(sorted(new)))

    async def _run(self) -> None:
        period_s = self.config.period_s
        while not self._stopping:
            try:
                await asyncio.wait_for(self.sync_once(), self.config.ttl_s)
                if self._failing:
                    log.warning("router books sync works again")
                self._failing = False
                await asyncio.sleep(period_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any Redis failure (or silence) only loses the others' books
                if not self._failing:
                    log.warning("router books sync failed (pricing this router's books only after %.1f s): %r",
                                self.config.ttl_s, exc)
                self._failing, self._written, self._deleted = True, None, False
                if self._clock() - self._last_read_s > self.config.ttl_s and self._docs:
                    self._owner.other_books, self._docs = NO_OTHERS, {}
                await asyncio.sleep(min(1.0, period_s * 10))
